"""The scheduler's side of speculative decoding with fake runner outputs (no model, no torch): what a
decoding request drafts (capped by max_tokens, the step's budget, requests it cannot verify), the
positions reserved, how far a request advances by what was kept, which pages are hashed (accepted
tokens only), MTP drafts carried from one step to the next (and only to the next), and stops inside
the kept run."""

from __future__ import annotations

from moetier.engine.pages import PagePool
from moetier.engine.prefix_cache import PrefixCache
from moetier.engine.request import Request
from moetier.engine.scheduler import Scheduler
from moetier.engine.speculation import Speculation
from moetier.sampling_params import SamplingParams
from moetier.spec.config import SpeculativeConfig

PAGE = 4


def make(method: str = "ngram", k: int = 3, max_num_tokens: int = 64) -> tuple[Scheduler, Speculation]:
    pages = PagePool(16)
    spec = Speculation(SpeculativeConfig(method, k))
    return Scheduler(pages, PAGE, max_num_tokens, 4, 64, cache=PrefixCache(pages, PAGE), speculation=spec), spec


def add(s: Scheduler, rid: str, prompt: list[int], **params) -> Request:
    req = Request(rid, prompt, SamplingParams(**{"max_tokens": 20, "ignore_eos": True, **params}), seed=0)
    s.add(req)
    return req


def step(s: Scheduler, sampled=None, emitted=None, drafts=None):
    out = s.schedule()
    recs = out.step().seqs
    s.update(out, sampled or {}, set(), emitted=emitted or {}, drafts=drafts)
    s.check()
    return recs


def test_kept_drafts_advance_the_request_and_only_their_pages_are_hashed():
    s, spec = make()
    spec.drafts = lambda req, budget: [7, 8, 9][:spec.k_for(req, budget)]
    req = add(s, "a", [1, 2])
    step(s, sampled={"a": 3})  # the prefill
    [rec] = step(s, emitted={"a": [5]})  # three drafts, none kept: the correction alone
    assert (rec.start, rec.token_ids, rec.num_draft) == (2, [3, 7, 8, 9], 3)
    assert (req.num_computed, req.output_ids, s.cache.num_hashed_pages("a")) == (3, [3, 5], 0)
    [rec] = step(s, emitted={"a": [7, 8, 4]})  # two kept and the correction: positions 3 .. 5 valid
    assert (rec.start, rec.token_ids) == (3, [5, 7, 8, 9]) and len(req.pages) == 2
    assert (req.num_computed, req.output_ids) == (6, [3, 5, 7, 8, 4])
    assert s.cache.num_hashed_pages("a") == 1  # tokens 1 2 3 5; the page of 7 8 (9 unverified) is not full
    assert s.cache.match([1, 2, 3, 5, 0]).num_tokens == 4 and s.cache.match([1, 2, 3, 7, 0]).num_tokens == 0
    [rec] = step(s, emitted={"a": [7, 8, 9, 6]})  # every draft kept and the bonus token
    assert (req.num_computed, len(req.output_ids)) == (10, 9) and s.cache.num_hashed_pages("a") == 2
    m = spec.counters.as_dict()
    assert (m["spec_decode_num_drafts"], m["spec_decode_num_draft_tokens"], m["spec_decode_num_accepted_tokens"]) \
        == (3, 9, 5)
    assert m["spec_decode_num_accepted_tokens_per_pos"] == [2, 2, 1]
    assert m["spec_decode_mean_acceptance_length"] == 1 + 5 / 3


def test_k_is_capped_by_max_tokens_budget_and_verifiability():
    s, spec = make(max_num_tokens=3)
    spec.drafts = lambda req, budget: [9] * spec.k_for(req, budget)
    a = add(s, "a", [1], max_tokens=3)
    b = add(s, "b", [2], logit_bias={3: 1.0})  # the bias is not added per verified position: no drafts
    step(s, sampled={"a": 5, "b": 6})
    recs = {r.request_id: r for r in step(s, emitted={"a": [9]}, sampled={"b": 7})}
    assert recs["a"].num_draft == 1  # max_tokens 3 with one token out: one draft, then the bonus
    assert recs["b"].num_draft == 0
    assert a.output_ids == [5, 9] and b.output_ids == [6, 7]
    s2, spec2 = make(max_num_tokens=2)  # a budget of 2 tokens: one draft at most
    assert spec2.k_for(add(s2, "c", [1]), 2) == 1


def test_mtp_drafts_are_carried_to_the_next_step_and_cut_to_its_k():
    s, spec = make("mtp", k=3)
    req = add(s, "a", [1, 2], max_tokens=4)
    [rec] = step(s, sampled={"a": 3}, drafts={"a": [4, 5, 6]})
    assert rec.draft_next == 3 and req.draft_ids == [4, 5, 6]
    [rec] = step(s, emitted={"a": [4, 7]}, drafts={"a": [8, 9, 1]})
    assert rec.token_ids == [3, 4, 5] and rec.num_draft == 2  # max_tokens 4, one out: two drafts
    assert req.output_ids == [3, 4, 7] and req.draft_ids == [8, 9, 1]


def test_mtp_drafts_next_follow_the_steps_k():
    """The runner makes the step's k drafts for the next step (expert-aware k prices each MTP pass)."""
    s, spec = make("mtp", k=3)
    add(s, "a", [1, 2])
    spec.set_k(2)
    [rec] = step(s, sampled={"a": 3}, drafts={"a": [4, 5]})
    assert rec.draft_next == 2
    spec.chooser = type("Zero", (), {"choose": lambda self, b: 0, "observe": lambda self, o: None})()
    [rec] = step(s, sampled={"a": 6})
    assert rec.num_draft == 0 and rec.draft_next == 0  # k 0: nothing verified, nothing drafted


def test_mtp_drafts_are_verified_only_in_the_next_step():
    """Drafts of a step that left the request out (its token budget spent) are not verified: the
    runner keeps sampled drafts' distributions for one step only."""
    s, spec = make("mtp", k=2, max_num_tokens=2)
    a, b = add(s, "a", [1]), add(s, "b", [2])
    step(s, sampled={"a": 3, "b": 3}, drafts={"a": [4, 5], "b": [6, 7]})  # both prefills, step 0
    assert (a.draft_ids, a.draft_step, b.draft_ids, b.draft_step) == ([4, 5], 0, [6, 7], 0)
    s.max_num_tokens = 1  # a's last token alone: no room for its drafts, none for b
    [rec] = step(s, sampled={"a": 6}, drafts={"a": [7, 8]})
    assert rec.request_id == "a" and rec.num_draft == 0 and a.draft_step == 1
    s.max_num_tokens = 8
    recs = {r.request_id: r for r in step(s, sampled={"b": 5}, emitted={"a": [7, 9]})}
    assert recs["a"].num_draft == 2 and recs["a"].token_ids == [6, 7, 8]  # made in the step just before
    assert recs["b"].num_draft == 0 and recs["b"].token_ids == [3]  # b's are from two steps ago
    assert a.output_ids == [3, 6, 7, 9] and b.output_ids == [3, 5]


def test_a_stop_inside_the_kept_run_ends_the_request_there():
    s, spec = make()
    spec.drafts = lambda req, budget: [7, 8, 9]
    req = add(s, "a", [1, 2], stop_token_ids=[8])
    step(s, sampled={"a": 3})
    step(s, emitted={"a": [7, 8, 9, 4]})
    assert req.output_ids == [3, 7, 8] and req.finish_reason == "stop" and req.stop_reason == 8
    assert s.cache.num_in_use == 0
