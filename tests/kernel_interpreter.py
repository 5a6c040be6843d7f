"""Runs the Triton kernels in Triton's interpreter on the CPU against their torch references.

Run as a script (TRITON_INTERPRET must be set before triton is imported); test_kernels_interpreter.py
does that in a subprocess. The persistent copy kernel loops over a device-side count, which the
interpreter cannot run; the GPU tests cover it.
"""

from __future__ import annotations

import os
import sys

os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402

from moetier.experts.cache import slot_kernels as kernels  # noqa: E402
from moetier.experts.cache.slots import SlotCache, policy_for  # noqa: E402


def bookkeeping(num_experts: int, num_slots: int, steps: int, seed: int, policy: str = "lru",
                pinned: tuple[int, ...] = ()) -> dict:
    g = torch.Generator().manual_seed(seed)
    pol = policy_for(policy, num_slots, 4)
    ref = SlotCache(num_experts, num_slots, policy=pol, pinned=pinned)
    ker = SlotCache(num_experts, num_slots, policy=pol, pinned=pinned)
    scratch = kernels.BookkeepingScratch(num_experts, num_slots, 128, torch.device("cpu"))
    for step in range(steps):
        t, k = [1, 2, 3, 20][step % 4], 4  # 20 x 4 = 80 pairs take the barrier kernel
        if step % 7 == 0:
            ids = torch.randint(0, 5, (t, k), generator=g)  # duplicates
        else:
            ids = torch.stack([torch.randperm(num_experts, generator=g)[:k] for _ in range(t)])
        want_slots, want_miss = ref.step_reference(ids)
        got_slots = kernels.bookkeeping(ker, scratch, ids)
        assert torch.equal(want_slots, got_slots), (step, want_slots, got_slots)
        for name in ("expert_slot", "slot_expert", "stamp", "clock", "stats", "freq", "fepoch"):
            assert torch.equal(getattr(ref, name), getattr(ker, name)), (step, name)
        n = int(want_miss.count)
        assert int(scratch.miss_count) == n
        assert torch.equal(want_miss.expert[:n], scratch.miss_expert[:n])
        assert torch.equal(want_miss.slot[:n], scratch.miss_slot[:n])
        ker.check()
    return ref.read_stats()


if __name__ == "__main__":
    for e, s, policy in ((32, 6, "lru"), (64, 20, "lru"), (128, 64, "lru"), (32, 6, "lfru"), (64, 20, "lfru")):
        print("bookkeeping", policy, e, s, bookkeeping(e, s, steps=120, seed=e + s, policy=policy))
    # pinned experts (experts/cache/split.py): permanent hits at rows after the slots, in both kernels
    for e, s, policy in ((32, 6, "lru"), (64, 20, "lfru")):
        got = bookkeeping(e, s, steps=120, seed=e + s + 1, policy=policy, pinned=tuple(range(0, e, 3)))
        print("pinned", policy, e, s, got)
    sys.exit(0)
