"""GPU tests of the prefill cache policy (experts/prefill/cache_policy.py) on CUDA; skipped without it.
The refresh path (ranking on the device, the fused bookkeeping kernel, copy_rows, then the large-step
GEMM) must: give the bypass path's bits (and resident's), leave the cache consistent and equal to
the torch reference's, and run without a host sync (sync-debug mode) and under a CUDA graph capture."""

from __future__ import annotations

import pytest
import torch

from tests.test_gpu import QE, QH, QK, qwen_rows, random_ids

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def backends(seed: int, policy: str = "lfru"):
    from moetier.experts.backends import ResidentExperts, SlotExperts

    store, layout = qwen_rows(seed=seed)
    host = store.rows(0)
    dev = host.cuda()
    resident = ResidentExperts(dev, layout, QK)
    out = {"resident": resident, "store": store, "host": host}
    # bypass with the uva prefill stream: the ring (the default) reads its miss list on the host
    # (experts/prefill/ring.py), and these tests hold the path to no host sync; "ring" is held to its bits
    for name, prefill, stream in (("bypass", "bypass", "uva"), ("refresh", "refresh", "uva"), ("ring", "bypass", "ring")):
        s = SlotExperts(host, layout, QK, num_slots=QE // 2, device="cuda", policy=policy, prefill=prefill,
                        prefill_stream=stream)
        s.cache.warm(list(range(0, QE, 2)))  # every other expert in a slot
        s.cache.stats.zero_()
        s.slots.copy_(dev[s.cache.slot_expert.long()])
        out[name] = s
    return out


def inputs(t: int, dup: bool):
    g = torch.Generator().manual_seed(t)
    x = torch.randn(t, QH, generator=g).to(torch.bfloat16).cuda()
    ids = random_ids(g, t, QK, QE, dup=dup).cuda()
    w = torch.rand(t, QK, generator=g).to(torch.bfloat16).cuda()
    return x, ids, w


@pytest.mark.parametrize("t,dup,policy", [(65, False, "lfru"), (512, False, "lru"), (1024, True, "lfru")])
def test_refresh_exact_consistent_and_without_host_sync(t, dup, policy):
    from moetier.experts.prefill.cache_policy import pair_counts, refresh_reference, rows_consistent
    from moetier.experts.cache.slots import STATE, SlotCache

    b = backends(seed=3, policy=policy)
    bypass, refresh = b["bypass"], b["refresh"]
    ref = SlotCache(QE, QE // 2, "cpu", refresh.cache.policy)
    ref.load_state({k: v.cpu() for k, v in refresh.cache.state().items()})
    x, ids, w = inputs(t, dup)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        got_r = refresh.forward(x, ids, w)
        got_b = bypass.forward(x, ids, w)
        want = b["resident"].forward(x, ids, w)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert torch.equal(got_r, got_b) and torch.equal(got_b, want)
    assert torch.equal(b["ring"].forward(x, ids, w), want)
    miss = refresh_reference(ref, ids.cpu())
    for k in STATE:  # the kernel path leaves the cache as the torch reference does
        assert torch.equal(getattr(refresh.cache, k).cpu(), getattr(ref, k)), k
    refresh.cache.check()
    assert rows_consistent(refresh.cache, refresh.slots, b["host"])
    counts = pair_counts(ids.cpu(), QE)
    if int((counts > 0).sum()) >= QE // 2:  # the chunk used at least S experts: its top S are in
        top = torch.argsort(-counts, stable=True)[: QE // 2]
        assert sorted(refresh.cache.slot_expert.cpu().tolist()) == sorted(top.tolist())
    s = refresh.stats()
    assert s["refreshed"] == int(miss.count) and s["hits"] == s["misses"] == s["steps"] == 0
    assert bypass.stats()["refreshed"] == 0


def test_refresh_replays_from_a_cuda_graph():
    """The whole refresh + large-step path captured in a graph (no sync, fixed addresses once
    captured) and replayed from the warm state: the same output and cache as the eager refresh."""
    b = backends(seed=4)
    refresh = b["refresh"]
    x, ids, w = inputs(300, False)
    start = refresh.cache.state()
    slots0 = refresh.slots.clone()
    eager = refresh.forward(x, ids, w).clone()  # also compiles every kernel before the capture
    after = refresh.cache.state()
    torch.cuda.synchronize()
    refresh.cache.load_state(start)
    refresh.slots.copy_(slots0)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):  # a host sync inside would fail the capture
        out = refresh.forward(x, ids, w)
    refresh.cache.load_state(start)  # capture ran nothing, but be sure
    refresh.slots.copy_(slots0)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)
    for k, v in refresh.cache.state().items():
        assert torch.equal(v, after[k]), k
    refresh.cache.check()


def test_engine_greedy_tokens_equal_bypass_and_refresh_on_cuda(tiny_ckpt):
    from moetier.engine.llm import LLM
    from moetier.experts.placement import ExpertOptions
    from moetier.sampling_params import SamplingParams

    prompt = list(range(3, 203))  # 200 tokens: above the decode limit, the large-step path
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    got, stats = {}, {}
    for policy in ("bypass", "refresh"):
        llm = LLM(tiny_ckpt, device="cuda", experts=ExpertOptions("slots", slots=4, prefill=policy),
                  max_num_seqs=2)
        got[policy] = llm.generate([prompt], params)[0].outputs[0].token_ids
        stats[policy] = llm.metrics()["expert_stats"]
        for block in llm.model.moe_blocks():
            block.experts.cache.check()
    assert got["bypass"] == got["refresh"] and len(got["bypass"]) == 40
    assert stats["refresh"]["refreshed"] > 0 and stats["bypass"]["refreshed"] == 0
