"""The prefill cache policy on the CPU (experts/prefill/cache_policy.py): bypass leaves the slot cache
alone, refresh moves the chunk's most used experts in with the cache's own step; both bit-exact in
the prefill's outputs, the cache's invariants kept, and more decode hits after a refresh when the
prompt and the decode share experts. The same logic on the Triton kernel runs in the interpreter
(prefill_cache_interpreter.py) and on CUDA (test_gpu_prefill_cache.py)."""

from __future__ import annotations

import pytest
import torch

from moetier.experts.backends import ResidentExperts, SlotExperts, set_prefill_policy
from moetier.experts.prefill.cache_policy import pair_counts, ranking, refresh_reference, rows_consistent
from moetier.experts.shape import RowLayout
from moetier.experts.cache.slots import SlotCache, policy_for
from moetier.experts.cache.store import HostStore
from tests.interpreter import run_script

E, S, K, H, I, DECODE = 16, 4, 2, 32, 16, 8


def backends(prefill: str, policy: str = "lfru", dtype=torch.float32):
    layout = RowLayout(H, I)
    store = HostStore([0], E, layout, dtype, pin=False)
    rows = store.rows(0)
    rows.copy_(torch.randn(E, layout.numel, generator=torch.Generator().manual_seed(0)) * 0.1)
    slots = SlotExperts(rows, layout, K, S, DECODE, policy=policy, prefill=prefill)
    return ResidentExperts(rows.clone(), layout, K, DECODE), slots


def hot_routing(g: torch.Generator, t: int, hot: list[int], share: float = 0.9) -> torch.Tensor:
    """[t, K] distinct ids per token: each pick from `hot` with probability `share`, else any expert."""
    out = []
    for _ in range(t):
        row: list[int] = []
        while len(row) < K:
            pool = hot if torch.rand(1, generator=g).item() < share else list(range(E))
            e = pool[int(torch.randint(len(pool), (1,), generator=g))]
            if e not in row:
                row.append(e)
        out.append(row)
    return torch.tensor(out)


def test_ranking_orders_by_pairs_then_id_and_repeats_the_first_past_the_used():
    ids = torch.tensor([[5, 3], [5, 9], [3, 5], [-1, 9], [2, -1]])  # 5: 3 pairs, 3: 2, 9: 2, 2: 1
    assert ranking(ids, 12, 6).tolist() == [5, 3, 9, 2, 5, 5]
    assert ranking(ids, 12, 2).tolist() == [5, 3]
    assert pair_counts(ids, 12)[[5, 3, 9, 2]].tolist() == [3, 2, 2, 1]


@pytest.mark.parametrize("policy", ["lru", "lfru"])
def test_refresh_leaves_the_top_experts_resident_and_the_counters_alone(policy):
    c = SlotCache(E, S, policy=policy_for(policy, S, K))
    c.warm([0, 1, 2, 3])
    c.step_reference(torch.tensor([[0, 1]]))
    before = c.read_stats()
    clock = int(c.clock)
    g = torch.Generator().manual_seed(1)
    ids = hot_routing(g, 200, [6, 7, 1, 12], 0.95)
    miss = refresh_reference(c, ids)
    c.check()
    counts = pair_counts(ids, E)
    top = torch.argsort(-counts, stable=True)[:S].tolist()
    assert sorted(c.slot_expert.tolist()) == sorted(top)  # the chunk used > S experts: exactly its top S
    assert c.read_stats() == before and int(c.clock) == clock + 1
    n = int(miss.count)
    assert sorted(miss.expert[:n].tolist()) == sorted(set(top) - {0, 1, 2, 3})  # 1 was a hit: kept, not moved
    assert int(c.expert_slot[1]) == 1


