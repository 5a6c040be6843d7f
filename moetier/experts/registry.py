"""The expert backends by name (`--expert-backend`): one class per backend owns its name, its help
line, its checks of the expert options, what it holds for the memory plan and its build. The command
line, the plan (moetier/plan) and the placement ask here; nobody else compares backend names.

    kind = backend_kind("slots")           # unknown names: one MoetierError naming the choices
    kind.cached, kind.host_store           # what the plan counts (slots per layer, the host store)
    kind.problems(options, shape, ep, tp)  # its own checks, one line each
    kind.build(placement, layer, rows)     # -> ExpertBackend for one MoE layer

"auto" is no backend: the memory plan chooses one (plan/sizing.auto_plan) before anything is built.
"""

from __future__ import annotations

import torch

from moetier.errors import MoetierError
from moetier.experts.backends import ExpertBackend, ResidentExperts, SlotExperts, UvaExperts
from moetier.experts.shape import MoeShape

AUTO = "auto"  # the memory plan chooses (resident when every expert fits, else slots)


class BackendKind:
    name: str
    help: str
    cached = False  # an HBM slot cache per MoE layer over the host store: slots per layer, --expert-slots
    host_store = True  # every routed expert has a row in the pinned host store (False: rows on the device)
    host_compute = False  # the host cores compute some misses: host buffers, graph pieces (plan/memory.py)
    expert_parallel = True  # may run under expert parallelism (--ep)
    column_split = True  # may hold a column share of every expert under --tp (experts/parallel/columns.py)

    def device_rows(self, num_experts: int, slots: int) -> int:
        """Expert rows one MoE layer holds in device memory (slots: that layer's slot count)."""
        return 0

    def layer_state(self, shape: MoeShape, dtype: torch.dtype, decode_tokens: int, slots: int,
                    pinned: int = 0) -> list[int]:
        """Bytes of each device tensor one layer's backend holds besides its rows and decode output
        (pinned: that layer's pinned experts, experts/cache/split.py)."""
        return []

    def problems(self, options, shape: MoeShape, ep: int = 1, tp: int = 1) -> list[str]:
        """What is wrong with ExpertOptions `options` for this backend, one line each."""
        out = []
        if ep > 1 and not self.expert_parallel:
            out.append(f"expert parallelism with the {self.name} backend is not supported yet; choose "
                       f"{either(k.name for k in KINDS.values() if k.expert_parallel)}")
        return out

    def build(self, placement, layer: int, rows: torch.Tensor) -> ExpertBackend:
        raise NotImplementedError


class Resident(BackendKind):
    name = "resident"
    help = "every expert in GPU memory"
    host_store = False

    def device_rows(self, num_experts, slots):
        return num_experts

    def build(self, placement, layer, rows):
        o = placement.options
        return ResidentExperts(rows, placement.layout, placement.shape.top_k, placement.decode_tokens, o.gemm)


class Slots(BackendKind):
    name = "slots"
    help = "an HBM slot cache over pinned host memory"
    cached = True

    def device_rows(self, num_experts, slots):
        return slots

    def layer_state(self, shape, dtype, decode_tokens, slots, pinned=0):
        return slot_cache_state(shape.num_experts, slots, decode_tokens * shape.top_k, pinned)

    def build(self, placement, layer, rows):
        o, p = placement.options, placement
        return SlotExperts(rows, p.layout, p.shape.top_k, p.num_slots(layer), p.decode_tokens, p.device,
                           o.policy, o.gemm, o.prefill, o.prefill_stream, (o.ring_group, o.ring_depth),
                           p.pinned.get(layer, ()), p.device_rows(layer))


class Uva(BackendKind):
    name = "uva"
    help = "read from host memory on every use"

    def layer_state(self, shape, dtype, decode_tokens, slots, pinned=0):
        # the [P] sentinel slot ids and one dummy device row (experts/backends.UvaExperts)
        return [4 * decode_tokens * shape.top_k, shape.layout.row_bytes(dtype)]

    def build(self, placement, layer, rows):
        p = placement
        return UvaExperts(rows, p.layout, p.shape.top_k, p.decode_tokens, p.device, p.options.gemm)


