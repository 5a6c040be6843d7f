"""Expert-aware k in the engine (engine/spec_k.py): the route hook counts what the router chose (a
replayed trace's choice when one is replayed), the resident mask follows the backend, the choice is
spec/expert_k.choose_k's on what was measured, a k of 0 is retried, and an engine choosing k per step
still gives plain greedy tokens."""

from __future__ import annotations

import torch

from moetier.engine.llm import LLM
from moetier.engine.spec_k import KChooser, resident_mask
from moetier.experts.placement import ExpertOptions
from moetier.sampling_params import SamplingParams
from moetier.spec.expert_k import StepCosts, choose_k

NGRAM = {"method": "ngram", "num_speculative_tokens": 3}
PROMPT = "def foo(self):\n    return self.foo\n\ndef bar(self):\n    return self."


def test_routing_counts_and_the_choice_are_the_cost_models(tiny_ckpt):
    llm = LLM(tiny_ckpt, device="cpu", dtype="float32", speculative_config=NGRAM)
    chooser = llm.scheduler.spec.chooser
    assert isinstance(chooser, KChooser) and chooser.costs.link_expert_s > 0 and chooser.costs.fixed_s > 0
    seen = []
    for b in chooser.blocks:  # what each router chose, beside the chooser's own hook
        inner = b.route_hook
        b.route_hook = lambda layer, ids, w, inner=inner: (seen.append((layer, ids.clone())), inner(layer, ids, w))[1]
    chooser.observe([])  # priming: the counts so far dropped
    before = chooser.routing.clone()
    llm.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=1))
    e, top_k = llm.cfg.num_experts, llm.cfg.top_k
    counts = torch.zeros(len(chooser.blocks), e, dtype=torch.float64)
    layer_row = {b.layer: i for i, b in enumerate(chooser.blocks)}
    for layer, ids in seen:
        counts[layer_row[layer]] += torch.bincount(ids.reshape(-1), minlength=e).double()
    # generate() ran one step and its update() observed it (Speculation.end_step)
    shares = counts / counts.sum(-1, keepdim=True) / top_k
    torch.testing.assert_close(chooser.routing, 0.9 * before + 0.1 * shares)
    assert torch.equal(chooser.counts, torch.zeros_like(chooser.counts))
    resident = torch.stack([resident_mask(b, e) for b in chooser.blocks])
    assert bool(resident.all())
    k = chooser.choose(4)
    want, rates = choose_k(3, 4, chooser.meter.rate, chooser.routing, resident, top_k, chooser.costs)
    assert (k, chooser.rates) == (want, rates)


def test_slots_mask_and_prices_decide_k(tiny_ckpt):
    llm = LLM(tiny_ckpt, device="cpu", dtype="float32", experts=ExpertOptions("slots", slots=4),
              speculative_config=NGRAM)
    chooser = llm.scheduler.spec.chooser
    e = llm.cfg.num_experts
    llm.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=3))
    masks = [resident_mask(b, e) for b in chooser.blocks]
    assert all(int(m.sum()) <= 4 for m in masks) and any(m.any() for m in masks)
    # the same measurements priced two ways: misses nearly free keep k high; costly misses (most
    # experts are not in the 4 slots) make k = 0 the fastest
    chooser.costs = StepCosts(fixed_s=1.0, per_token_s=0.0, hbm_expert_s=0.001, link_expert_s=0.001)
    assert chooser.choose(1) == 3
    chooser.costs = StepCosts(fixed_s=1.0, per_token_s=0.0, hbm_expert_s=0.001, link_expert_s=1.0)
    assert chooser.choose(1) == 0


