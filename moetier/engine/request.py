"""A request as the scheduler tracks it: its tokens, pages, status and timings. Plain CPU state; the
text side (detokenizer, stop strings) is the output processor's (output.py)."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from moetier.sampling_params import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"  # no KV held: new, or preempted and to be recomputed
    RUNNING = "running"  # holds pages (and a state slot); computes tokens every step it is scheduled
    FINISHED = "finished"


@dataclass
class Request:
    id: str
    prompt_ids: list[int]
    params: SamplingParams
    seed: int  # the noise seed of its sampling (layers/sampler.py): its own, or drawn at arrival
    prompt: str | None = None  # the prompt text, when it came as text
    arrival: float = field(default_factory=time.perf_counter)
    output_ids: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    num_computed: int = 0  # tokens whose keys and values sit in this request's pages
    pages: list[int] = field(default_factory=list)
    state_slot: int | None = None  # its recurrent-state slot while running (models with KDA layers)
    finish_reason: str | None = None  # "stop", "length" or "abort"
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it (None for EOS)
    first_scheduled: float | None = None
    # per output token, seconds from arrival to the step that sampled it: kept relative, so a step's
    # metrics copy the list instead of rebuilding it (that was O(output) of work per request per step)
    token_times: list[float] = field(default_factory=list)
    preemptions: int = 0
    num_cached_tokens: int = 0  # tokens its last admission found in the prefix cache (prefill skipped)
    # per output token, when params.logprobs is set: (logprob, [(alternative id, logprob)])
    output_logprobs: list[tuple] = field(default_factory=list)
    # when params.prompt_logprobs is set: per prompt token its (logprob, rank, [(alternative id, logprob)]),
    # None for the first (nothing predicts it); filled chunk by chunk as the prefill computes them
    prompt_logprobs: list[tuple | None] = field(default_factory=lambda: [None])
    # speculative method mtp: the drafts its MTP layer made for its next step (engine/speculation.py),
    # in the step numbered draft_step: they are verified only in the step right after it, where the
    # runner still holds the distributions sampled drafts were drawn from (engine/spec_step.py)
    draft_ids: list[int] = field(default_factory=list)
    draft_step: int = -1

    @property
    def total_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    def score_prompt(self, first: int, entries: list[tuple]) -> None:
        """Record the logprobs of prompt tokens first, first + 1, ...; a recomputed prefill (after a
        preemption) writes the same positions again."""
        del self.prompt_logprobs[first:]
        assert len(self.prompt_logprobs) == first, f"{self.id}: prompt logprobs from {first} after a gap"
        self.prompt_logprobs.extend(entries)

    def token(self, i: int) -> int:
        """Token i of prompt + output."""
        n = len(self.prompt_ids)
        return self.prompt_ids[i] if i < n else self.output_ids[i - n]

    def tokens(self, start: int, end: int) -> list[int]:
        """Tokens [start, end) of prompt + output, as slices (a prefill chunk is thousands of tokens)."""
        n = len(self.prompt_ids)
        if end <= n:
            return self.prompt_ids[start:end]
        if start >= n:
            return self.output_ids[start - n:end - n]
        return self.prompt_ids[start:] + self.output_ids[:end - n]

    def metrics(self) -> dict[str, float | int | str | None]:
        first = self.token_times[0] if self.token_times else None
        last = self.token_times[-1] if self.token_times else None
        decode = len(self.token_times) - 1
        return {
            "arrival": self.arrival,
            "queue_s": None if self.first_scheduled is None else self.first_scheduled - self.arrival,
            "ttft_s": first,
            "decode_tok_per_s": decode / (last - first) if decode > 0 and last > first else 0.0,
            "e2e_s": last,
            "token_times": list(self.token_times),
            "prompt_tokens": len(self.prompt_ids),
            "output_tokens": len(self.output_ids),
            "preemptions": self.preemptions,
            "cached_tokens": self.num_cached_tokens,
            "finish_reason": self.finish_reason,
        }
