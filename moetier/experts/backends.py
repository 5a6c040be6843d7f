"""The ExpertBackend interface (one per MoE layer) and its `resident` implementation.

    forward(hidden [T, H], topk_ids [T, k], topk_weights [T, k]) -> [T, H]

Weights follow the transformers 5 fused layout: w13 [E, 2I, H] (gate rows, then up rows) and
w2 [E, H, I]. Every backend computes each (token, expert) pair with the same ops and combines the
k outputs in slot order, so a backend that only changes where an expert's bytes sit (slots, uva)
is bit-exact against `resident`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from moetier.errors import MoetierError
from moetier.models.layers import silu_mul


@dataclass
class ExpertWeights:
    """One MoE layer's routed experts, as the loader fills them."""

    w13: torch.Tensor  # [E, 2I, H]
    w2: torch.Tensor  # [E, H, I]

    @property
    def num_experts(self) -> int:
        return self.w13.shape[0]

    @property
    def expert_nbytes(self) -> int:
        return (self.w13[0].numel() + self.w2[0].numel()) * self.w13.element_size()


def expert_pairs(hidden: torch.Tensor, topk_ids: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                 index: torch.Tensor | None = None) -> torch.Tensor:
    """Outputs of every (token, slot) pair, before weighting: [T, k, H].

    `index` maps expert ids to rows of w13/w2 (identity when None): a cache passes its slot ids here.
    Experts are visited one at a time over the tokens that chose them; each pair's result does not
    depend on which other pairs share its expert, so the order of visits never changes a bit.
    """
    t, k = topk_ids.shape
    rows = topk_ids if index is None else index
    flat_rows = rows.reshape(-1)
    flat_tok = torch.arange(t, device=hidden.device).repeat_interleave(k)
    out = hidden.new_empty(t * k, hidden.shape[-1])
    order = torch.argsort(flat_rows, stable=True)
    sorted_rows = flat_rows[order]
    # NOTE: host-side loop over used rows; this is the CPU path. The GPU path is a grouped kernel.
    uniq, counts = torch.unique_consecutive(sorted_rows, return_counts=True)
    begin = 0
    for row, n in zip(uniq.tolist(), counts.tolist()):
        pairs = order[begin:begin + n]
        begin += n
        x = hidden[flat_tok[pairs]]  # [n, H]
        h = silu_mul(F.linear(x, w13[row]))  # [n, I]
        out[pairs] = F.linear(h, w2[row])
    return out.view(t, k, -1)


def combine(pair_out: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
    # pair_out: [T, k, H], topk_weights: [T, k] -> [T, H]; a fixed reduction order over k.
    return (pair_out * topk_weights[..., None].to(pair_out.dtype)).sum(dim=1)


class ExpertBackend(ABC):
    """Computes one MoE layer's routed experts for the tokens of a step."""

    name: str

    @abstractmethod
    def forward(self, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        ...

    @abstractmethod
    def nbytes(self) -> dict[str, int]:
        """Bytes this backend holds, by tier ('device', 'host')."""


class ResidentExperts(ExpertBackend):
    """Every expert in the compute device's memory. The ceiling and the reference."""

    name = "resident"

    def __init__(self, weights: ExpertWeights):
        self.w13 = weights.w13
        self.w2 = weights.w2

    def forward(self, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        return combine(expert_pairs(hidden, topk_ids, self.w13, self.w2), topk_weights)

    def nbytes(self) -> dict[str, int]:
        n = self.w13.numel() * self.w13.element_size() + self.w2.numel() * self.w2.element_size()
        return {"device": n, "host": 0}


BACKENDS = {"resident": ResidentExperts}


def make_backend(name: str, weights: ExpertWeights) -> ExpertBackend:
    if name not in BACKENDS:
        raise MoetierError(f"unknown expert backend {name!r}; choose one of: {', '.join(BACKENDS)}")
    return BACKENDS[name](weights)
