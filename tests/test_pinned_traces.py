"""Pinned experts with routing traces and over several ranks, on the CPU: a trace replayed through the
engine's split takes the split simulator's counts (traces/split_plan.simulate_split), a run recorded
over a split routes as resident does, and tensor and expert parallelism with pinned experts give the
one-process logits."""

from __future__ import annotations

import numpy as np
import pytest

from moetier.engine import LLM
from moetier.experts.placement import ExpertOptions
from moetier.sampling_params import SamplingParams
from moetier.traces.format import read_trace, write_trace
from moetier.traces.split_plan import simulate_split
from moetier.traces.synth import SynthParams, synthesize

# the tiny preset: MoE layers 0..3, 32 experts top-4
PINNED = {0: (0, 1, 2, 3, 4, 5), 1: tuple(range(0, 32, 3)), 2: (31,), 3: (7, 8)}


@pytest.mark.parametrize("policy", ["lru", "lfru"])
def test_engine_over_a_split_and_the_split_simulator_agree(tiny_ckpt, tmp_path, policy):
    ids = synthesize(SynthParams(32, 4, 4, tokens=300, skew=1.0, reuse=0.3, layer_corr=0.2, seed=3))
    write_trace(tmp_path / "t.mtrace", ids, {"experts": 32, "top_k": 4, "layers": [0, 1, 2, 3]})
    steps = 200
    llm = LLM(tiny_ckpt, device="cpu", experts=ExpertOptions("slots", slots=6, policy=policy, pinned=PINNED),
              replay_trace=tmp_path / "t.mtrace")
    llm.generate([[17]], SamplingParams(max_tokens=steps, ignore_eos=True))
    for i, moe in enumerate(llm.model.moe_blocks()):
        got = moe.experts.cache.read_stats()
        sim = simulate_split(ids[:steps, i], 32, 6, policy, PINNED[moe.layer], 4)
        assert (got["hits"], got["misses"], got["overflow"], got["pinned"]) == (
            sim.hits, sim.misses, sim.overflow, sim.pinned), f"layer {moe.layer}"
        assert sim.pinned > 0 and sim.misses > 0


def test_recorded_over_a_split_routes_as_resident(tiny_ckpt, tmp_path):
    prompts = [[5, 17, 99, 3, 250, 41], [77, 2, 401]]
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    got = {}
    for name, experts in (("resident", ExpertOptions("resident")),
                          ("split", ExpertOptions("slots", slots=4, pinned=PINNED))):
        llm = LLM(tiny_ckpt, device="cpu", experts=experts, record_trace=tmp_path / f"{name}.mtrace")
        tokens = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        llm.close()
        got[name] = (tokens, read_trace(tmp_path / f"{name}.mtrace"))
    (want, ref), (tokens, trace) = got["resident"], got["split"]
    assert tokens == want and trace.num_tokens == ref.num_tokens > 20
    assert np.array_equal(trace.ids, ref.ids) and np.array_equal(trace.weights, ref.weights)


@pytest.mark.parametrize("tp,ep", [(2, 1), (1, 2)])
def test_parallel_ranks_with_pinned_experts_equal_one_process(tiny_ckpt, tp, ep):
    from tests.test_tp import ENGINE, close_enough, logits_of

    experts = ExpertOptions("slots", slots=4, pinned=PINNED, split="columns" if tp > 1 else "auto")
    one = LLM(tiny_ckpt, experts=experts, **ENGINE)
    ref = logits_of(one)
    llm = LLM(tiny_ckpt, experts=experts, tensor_parallel_size=tp, expert_parallel_size=ep, **ENGINE)
    try:
        for g, want in zip(logits_of(llm), ref):
            close_enough(g, want)
        ranks = llm.expert_stats_per_rank()
        assert len(ranks) == tp * ep and all(r["pinned"] > 0 for r in ranks)
        if ep > 1:  # every pair on its owner: the ranks' pinned hits sum to the one process's
            assert sum(r["pinned"] for r in ranks) == one.expert_stats_per_rank()[0]["pinned"]
    finally:
        llm.close()