class Hybrid(Slots):
    name = "hybrid"
    help = "slots whose misses the host cores may compute"
    host_compute = True
    expert_parallel = False
    column_split = False

    def build(self, placement, layer, rows):
        from moetier.experts.hybrid.backend import HostPath, HybridExperts
        from moetier.experts.hybrid.nodes import HybridNodesExperts

        o, p = placement.options, placement
        nodes = o.hybrid_nodes
        if nodes is None:
            nodes = nodes_by_default(p.device, o.host_kernel, p.par.tp * p.par.ep, p.layout.quant)
        if p.hostpath is None:  # one host worker and one calibration for every layer
            p.hostpath = HostPath(p.layout, o.host_kernel, o.host_threads, o.rates)
        kind = HybridNodesExperts if nodes else HybridExperts
        hybrid = kind(rows, p.layout, p.shape.top_k, p.num_slots(layer), p.decode_tokens, p.device,
                      o.policy, o.gemm, p.hostpath, p.pinned.get(layer, ()), p.device_rows(layer))
        hybrid.prefill = o.prefill  # its large steps are SlotExperts._bypass
        hybrid.prefill_stream, hybrid.ring_shape = o.prefill_stream, (o.ring_group, o.ring_depth)
        return hybrid


KINDS: dict[str, BackendKind] = {k.name: k for k in (Resident(), Slots(), Uva(), Hybrid())}
NAMES = tuple(KINDS)  # resident, slots, uva, hybrid


def backend_kind(name: str) -> BackendKind:
    kind = KINDS.get(name)
    if kind is None:
        raise MoetierError(f"--expert-backend {name!r}: unknown expert backend; choose {either((AUTO, *NAMES))}")
    return kind


def either(names) -> str:
    """'a, b or c'."""
    names = list(names)
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} or {names[-1]}"


def find(name: str) -> BackendKind | None:
    """The kind of `name`, None for auto (not chosen yet) or an unknown name."""
    return KINDS.get(name)


def choices_help() -> str:
    """The choices of --expert-backend, for every command's help."""
    kinds = ", ".join(f"{k.name} ({k.help})" for k in KINDS.values())
    return (f"Where routed experts live: {AUTO} (resident when every expert fits the memory plan, else as many "
            f"slots as fit), {kinds}.")


def slot_cache_state(num_experts: int, num_slots: int, max_pairs: int, pinned: int = 0) -> list[int]:
    """Device tensors of one slots layer besides its rows: SlotCache (cache/slots.py: expert_slot, freq,
    fepoch [E] int32; slot_expert [S] int32; stamp [S] int64; clock [1], stats [5] int64; the pinned
    experts' ids [P] int64 and rows [P] int32), the prefill refresh
    counter (backends.SlotExperts, int64 [1]) and BookkeepingScratch (cache/slot_kernels.py: first [E],
    used [S], victim [next_pow2(S)], slots_out / miss_expert / miss_slot [max(P, S)]: a refresh step
    asks for S ids, miss_count [1], all int32)."""
    e, s, p = num_experts, num_slots, max(max_pairs, num_slots)
    held = [8 * pinned, 4 * pinned] if pinned else []  # empty tensors take no block
    return [4 * e, 4 * e, 4 * e, 4 * s, 8 * s, 8, 40, 8, *held,
            4 * e, 4 * s, 4 * (1 if s <= 1 else 1 << (s - 1).bit_length()), 4 * p, 4 * p, 4 * p, 4]


def nodes_by_default(device: torch.device | str = "cuda", host_kernel: str = "auto", ranks: int = 1,
                     quant: str | None = None) -> bool:
    """Whether a hybrid backend whose options leave hybrid_nodes None runs the nodes mode: on CUDA with
    the compiled host kernel (which the node calls; a torch kernel named by host_kernel keeps the pieces),
    one rank and unquantized rows, where it measured the fastest (docs/hybrid.md). Several ranks' nodes
    graphs and FP8 rows in them have not run on a GPU: those keep the pieces."""
    from moetier.experts.hybrid import host_ext

    return (ranks == 1 and quant is None and torch.device(device).type == "cuda"
            and host_kernel in ("auto", "compiled") and host_ext.available()[0])
