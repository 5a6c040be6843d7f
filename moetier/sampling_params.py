"""What a request asks of sampling: plain data (no torch), validated once at arrival. The kernels
that apply it are layers/sampler.py."""

from __future__ import annotations

import math
import secrets
from dataclasses import dataclass, field

from moetier.errors import MoetierError

MAX_LOGPROBS = 20  # alternatives per token, as OpenAI's API allows
LOGIT_BIAS_MAX = 100.0  # |bias| at most this, as OpenAI's API allows


@dataclass
class SamplingParams:
    max_tokens: int = 64
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0  # 1 = off
    top_k: int = 0  # 0 = off
    seed: int | None = None
    stop: list[str] = field(default_factory=list)  # stop strings; not part of the output
    stop_token_ids: list[int] = field(default_factory=list)  # besides the model's EOS ids
    ignore_eos: bool = False
    # log-probabilities of each sampled token and of this many most likely alternatives (None = off,
    # 0 = the sampled token's only), from the model's distribution before temperature and filters
    logprobs: int | None = None
    # log-probabilities of the prompt's tokens (each after the first) and of this many most likely
    # alternatives at each position (None = off), computed in the prefill from the logits of the same
    # forward pass (vLLM's prompt_logprobs): what scoring (echo, lm-eval's log-likelihoods) reads
    prompt_logprobs: int | None = None
    # token id -> bias added to its logit before sampling (temperature, filters), as OpenAI and vLLM do;
    # not to the logprobs, which stay the model's (raw) distribution
    logit_bias: dict[int, float] | None = None
    # special token ids kept in the output text (others are skipped): the markers that a server's
    # reasoning and tool-call parsers read, where the checkpoint made them special tokens
    keep_special_ids: frozenset[int] = frozenset()

    def validate(self) -> SamplingParams:
        problems = []
        if self.max_tokens < 1:
            problems.append(f"max_tokens must be at least 1, got {self.max_tokens}")
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            problems.append(f"temperature must be a finite number >= 0 (0 = greedy), got {self.temperature}")
        if not 0 < self.top_p <= 1:  # NaN fails this too
            problems.append(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            problems.append(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if self.seed is not None and not 0 <= self.seed < 2**63:
            problems.append(f"seed must be in [0, 2^63), got {self.seed}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            problems.append(f"logprobs must be in 0..{MAX_LOGPROBS}, got {self.logprobs}")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= MAX_LOGPROBS:
            problems.append(f"prompt_logprobs must be in 0..{MAX_LOGPROBS}, got {self.prompt_logprobs}")
        for token, bias in (self.logit_bias or {}).items():
            if not (isinstance(token, int) and token >= 0 and -LOGIT_BIAS_MAX <= bias <= LOGIT_BIAS_MAX):
                problems.append(f"logit_bias {{{token}: {bias}}}: keys are token ids >= 0, biases in [-100, 100]")
                break
        if any(not s for s in self.stop):
            problems.append("stop strings must not be empty")
        if problems:
            raise MoetierError("invalid sampling parameters: " + "; ".join(problems))
        return self

    def noise_seed(self) -> int:
        """The seed of this request's noise: its own, or a fresh random one."""
        return self.seed if self.seed is not None else secrets.randbits(63)

    @property
    def filters(self) -> bool:
        return self.temperature > 0 and (self.top_k > 0 or self.top_p < 1)
