"""Cache simulation on routing traces: LRU, LFU, LFRU exactly as the engine's slot cache runs them
(same victim order, same tie-breaks; tests hold the two to equal counts), and Belady's optimal as
the upper bound. Plus the physics model that turns misses into decode time.

A step is one token by default (decode at batch 1); `steps` can group tokens as the engine did.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from moetier.experts.slots import CachePolicy, policy_for

POLICIES = ("lru", "lfu", "lfru", "belady")


@dataclass
class Counts:
    hits: int = 0
    misses: int = 0  # filled into a slot
    overflow: int = 0  # read over the link without a slot
    steps: int = 0

    @property
    def lookups(self) -> int:
        return self.hits + self.misses + self.overflow

    @property
    def hit_rate(self) -> float:
        return self.hits / self.lookups if self.lookups else 0.0

    def add(self, needed: list[int], misses: list[int], victims: list[int]) -> None:
        """Count one step: needed experts, the missing ones, and the slots they got."""
        self.hits += len(needed) - len(misses)
        self.misses += len(victims)
        self.overflow += len(misses) - len(victims)
        self.steps += 1

    def as_dict(self) -> dict:
        return {"hits": self.hits, "misses": self.misses, "overflow": self.overflow, "steps": self.steps,
                "hit_rate": self.hit_rate}


def _needed(step: np.ndarray) -> list[int]:
    return list(dict.fromkeys(int(e) for e in step.reshape(-1)))  # first-appearance order


def _step(needed: list[int], heap: list, key: list[int], expert_slot: list[int], slot_expert: list[int]
          ) -> tuple[list[int], list[int]]:
    """Misses of the step and the victims they take: the smallest valid (key, slot) heap entries
    among slots the step does not use. Fills the maps. Entries whose key is not the slot's current
    key are stale and dropped; used slots get fresh entries from the caller after the step."""
    used = {expert_slot[e] for e in needed if expert_slot[e] >= 0}
    misses = [e for e in needed if expert_slot[e] < 0]
    victims: list[int] = []
    while len(victims) < len(misses) and heap:
        k, s = heapq.heappop(heap)
        if k != key[s] or s in used:
            continue
        victims.append(s)
    for e, s in zip(misses, victims):
        old = slot_expert[s]
        if old >= 0:
            expert_slot[old] = -1
        expert_slot[e], slot_expert[s] = s, e
    return misses, victims


def simulate_policy(steps: Iterable[np.ndarray], num_experts: int, num_slots: int, policy: CachePolicy) -> Counts:
    """The slot cache's step (moetier.experts.slots) in plain Python with a heap of (key, slot)."""
    expert_slot = [-1] * num_experts
    slot_expert = [-1] * num_slots
    stamp = [-1] * num_slots
    freq, fepoch = [0] * num_experts, [0] * num_experts
    w = policy.weight
    key = [-1] * num_slots  # current key of each slot; heap entries that differ are stale
    heap = [(-1, s) for s in range(num_slots)]
    counts = Counts()
    epoch = 0

    def slot_key(s: int, ep: int) -> int:
        e = slot_expert[s]
        if e < 0:
            return -1
        return stamp[s] + (w * (freq[e] >> min(ep - fepoch[e], 31)) if w else 0)

    for t, step in enumerate(steps):
        ep = policy.epoch(t)
        if w and ep != epoch:  # every resident key decays at an epoch boundary: rebuild
            epoch = ep
            key = [slot_key(s, ep) for s in range(num_slots)]
            heap = [(k, s) for s, k in enumerate(key)]
            heapq.heapify(heap)
        needed = _needed(step)
        misses, victims = _step(needed, heap, key, expert_slot, slot_expert)
        if w:
            for e in needed:
                freq[e] = (freq[e] >> min(ep - fepoch[e], 31)) + 1
                fepoch[e] = ep
        for e in needed:
            s = expert_slot[e]
            if s >= 0:
                stamp[s] = t
                key[s] = slot_key(s, ep)
                heapq.heappush(heap, (key[s], s))
        counts.add(needed, misses, victims)
    return counts


def simulate_belady(steps: Sequence[np.ndarray], num_experts: int, num_slots: int) -> Counts:
    """Belady's MIN under the same rules (demand fill, never evict what the step needs): the victim
    is the resident expert used again furthest in the future (never again first)."""
    needed_per_step = [_needed(s) for s in steps]
    n = len(needed_per_step)
    nxt: list[dict[int, int]] = [dict() for _ in range(n)]  # step -> expert -> its next use after
    last = [n] * num_experts  # n: never again
    for t in range(n - 1, -1, -1):
        for e in needed_per_step[t]:
            nxt[t][e] = last[e]
        for e in needed_per_step[t]:
            last[e] = t
    expert_slot = [-1] * num_experts
    slot_expert = [-1] * num_slots
    heap = [(-(n + 1), s) for s in range(num_slots)]  # max-heap on next use; empty slots first
    prio = [-(n + 1)] * num_slots
    counts = Counts()
    for t, needed in enumerate(needed_per_step):
        misses, victims = _step(needed, heap, prio, expert_slot, slot_expert)
        for e in needed:
            s = expert_slot[e]
            if s >= 0:
                prio[s] = -nxt[t][e]
                heapq.heappush(heap, (prio[s], s))
        counts.add(needed, misses, victims)
    return counts


def token_steps(ids: np.ndarray, group: np.ndarray | None = None) -> list[np.ndarray]:
    """ids [N, k] of one layer -> steps: one token each, or grouped by equal values of `group`."""
    if group is None:
        return [ids[i] for i in range(ids.shape[0])]
    cuts = np.flatnonzero(np.diff(group)) + 1
    return np.split(ids, cuts)


def simulate(ids: np.ndarray, num_experts: int, num_slots: int, policy: str, top_k: int | None = None,
             group: np.ndarray | None = None) -> Counts:
    """One layer's ids [N, k] through `policy` with `num_slots` slots."""
    steps = token_steps(ids, group)
    if policy == "belady":
        return simulate_belady(steps, num_experts, num_slots)
    return simulate_policy(steps, num_experts, num_slots, policy_for(policy, num_slots, top_k or ids.shape[1]))


@dataclass
class Physics:
    """Decode time of one token: bytes over the bandwidth each crosses."""

    hbm_GBps: float
    link_GBps: float
    row_bytes: int  # one routed expert
    moe_layers: int  # of the model the time is for (a trace may cover fewer: its mean layer stands in)
    dense_bytes_per_token: int = 0  # attention, norms, router, LM head: read from HBM every token

    def ms_per_token(self, top_k: int, misses_per_layer: float, overflow_per_layer: float = 0.0) -> float:
        """misses_per_layer, overflow_per_layer: per token, averaged over the traced layers."""
        hbm = self.moe_layers * (top_k - overflow_per_layer) * self.row_bytes + self.dense_bytes_per_token
        link = self.moe_layers * (misses_per_layer + overflow_per_layer) * self.row_bytes
        return (hbm / (self.hbm_GBps * 1e9) + link / (self.link_GBps * 1e9)) * 1e3
