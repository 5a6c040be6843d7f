"""Sampling: greedy, temperature, top-k, top-p, seeded per request.

Works on a batch of rows, each with its own parameters, so the serving engine can sample a mixed
batch in one call. Seeded rows draw their noise from their own generator, so a request's tokens do
not depend on what else shares its batch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from moetier.errors import MoetierError


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

    def validate(self) -> SamplingParams:
        problems = []
        if self.max_tokens < 0:
            problems.append(f"max_tokens must be >= 0, got {self.max_tokens}")
        if self.temperature < 0:
            problems.append(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            problems.append(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            problems.append(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if any(not s for s in self.stop):
            problems.append("stop strings must not be empty")
        if problems:
            raise MoetierError("invalid sampling parameters: " + "; ".join(problems))
        return self

    def generator(self, device: torch.device | str = "cpu") -> torch.Generator:
        g = torch.Generator(device=device)
        if self.seed is not None:
            g.manual_seed(self.seed)
        else:
            g.seed()
        return g


def filter_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """logits: [B, V] float32; top_k: [B] int (0 = off); top_p: [B] float (1 = off).

    Returns logits with everything outside each row's support set to -inf. Top-k first, then top-p
    over what remains (the order transformers uses). Ties at the top-k boundary keep the lower ids.
    """
    b, v = logits.shape
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True, stable=True)
    rank = torch.arange(v, device=logits.device).expand(b, v)
    k = torch.where(top_k > 0, top_k.clamp(max=v), torch.full_like(top_k, v))
    drop = rank >= k[:, None]
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    probs = torch.softmax(sorted_logits, dim=-1)
    # A token stays while the mass strictly before it is below p; the first token always stays.
    before = torch.cumsum(probs, dim=-1) - probs
    drop = drop | (before >= top_p[:, None])
    drop[:, 0] = False
    return torch.full_like(logits, float("-inf")).scatter(1, order, sorted_logits.masked_fill(drop, float("-inf")))


def sample(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator]) -> torch.Tensor:
    """logits: [B, V] float32 -> token ids [B] int64."""
    greedy = logits.argmax(dim=-1)
    rows = [i for i, p in enumerate(params) if p.temperature > 0]
    if not rows:
        return greedy
    dev = logits.device
    sub = logits[rows] / torch.tensor([params[i].temperature for i in rows], device=dev)[:, None]
    sub = filter_top_k_top_p(
        sub,
        torch.tensor([params[i].top_k for i in rows], device=dev),
        torch.tensor([params[i].top_p for i in rows], device=dev, dtype=torch.float32),
    )
    probs = torch.softmax(sub, dim=-1)
    # Exponential race: argmax(p / q) with q ~ Exp(1) draws from p; q comes from each row's generator.
    noise = torch.stack([torch.empty(sub.shape[1], device=dev).exponential_(generator=generators[i]) for i in rows])
    picked = (probs / noise).argmax(dim=-1)
    out = greedy.clone()
    out[torch.tensor(rows, device=dev)] = picked
    return out
