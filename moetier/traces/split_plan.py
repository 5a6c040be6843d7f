"""Pinned or slots, per layer, from a routing trace (experts/cache/split.py is the split itself).

A layer has D rows of GPU memory for its experts: P pinned (always resident, chosen once, no host
copy) and S = D - P slots (filled on demand over the link). Pinning wins where the layer's hot set is
stable: a pinned row never misses and costs no host copy, but it cannot follow the routing when the
hot set drifts, which a slot does. So the choice is tested held out: the pinned set is taken from the
trace's first half (its hottest experts) and the hit rate measured on the second half, the slots
simulated exactly as the engine's cache runs them over the cached experts (simulate_split, held to
the cache by tests). The best P on the grid wins, ties going to more pinned; the set the engine pins
is then the hottest of the whole trace.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from moetier.experts.cache.slots import policy_for
from moetier.traces.simulate import Counts, simulate_policy

GRID_POINTS = 6  # candidate pinned counts per layer, min to max
CHOICE_TOKENS = 4096  # at most this many tokens of the trace decide a layer's split (pure Python simulation)


@dataclass
class SplitCounts(Counts):
    pinned: int = 0  # of the hits, those of pinned experts


def hottest(ids: np.ndarray, num_experts: int, n: int) -> tuple[int, ...]:
    """The n most used experts of ids [N, k] (ties: the lower id), ascending."""
    if n <= 0:
        return ()
    counts = np.bincount(np.asarray(ids).reshape(-1), minlength=num_experts)
    order = np.argsort(-counts, kind="stable")[:n]
    return tuple(sorted(int(e) for e in order))


def simulate_split(ids: np.ndarray, num_experts: int, num_slots: int, policy: str, pinned: tuple[int, ...],
                   top_k: int | None = None) -> SplitCounts:
    """One layer's ids [N, k] (one token a step) through the slot cache with `pinned` permanent hits:
    the same counts as slots.SlotCache (hits include the pinned ones)."""
    held = np.zeros(num_experts, dtype=bool)
    held[list(pinned)] = True
    ids = np.asarray(ids)
    steps = [row[~held[row]] for row in ids]
    base = simulate_policy(steps, num_experts, num_slots, policy_for(policy, num_slots, top_k or ids.shape[1]))
    pin = sum(len(set(row[held[row]].tolist())) for row in ids)
    return SplitCounts(base.hits + pin, base.misses, base.overflow, base.steps, pin)


def grid(low: int, high: int, points: int = GRID_POINTS) -> list[int]:
    """About `points` pinned counts from low to high, both included."""
    if high <= low:
        return [low]
    step = max(1, (high - low) // (points - 1))
    return sorted(set(range(low, high, step)) | {high})


@dataclass
class LayerSplit:
    pinned: tuple[int, ...]
    slots: int
    hit_rate: float  # held out: the first half's pinned set, measured on the second half
    stability: float  # the first half's hottest P cover this share of what the second half's own would


def choose(ids: np.ndarray, num_experts: int, rows: int, min_pinned: int, top_k: int, policy: str = "lfru",
           tokens: int = CHOICE_TOKENS) -> LayerSplit:
    """The split of one layer's D = `rows` device rows that the trace ids [N, k] predicts hits most,
    with at least `min_pinned` pinned (what the host cannot hold) and at least one slot (fewer than
    top_k slots only where the budget leaves no more)."""
    ids = np.asarray(ids)[:tokens]
    half = max(1, ids.shape[0] // 2)
    first, second = ids[:half], ids[half:] if ids.shape[0] > 1 else ids
    high = max(min_pinned, min(rows - top_k, num_experts - 1))
    high = min(high, rows - 1, num_experts - 1)
    best: tuple[float, int] | None = None
    for p in grid(min_pinned, high):
        s = min(rows - p, num_experts - p)
        got = simulate_split(second, num_experts, s, policy, hottest(first, num_experts, p), top_k)
        if best is None or got.hit_rate >= best[0]:  # ties: more pinned
            best = (got.hit_rate, p)
    rate, p = best
    s = min(rows - p, num_experts - p)
    own = np.bincount(second.reshape(-1), minlength=num_experts)
    top = sorted(own, reverse=True)[:p]
    cover = sum(int(own[e]) for e in hottest(first, num_experts, p))
    return LayerSplit(hottest(ids, num_experts, p), s, rate, cover / sum(top) if p and sum(top) else 1.0)


def predict(ids: np.ndarray, num_experts: int, slots: int, pinned: tuple[int, ...], policy: str, top_k: int,
            tokens: int = CHOICE_TOKENS) -> SplitCounts:
    """Counts of one layer's split over (the first `tokens` of) the trace: what the plan prints."""
    return simulate_split(np.asarray(ids)[:tokens], num_experts, slots, policy, pinned, top_k)
