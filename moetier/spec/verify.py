"""The verify arithmetic of speculative decoding, batched over sequences that drafted different
numbers of tokens, in fixed shapes and without a host read (the decode step's rules: no .item(), no
data-dependent shapes), so the step loop can call it inside a CUDA graph.

Shapes: B sequences, K the step's most draft tokens, V the vocabulary.

    draft        [B, K]       int64, sequence b's draft tokens; entries j >= draft_lens[b] are ignored
    draft_lens   [B]          int64, 0 .. K (a sequence that drafted nothing verifies one token)
    target       [B, K + 1, V] the target model's logits (greedy) or probabilities (sampled) at the
                              K + 1 verified positions: position j scores the token after draft[:, :j]

Both return (accepted [B] int64: drafts kept, 0 .. draft_lens; tokens [B, K + 1] int64: the step's
output, accepted drafts then one more token: the target's correction at the first rejection, or the
bonus token when every draft was kept; entries past accepted are PAD). A sequence emits accepted + 1
tokens.

Sampled acceptance is the rejection sampling of Leviathan et al. and Chen et al.: draft x at j is
kept with probability min(1, p_j(x) / q_j(x)); at the first rejection the token is drawn from the
residual norm(max(p_j - q_j, 0)); after K kept drafts from p_K. Every emitted token is then
distributed exactly as the target would sample it (tests/test_spec_verify.py measures it). A draft
without a distribution (n-gram: q is one-hot) is kept with probability p_j(x).
"""

from __future__ import annotations

import torch

PAD = -1


def _kept(match: torch.Tensor, draft_lens: torch.Tensor) -> torch.Tensor:
    # match [B, K] bool -> accepted [B]: the leading run of matches, capped by each draft's length
    k = match.shape[1]
    valid = torch.arange(k, device=match.device)[None, :] < draft_lens[:, None]
    return torch.cumprod((match & valid).to(torch.int64), dim=1).sum(dim=1)


def _emit(draft: torch.Tensor, accepted: torch.Tensor, last: torch.Tensor) -> torch.Tensor:
    # tokens [B, K + 1]: draft[:, :accepted], then `last`, then PAD
    b, k = draft.shape
    j = torch.arange(k + 1, device=draft.device)[None, :]
    padded = torch.cat([draft, draft.new_full((b, 1), PAD)], dim=1)
    out = torch.where(j < accepted[:, None], padded, torch.full_like(padded, PAD))
    return out.scatter(1, accepted[:, None], last[:, None])


def greedy_accept(draft: torch.Tensor, draft_lens: torch.Tensor, target_logits: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact greedy verification: drafts are kept while they equal the target's argmax; the token
    after them is the target's argmax there. The output equals non-speculative greedy decoding."""
    best = target_logits.argmax(dim=-1)  # [B, K + 1]
    accepted = _kept(draft == best[:, :-1], draft_lens)
    return accepted, _emit(draft, accepted, best.gather(1, accepted[:, None])[:, 0])


def sample_from(probs: torch.Tensor, exponential: torch.Tensor) -> torch.Tensor:
    """[..., V] probabilities -> [...] tokens: argmax(p / E) with E ~ Exp(1) is a draw from p (the
    exponential race; no multinomial, so no host sync). A zero-probability token never wins."""
    return (probs / exponential).argmax(dim=-1)


def rejection_accept(draft: torch.Tensor, draft_lens: torch.Tensor, target_probs: torch.Tensor,
                     draft_probs: torch.Tensor | None = None, generator: torch.Generator | None = None,
                     uniforms: torch.Tensor | None = None, exponentials: torch.Tensor | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """Sampled verification preserving the target distribution. draft_probs [B, K, V]: the
    distributions the drafts were drawn from (None: deterministic drafts, n-gram). The random numbers
    come from `generator` (a fixed seed gives fixed tokens), or are given: uniforms [B, K] in (0, 1)
    for the accept tests, exponentials [B, V] (Exp(1)) for the last token's draw (the engine derives
    both from each request's own seed, as its sampler does)."""
    b, k, v = draft.shape[0], draft.shape[1], target_probs.shape[-1]
    p = target_probs.float()
    safe = draft.clamp_min(0)[:, :, None]  # entries past draft_lens may be PAD: gathered, never used
    p_draft = p[:, :k].gather(2, safe)[:, :, 0]  # [B, K]
    if draft_probs is None:
        q_draft = torch.ones_like(p_draft)
        residual = p[:, :k].scatter(2, safe, 0.0)  # max(p - onehot, 0) but at x: 0
    else:
        q = draft_probs.float()
        q_draft = q.gather(2, safe)[:, :, 0]
        residual = (p[:, :k] - q).clamp_min(0.0)
    u = torch.rand(b, k, generator=generator, device=draft.device) if uniforms is None else uniforms
    # u < p / q, written without the division (q may be 0 where p is not: then always kept)
    accepted = _kept(u * q_draft < p_draft, draft_lens)
    mass = residual.sum(dim=-1, keepdim=True)
    # residual all zero (p == q): a rejection has probability 0 there; fall back to p to stay finite
    residual = torch.where(mass > 0, residual / mass.clamp_min(1e-30), p[:, :k])
    # the distribution of the step's last token, by where the run of kept drafts ends
    ends = torch.arange(k + 1, device=draft.device)[None, :] < draft_lens[:, None]  # [B, K + 1]: a rejection there
    final = torch.where(ends[:, :, None], torch.cat([residual, p[:, k:]], dim=1), p)  # [B, K + 1, V]
    at = final.gather(1, accepted[:, None, None].expand(b, 1, v))[:, 0]  # [B, V]
    e = torch.empty(b, v, device=draft.device).exponential_(generator=generator) if exponentials is None \
        else exponentials
    return accepted, _emit(draft, accepted, sample_from(at, e))


def emitted_counts(accepted: torch.Tensor) -> torch.Tensor:
    """Tokens each sequence emits this step (accepted drafts plus the correction or bonus)."""
    return accepted + 1