def test_the_eager_term_applies_where_a_k_of_zero_replays(tiny_ckpt):
    """time_graphs gives the chooser the graphs' timed eager cost and per-row cost; the eager cost is
    charged only at batches the decode graphs hold (above them a k = 0 step runs eagerly too)."""
    from moetier.engine.spec_k import time_graphs

    llm = LLM(tiny_ckpt, device="cpu", dtype="float32", speculative_config=NGRAM)
    chooser = llm.scheduler.spec.chooser
    assert chooser.eager_s == 0.0 and chooser.replay_batch == 0  # the CPU captures no graphs
    chooser.costs = StepCosts(fixed_s=1.0, per_token_s=0.0, hbm_expert_s=0.001, link_expert_s=0.001)
    assert chooser.choose(4) == 3

    class Graphs:  # DecodeGraphs' timings: an eager step 9 s over its replay, 1 us a row, a replay 0.5 s
        max_batch = 4

        def step_costs(self, timer):
            assert timer(lambda: None) >= 0.0
            return 9.0, 1e-6, 0.5

    time_graphs(llm.scheduler.spec, Graphs())
    assert (chooser.eager_s, chooser.replay_batch, chooser.costs.per_token_s) == (9.0, 4, 1e-6)
    assert chooser.costs.fixed_s == 0.5 - 1e-6  # the one-row replay less its row: the step's fixed cost
    assert chooser.choose(4) == 0  # 9 s per eager step outweighs 3 drafts on a 1 s step
    assert chooser.choose(5) == 3  # 5 sequences: no graph holds them, every step eager alike


def test_an_mtp_engine_times_its_chained_pass():
    """Drafting with tiny-stdlib's MTP layer: the chooser prices a chained MTP pass (timed at start on
    the scratch page, with no route hook seeing it) and the engine's tokens stay plain greedy's."""
    llm = LLM(None, device="cpu", dtype="float32", speculative_config={"method": "mtp", "num_speculative_tokens": 2})
    assert llm.scheduler.spec.chooser.costs.draft_pass_s > 0
    plain = LLM(None, device="cpu", dtype="float32")
    p = plain.encode(PROMPT)
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    assert llm.generate([p], params)[0].outputs[0].token_ids == plain.generate([p], params)[0].outputs[0].token_ids


def test_hybrid_prices_a_miss_on_the_link_and_the_host_cores_at_once(tmp_path):
    """Under hybrid the chooser reads the host cores' seconds per expert row from the backend's own
    calibration; the link and the host fill misses side by side, so their rates add."""
    from moetier.checkpoint.writer import make_checkpoint
    from moetier.experts.hybrid.cost_model import PathRates

    path = make_checkpoint(tmp_path / "m", "tiny", seed=3, dtype="bfloat16")
    opts = ExpertOptions("hybrid", slots=4, rates=PathRates(50.0, {"bfloat16": 2.0}), host_threads=1)
    llm = LLM(path, device="cpu", dtype="bfloat16", experts=opts, speculative_config=NGRAM)
    c = llm.scheduler.spec.chooser.costs
    row = llm.model.moe_blocks()[0].experts.model.row_bytes
    assert c.host_expert_s == row / 2e9
    assert c.miss_expert_s == 1 / (1 / c.link_expert_s + 1 / c.host_expert_s) < min(c.link_expert_s, c.host_expert_s)
    plain = LLM(path, device="cpu", dtype="bfloat16", speculative_config=NGRAM)
    assert plain.scheduler.spec.chooser.costs.host_expert_s is None  # resident: no host path


def test_eager_rows_are_timed_on_the_scratch_page_unseen(tmp_path):
    """Without decode graphs each row's eager cost is timed at start on the scratch page, where no route
    hook sees it: a replayed trace's cursor and the chooser's counts are untouched. A model with
    recurrent state times on the spare state slot and decodes as plain."""
    from pathlib import Path

    from moetier.checkpoint.writer import make_checkpoint

    trace = Path(__file__).parents[1] / "data" / "traces" / "tiny-stdlib-heldout.mtrace"
    llm = LLM(None, device="cpu", dtype="float32", replay_trace=trace, speculative_config=NGRAM)
    chooser = llm.scheduler.spec.chooser
    assert chooser.costs.per_token_s > 0 and int(llm.replayer.cursor) == 0 and float(chooser.counts.sum()) == 0
    path = make_checkpoint(tmp_path / "g", "tiny-glm5-next", seed=2, dtype="float32")
    prompts = [[5, 17, 99, 3, 5, 17, 99], [8, 8, 8, 8]]
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in LLM(path, device="cpu", dtype="float32").generate(prompts, params)]
    spec = LLM(path, device="cpu", dtype="float32", speculative_config=NGRAM)
    assert spec.scheduler.spec.chooser.costs.per_token_s >= 0
    assert [o.outputs[0].token_ids for o in spec.generate(prompts, params)] == want


