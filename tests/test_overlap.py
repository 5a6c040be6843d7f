"""Overlapped scheduling (engine/overlap.py, EngineConfig.async_scheduling) on the CPU: the same tokens,
texts and finish reasons as the synchronous loop, under stop tokens, stop strings, EOS, max_tokens,
seeded sampling, arrivals, aborts, preemption and prefix hits; plan_ahead's bookkeeping driven
directly. (CUDA: the graphs' device-side ids and host twins, tests/test_gpu_overlap.py.)"""

from __future__ import annotations

import pytest
import torch

from moetier.engine import LLM
from moetier.engine.config import EngineConfig
from moetier.errors import MoetierError
from moetier.engine.overlap import ahead_step, plan_ahead
from moetier.engine.pages import PagePool
from moetier.engine.request import Request
from moetier.engine.scheduler import Scheduler
from moetier.sampling_params import SamplingParams


def prompts(n: int = 6, seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    shared = torch.randint(0, 448, (20,), generator=g).tolist()  # two requests share a prefix: cache hits
    out = [torch.randint(0, 448, (int(torch.randint(1, 30, (1,), generator=g)),), generator=g).tolist()
           for _ in range(n - 2)]
    return out + [shared + [7], shared + [9, 10]]


def mixed_params(llm: LLM, ps: list[list[int]]) -> list[SamplingParams]:
    """Each request ends its own way: max_tokens, a stop token it will sample, a stop string, EOS
    allowed, seeded sampling (the stop token and string taken from a plain greedy run)."""
    probe = llm.generate(ps[1:3], SamplingParams(max_tokens=12, ignore_eos=True))
    stop_tok = probe[0].outputs[0].token_ids[5]
    text = probe[1].outputs[0].text
    stop_str = text[len(text) // 2: len(text) // 2 + 2]
    assert stop_str.strip(), text
    return [SamplingParams(max_tokens=9, ignore_eos=True),
            SamplingParams(max_tokens=20, stop_token_ids=[stop_tok], ignore_eos=True),
            SamplingParams(max_tokens=20, stop=[stop_str], ignore_eos=True),
            SamplingParams(max_tokens=14),
            SamplingParams(max_tokens=16, temperature=0.9, top_p=0.8, seed=5, ignore_eos=True),
            SamplingParams(max_tokens=1, ignore_eos=True)][:len(ps)]


def run(llm: LLM, ps, params, arrive_at: int = 2, abort_at: int = 4) -> list[tuple]:
    """The first half of the requests at once, the rest after `arrive_at` steps; the first request
    aborted after `abort_at` steps. -> per request (tokens, text, finish reason of its last output)."""
    half = len(ps) // 2
    ids = [llm.add_request(p, sp) for p, sp in zip(ps[:half], params[:half])]
    got: dict[str, tuple] = {}
    steps = 0
    while llm.has_unfinished() or len(ids) < len(ps):
        if steps == arrive_at:
            ids += [llm.add_request(p, sp) for p, sp in zip(ps[half:], params[half:])]
        if steps == abort_at:
            llm.abort(ids[0])
        for out in llm.step():
            c = out.outputs[0]
            got[out.request_id] = (c.token_ids, c.text, c.finish_reason)
        steps += 1
    llm.scheduler.check()
    assert llm.scheduler.cache.num_in_use == 0
    return [got.get(i) for i in ids]


@pytest.mark.parametrize("engine", [
    dict(),
    dict(kv_tokens=128, page_size=4, max_num_tokens=32),  # 32 pages: preemption, page boundaries every 4
    dict(max_num_seqs=2),  # requests wait for a running one to end: no step ahead while one could start
], ids=["plain", "preempting", "two-seqs"])
def test_outputs_equal_the_synchronous_loop(tiny_ckpt, engine):
    sync = LLM(tiny_ckpt, device="cpu", **engine)
    ps = prompts()
    params = mixed_params(sync, ps)
    want = run(sync, ps, params)
    llm = LLM(tiny_ckpt, device="cpu", async_scheduling=True, **engine)
    assert run(llm, ps, params) == want
    assert llm.overlap.launched_ahead > 10  # the pipeline ran: steps launched before their predecessor's read
    assert want[0][2] is None and len(want[0][0]) < 9  # aborted before its max_tokens
    assert {w[2] for w in want[1:]} == {"length", "stop"} and len(want[1][0]) < 20 and len(want[2][0]) < 20
    assert llm.overlap.pending is None  # settled: nothing left in flight for ended requests


def test_generate_and_metrics_with_async_scheduling(tiny_ckpt):
    llm = LLM(tiny_ckpt, device="cpu", async_scheduling=True)
    outs = llm.generate([[1, 2, 3], [4] * 17], SamplingParams(max_tokens=11, ignore_eos=True))
    assert [len(o.outputs[0].token_ids) for o in outs] == [11, 11]
    m = llm.metrics()
    assert m["steps"] == 11 and m["steps_launched_ahead"] == 9  # the prefill and the first decode step: not ahead
    assert "steps_launched_ahead" not in LLM(tiny_ckpt, device="cpu").metrics()


def scheduler(pages: int = 8, page_size: int = 4, max_num_seqs: int = 4) -> Scheduler:
    return Scheduler(PagePool(pages), page_size, max_num_tokens=64, max_num_seqs=max_num_seqs, max_model_len=64)


def decode_plan(s: Scheduler, reqs: list[Request]):
    """Prefill every request, apply a token, and schedule the first decode step."""
    for r in reqs:
        s.add(r)
    plan = s.schedule()
    s.update(plan, {r.id: 1 for r in reqs}, set())
    return s.schedule()


def test_plan_ahead_grows_pages_and_counts_the_token_in_flight():
    s = scheduler()
    a, b = Request("a", [5, 6], SamplingParams(max_tokens=8), 0), Request("b", [5, 6, 7], SamplingParams(max_tokens=8), 0)
    plan = decode_plan(s, [a, b])  # a computes position 2, b position 3 (the last of its first page)
    assert [(x.start, x.num_tokens) for x in plan.seqs] == [(2, 1), (3, 1)]
    ahead = plan_ahead(s, plan)
    assert [(x.request.id, x.start) for x in ahead.seqs] == [("a", 3), ("b", 4)]
    assert len(a.pages) == 1 and len(b.pages) == 2  # b's position 4 opens its second page
    step = ahead_step(ahead)
    assert [x.sample_index for x in step.seqs] == [2, 2]  # the token in flight counted
    s.update(plan, {"a": 3, "b": 3}, set())
    s.update(ahead, {"a": 4, "b": 4}, set())
    assert a.output_ids == [1, 3, 4] and a.num_computed == 4 and b.num_computed == 5
    s.check()


def test_plan_ahead_refuses_what_it_cannot_know():
    s = scheduler(pages=3, page_size=4)
    a = Request("a", [5, 6, 7], SamplingParams(max_tokens=5), 0)
    b = Request("b", [1, 2, 3], SamplingParams(max_tokens=5), 0)
    plan = decode_plan(s, [a, b])
    assert plan_ahead(s, plan) is None and len(a.pages) == 1  # two new pages, one free: no preemption here
    s2 = scheduler(max_num_seqs=4)
    plan = decode_plan(s2, [Request("c", [1], SamplingParams(max_tokens=8), 0)])
    s2.add(Request("d", [2], SamplingParams(max_tokens=8), 0))
    assert plan_ahead(s2, plan) is None  # d could start now: the synchronous scheduler admits it
    s3 = scheduler()
    e = Request("e", [1], SamplingParams(max_tokens=2), 0)
    plan = decode_plan(s3, [e, Request("f", [2], SamplingParams(max_tokens=8), 0)])
    assert [x.request.id for x in plan_ahead(s3, plan).seqs] == ["f"]  # e's token in flight is its last
    s3.abort("f")
    s3.finish(e, "length")
    assert plan_ahead(s3, plan) is None  # nothing left running


def test_several_ranks_are_refused_in_one_line():
    with pytest.raises(MoetierError, match="async_scheduling with several ranks"):
        EngineConfig.of(async_scheduling=True, tensor_parallel_size=2)
    with pytest.raises(MoetierError, match="async_scheduling must be True or False"):
        EngineConfig.of(async_scheduling="yes")
