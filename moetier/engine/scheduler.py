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

Prefix caching (prefix_cache.py, docs/prefix-cache.md): every page table is held through the
PrefixCache, on or off (off: refcounts without match or insert). A request admitted with no KV first
matches its tokens against the cached pages; the hit's pages join its page table and its first chunk
starts after them, so the hit costs no budget and no compute. A request that asks for prompt log-probs
never takes a hit (its prompt's logits must be computed). Pages that a step fills are registered
after the step (update). For models with recurrent state a hit also needs the state at its end: the
scheduler ends prefill chunks on page boundaries (a prompt's last partial page is its own chunk) and
asks the runner to save the state there into a checkpoint (SeqStep.save_checkpoint); a hit resumes
from the last boundary that has one (SeqStep.restore_checkpoint).

Speculative decoding (speculation.py, docs/speculative.md): a decoding request may carry k draft
tokens after its last one; the step computes all k + 1 positions (pages reserved for them), and the
runner says which drafts it kept. The request then advances by the kept drafts plus one token: KV rows
written past them are garbage that the next step overwrites before anything reads them, and only pages
full of accepted tokens are hashed into the prefix cache. A model with recurrent state cannot overwrite
its state: where a draft was rejected the runner restores the state from before the step, and the
request goes back to where the step started, its kept tokens recomputed by the next step as a chunk.

A plain CPU object (no torch): tests drive it with fake runner outputs. Each step it hands the
runner one plain record (step.StepInput) and takes one back (the sampled tokens).
"""

from __future__ import annotations

import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field

from moetier.engine.kv_host_tier import CopyPlan
from moetier.engine.pages import PagePool
from moetier.engine.prefix_cache import PrefixCache, PrefixHit
from moetier.engine.request import Request, Status
from moetier.engine.speculation import Speculation
from moetier.engine.step import SeqStep, StepInput
from moetier.errors import MoetierError


CHECKPOINT_OWNER = "<state-checkpoints>"  # owner of every id in the checkpoint pool


@dataclass
class ScheduledSeq:
    request: Request
    start: int  # tokens computed before this step
    num_tokens: int  # tokens to compute this step
    sample: bool  # the chunk reaches the end: the step samples this request's next token
    num_cached: int = 0  # tokens of `start` that a prefix hit supplied (admission only)
    restore_checkpoint: int = -1  # state checkpoint to load into the slot before the chunk; -1: none
    save_checkpoint: int = -1  # checkpoint to save the slot's state into after the chunk; -1: none
    draft: list[int] = field(default_factory=list)  # draft tokens verified after the last one (in num_tokens)
    draft_next: int = 0  # MTP: drafts the runner makes for the next step

    def record(self) -> SeqStep:
        r = self.request
        own = self.num_tokens - len(self.draft)
        tokens = r.tokens(self.start, self.start + own) + self.draft
        slot = -1 if r.state_slot is None else r.state_slot
        targets = []
        if r.params.prompt_logprobs is not None:  # position j predicts prompt token j + 1
            targets = r.prompt_ids[self.start + 1:min(self.start + self.num_tokens, len(r.prompt_ids) - 1) + 1]
        after = self.start + own
        return SeqStep(r.id, self.start, tokens, r.pages, self.sample, r.params, r.seed, len(r.output_ids), slot,
                       self.num_cached, self.restore_checkpoint, self.save_checkpoint, targets,
                       num_draft=len(self.draft), draft_next=self.draft_next,
                       next_token=r.token(after) if after < r.total_tokens else -1)


@dataclass
class SchedulerOutput:
    seqs: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    copies: CopyPlan = field(default_factory=CopyPlan)  # host <-> GPU page copies, before the step's KV writes
    free_checkpoints: list[int] = field(default_factory=list)  # state checkpoints no longer kept

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.seqs)

    def step(self) -> StepInput:
        """The record the runner gets."""
        return StepInput([s.record() for s in self.seqs], copies_to_host=list(self.copies.to_host),
                         copies_to_gpu=list(self.copies.to_gpu))


class Scheduler:
    def __init__(self, pages: PagePool, page_size: int, max_num_tokens: int = 512, max_num_seqs: int = 64,
                 max_model_len: int = 4096, states: PagePool | None = None, cache: PrefixCache | None = None,
                 checkpoints: PagePool | None = None, speculation: Speculation | None = None):
        """cache: the prefix cache over `pages` (None: one that is off). checkpoints: the ids of the
        state checkpoints the runner holds (models with recurrent state and prefix caching on).
        speculation: drafts for decoding requests (None: no speculative decoding)."""
        if max_num_tokens < 1 or max_num_seqs < 1:
            raise ValueError("max_num_tokens and max_num_seqs must be positive")
        if states is not None and states.num_pages < max_num_seqs:
            raise ValueError(f"the state pool has {states.num_pages} slots for max_num_seqs {max_num_seqs}")
        if cache is not None and cache.pool is not pages:
            raise ValueError("the prefix cache must be built over the scheduler's page pool")
        self.spec = speculation
        self.states = states  # None: the model keeps no per-sequence state
        self.pages, self.page_size = pages, page_size
        self.cache = cache if cache is not None else PrefixCache(pages, page_size, enabled=False)
        self.checkpoints = checkpoints if self.cache.enabled and states is not None else None
        self.cache.checkpoints = self.checkpoints is not None  # match stops at a checkpointed boundary
        self.aligned = self.checkpoints is not None  # prefill chunks end on page boundaries
        # kept checkpoints, least recently recorded or restored first: a full pool reuses the oldest
        self._checkpoint_lru: OrderedDict[int, None] = OrderedDict()
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
        if self.spec is not None:
            self.spec.begin_step(len(self.running))  # expert-aware k: this step's k
        budget = self.max_num_tokens
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            decoding = req.num_computed + 1 == req.total_tokens  # one token to compute: its last sampled
            n = 1 if decoding else self._chunk(req, req.num_computed, budget)
            draft = self.spec.drafts(req, budget) if self.spec is not None and decoding else []
            if not self._grow(req, req.num_computed + n + len(draft), out):
                break  # req itself was preempted: it was the newest, nothing runs after it
            seq = self._seq(req, req.num_computed, n, out)
            seq.draft, seq.num_tokens = draft, n + len(draft)
            out.seqs.append(seq)
            budget -= seq.num_tokens
            i += 1
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs and not out.preempted:
            req = self.waiting[0]
            hit = self._match(req)
            start = hit.num_tokens  # tokens whose prefill is skipped: they cost no budget
            n = self._chunk(req, start, budget)
            if self.checkpoints is not None and start < hit.kv_tokens < start + n:
                # cached KV past the last checkpoint (a shared prefix whose requests diverge inside
                # their first chunk): end the chunk at the KV's end, where a checkpoint is saved
                n = hit.kv_tokens - start
            need = self._pages_for(start + n) - hit.num_pages
            if not self.cache.can_acquire(hit, need):
                break  # FIFO: later arrivals do not jump the queue
            self.waiting.popleft()
            req.pages = self.cache.acquire(req.id, hit) + self.cache.allocate(req.id, need)
            req.num_computed = req.num_cached_tokens = start
            if self.states is not None:
                req.state_slot = self.states.allocate(1, req.id)[0]  # free: running < max_num_seqs
            req.status = Status.RUNNING
            if req.first_scheduled is None:
                req.first_scheduled = time.perf_counter()
            self.running.append(req)
            if hit.checkpoint is not None:
                self._checkpoint_lru.move_to_end(hit.checkpoint)
            seq = self._seq(req, start, n, out)
            seq.num_cached = start
            seq.restore_checkpoint = -1 if hit.checkpoint is None else hit.checkpoint
            out.seqs.append(seq)
            budget -= n
        out.copies = self.cache.take_copies()
        if self.checkpoints is not None:
            out.free_checkpoints += self._free_dropped_checkpoints()
        return out

    def _free_dropped_checkpoints(self) -> list[int]:
        """Give back the checkpoints whose boundary left every tier (before any is chosen again)."""
        ids = self.cache.take_dropped_checkpoints()
        self.checkpoints.free(ids, CHECKPOINT_OWNER)
        for c in ids:
            self._checkpoint_lru.pop(c, None)
        return ids

    def _checkpoint_for_save(self, out: SchedulerOutput) -> int:
        """A checkpoint id to save into: a free one, else the least recently used kept one (its boundary
        forgets it; a hit of this very step may still restore from it: restores run before the forward,
        saves after it); -1 when every id is being saved into this step."""
        out.free_checkpoints += self._free_dropped_checkpoints()
        if self.checkpoints.can_allocate(1):
            return self.checkpoints.allocate(1, CHECKPOINT_OWNER)[0]
        if not self._checkpoint_lru:
            return -1
        oldest, _ = self._checkpoint_lru.popitem(last=False)
        self.cache.forget_checkpoint(oldest)
        return oldest

    def _match(self, req: Request) -> PrefixHit:
        """The cached prefix of a request about to start (nothing held yet). A request that wants its
        prompt's log-probs computes its whole prompt (as vLLM does): no hit, but still a query."""
        tokens = req.prompt_ids + req.output_ids
        if req.params.prompt_logprobs is not None:
            return PrefixHit(num_query_tokens=len(tokens))
        return self.cache.match(tokens)

    def _chunk(self, req: Request, start: int, budget: int) -> int:
        """Tokens to compute from `start` within budget. With state checkpoints a chunk of more than one
        token is cut back to the last page boundary inside it, so every prefill chunk ends where a
        checkpoint can be saved but a last partial page, which becomes a chunk of its own."""
        n = min(req.total_tokens - start, budget)
        if not self.aligned or n <= 1:
            return n
        cut = (start + n) // self.page_size * self.page_size
        return cut - start if cut > start else n

    def _seq(self, req: Request, start: int, n: int, out: SchedulerOutput) -> ScheduledSeq:
        seq = ScheduledSeq(req, start, n, start + n == req.total_tokens)
        if self.spec is not None and seq.sample:
            seq.draft_next = self.spec.draft_next(req)
        if self.checkpoints is not None and n > 1 and (start + n) % self.page_size == 0:
            seq.save_checkpoint = self._checkpoint_for_save(out)
        return seq

    def _grow(self, req: Request, tokens: int, out: SchedulerOutput) -> bool:
        """Give req pages for `tokens`, preempting the newest running requests as needed.
        False when req itself had to be preempted."""
        need = self._pages_for(tokens) - len(req.pages)
        if need <= 0:
            return True  # the common decode step: the last page still has room
        while not self.cache.can_allocate(need):
            victim = self.running[-1]
            self._preempt(victim)
            out.preempted.append(victim)
            if victim is req:
                return False
        req.pages += self.cache.allocate(req.id, need)
        return True

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.cache.release(req.id)  # its hashed pages stay cached: it may find them again
        self._free_state(req)
        req.pages, req.num_computed, req.draft_ids = [], 0, []
        req.status = Status.WAITING
        req.preemptions += 1
        self.waiting.appendleft(req)

    def update(self, out: SchedulerOutput, sampled: dict[str, int], eos_ids: set[int],
               logprobs: dict[str, tuple] | None = None, prompt_logprobs: dict[str, tuple] | None = None,
               emitted: dict[str, list[int]] | None = None, drafts: dict[str, list[int]] | None = None,
               emitted_logprobs: dict[str, list[tuple]] | None = None) -> list[Request]:
        """Apply a step's results: tokens computed, sampled tokens (and their logprobs, for requests that
        asked) appended, prompt logprobs recorded. Finishes requests on a stop token or on max_tokens;
        returns the requests that got a token this step. emitted: per request that verified drafts, its
        kept drafts and one more token (emitted_logprobs: their logprobs, for requests that asked);
        drafts: per request, its MTP drafts for the next step."""
        now = time.perf_counter()
        got = []
        for s in out.seqs:
            req = s.request
            if req.status is not Status.RUNNING:
                continue  # it ended while an overlapped step ran one token past it (overlap.py)
            new = (emitted[req.id] if s.draft else [sampled[req.id]]) if s.sample else []
            if s.draft:
                self.spec.record(len(s.draft), len(new) - 1)
            # tokens whose KV is valid: the chunk's own, plus the kept drafts; with recurrent state a
            # rejected draft rolled the state back to before the step: the kept tokens are recomputed
            computed = s.start + s.num_tokens - len(s.draft) + (len(new) - 1 if s.draft else 0)
            if s.draft and self.states is not None and len(new) - 1 < len(s.draft):
                computed = s.start
            if len(new) > 1:
                new = self._until_stop(req, new, eos_ids)
            req.output_ids += new
            req.token_times += [now - req.arrival] * len(new)
            req.num_computed = min(computed, req.total_tokens - 1) if new else computed  # a stop drops the rest
            if self.cache.enabled and req.num_computed // self.page_size > self.cache.num_hashed_pages(req.id):
                self.cache.insert(req.id, req.prompt_ids + req.output_ids, req.num_computed)
            if s.save_checkpoint >= 0:
                kept = self.cache.record_checkpoint(req.id, req.num_computed, s.save_checkpoint)
                if kept is not None:
                    self._checkpoint_lru[kept] = None
                    self._checkpoint_lru.move_to_end(kept)
                if kept != s.save_checkpoint:  # the boundary had one already, or its KV is gone
                    self.checkpoints.free([s.save_checkpoint], CHECKPOINT_OWNER)
            if prompt_logprobs and req.id in prompt_logprobs:
                req.score_prompt(*prompt_logprobs[req.id])
            if self.spec is not None and self.spec.mtp and s.sample:  # this step's drafts, or none: never stale
                req.draft_ids, req.draft_step = (drafts or {}).get(req.id, []), self.spec.steps
            if not s.sample:
                continue
            if s.draft and emitted_logprobs and req.id in emitted_logprobs:
                req.output_logprobs += emitted_logprobs[req.id][:len(new)]
            elif logprobs and req.id in logprobs:
                req.output_logprobs.append(logprobs[req.id])
            got.append(req)
            p, tok = req.params, req.output_ids[-1]
            if tok in p.stop_token_ids:
                req.stop_reason = tok
                self.finish(req, "stop")
            elif not p.ignore_eos and tok in eos_ids:
                self.finish(req, "stop")
            elif len(req.output_ids) >= p.max_tokens:
                self.finish(req, "length")
        if self.spec is not None:
            self.spec.end_step()
        return got

    @staticmethod
    def _until_stop(req: Request, new: list[int], eos_ids: set[int]) -> list[int]:
        """The step's tokens up to the first that ends the request (a stop token, EOS, max_tokens)."""
        p = req.params
        for i, tok in enumerate(new):
            if (tok in p.stop_token_ids or (not p.ignore_eos and tok in eos_ids)
                    or len(req.output_ids) + i + 1 >= p.max_tokens):
                return new[:i + 1]
        return new

    def finish(self, req: Request, reason: str) -> None:
        if req.status is Status.FINISHED:
            return
        if req.status is Status.RUNNING:
            self.running.remove(req)
        else:
            self.waiting.remove(req)
        self.cache.release(req.id)
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
        """Integrity: the prefix cache's (refcounts, hash maps, free + evictable + in use == total);
        pages of running requests are theirs and cover their computed tokens."""
        self.cache.check()
        for r in self.running:
            assert r.pages == self.cache.pages(r.id), f"{r.id}'s page table differs from the cache's"
            assert len(r.pages) >= self._pages_for(r.num_computed), f"{r.id} lacks pages for its KV"
        held = {p for r in self.running for p in r.pages}
        assert len(held) == self.cache.num_in_use, "pages are held by requests that are not running"
        for r in self.waiting:
            assert not r.pages and r.num_computed == 0, f"waiting {r.id} still holds KV"
            assert r.state_slot is None, f"waiting {r.id} still holds a state slot"
            assert not self.cache.pages(r.id), f"waiting {r.id} still holds pages in the prefix cache"
        if self.states is not None:
            self.states.check()
            assert self.states.num_used == len(self.running), "state slots are held by requests that are not running"
            assert all(r.state_slot is not None for r in self.running), "a running request has no state slot"
        if self.checkpoints is not None:  # between steps every save has been recorded or given back
            self.checkpoints.check()
            kept = self.cache.checkpoint_ids()
            assert kept == self._checkpoint_lru.keys(), "the checkpoint LRU differs from the kept checkpoints"
            assert self.checkpoints.num_used == len(kept), "a checkpoint id is held but kept by no boundary"
