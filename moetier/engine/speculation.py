"""The scheduler's side of speculative decoding (docs/speculative.md): which decoding requests draft,
how many tokens, where the drafts come from, and the counters of what the verify steps kept. Plain
CPU state, no torch (the scheduler's rule); the runner's side is spec_step.py.

Per decoding request and step: k = min(the step's k, max_tokens - output - 1, budget - 1), or 0 for
a request this engine cannot verify exactly (it asked for a logit_bias: it is not added per verified
position). Method "ngram" looks the drafts up in the request's tokens
(spec/ngram.py) at schedule time; method "mtp" takes the up to k drafts the runner's MTP layer made
at the end of the request's previous step (Request.draft_ids), if that was the step just before this
one (a request the last step left out, its token budget spent, drafts again first: the runner keeps
the distributions of sampled drafts for one step only). The step then computes the request's last
token and its drafts, k + 1 positions; the runner keeps accepted drafts plus one token.

Expert-aware k: an attached chooser (engine/spec_k.KChooser) sets the step's k before the scheduler
drafts (begin_step) and hears every verify row's outcome after the update (end_step).

Metrics, as vLLM names them: spec_decode_num_drafts (verify rows that carried drafts),
spec_decode_num_draft_tokens, spec_decode_num_accepted_tokens, and per position j the drafts kept
there (spec_decode_num_accepted_tokens_per_pos[j]).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from moetier.engine.request import Request
from moetier.sampling_params import SamplingParams
from moetier.spec.config import SpeculativeConfig
from moetier.spec.ngram import propose


def speculable(params: SamplingParams) -> bool:
    """Whether a request's tokens can be verified exactly: greedy or sampled (temperature, top-k,
    top-p), with or without logprobs, without a logit bias (not added per verified position)."""
    return not params.logit_bias


@dataclass
class SpecCounters:
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)
    # steps per k chosen (expert-aware k: engine/spec_k.py)
    k_chosen: dict[int, int] = field(default_factory=dict)

    def record(self, drafted: int, accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += drafted
        self.num_accepted_tokens += accepted
        for j in range(accepted):
            self.accepted_per_pos[j] += 1

    def since(self, before: SpecCounters) -> SpecCounters:
        """What was counted after `before` (a copy of these counters taken earlier): a timed window's."""
        return SpecCounters(self.num_drafts - before.num_drafts, self.num_draft_tokens - before.num_draft_tokens,
                            self.num_accepted_tokens - before.num_accepted_tokens,
                            [a - b for a, b in zip(self.accepted_per_pos, before.accepted_per_pos)],
                            {k: n - before.k_chosen.get(k, 0) for k, n in self.k_chosen.items()
                             if n > before.k_chosen.get(k, 0)})

    def as_dict(self) -> dict:
        return {"spec_decode_num_drafts": self.num_drafts,
                "spec_decode_num_draft_tokens": self.num_draft_tokens,
                "spec_decode_num_accepted_tokens": self.num_accepted_tokens,
                "spec_decode_num_accepted_tokens_per_pos": list(self.accepted_per_pos),
                "spec_decode_acceptance_rate": (self.num_accepted_tokens / self.num_draft_tokens
                                                if self.num_draft_tokens else None),
                "spec_decode_mean_acceptance_length": (1 + self.num_accepted_tokens / self.num_drafts
                                                       if self.num_drafts else None),
                "spec_decode_k_chosen": dict(sorted(self.k_chosen.items()))}


class Speculation:
    def __init__(self, config: SpeculativeConfig):
        self.config = config
        self.k = config.num_speculative_tokens  # this step's most drafts (expert-aware k may lower it)
        self.counters = SpecCounters(accepted_per_pos=[0] * config.num_speculative_tokens)
        # expert-aware k (engine/spec_k.KChooser, attached by the engine): choose(batch) -> k before a
        # step, observe([(drafted, kept)]) after it; None: always the configured k
        self.chooser = None
        self._outcomes: list[tuple[int, int]] = []
        self.steps = 0  # steps ended: the number of the step in flight

    def begin_step(self, batch: int) -> None:
        if self.chooser is not None:
            self.set_k(self.chooser.choose(batch))

    def record(self, drafted: int, accepted: int) -> None:
        self.counters.record(drafted, accepted)
        self._outcomes.append((drafted, accepted))

    def end_step(self) -> None:
        if self.chooser is not None:
            self.chooser.observe(self._outcomes)
        self._outcomes = []
        self.steps += 1

    @property
    def mtp(self) -> bool:
        return self.config.method == "mtp"

    def set_k(self, k: int) -> None:
        if not 0 <= k <= self.config.num_speculative_tokens:
            raise ValueError(f"k {k} outside 0 .. {self.config.num_speculative_tokens}")
        self.k = k
        self.counters.k_chosen[k] = self.counters.k_chosen.get(k, 0) + 1

    def k_for(self, req: Request, budget: int) -> int:
        if not speculable(req.params):
            return 0
        return max(0, min(self.k, req.params.max_tokens - len(req.output_ids) - 1, budget - 1))

    def drafts(self, req: Request, budget: int) -> list[int]:
        """The drafts a decoding request verifies this step (maybe none)."""
        k = self.k_for(req, budget)
        if k == 0:
            return []
        if self.mtp:  # made by the step just before this one, or none
            return req.draft_ids[:k] if req.draft_step == self.steps - 1 else []
        c = self.config
        return propose(req.prompt_ids + req.output_ids, k, c.prompt_lookup_min, c.prompt_lookup_max)

    def draft_next(self, req: Request) -> int:
        """MTP: how many drafts the runner makes for the request's next step: this step's k (expert-aware
        k prices each chained pass; a step whose k was 0 makes none, and the next verifies none), cut to
        the next step's k then."""
        return self.k if self.mtp and speculable(req.params) else 0
