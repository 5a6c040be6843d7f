"""Expert-aware k: how many draft tokens the next step should verify, priced by the experts the
verify step would touch. Plain CPU arithmetic between steps (float64 torch on the host), from:

    acceptance [K]   measured P(draft j kept | drafts 0 .. j-1 kept), per position (AcceptanceMeter)
    routing [L, E]   per MoE layer, each expert's share of recent routing (sums to top_k per token
                     once multiplied: routing[l].sum() == 1); uniform when nothing is measured
    resident [L, E]  bool, whether the expert sits in HBM now (pinned, in a slot, or all resident)
    StepCosts        the seconds the device pays once per step (the dense weights read: a decode
                     step is memory-bound), per token, per expert read from HBM, per expert brought
                     over the link (hybrid: the link and the host cores fill misses side by side, so
                     a miss costs 1 / (1 / link + 1 / host), experts/hybrid/cost_model.py), per
                     draft token, per chained MTP pass (one per draft after the first, all sequences
                     at once), and what an eager step pays over a CUDA-graph replay

With B sequences verifying k + 1 tokens each, a layer's n = B (k + 1) tokens each pick top_k
experts; expert e is used by one token with probability p_e = min(1, top_k * routing[l, e]), so by
the step with probability 1 - (1 - p_e)^n (tokens independent). The step's expected time is

    t(k) = fixed + n * per_token + sum over layers and experts of
               P(e used) * (hbm_expert if resident[e] else miss_expert) + B * k * per_draft_token
               + max(k - 1, 0) * draft_pass + (eager if the step of k runs eagerly)

where `eager` is the launches a graph saves: a k = 0 step of a batch the decode graphs hold replays
one, a verify step replays one where a verify graph holds its batch and k (n-gram drafting,
engine/verify_graphs.py), and every other step runs eagerly (without graphs eager is 0: every step
alike).

and each sequence emits E(k) = 1 + sum_{i=1..k} prod_{j<i} acceptance[j] tokens (the kept run plus
the correction or bonus token). choose_k returns the k in 0 .. max_k with the most tokens per second
B E(k) / t(k); ties go to the smaller k. Misses are priced whole (one expert row over the link); the
overlap of copies with compute and the slot evictions a step causes are not modelled.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class StepCosts:
    fixed_s: float  # once per step: the dense weights (attention, shared experts, head) read from HBM
    per_token_s: float  # what grows with the tokens: attention over the context, activations
    hbm_expert_s: float  # one expert's weights read from HBM (expert bytes / HBM bandwidth)
    link_expert_s: float  # one expert's weights brought over the link (expert bytes / link bandwidth)
    per_draft_token_s: float = 0.0  # one draft token (an MTP layer forward; ~0 for n-gram)
    host_expert_s: float | None = None  # hybrid: one miss computed by the host cores instead
    eager_s: float = 0.0  # what a step of k > 0 (eager) pays over a k = 0 step that replays a CUDA graph
    draft_pass_s: float = 0.0  # one chained MTP pass (drafts 2 .. k; draft 1 comes from the catch-up)

    @property
    def miss_expert_s(self) -> float:
        """One miss: over the link, or under hybrid over the link and on the host cores at once (the two
        paths run concurrently, so their rates add; the per-call overhead and a shared expert's extra
        tokens on the host are left out)."""
        if self.host_expert_s is None:
            return self.link_expert_s
        return 1.0 / (1.0 / self.link_expert_s + 1.0 / self.host_expert_s)

    @classmethod
    def from_rates(cls, dense_bytes: int, expert_bytes: int, hbm_bytes_per_s: float, link_bytes_per_s: float,
                   per_token_s: float, per_draft_token_s: float = 0.0, host_expert_s: float | None = None
                   ) -> StepCosts:
        """From measured rates (bytes per second; the link measured at start-up, never assumed)."""
        return cls(dense_bytes / hbm_bytes_per_s, per_token_s, expert_bytes / hbm_bytes_per_s,
                   expert_bytes / link_bytes_per_s, per_draft_token_s, host_expert_s)


def expected_tokens(acceptance: torch.Tensor, k: int) -> float:
    """Tokens one sequence emits when it verifies k drafts with these per-position acceptances."""
    return 1.0 + float(torch.cumprod(acceptance[:k].double(), 0).sum()) if k else 1.0


def used_probability(routing: torch.Tensor, top_k: int, tokens: int) -> torch.Tensor:
    """[L, E]: the probability each expert is used by at least one of `tokens` tokens."""
    p = (routing.double() * top_k).clamp(0.0, 1.0)
    return 1.0 - (1.0 - p) ** tokens


def step_seconds(k: int, batch: int, routing: torch.Tensor, resident: torch.Tensor, top_k: int,
                 costs: StepCosts, eager: bool | None = None) -> float:
    """Expected seconds of one verify step of `batch` sequences with k drafts each (plus their drafting);
    eager: whether that step runs without a graph (None: k > 0, every verify step eager)."""
    n = batch * (k + 1)
    used = used_probability(routing, top_k, n)
    res = resident.to(torch.bool)
    hits, misses = float(used[res].sum()), float(used[~res].sum())
    return costs.fixed_s + n * costs.per_token_s + hits * costs.hbm_expert_s + misses * costs.miss_expert_s \
        + batch * k * costs.per_draft_token_s + max(k - 1, 0) * costs.draft_pass_s \
        + (costs.eager_s if (k > 0 if eager is None else eager) else 0.0)


def choose_k(max_k: int, batch: int, acceptance: torch.Tensor, routing: torch.Tensor, resident: torch.Tensor,
             top_k: int, costs: StepCosts, eager: list[bool] | None = None) -> tuple[int, list[float]]:
    """(the best k in 0 .. max_k, the expected tokens per second of every k); eager[k]: whether the step
    of k runs without a graph (None: every k > 0 eager)."""
    if acceptance.shape[0] < max_k:
        raise ValueError(f"acceptance has {acceptance.shape[0]} positions, fewer than max_k {max_k}")
    if routing.shape != resident.shape:
        raise ValueError(f"routing {tuple(routing.shape)} and resident {tuple(resident.shape)} differ in shape")
    rates = [batch * expected_tokens(acceptance, k)
             / step_seconds(k, batch, routing, resident, top_k, costs, None if eager is None else eager[k])
             for k in range(max_k + 1)]
    best = max(range(max_k + 1), key=lambda k: (rates[k], -k))
    return best, rates


class AcceptanceMeter:
    """Per-position acceptance measured from verify outcomes, an exponential moving average so it
    follows the text; starts at `prior` (optimistic, so k > 0 is tried and measured)."""

    def __init__(self, max_k: int, prior: float = 0.7, decay: float = 0.95):
        self.decay = decay
        self.rate = torch.full((max_k,), prior, dtype=torch.float64)

    def update(self, accepted: torch.Tensor, draft_lens: torch.Tensor) -> None:
        """accepted, draft_lens [B] (host tensors, read between steps): position j was tried by the
        sequences with accepted >= j and draft_lens > j, and kept by those with accepted > j."""
        j = torch.arange(self.rate.shape[0])[None, :]
        tried = (accepted[:, None] >= j) & (draft_lens[:, None] > j)
        kept = accepted[:, None] > j
        n = tried.sum(0).double()
        seen = n > 0
        frac = (kept & tried).sum(0).double() / n.clamp_min(1)
        w = self.decay ** n  # each observation moves the average by the usual EMA step
        self.rate = torch.where(seen, w * self.rate + (1 - w) * frac, self.rate)
