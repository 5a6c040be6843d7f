"""The scheduler driven with fake runner outputs: budget, fairness, chunked prefill, preemption and
resumption, aborts."""

from __future__ import annotations

import pickle
import subprocess
import sys

import pytest

from moetier.engine.pages import PagePool
from moetier.engine.request import Request, Status
from moetier.engine.scheduler import Scheduler
from moetier.engine.step import SeqStep, StepInput
from moetier.errors import MoetierError
from moetier.sampling_params import SamplingParams

PAGE = 4


def req(rid, prompt_len, max_tokens=8):
    return Request(rid, list(range(1, prompt_len + 1)), SamplingParams(max_tokens=max_tokens), seed=7)


def test_scheduler_imports_no_torch():
    code = "import sys, moetier.engine.scheduler; assert 'torch' not in sys.modules, 'torch was imported'"
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert p.returncode == 0, p.stderr


def test_step_record_is_plain_data():
    s = Scheduler(PagePool(100), PAGE, max_num_tokens=16)
    s.add(req("a", 10))
    s.add(req("b", 3, max_tokens=2))
    step = s.schedule().step()
    assert isinstance(step, StepInput) and all(type(q) is SeqStep for q in step.seqs)
    a, b = step.seqs
    assert (a.request_id, a.start, a.token_ids, a.sample) == ("a", 0, list(range(1, 11)), True)
    assert a.pages == s.requests["a"].pages and len(a.pages) == 3 and a.seed == 7 and a.sample_index == 0
    assert b.token_ids == [1, 2, 3] and b.params.max_tokens == 2
    assert pickle.loads(pickle.dumps(step)) == step  # it can cross a process boundary as it is


def test_request_tokens_slice_prompt_then_output():
    r = req("a", 4)
    r.output_ids += [50, 51, 52]
    for start in range(8):
        for end in range(start, 8):
            assert r.tokens(start, end) == [r.token(i) for i in range(start, end)], (start, end)
    got = r.tokens(0, 4)
    got.append(0)
    assert r.prompt_ids == [1, 2, 3, 4]  # a copy: a step record never aliases the request's lists


def run_step(s: Scheduler, token=7, eos=()):
    out = s.schedule()
    assert out.num_tokens <= s.max_num_tokens
    sampled = {q.request.id: token for q in out.seqs if q.sample}
    s.update(out, sampled, set(eos))
    s.check()
    return out


def test_budget_chunked_prefill_and_decode_share_a_step():
    s = Scheduler(PagePool(100), PAGE, max_num_tokens=16)
    s.add(req("long", 40))
    s.add(req("short", 3))
    out = run_step(s)
    assert [(q.request.id, q.num_tokens, q.sample) for q in out.seqs] == [("long", 16, False)]
    out = run_step(s)
    assert [(q.request.id, q.num_tokens, q.sample) for q in out.seqs] == [("long", 16, False)]
    out = run_step(s)  # the rest of the prompt, and the short one fits the remaining budget
    assert [(q.request.id, q.num_tokens, q.sample) for q in out.seqs] == [("long", 8, True), ("short", 3, True)]
    out = run_step(s)  # both decode, one token each
    assert [(q.request.id, q.num_tokens, q.start) for q in out.seqs] == [("long", 1, 40), ("short", 1, 3)]


def test_fifo_and_max_num_seqs():
    s = Scheduler(PagePool(100), PAGE, max_num_tokens=100, max_num_seqs=2)
    for i in range(4):
        s.add(req(f"r{i}", 5, max_tokens=2))
    out = run_step(s)
    assert [q.request.id for q in out.seqs] == ["r0", "r1"]
    run_step(s)  # r0, r1 finish (2 tokens each)
    assert not s.running or all(r.id in ("r0", "r1") for r in s.running)
    out = run_step(s)
    assert [q.request.id for q in out.seqs] == ["r2", "r3"]


def test_preemption_recomputes_and_loses_nothing():
    # 6 pages of 4 tokens; three requests of 8 prompt tokens each need 2 pages, then a third page
    s = Scheduler(PagePool(6), PAGE, max_num_tokens=64)
    for i in range(3):
        s.add(req(f"r{i}", 8, max_tokens=6))
    run_step(s)  # all three prefill: 6 pages used
    assert s.pages.num_free == 0
    out = run_step(s)  # r0 needs a 3rd page for token 9: the newest (r2) is preempted
    assert [r.id for r in out.preempted] == ["r2"]
    assert s.waiting[0].id == "r2" and s.waiting[0].num_computed == 0 and s.waiting[0].output_ids == [7]
    finished = set()
    for _ in range(60):
        if not s.has_unfinished():
            break
        out = s.schedule()
        s.update(out, {q.request.id: 7 for q in out.seqs if q.sample}, set())
        s.check()
        finished |= {q.request.id for q in out.seqs if q.request.status is Status.FINISHED}
    assert finished == {"r0", "r1", "r2"}
    r2 = out.seqs[0].request if out.seqs else None
    assert s.pages.num_used == 0 and not s.requests and r2 is not None


