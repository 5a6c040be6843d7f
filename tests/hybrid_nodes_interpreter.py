"""Runs the hybrid nodes mode's device plan (experts/hybrid/device_plan.plan_kernel, one Triton program) in
Triton's interpreter on the CPU and holds it to its torch reference (plan_reference) bit for bit: dev_ids,
the host job (count, tokens, experts), the positions and the counters, over random steps of 1 to 64
tokens of top-8 (8 to 512 pairs) and small shapes, with cached experts, NOT_MINE ids (-1), repeated
experts across tokens, rates that send nothing, everything or a split to the host, and an infinite host
cost; and that the per-expert scratch is restored after every step.

Run as a script (TRITON_INTERPRET must be set before triton is imported); test_hybrid_nodes.py does
that in a subprocess. What it cannot check: the kernel's speed, or the GPU's atomics and barrier.
"""

from __future__ import annotations

import math
import os

os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402

from moetier.experts.hybrid.cost_model import CostModel, PathRates  # noqa: E402
from moetier.experts.hybrid.device_plan import (  # noqa: E402
    BIG32,
    PlanBuffers,
    plan_kernel,
    plan_rates,
    plan_reference,
)


def case(g: torch.Generator, e: int, t: int, k: int, slots: int, link: float, host: float, token_s: float):
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
    ids[torch.rand(t, k, generator=g) < 0.1] = -1  # another rank's experts
    expert_slot = torch.full((e,), -1, dtype=torch.int32)
    cached = torch.randperm(e, generator=g)[:slots]
    expert_slot[cached] = torch.arange(slots, dtype=torch.int32)
    model = CostModel(PathRates(link, {"bfloat16": host}, 1e-4 * float(torch.rand(1, generator=g)), token_s),
                      9_437_184, "bfloat16")
    return ids, expert_slot, plan_rates(model, t)


def main() -> None:
    g = torch.Generator().manual_seed(0)
    shapes = [(16, 1, 4), (16, 3, 4), (128, 1, 8), (128, 8, 8), (128, 64, 8), (32, 17, 2)]
    rates = [(55.0, 75.0, 1e-5), (55.0, 0.0, 0.0), (1e-3, 1e6, 0.0), (1e6, 1e-3, 0.0), (20.0, 30.0, 0.0)]
    n = split = 0
    for e, t, k in shapes:
        for link, host, token_s in rates:
            for _ in range(2):
                ids, expert_slot, table = case(g, e, t, k, int(torch.randint(0, e, (1,), generator=g)), link,
                                               host, token_s)
                a, b = PlanBuffers(e, 64 * 8, "cpu"), PlanBuffers(e, 64 * 8, "cpu")
                ca, cb = torch.tensor([3, 5]), torch.tensor([3, 5])
                plan_kernel(ids, expert_slot, table, a, ca)
                plan_reference(ids, expert_slot, table, b, cb)
                p, nh = t * k, int(b.job[0])
                assert torch.equal(a.dev_ids[:p], b.dev_ids[:p]), (e, t, k, link, host)
                assert int(a.job[0]) == nh
                assert torch.equal(a.job[1:1 + nh], b.job[1:1 + nh])
                assert torch.equal(a.job[1 + a.max_pairs:1 + a.max_pairs + nh], b.job[1 + b.max_pairs:1 + b.max_pairs + nh])
                assert torch.equal(a.pos[:p], b.pos[:p]) and torch.equal(ca, cb)
                assert bool((a.first == BIG32.value).all()) and bool((a.count == 0).all())  # scratch restored
                if host == 0.0 or not math.isfinite(float(table[3])):
                    assert nh == 0
                misses = (expert_slot[ids.clamp(min=0)] < 0) & (ids >= 0)
                split += 0 < nh < int(misses.sum())
                n += 1
    assert split >= 5, split  # the rates above really split some steps
    print(f"ok: {n} plans equal, {split} split")


if __name__ == "__main__":
    main()
