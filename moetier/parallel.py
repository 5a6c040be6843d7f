"""The parallel layout one rank runs under: a plain record handed to the model, its layers and the
expert placement when they are built (never a global; moetier/dist sets up the process group).

    Parallel(rank, world, tp, ep, group, timer)
        tp  tensor-parallel size: attention heads and dense MLP columns split over tp ranks
        ep  expert-parallel size: the routed experts split over ep ranks (expert e on rank e % ep)
        group  the torch.distributed process group of the collectives (None: the default group)
        timer  a CollectiveTimer (dist/timing.py) the benchmarks switch on; off, it costs one check

Step 1 of issue 18: tp and ep are each 1 or the whole world (so both groups are the world group),
and rank r is TP rank r and EP rank r. Parallel() is the single-process layout: every collective is
a no-op and every split is the whole.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from moetier.errors import MoetierError


@dataclass(frozen=True)
class Parallel:
    rank: int = 0
    world: int = 1
    tp: int = 1
    ep: int = 1
    group: Any = None  # a torch.distributed ProcessGroup; None: the default (world) group
    timer: Any = field(default=None, compare=False)  # a CollectiveTimer, or None

    def __post_init__(self):
        problems = layout_problems(self.world, self.tp, self.ep)
        if not 0 <= self.rank < self.world:
            problems.append(f"rank {self.rank} is outside 0..{self.world - 1}")
        if problems:
            raise MoetierError("invalid parallel layout: " + "; ".join(problems))

    @classmethod
    def of(cls, tp: int = 1, ep: int = 1, rank: int = 0) -> Parallel:
        """Rank `rank`'s layout of tensor-parallel tp and expert-parallel ep (world: the larger)."""
        return cls(rank, max(tp, ep), tp, ep)

    @property
    def tp_rank(self) -> int:
        return self.rank if self.tp > 1 else 0

    @property
    def ep_rank(self) -> int:
        return self.rank if self.ep > 1 else 0

    def tp_split(self, n: int, what: str) -> int:
        """n // tp: this rank's share of n heads / columns; a clear error when tp does not divide n."""
        if n % self.tp:
            raise MoetierError(f"tensor parallelism {self.tp} does not divide {what} ({n}): every rank must "
                               f"hold the same number; choose a tensor-parallel size that divides {n}")
        return n // self.tp

    def all_reduce(self, x: torch.Tensor, over: str) -> torch.Tensor:
        """Sum x [*] over the ranks of `over` ("tp" or "ep") in place; a no-op when that size is 1.
        NOTE: every rank of the group must call it in the same order (the step protocol guarantees it)."""
        if (self.tp if over == "tp" else self.ep) > 1:
            import torch.distributed as dist

            if self.timer is not None and self.timer.on:
                with self.timer.span(over, x):
                    dist.all_reduce(x, group=self.group)
            else:
                dist.all_reduce(x, group=self.group)
        return x


def layout_problems(world: int, tp: int, ep: int) -> list[str]:
    """What is wrong with a (world, tp, ep) layout, one line each (step 1: tp, ep in {1, world})."""
    out = []
    for name, v in (("world size", world), ("tensor-parallel size", tp), ("expert-parallel size", ep)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            out.append(f"{name} must be a positive integer, got {v!r}")
    if out:
        return out
    if world != max(tp, ep):
        out.append(f"world size {world} must equal the larger of tensor-parallel {tp} and expert-parallel {ep}")
    for name, v in (("tensor-parallel", tp), ("expert-parallel", ep)):
        if v not in (1, world):
            out.append(f"{name} size {v} must be 1 or the world size {world} (groups inside the world are "
                       "not supported yet)")
    return out
