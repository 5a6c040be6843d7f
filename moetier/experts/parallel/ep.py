"""Expert parallelism: one rank's share of a MoE layer's routed experts, behind the ordinary
ExpertBackend interface, so the model and the MoE block never know the experts are split.

Ownership is strided: rank r of ep ranks owns the experts e with e % ep == r, at local id e // ep
(strided rather than contiguous ranges: neighbouring expert ids, which published routers often
use together, land on different ranks). Its host store and its slots hold only those E / ep rows.

    ShardedExperts(inner, rank, ep, par).forward(hidden [T, H], topk_ids [T, k], w [T, k]) -> [T, H]
        every rank routes every token (the router is replicated); pairs of experts this rank owns
        are computed by `inner` (any backend, built over the E / ep local rows) at their local ids,
        the other pairs carry the sentinel id -1 and contribute zero; one all-reduce over the ep
        group sums the ranks' partial outputs into the full MoE output, identical on every rank.
"""

from __future__ import annotations

import torch

from moetier.errors import MoetierError
from moetier.experts.backends import ExpertBackend
from moetier.parallel import Parallel

NOT_MINE = -1  # the topk id of a pair another rank computes (every backend path, CPU and CUDA, skips it)


def local_experts(num_experts: int, ep: int, what: str = "num_experts") -> int:
    """Experts per rank; every rank must hold the same number (fixed shapes: slots, stores)."""
    if num_experts % ep:
        raise MoetierError(f"expert parallelism {ep} does not divide {what} ({num_experts}): every rank "
                           f"must own the same number of experts; choose an expert-parallel size that "
                           f"divides {num_experts}")
    return num_experts // ep


def owned_experts(num_experts: int, rank: int, ep: int) -> list[int]:
    """The global ids rank `rank` owns, in local-id order: local id i is global id i * ep + rank."""
    return list(range(rank, num_experts, ep))


def local_ids(topk_ids: torch.Tensor, rank: int, ep: int) -> torch.Tensor:
    """[T, k] global expert ids -> [T, k] local ids of this rank's experts, NOT_MINE for the others.
    Device ops only (no host sync)."""
    return torch.where(topk_ids % ep == rank, topk_ids // ep, torch.full_like(topk_ids, NOT_MINE))


class ReducedExperts(ExpertBackend):
    """A rank's share of a MoE layer's routed experts (inner: any backend over this rank's rows) and the
    all-reduce over the `over` group that sums the ranks' partial outputs into the whole MoE output.
    Subclasses say what the share is: ShardedExperts (experts by owner, ids made local) and
    columns.ColumnExperts (every expert's I/tp columns, ids unchanged)."""

    over = "ep"

    def __init__(self, inner: ExpertBackend, par: Parallel, name: str):
        self.inner, self.par, self.name = inner, par, name
        # the all-reduce is captured inside the decode graph on every rank (engine/graphs.py)
        self.graph_safe = getattr(inner, "graph_safe", True)
        self.layout, self.top_k, self.device = inner.layout, inner.top_k, inner.device
        self.decode_tokens, self.cuda = inner.decode_tokens, inner.cuda

    def ids(self, topk_ids: torch.Tensor) -> torch.Tensor:
        return topk_ids

    def forward(self, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        # [T, H]: this rank's part; summed over the ranks by the all-reduce (in place)
        out = self.inner.forward(hidden, self.ids(topk_ids), topk_weights).contiguous()
        return self.par.all_reduce(out, self.over)

    def nbytes(self) -> dict[str, int]:
        return self.inner.nbytes()

    def stats(self) -> dict[str, int]:
        return self.inner.stats()  # this rank's share only

    def reset(self) -> None:
        self.inner.reset()


class ShardedExperts(ReducedExperts):
    """One rank's experts (inner: a backend over its local rows) plus the all-reduce of the layer."""

    over = "ep"

    def __init__(self, inner: ExpertBackend, par: Parallel):
        super().__init__(inner, par, f"{inner.name}+ep{par.ep}")
        self.rank, self.ep = par.ep_rank, par.ep

    def ids(self, topk_ids: torch.Tensor) -> torch.Tensor:
        return local_ids(topk_ids, self.rank, self.ep)
