"""Where a model's routed experts live, decided before loading: the rows the loader fills and the
backend each MoE layer gets afterwards."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from moetier.config import ModelConfig
from moetier.errors import MoetierError
from moetier.experts.backends import BACKENDS, ExpertBackend, ResidentExperts, SlotExperts, UvaExperts
from moetier.experts.store import HostStore, RowLayout


@dataclass
class ExpertOptions:
    backend: str = "resident"
    slots: int | None = None  # slots per MoE layer (slots backend); default half the experts
    slots_per_layer: dict[int, int] = field(default_factory=dict)  # overrides `slots` by layer
    # Steps of more tokens (prefill) bypass the cache. With the per-pair GEMV the cached decode path won
    # up to 16 tokens on the H200 (bench layer). The grouped GEMM (grouped.py) reads each distinct expert
    # once per step: 0.30 ms per Qwen3-30B layer at 64 tokens against the GEMV's 0.71 (H200,
    # bench/results/h200-tune-experts.json), so decode batches to 64 stay cached and graph-replayed
    # (docs/bench-decode.md). The crossover against the bypass at 32-64 tokens was not re-measured.
    decode_tokens: int = 64
    fill: str = "kernel"  # "kernel" (graph-safe) or "copy" (copy engine, eager)
    # Victim order of the slot cache. LFRU beats LRU on every committed trace (docs/traces.md).
    policy: str = "lfru"

    def slots_for(self, layer: int, num_experts: int) -> int:
        s = self.slots_per_layer.get(layer, self.slots if self.slots is not None else max(1, num_experts // 2))
        return s


class ExpertPlacement:
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device: torch.device | str, options: ExpertOptions):
        self.cfg, self.dtype, self.device, self.options = cfg, dtype, torch.device(device), options
        self.layout = RowLayout(cfg.hidden_size, cfg.moe_intermediate_size)
        problems = []
        if options.backend not in BACKENDS:
            problems.append(f"unknown expert backend {options.backend!r}; choose one of: {', '.join(BACKENDS)}")
        if options.backend == "slots":
            for layer in cfg.moe_layers:
                s = options.slots_for(layer, cfg.num_experts)
                if not 1 <= s <= cfg.num_experts:
                    problems.append(f"layer {layer}: {s} expert slots; it must be between 1 and "
                                    f"num_experts ({cfg.num_experts})")
        if options.decode_tokens < 1:
            problems.append(f"the decode token threshold must be >= 1, got {options.decode_tokens}")
        if options.policy not in ("lru", "lfru"):
            problems.append(f"cache policy {options.policy!r}: choose lru or lfru")
        unknown = sorted(set(options.slots_per_layer) - set(cfg.moe_layers))
        if unknown:
            problems.append(f"the slots file names layers {unknown}, which are not MoE layers of this model "
                            f"({cfg.moe_layers[0]}..{cfg.moe_layers[-1]})")
        if options.fill not in ("kernel", "copy"):
            problems.append(f"fill must be 'kernel' or 'copy', got {options.fill!r}")
        if problems:
            raise MoetierError("; ".join(problems))
        self.store: HostStore | None = None
        if options.backend in ("slots", "uva"):
            self.store = HostStore(cfg.moe_layers, cfg.num_experts, self.layout, dtype,
                                   pin=self.device.type == "cuda")

    def rows(self, layer: int) -> torch.Tensor:
        """[E, R] rows the loader fills for `layer`: device memory (resident) or the host store."""
        if self.store is None:
            return torch.empty(self.cfg.num_experts, self.layout.numel, dtype=self.dtype, device=self.device)
        return self.store.rows(layer)

    def build(self, layer: int, rows: torch.Tensor) -> ExpertBackend:
        o, k = self.options, self.cfg.top_k
        if o.backend == "resident":
            return ResidentExperts(rows, self.layout, k, o.decode_tokens)
        if o.backend == "uva":
            return UvaExperts(rows, self.layout, k, o.decode_tokens, self.device)
        return SlotExperts(rows, self.layout, k, o.slots_for(layer, self.cfg.num_experts), o.decode_tokens,
                           self.device, o.fill, o.policy)


def read_slots_file(path) -> dict[int, int]:
    """Slots per layer from `moetier trace plan-slots` output: {"slots": {"layer": S, ...}, ...}."""
    import json
    from pathlib import Path

    try:
        data = json.loads(Path(path).read_text())
        return {int(layer): int(s) for layer, s in data["slots"].items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise MoetierError(f"--expert-slots-file {path}: not a slots file ({e}); make one with "
                           "`moetier trace plan-slots`") from None
