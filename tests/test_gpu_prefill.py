"""GPU tests of the large-step (prefill) expert path; skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

from tests.test_gpu import QE, QH, QK, qwen_rows, random_ids

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("t,dup", [(65, False), (512, False), (1024, True)])
def test_large_step_backends_vs_float64_exact_and_without_host_sync(t, dup):
    """Issue 16: steps above the decode limit take the large-step grouped GEMM on every backend: within
    bf16 tolerance of a float64 oracle, bit-exact between resident, slots (half the experts in slots,
    misses read across the link) and uva, and no host synchronisation anywhere in the step (CUDA's
    sync-debug mode raises on one)."""
    from moetier.experts.backends import ResidentExperts, SlotExperts, UvaExperts
    from moetier.experts.reference import combine, expert_pairs

    store, layout = qwen_rows(seed=2)
    host = store.rows(0)
    dev = host.cuda()
    resident = ResidentExperts(dev, layout, QK)
    slots = SlotExperts(host, layout, QK, num_slots=QE // 2, device="cuda")
    slots.cache.warm(list(range(0, QE, 2)))  # every other expert in a slot
    slots.slots.copy_(dev[slots.cache.slot_expert.long()])
    uva = UvaExperts(host, layout, QK, device="cuda")
    g = torch.Generator().manual_seed(t)
    x = torch.randn(t, QH, generator=g).to(torch.bfloat16).cuda()
    ids = random_ids(g, t, QK, QE, dup=dup).cuda()
    w = torch.rand(t, QK, generator=g).to(torch.bfloat16).cuda()
    state = slots.cache.state()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        got = {name: b.forward(x, ids, w) for name, b in (("resident", resident), ("slots", slots), ("uva", uva))}
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert torch.equal(got["slots"], got["resident"]) and torch.equal(got["uva"], got["resident"])
    for k, v in slots.cache.state().items():  # prefill leaves the cache alone
        assert torch.equal(v, state[k]), k
    assert resident.stats()["bypassed"] == slots.stats()["bypassed"] == uva.stats()["bypassed"] == 1

    def fetch(key):
        row = dev[key:key + 1].double()
        return layout.w13(row)[0], layout.w2(row)[0]
    want = combine(expert_pairs(x.double(), ids, fetch), w.double())
    err = ((got["resident"].double() - want).norm() / want.norm()).item()
    assert err <= 1e-2, err
