"""Overlapped scheduling (EngineConfig.async_scheduling; vLLM's async scheduling, SGLang's overlap
scheduler): while the GPU runs decode step N, the host schedules step N+1 and launches it, its input
ids gathered on the device from step N's sampled tokens, and only then waits for step N's tokens,
applies them (scheduler.update) and detokenizes. The host's part of a step (building the records,
the graphs' inputs, the update, the outputs) then runs beside the GPU's instead of between steps.

    call k:   launch N+1 (ids <- N's tokens, on the device) | wait for N's tokens | update N | outputs N
    GPU:      ... N ............................ N+1 ........................ N+2 ...

Step N+1 is planned before N's tokens are known (plan_ahead): the same requests, one token further,
each as if N's token did not end it. Where N's token does end a request (EOS, a stop token or stop
string, max_tokens, an abort), its row of N+1 computed one token past its end: the scheduler's
update skips a request that no longer runs, so that token is never emitted, and its KV row and state
went to the request's own page or slot, which the finish gave back (later steps that reuse them run
after N+1 on the same stream). A request whose max_tokens N's token reaches is left out of N+1.

Only plain decode steps overlap (runner.can_launch: one sampled token per row, nothing else read
back): a step with a prefill chunk, drafts, logprobs or state checkpoints, a request that could be
admitted, or a page that only a preemption would free, runs as before, synchronously, and the
pipeline starts again after it. Greedy and seeded tokens equal the synchronous loop's (the same
rows, positions, pages and noise indices; only the host's timing changes).

On CUDA the tokens come back through pinned memory and an event recorded after the sampler, so the
host waits for step N alone, never for N+1 behind it. On the CPU the forward is synchronous, and the
bookkeeping (tests/test_overlap.py) is the same.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from moetier.engine.request import Status
from moetier.engine.step import SeqStep, StepInput, StepOutput

if TYPE_CHECKING:
    from moetier.engine.scheduler import Scheduler, SchedulerOutput


@dataclass
class Launched:
    """A step started by ModelRunner.launch and not yet collected."""
    ids: list[str]  # request ids, one per row (one token each)
    tokens: torch.Tensor  # [rows] int64 sampled tokens, on the model's device (the next step's ids)
    host: torch.Tensor  # [rows] int64: pinned host memory the tokens land in (the CPU: tokens itself)
    event: torch.cuda.Event | None  # recorded after the copy to host; None on the CPU
    kept: list[str] | None = None  # bench output check: the request ids of the logits this step kept


def plan_ahead(scheduler: Scheduler, prev: SchedulerOutput) -> SchedulerOutput | None:
    """The decode step after `prev` (a launched step of one-token rows, not yet updated) for its requests
    still running, each one token further, pages grown for it. None where the next step cannot be known
    without prev's tokens, or should not be planned without them: speculative decoding (the drafts
    follow the tokens), a waiting request that could be admitted, a running request prev left out, or
    pages that only a preemption would free. Takes no page unless it returns a plan."""
    from moetier.engine.scheduler import ScheduledSeq, SchedulerOutput

    if scheduler.spec is not None or (scheduler.waiting and len(scheduler.running) < scheduler.max_num_seqs):
        return None
    live = [s for s in prev.seqs if s.request.status is Status.RUNNING]
    if len(live) != len(scheduler.running):
        return None  # a running request that prev did not schedule: the synchronous scheduler decides
    seqs = [ScheduledSeq(s.request, s.start + 1, 1, True) for s in live
            if len(s.request.output_ids) + 1 < s.request.params.max_tokens]  # prev's token is not its last
    if not seqs:
        return None
    page = scheduler.page_size
    grow = [(s.request, -(-(s.start + 1) // page) - len(s.request.pages)) for s in seqs]  # KV up to position start
    need = sum(n for _, n in grow if n > 0)
    if need and not scheduler.cache.can_allocate(need):
        return None
    for req, n in grow:
        if n > 0:
            req.pages += scheduler.cache.allocate(req.id, n)
    out = SchedulerOutput(seqs)
    out.copies = scheduler.cache.take_copies()
    return out


def ahead_step(plan: SchedulerOutput) -> StepInput:
    """plan_ahead's record for the runner: each row's token id is a placeholder (launch gathers the
    previous step's sampled token on the device); its noise index counts that token."""
    seqs = []
    for s in plan.seqs:
        r = s.request
        slot = -1 if r.state_slot is None else r.state_slot
        seqs.append(SeqStep(r.id, s.start, [0], r.pages, True, r.params, r.seed, len(r.output_ids) + 1, slot))
    return StepInput(seqs, copies_to_host=list(plan.copies.to_host), copies_to_gpu=list(plan.copies.to_gpu))


class Overlap:
    """The pipeline of one engine (LLM.step): at most one launched step in flight between calls."""

    def __init__(self, scheduler: Scheduler, runner):
        self.scheduler, self.runner = scheduler, runner
        self.pending: tuple[SchedulerOutput, StepInput, Launched] | None = None
        self.launched_ahead = 0  # steps launched before their predecessor's tokens were read (metrics)

    def step(self) -> tuple[SchedulerOutput, StepInput, StepOutput]:
        """One step's (plan, record, result), its tokens read back and not yet applied: the step in
        flight when there is one (after launching its successor where plan_ahead allows), else a newly
        scheduled one, launched and pipelined if it can be, else run synchronously."""
        if self.pending is None:
            plan = self.scheduler.schedule()
            step = plan.step()
            if not self.runner.can_launch(step):
                return plan, step, self.runner.execute(step)
            self.pending = (plan, step, self.runner.launch(step))
        plan, step, launched = self.pending
        self.pending = None
        ahead = plan_ahead(self.scheduler, plan)
        if ahead is not None:
            record = ahead_step(ahead)
            self.pending = (ahead, record, self.runner.launch(record, after=launched))
            self.launched_ahead += 1
        result = self.runner.collect(launched)
        self._drop_finished_rows(launched)
        return plan, step, result

    def settle(self) -> None:
        """After the collected step's update and outputs: a step in flight none of whose requests still
        runs (every one ended with the step before it) is dropped: nothing of it is ever read."""
        if self.pending is not None and not any(s.request.status is Status.RUNNING for s in self.pending[0].seqs):
            self._drop_finished_rows(self.pending[2])
            self.pending = None

    def _drop_finished_rows(self, launched: Launched) -> None:
        """Rows of requests that ended before this step's tokens were applied: their kept logits (bench
        output check) are not theirs to keep."""
        if launched.kept is not None:
            for i, rid in enumerate(launched.kept):
                req = self.scheduler.requests.get(rid)
                if req is None or req.status is not Status.RUNNING:
                    launched.kept[i] = None
