"""Where a model's routed experts live, decided before loading: the rows the loader fills and the
backend each MoE layer gets afterwards. Knows a MoE shape and a list of MoE layers, never a model.

    placement = ExpertPlacement(shape, dtype, moe_layers, options, device, decode_tokens)
    rows = placement.rows(layer)          # [E, R]: device memory (resident) or the pinned host store;
                                          # R in the model dtype, or bytes (uint8) for FP8 rows
    ... the loader fills rows from the checkpoint ...
    backend = placement.build(layer, rows)  # rows: these, or any [E, R] rows (benchmarks reuse one store)

Under expert parallelism (par.ep > 1, experts/parallel/ep.py) E is this rank's share, num_experts / ep: rows,
host store and slots hold only the experts it owns (placement.owned), and build() wraps the backend
in ShardedExperts, which maps router ids to local ids and sums the ranks' outputs. Under tensor
parallelism with options.split resolving to "columns" (experts/parallel/columns.py) every row is this rank's
I/tp columns of its expert (self.shape, self.layout: the local shape; full_shape: the model's), and
build() wraps the backend in ColumnExperts, which sums the ranks' partial outputs over the tp group.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from moetier.errors import MoetierError
from moetier.experts.backends import ExpertBackend
from moetier.experts.parallel.columns import ColumnExperts, local_shape, resolve, split_problems
from moetier.experts.hybrid.cost_model import PathRates
from moetier.experts.hybrid.host_kernels import CHOICES as HOST_KERNELS
from moetier.experts.parallel.ep import ShardedExperts, local_experts, owned_experts
from moetier.experts.kernels.gemm_config import GemmConfig
from moetier.experts.prefill.cache_policy import PREFILL_POLICIES
from moetier.experts.prefetch import MODES as PREFETCH_MODES
from moetier.experts.prefill.ring import PREFILL_STREAMS, RING_DEPTH, RING_GROUP, check_geometry
from moetier.experts.registry import KINDS, NAMES, Resident, backend_kind, either, find
from moetier.experts.shape import MoeShape
from moetier.experts.cache.split import check_pinned, local_pinned
from moetier.experts.cache.store import HostStore
from moetier.parallel import Parallel

POLICIES = ("lru", "lfru")


@dataclass
class ExpertOptions:
    backend: str = Resident.name
    slots: int | None = None  # slots per MoE layer (slots backend); default half the experts
    slots_per_layer: dict[int, int] = field(default_factory=dict)  # overrides `slots` by layer
    # Victim order of the slot cache. LFRU beats LRU on every committed trace (docs/traces.md).
    policy: str = "lfru"
    # What a larger step (prefill) does to the slot cache (slots, hybrid; --prefill-cache): "bypass"
    # leaves it alone, "refresh" first moves the chunk's most used experts into slots
    # (experts/prefill/cache_policy.py).
    prefill: str = "bypass"
    # How a bypass step's misses reach the expert GEMM (slots, hybrid; --prefill-stream): "uva" reads them
    # across the link inside the kernel, "ring" stages them by the copy engine while the GEMM runs
    # (experts/prefill/ring.py; the default: it prefilled faster, docs/measured-defaults.md); and the
    # ring's G rows per buffer and D buffers.
    prefill_stream: str = "ring"
    ring_group: int = RING_GROUP
    ring_depth: int = RING_DEPTH
    gemm: GemmConfig = field(default_factory=GemmConfig)  # block sizes of the grouped expert GEMM
    # hybrid backend: the host expert kernel (cpu_experts.py; auto: the compiled one where it builds,
    # else grouped), its threads (None: torch's count), and the path rates (None: measured when the
    # first layer is built)
    host_kernel: str = "auto"
    host_threads: int | None = None
    rates: PathRates | None = None
    # hybrid: the host's share as a host-function node of the engine's one decode graph (graph-safe, no
    # host sync; experts/hybrid/nodes.py; needs the compiled host kernel), or False: the pieces
    # (engine/piecewise.py, a host sync per layer). None: nodes where registry.nodes_by_default() says; True / False
    # force one (tests and scripts/profile_hybrid.py compare the two)
    hybrid_nodes: bool | None = None
    # routed experts under tensor parallelism (experts/parallel/columns.py): "replicate" (every rank holds every
    # expert whole), "columns" (every rank holds I/tp of every expert), "auto" (columns whenever valid).
    # auto is the default: columns measured faster than replicate (docs/measured-defaults.md)
    split: str = "auto"
    # slots, hybrid: per MoE layer the experts (global ids) pinned on the GPU for good, with no host copy
    # (experts/cache/split.py); the others are cached. From --pinned-experts-file or the plan.
    pinned: dict[int, tuple[int, ...]] = field(default_factory=dict)
    # next-layer expert prefetch of slots backends (experts/prefetch.py: off, router, trace); off until
    # the H200 measures it (docs/prefetch.md)
    prefetch: str = "off"

    def slots_for(self, layer: int, num_experts: int, num_pinned: int = 0) -> int:
        """num_experts: this rank's; num_pinned: of them pinned (the default is half the cached ones)."""
        cached = num_experts - num_pinned
        return self.slots_per_layer.get(layer, self.slots if self.slots is not None else max(1, cached // 2))

    def problems(self, shape: MoeShape, moe_layers: list[int], ep: int = 1, tp: int = 1) -> list[str]:
        """Everything wrong with these options for this shape (and tp, ep ranks), one line each."""
        out = split_problems(self.split, shape, tp, ep, self.backend)
        e = shape.num_experts // ep  # the experts one rank holds
        kind = find(self.backend)
        if kind is None:
            out.append(f"unknown expert backend {self.backend!r}; choose one of: {', '.join(NAMES)}")
        else:
            out += kind.problems(self, shape, ep, tp)
        if self.slots is not None and not 1 <= self.slots <= e:
            held = "experts" if ep == 1 else f"experts a rank holds under expert parallelism {ep}"
            out.append(f"--expert-slots {self.slots}: it must be between 1 and the number of {held} ({e})")
        bad = {layer: s for layer, s in self.slots_per_layer.items() if not 1 <= s <= e}
        if bad:
            out.append(f"the slots file gives {len(bad)} layer(s) a count outside 1..{e} (e.g. layer "
                       f"{next(iter(bad))}: {next(iter(bad.values()))})")
        unknown = sorted(set(self.slots_per_layer) - set(moe_layers))
        if unknown:
            out.append(f"the slots file names layers {unknown}, which are not MoE layers of this model "
                       f"({moe_layers[0]}..{moe_layers[-1]})" if moe_layers else
                       f"the slots file names layers {unknown}, but this model has no MoE layers")
        out += self._pinned_problems(shape, moe_layers, ep)
        if self.policy not in POLICIES:
            out.append(f"cache policy {self.policy!r}: choose lru or lfru")
        if self.host_kernel not in HOST_KERNELS:
            out.append(f"host expert kernel {self.host_kernel!r}: choose one of {', '.join(HOST_KERNELS)}")
        if self.host_threads is not None and self.host_threads < 1:
            out.append(f"host threads must be at least 1, got {self.host_threads}")
        if self.prefill not in PREFILL_POLICIES:
            out.append(f"prefill cache policy {self.prefill!r}: choose bypass or refresh")
        if self.prefill_stream not in PREFILL_STREAMS:
            out.append(f"prefill stream {self.prefill_stream!r}: choose uva or ring")
        out += check_geometry(self.ring_group, self.ring_depth)
        if self.prefetch not in PREFETCH_MODES:
            out.append(f"expert prefetch {self.prefetch!r}: choose one of {', '.join(PREFETCH_MODES)}")
        return out

    def _pinned_problems(self, shape: MoeShape, moe_layers: list[int], ep: int) -> list[str]:
        if not any(self.pinned.values()):
            return []
        kind = find(self.backend)
        if kind is None or not kind.cached:
            cached = either(k.name for k in KINDS.values() if k.cached)
            return [f"pinned experts need the {cached} backend (got {self.backend}); resident pins them all"]
        unknown = sorted(set(self.pinned) - set(moe_layers))
        if unknown:
            return [f"the pinned file names layers {unknown}, which are not MoE layers of this model"]
        for layer, ids in sorted(self.pinned.items()):
            for rank in range(ep):
                mine = local_pinned(ids, rank, ep)
                e = shape.num_experts // ep
                got = check_pinned(tuple(ids), shape.num_experts, 0) if rank == 0 else []
                got += check_pinned(mine, e, self.slots_for(layer, e, len(mine)))
                if got:
                    return [f"layer {layer}: {got[0]}"]
        return []


class ExpertPlacement:
    def __init__(self, shape: MoeShape, dtype: torch.dtype, moe_layers: list[int], options: ExpertOptions,
                 device: torch.device | str, decode_tokens: int, par: Parallel = Parallel()):
        self.dtype, self.options, self.par = dtype, options, par
        self.device, self.decode_tokens = torch.device(device), decode_tokens
        self.full_shape = shape
        # the experts this rank holds, in local-id order (all of them without expert parallelism)
        self.num_local = local_experts(shape.num_experts, par.ep)
        self.owned = owned_experts(shape.num_experts, par.ep_rank, par.ep)
        problems = options.problems(shape, moe_layers, par.ep, par.tp)
        if decode_tokens < 1:
            problems.append(f"the decode token limit must be >= 1, got {decode_tokens}")
        if problems:
            raise MoetierError("; ".join(problems))
        self.split = resolve(options.split, shape, par.tp, par.ep, options.backend)
        self.shape = local_shape(shape, self.split, par.tp)  # this rank's rows
        self.layout = self.shape.layout
        self.moe_layers = moe_layers
        self.kind = backend_kind(options.backend)
        self.store: HostStore | None = None  # made by the first rows() of a host-backed placement
        self.hostpath = None  # hybrid: one host worker and one calibration for every layer
        # per MoE layer the pinned experts (local ids, ascending) and their device block [S + P, R]
        self.pinned = {layer: local_pinned(ids, par.ep_rank, par.ep) for layer, ids in options.pinned.items()}
        self.pinned = {layer: ids for layer, ids in self.pinned.items() if ids}
        self._device_rows: dict[int, torch.Tensor] = {}

    def local_id(self, expert: int) -> int | None:
        """The row of global expert `expert` in this rank's rows; None: another rank owns it."""
        return expert // self.par.ep if expert % self.par.ep == self.par.ep_rank else None

    def rows(self, layer: int) -> torch.Tensor:
        """[E, R] rows the loader fills for `layer` (E: this rank's experts): device memory (resident)
        or the host store."""
        if not self.kind.host_store:
            return torch.empty(self.num_local, self.layout.numel, dtype=self.layout.row_dtype(self.dtype),
                               device=self.device)
        if self.store is None:
            self.store = HostStore(self.moe_layers, self.num_local, self.layout, self.dtype,
                                   pin=self.device.type == "cuda", pinned=self.pinned)
        return self.store.rows(layer)

    def num_slots(self, layer: int) -> int:
        return self.options.slots_for(layer, self.num_local, len(self.pinned.get(layer, ())))

    def device_rows(self, layer: int) -> torch.Tensor | None:
        """[S + P, R] device block of a layer with pinned experts (slots, then pinned[j] at S + j), made at
        the first call; None for a layer without."""
        if layer not in self.pinned:
            return None
        if layer not in self._device_rows:
            n = self.num_slots(layer) + len(self.pinned[layer])
            self._device_rows[layer] = torch.empty(n, self.layout.numel, dtype=self.layout.row_dtype(self.dtype),
                                                   device=self.device)
        return self._device_rows[layer]

    def home(self, layer: int, local: int, rows: torch.Tensor) -> tuple[torch.Tensor, int]:
        """Where the loader writes expert `local` of `layer` (rows: the layer's rows()): (device block,
        its row) for a pinned expert, whose host row stays unbacked; else (rows, local)."""
        held = self.pinned.get(layer, ())
        if local in held:
            return self.device_rows(layer), self.num_slots(layer) + held.index(local)
        return rows, local

    def build(self, layer: int, rows: torch.Tensor) -> ExpertBackend:
        backend = self.kind.build(self, layer, rows)
        if self.split == "columns":
            return ColumnExperts(backend, self.par)
        return ShardedExperts(backend, self.par) if self.par.ep > 1 else backend


def read_slots_file(path: str | Path) -> dict[int, int]:
    """Slots per layer from `moetier trace plan-slots` output: {"slots": {"layer": S, ...}, ...}."""
    try:
        data = json.loads(Path(path).read_text())
        return {int(layer): int(s) for layer, s in data["slots"].items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise MoetierError(f"--expert-slots-file {path}: not a slots file ({e}); make one with "
                           "`moetier trace plan-slots`") from None