def test_a_k_of_zero_is_tried_again():
    from moetier.engine.spec_k import PRIOR, RETRY

    class Fake(KChooser):
        def __init__(self):  # the meter alone
            from moetier.spec.expert_k import AcceptanceMeter

            self.meter, self.prior, self.primed = AcceptanceMeter(2, PRIOR), PRIOR, True
            self.counts, self.routing, self.top_k = torch.zeros(1, 4), torch.full((1, 4), 0.25, dtype=torch.float64), 1

    f = Fake()
    f.observe([(2, 0)] * 50)  # nothing kept: acceptance near 0
    low = f.meter.rate.clone()
    assert float(low[0]) < 0.1
    f.observe([])
    torch.testing.assert_close(f.meter.rate, low + RETRY * (PRIOR - low))


def test_engine_with_expert_aware_k_equals_plain_and_reports_its_choices():
    plain = LLM(None, device="cpu", dtype="float32")
    p = plain.encode(PROMPT)
    want = plain.generate([p, p[:20]], SamplingParams(max_tokens=30, ignore_eos=True))
    llm = LLM(None, device="cpu", dtype="float32", speculative_config=NGRAM)
    # prices as a GPU's (a hit cheap beside the dense read): the CPU's timed copies are noise here
    llm.scheduler.spec.chooser.costs = StepCosts(fixed_s=1.0, per_token_s=0.0, hbm_expert_s=0.01, link_expert_s=0.1)
    got = llm.generate([p, p[:20]], SamplingParams(max_tokens=30, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    m = llm.metrics()
    assert sum(m["spec_decode_k_chosen"].values()) == llm.steps and m["spec_decode_num_accepted_tokens"] > 0
    off = LLM(None, device="cpu", dtype="float32", speculative_config={**NGRAM, "expert_aware_k": False})
    assert off.scheduler.spec.chooser is None
    off.generate([p], SamplingParams(max_tokens=5))
    assert off.metrics()["spec_decode_k_chosen"] == {}


def test_a_verify_step_that_replays_pays_no_eager_term(tiny_ckpt):
    """With verify graphs (n-gram drafting, engine/verify_graphs.py) a step of k > 0 replays where they
    hold its batch and k: the chooser charges the eager cost only to the k whose step runs eagerly."""
    from moetier.engine.spec_k import time_graphs

    llm = LLM(tiny_ckpt, device="cpu", dtype="float32", speculative_config=NGRAM)
    chooser = llm.scheduler.spec.chooser
    chooser.costs = StepCosts(fixed_s=1.0, per_token_s=0.0, hbm_expert_s=0.001, link_expert_s=0.001)

    class Graphs:  # an eager step 9 s over its replay
        max_batch = 4

        def step_costs(self, timer):
            return 9.0, 1e-6, 0.5

    class Verify:  # graphs for k = 1, 2 at up to 2 sequences
        @staticmethod
        def covers(n, k):
            return 1 <= k <= 2 and n <= 2

    time_graphs(llm.scheduler.spec, Graphs(), Verify())
    assert chooser.choose(2) == 2  # k = 3 would run eagerly: its drafts do not pay 9 s
    assert chooser.choose(4) == 0  # no verify graph holds 4 sequences: k = 0 replays, every k > 0 is eager
