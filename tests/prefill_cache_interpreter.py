"""The refresh step of a prefill on the Triton bookkeeping kernel (prefill_cache.refresh_device), in
Triton's CPU interpreter, against the torch reference (refresh_reference): the same maps, stamps,
clock, use counts, miss list, and counters left alone, over churning chunks for both policies and
for slot counts that take the register kernel (S <= 64) and the barrier kernel. Run as a script
(TRITON_INTERPRET must be set before triton is imported); test_prefill_cache.py does that."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402

from moetier.experts.prefill.cache_policy import refresh_device, refresh_reference  # noqa: E402
from moetier.experts.cache.slot_kernels import BookkeepingScratch  # noqa: E402
from moetier.experts.cache.slots import STATE, SlotCache, policy_for  # noqa: E402


def run(num_experts: int, num_slots: int, policy: str, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    pol = policy_for(policy, num_slots, 4)
    ref, ker = SlotCache(num_experts, num_slots, policy=pol), SlotCache(num_experts, num_slots, policy=pol)
    scratch = BookkeepingScratch(num_experts, num_slots, max(32, num_slots), torch.device("cpu"))
    for step in range(12):
        if step % 3 == 2:  # a decode step between chunks, so stamps and use counts differ
            ids = torch.randperm(num_experts, generator=g)[:4].view(1, 4)
            ref.step_reference(ids)
            ker.step_reference(ids)
            continue
        t = [3, 40, 200][step % 3]  # 3 tokens x 4: fewer experts than slots, padded ranking
        hot = torch.randperm(num_experts, generator=g)[: max(4, num_experts // 4)]
        pick = torch.randint(0, hot.numel(), (t, 4), generator=g)
        ids = torch.where(torch.rand(t, 4, generator=g) < 0.8, hot[pick],
                          torch.randint(0, num_experts, (t, 4), generator=g))
        miss = refresh_reference(ref, ids)
        refresh_device(ker, scratch, ids)
        for name in STATE:
            assert torch.equal(getattr(ref, name), getattr(ker, name)), (step, name)
        n = int(miss.count)
        assert int(scratch.miss_count) == n, (step, n, int(scratch.miss_count))
        assert torch.equal(miss.expert[:n], scratch.miss_expert[:n])
        assert torch.equal(miss.slot[:n], scratch.miss_slot[:n])
        ker.check()
        assert int(ker.stats[3]) == (step + 1) // 3  # only the decode steps between chunks counted


if __name__ == "__main__":
    for e, s in ((32, 8), (128, 64), (128, 100)):  # 100 slots: BLOCK_N 128, the barrier kernel
        for policy in ("lru", "lfru"):
            run(e, s, policy, seed=e + s)
    print("refresh steps ok")