def test_refresh_with_fewer_experts_than_slots_keeps_the_policys_choice():
    c = SlotCache(E, S)  # LRU
    c.warm([0, 1, 2, 3])
    c.step_reference(torch.tensor([[2, 3]]))  # 0 and 1 are now the least recent
    c.stats.zero_()
    refresh_reference(c, torch.tensor([[9, 8], [9, 8], [9, 3]]))
    c.check()
    assert sorted(c.slot_expert.tolist()) == [2, 3, 8, 9]  # 9 and 8 took the LRU slots of 0 and 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_outputs_bit_exact_between_policies_and_resident(dtype):
    resident, bypass = backends("bypass", dtype=dtype)
    _, refresh = backends("refresh", dtype=dtype)
    g = torch.Generator().manual_seed(2)
    for s in (bypass, refresh):
        s.cache.warm([0, 1, 2, 3])
        s.slots.copy_(s.host[s.cache.slot_expert.long()])
    for i in range(6):
        t = [20, 9, 33][i % 3]  # above DECODE: the large-step path
        x = torch.randn(t, H, generator=g).to(dtype)
        ids = hot_routing(g, t, [4 + i, 10, 11, 15], 0.8)
        w = torch.rand(t, K, generator=g).to(dtype)
        want = resident.forward(x, ids, w)
        state = bypass.cache.state()
        assert torch.equal(bypass.forward(x, ids, w), want)
        assert torch.equal(refresh.forward(x, ids, w), want)
        for k, v in bypass.cache.state().items():  # bypass: the cache untouched
            assert torch.equal(v, state[k]), k
        refresh.cache.check()
        assert rows_consistent(refresh.cache, refresh.slots, refresh.host)
    sr, sb = refresh.stats(), bypass.stats()
    assert sr["bypassed"] == sb["bypassed"] == 6 and sb["refreshed"] == 0 and sr["refreshed"] > 0
    assert sr["hits"] == sr["misses"] == sr["steps"] == 0  # the counters describe decode only
    refresh.reset()
    assert refresh.stats()["refreshed"] == 0


@pytest.mark.parametrize("policy", ["lru", "lfru"])
def test_decode_after_a_refresh_hits_more_than_after_a_bypass(policy):
    g = torch.Generator().manual_seed(3)
    hot = [5, 9, 12, 14]
    prompt = hot_routing(g, 64, hot, 0.9)
    decode = [hot_routing(g, 1, hot, 0.9) for _ in range(12)]
    x = torch.randn(64, H, generator=g)
    w = torch.rand(64, K, generator=g)
    out, hits = {}, {}
    for prefill in ("bypass", "refresh"):
        _, s = backends(prefill, policy)
        s.cache.warm([0, 1, 2, 3])  # what an earlier request left: none of the prompt's experts
        s.slots.copy_(s.host[s.cache.slot_expert.long()])
        out[prefill] = [s.forward(x, prompt, w)]
        out[prefill] += [s.forward(x[:1], ids, w[:1]) for ids in decode]
        s.cache.check()
        assert rows_consistent(s.cache, s.slots, s.host)
        hits[prefill] = (s.stats()["hits"], s.stats()["misses"])
    assert hits["refresh"][0] > hits["bypass"][0] and hits["refresh"][1] < hits["bypass"][1], hits
    for a, b in zip(out["bypass"], out["refresh"]):
        assert torch.equal(a, b)  # decode differs only in where rows are read from


def test_policy_checks_and_setter():
    _, s = backends("bypass")
    set_prefill_policy(s, "refresh")
    assert s.prefill == "refresh"
    with pytest.raises(ValueError, match="bypass or refresh"):
        set_prefill_policy(s, "stream")
    with pytest.raises(ValueError, match="bypass or refresh"):
        backends("sometimes")
    resident, _ = backends("bypass")
    set_prefill_policy(resident, "refresh")  # nothing to refresh: no error, no attribute
    assert not hasattr(resident, "prefill")


def test_refresh_kernel_path_matches_the_reference_in_the_interpreter():
    out = run_script("prefill_cache_interpreter.py")
    assert "refresh steps ok" in out


def test_engine_greedy_tokens_identical_bypass_and_refresh():
    """The embedded tiny model with 4 slots a layer: a 100+-token prompt takes the large-step path;
    refresh changes what is in the slots for the decode, never a token."""
    from moetier.engine.llm import LLM
    from moetier.experts.placement import ExpertOptions
    from moetier.sampling_params import SamplingParams

    text = "The slot cache keeps the experts a prompt used most, so the decode that follows hits. " * 4
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    got, stats = {}, {}
    for policy in ("bypass", "refresh"):
        llm = LLM(device="cpu", experts=ExpertOptions("slots", slots=4, prefill=policy),
                  decode_tokens=16)
        assert len(llm.encode(text)) > 16 and llm.config.max_num_tokens == 2048  # automatic, on the CPU
        got[policy] = llm.generate([text], params)[0].outputs[0].token_ids
        stats[policy] = llm.metrics()["expert_stats"]
        for block in llm.model.moe_blocks():
            block.experts.cache.check()
            assert rows_consistent(block.experts.cache, block.experts.slots, block.experts.host)
    assert got["bypass"] == got["refresh"] and len(got["bypass"]) == 24
    assert stats["refresh"]["refreshed"] > 0 and stats["bypass"]["refreshed"] == 0
    assert stats["refresh"]["bypassed"] == stats["bypass"]["bypassed"] > 0
