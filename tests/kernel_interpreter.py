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

from moetier.experts import pair_gemv as gemm, slot_kernels as kernels  # noqa: E402
from moetier.experts.reference import combine, expert_pairs, row_fetch  # noqa: E402
from moetier.experts.slots import SlotCache, policy_for  # noqa: E402
from moetier.experts.shape import RowLayout  # noqa: E402


def bookkeeping(num_experts: int, num_slots: int, steps: int, seed: int, policy: str = "lru") -> dict:
    g = torch.Generator().manual_seed(seed)
    pol = policy_for(policy, num_slots, 4)
    ref, ker = SlotCache(num_experts, num_slots, policy=pol), SlotCache(num_experts, num_slots, policy=pol)
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


def expert_mlp(seed: int) -> float:
    g = torch.Generator().manual_seed(seed)
    e, h, i, k, t, s = 32, 40, 24, 3, 2, 6
    layout = RowLayout(h, i)
    rows = torch.randn(e, layout.numel, generator=g) * 0.1
    x = torch.randn(t, h, generator=g)
    ids = torch.tensor([[3, 7, 1], [7, 2, 30]])
    w = torch.rand(t, k, generator=g)
    slots = torch.zeros(s, layout.numel)
    slots[0], slots[2], slots[1] = rows[3], rows[1], rows[2]
    slot_ids = torch.tensor([[0, -1, 2], [-1, 1, -1]], dtype=torch.int32)  # -1: read the host row
    out = torch.empty(t, h)
    gemm.expert_mlp(x, slot_ids, ids, w, slots, rows, h, i, torch.empty(t * k, i), out, (8, 16, 4), (8, 16, 4))
    want = combine(expert_pairs(x, ids, row_fetch(rows, layout)), w)
    return ((out - want).norm() / want.norm()).item()


if __name__ == "__main__":
    for e, s, policy in ((32, 6, "lru"), (64, 20, "lru"), (128, 64, "lru"), (32, 6, "lfru"), (64, 20, "lfru")):
        print("bookkeeping", policy, e, s, bookkeeping(e, s, steps=120, seed=e + s, policy=policy))
    # NOTE: bookkeeping is integers, so equal to the reference under any CPU; the expert GEMV goes
    # through the interpreter's tl.dot (numpy's BLAS matmul), so only a tolerance is promised there.
    err = expert_mlp(0)
    assert err < 1e-5, err
    print("expert_mlp rel err", err)
    sys.exit(0)
