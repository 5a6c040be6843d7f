"""Continuous batching: which requests compute how many tokens in the next step.

No phases: every request has tokens computed (KV in its pages) and tokens in total (prompt plus
output so far). A step computes, for each scheduled request, the next chunk of the difference:
one token for a decoding request, up to the budget for a prompt. The step's token budget is shared
by all of them, running requests first (oldest first), then waiting ones in arrival order. When a
request needs pages and none are free, the newest running request is preempted: its pages are
freed and it waits at the front of the queue to be recomputed later (its output so far is kept, so
it resumes where it stopped). A request is never dropped for lack of memory once admitted.

Models with linear-attention layers (KDA) keep a recurrent state per sequence instead of pages for
those layers: with a state pool (a PagePool of max_num_seqs slots), a request takes one slot when
it starts running and gives it back when it finishes or is preempted (its state is then recomputed
with its KV; a fresh start at position 0 zeroes whatever the slot held).

A plain CPU object (no torch): tests drive it with fake runner outputs. Each step it hands the
runner one plain record (step.StepInput) and takes one back (the sampled tokens).
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from moetier.engine.pages import PagePool
from moetier.engine.request import Request, Status
from moetier.engine.step import SeqStep, StepInput
from moetier.errors import MoetierError


@dataclass
class ScheduledSeq:
    request: Request
    start: int  # tokens computed before this step
    num_tokens: int  # tokens to compute this step
    sample: bool  # the chunk reaches the end: the step samples this request's next token

    def record(self) -> SeqStep:
        r = self.request
        tokens = [r.token(i) for i in range(self.start, self.start + self.num_tokens)]
        slot = -1 if r.state_slot is None else r.state_slot
        targets = []
        if r.params.prompt_logprobs is not None:  # position j predicts prompt token j + 1
            targets = r.prompt_ids[self.start + 1:min(self.start + self.num_tokens, len(r.prompt_ids) - 1) + 1]
        return SeqStep(r.id, self.start, tokens, r.pages, self.sample, r.params, r.seed, len(r.output_ids), slot,
                       targets)


@dataclass
class SchedulerOutput:
    seqs: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.seqs)

    def step(self) -> StepInput:
        """The record the runner gets."""
        return StepInput([s.record() for s in self.seqs])


class Scheduler:
    def __init__(self, pages: PagePool, page_size: int, max_num_tokens: int = 512, max_num_seqs: int = 64,
                 max_model_len: int = 4096, states: PagePool | None = None):
        if max_num_tokens < 1 or max_num_seqs < 1:
            raise ValueError("max_num_tokens and max_num_seqs must be positive")
        if states is not None and states.num_pages < max_num_seqs:
            raise ValueError(f"the state pool has {states.num_pages} slots for max_num_seqs {max_num_seqs}")
        self.states = states  # None: the model keeps no per-sequence state
        self.pages, self.page_size = pages, page_size
        self.max_num_tokens, self.max_num_seqs, self.max_model_len = max_num_tokens, max_num_seqs, max_model_len
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # in order of admission; the last is the newest
        self.requests: dict[str, Request] = {}

    def _pages_for(self, tokens: int) -> int:
        return -(-tokens // self.page_size)

    def add(self, req: Request) -> None:
        """Admit a request, or refuse it now (with the numbers) if it could never run."""
        if req.id in self.requests:
            raise MoetierError(f"request id {req.id!r} is already in use")
        need = len(req.prompt_ids) + req.params.max_tokens
        if need > self.max_model_len:
            raise MoetierError(f"request {req.id}: prompt ({len(req.prompt_ids)} tokens) + max_tokens "
                               f"({req.params.max_tokens}) exceeds the context of {self.max_model_len} tokens")
        if self._pages_for(need) > self.pages.num_pages:
            raise MoetierError(f"request {req.id} needs {self._pages_for(need)} KV pages but the pool holds "
                               f"{self.pages.num_pages}; give the engine more KV memory or lower max_tokens")
        self.requests[req.id] = req
        self.waiting.append(req)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_tokens
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = min(req.total_tokens - req.num_computed, budget)
            if not self._grow(req, req.num_computed + n, out):
                break  # req itself was preempted: it was the newest, nothing runs after it
            out.seqs.append(ScheduledSeq(req, req.num_computed, n, req.num_computed + n == req.total_tokens))
            budget -= n
            i += 1
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs and not out.preempted:
            req = self.waiting[0]
            n = min(req.total_tokens - req.num_computed, budget)
            need = self._pages_for(req.num_computed + n) - len(req.pages)
            if not self.pages.can_allocate(need):
                break  # FIFO: later arrivals do not jump the queue
            self.waiting.popleft()
            req.pages += self.pages.allocate(need, req.id)
            if self.states is not None:
                req.state_slot = self.states.allocate(1, req.id)[0]  # free: running < max_num_seqs
            req.status = Status.RUNNING
            if req.first_scheduled is None:
                req.first_scheduled = time.perf_counter()
            self.running.append(req)
            out.seqs.append(ScheduledSeq(req, req.num_computed, n, req.num_computed + n == req.total_tokens))
            budget -= n
        return out

    def _grow(self, req: Request, tokens: int, out: SchedulerOutput) -> bool:
        """Give req pages for `tokens`, preempting the newest running requests as needed.
        False when req itself had to be preempted."""
        need = self._pages_for(tokens) - len(req.pages)
        while not self.pages.can_allocate(need):
            victim = self.running[-1]
            self._preempt(victim)
            out.preempted.append(victim)
            if victim is req:
                return False
        req.pages += self.pages.allocate(need, req.id)
        return True

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.pages.free(req.pages, req.id)
        self._free_state(req)
        req.pages, req.num_computed = [], 0
        req.status = Status.WAITING
        req.preemptions += 1
        self.waiting.appendleft(req)

    def update(self, out: SchedulerOutput, sampled: dict[str, int], eos_ids: set[int],
               logprobs: dict[str, tuple] | None = None, prompt_logprobs: dict[str, tuple] | None = None
               ) -> list[Request]:
        """Apply a step's results: tokens computed, sampled tokens (and their logprobs, for requests that
        asked) appended, prompt logprobs recorded. Finishes requests on a stop token or on max_tokens;
        returns the requests that got a token this step."""
        now = time.perf_counter()
        got = []
        for s in out.seqs:
            req = s.request
            req.num_computed = s.start + s.num_tokens
            if prompt_logprobs and req.id in prompt_logprobs:
                req.score_prompt(*prompt_logprobs[req.id])
            if not s.sample:
                continue
            tok = sampled[req.id]
            req.output_ids.append(tok)
            req.token_times.append(now)
            if logprobs and req.id in logprobs:
                req.output_logprobs.append(logprobs[req.id])
            got.append(req)
            p = req.params
            if tok in p.stop_token_ids:
                req.stop_reason = tok
                self.finish(req, "stop")
            elif not p.ignore_eos and tok in eos_ids:
                self.finish(req, "stop")
            elif len(req.output_ids) >= p.max_tokens:
                self.finish(req, "length")
        return got

    def finish(self, req: Request, reason: str) -> None:
        if req.status is Status.FINISHED:
            return
        if req.status is Status.RUNNING:
            self.running.remove(req)
        else:
            self.waiting.remove(req)
        if req.pages:
            self.pages.free(req.pages, req.id)
        self._free_state(req)
        req.pages = []
        req.status, req.finish_reason = Status.FINISHED, reason
        del self.requests[req.id]

    def _free_state(self, req: Request) -> None:
        if req.state_slot is not None:
            self.states.free([req.state_slot], req.id)
            req.state_slot = None

    def abort(self, request_id: str) -> bool:
        req = self.requests.get(request_id)
        if req is None:
            return False
        self.finish(req, "abort")
        return True

    def check(self) -> None:
        """Integrity: pages of running requests are theirs and cover their computed tokens."""
        self.pages.check()
        owned = sum(len(r.pages) for r in self.running)
        assert owned == self.pages.num_used, "pages are held by requests that are not running"
        for r in self.running:
            assert len(r.pages) >= self._pages_for(r.num_computed), f"{r.id} lacks pages for its KV"
        for r in self.waiting:
            assert not r.pages and r.num_computed == 0, f"waiting {r.id} still holds KV"
            assert r.state_slot is None, f"waiting {r.id} still holds a state slot"
        if self.states is not None:
            self.states.check()
            assert self.states.num_used == len(self.running), "state slots are held by requests that are not running"
            assert all(r.state_slot is not None for r in self.running), "a running request has no state slot"