def test_resumed_request_recomputes_prompt_and_outputs():
    s = Scheduler(PagePool(3), PAGE, max_num_tokens=64)
    a, b = req("a", 4, max_tokens=5), req("b", 4, max_tokens=5)
    s.add(a)
    s.add(b)
    run_step(s)  # a: 1 page, b: 1 page, both sample their first token
    out = run_step(s)  # a takes the last page for its 5th token; b needs one too: b, the newest, yields
    assert [r.id for r in out.preempted] == ["b"] and b.status is Status.WAITING
    assert [q.request.id for q in out.seqs] == ["a"]
    while a.status is not Status.FINISHED:
        run_step(s)
    out = run_step(s)  # b comes back: recompute prompt + its output in one chunk, then sample
    q = out.seqs[0]
    assert (q.request.id, q.start, q.num_tokens, q.sample) == ("b", 0, 5, True)
    assert q.record().token_ids == [1, 2, 3, 4, 7] and b.preemptions == 1


def test_abort_frees_pages_anywhere():
    s = Scheduler(PagePool(20), PAGE, max_num_tokens=8)
    s.add(req("run", 6))
    s.add(req("wait", 30))
    run_step(s)
    assert s.abort("run") and s.pages.num_used > 0  # "wait" took a chunk's pages already
    assert s.abort("wait") and s.pages.num_used == 0 and not s.has_unfinished()
    assert not s.abort("nope")
    s.check()


def test_stop_token_and_eos_and_length():
    s = Scheduler(PagePool(20), PAGE, max_num_tokens=64)
    a = req("a", 3, max_tokens=10)
    a.params.stop_token_ids = [9]
    s.add(a)
    s.add(req("b", 3, max_tokens=2))
    out = s.schedule()
    s.update(out, {"a": 5, "b": 5}, eos_ids={5})  # 5 is EOS: both stop
    assert a.finish_reason == "stop" and s.pages.num_used == 0
    c = req("c", 3, max_tokens=2)
    c.params.ignore_eos = True
    s.add(c)
    for _ in range(2):
        out = s.schedule()
        s.update(out, {"c": 5}, eos_ids={5})
    assert c.finish_reason == "length" and c.output_ids == [5, 5]


def test_refuses_what_can_never_fit():
    s = Scheduler(PagePool(4), PAGE, max_num_tokens=64, max_model_len=64)
    with pytest.raises(MoetierError, match="needs 5 KV pages but the pool holds 4"):
        s.add(req("big", 18, max_tokens=2))
    with pytest.raises(MoetierError, match="exceeds the context of 64 tokens"):
        s.add(req("long", 60, max_tokens=10))
    s.add(req("x", 2))
    with pytest.raises(MoetierError, match="already in use"):
        s.add(req("x", 2))


def test_state_slots_follow_running_requests():
    """Models with recurrent state (KDA): a request holds one state slot while it runs; finishing,
    aborting or preemption gives it back (a preempted request recomputes), and the step record
    carries it. Three slots for four requests: the fourth waits for one."""
    s = Scheduler(PagePool(12), PAGE, max_num_tokens=64, max_num_seqs=3, states=PagePool(3))
    for i, n in enumerate((9, 5, 7, 3)):
        s.add(req(f"r{i}", n, max_tokens=12))
    out = run_step(s)
    assert [q.request.id for q in out.seqs] == ["r0", "r1", "r2"]
    step = out.step()
    assert sorted(q.state_slot for q in step.seqs) == [0, 1, 2] and s.states.num_free == 0
    preempted = 0
    while s.has_unfinished():
        out = s.schedule()
        preempted += len(out.preempted)
        for q in out.preempted:
            assert q.state_slot is None and q.status is Status.WAITING
        slots = [q.state_slot for q in out.step().seqs]
        assert len(set(slots)) == len(slots) and min(slots) >= 0
        s.update(out, {q.request.id: 7 for q in out.seqs if q.sample}, set())
        s.check()
    assert preempted > 0  # 12 pages of 4 tokens cannot hold three requests of up to 21 tokens
    assert s.states.num_used == 0 and s.pages.num_used == 0
    s.add(req("gone", 4))
    run_step(s)
    assert s.abort("gone") and s.states.num_used == 0
    with pytest.raises(ValueError, match="state pool has 2 slots"):
        Scheduler(PagePool(12), PAGE, max_num_seqs=3, states=PagePool(2))
