"""Cache simulation on routing traces: LRU, LFU, LFRU exactly as the engine's slot cache runs them
(same victim order, same tie-breaks; tests hold the two to equal counts), and Belady's optimal as
the upper bound. Plus the physics model that turns misses into decode time.

A step is one token by default (decode at batch 1); `steps` can group tokens as the engine did.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from moetier.experts.cache.slots import CachePolicy, policy_for

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
    """The slot cache's step (moetier.experts.cache.slots) in plain Python with a heap of (key, slot)."""
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


def _next_use(ids: np.ndarray) -> np.ndarray:
    """ids [N, L, k], k distinct per token -> [N, L, k]: the step after t where layer l next needs
    ids[t, l, j], N if never (Belady's priority)."""
    n, layers, k = ids.shape
    out = np.full(ids.shape, n, dtype=np.int64)
    t = np.repeat(np.arange(n), k)
    for i in range(layers):
        e = ids[:, i, :].reshape(-1)
        order = np.lexsort((t, e))  # by expert, then step
        same = e[order[1:]] == e[order[:-1]]
        nxt = np.full(n * k, n, dtype=np.int64)
        nxt[order[:-1][same]] = t[order[1:][same]]
        out[:, i, :] = nxt.reshape(n, k)
    return out


def simulate_many(ids: np.ndarray, jobs: list[tuple[int, int, str]], num_experts: int, top_k: int | None = None,
                  progress: Callable[[int], None] | None = None) -> list[Counts]:
    """Many caches at once, one token per step: ids [N, L, k]; jobs [(traced layer index, slots, policy)].
    -> Counts per job, equal to simulate(ids[:, layer], num_experts, slots, policy, top_k).

    simulate_policy's heap pops the smallest (key, slot) among the slots the step does not use and
    holds each slot's current key once (a slot's key only grows while its expert stays, an epoch
    rebuilds them all, Belady's keys only fall and never repeat), so here each job keeps its slots'
    keys in a row and every step is a few numpy calls over all jobs: argmin per victim (the first
    minimum: ties go to the lower slot, as in the heap). The per-job Python loop took 0.23 s per
    8,192 tokens of one layer; a plot's 608 jobs take one pass. `progress(tokens done)` every 512 tokens.
    """
    n, _, k = ids.shape
    ids = np.asarray(ids, dtype=np.int64)
    distinct = bool((np.diff(np.sort(ids, axis=2), axis=2) != 0).all())
    in_range = ids.size == 0 or (ids.min() >= 0 and ids.max() < num_experts)
    # NOTE: LFU keys are stamp + 2**40 * uses: int64 holds them below 2**22 tokens. Repeated ids in a
    # token, ids out of range (an IndexError there) and longer traces take the reference.
    if not jobs or n == 0 or not distinct or not in_range or n >= 1 << 22:
        return [simulate(ids[:, layer], num_experts, s, pol, top_k) for layer, s, pol in jobs]
    b = len(jobs)
    layer = np.array([j[0] for j in jobs])
    slots = np.array([j[1] for j in jobs])
    belady = np.array([j[2] == "belady" for j in jobs])
    pols = [CachePolicy() if pol == "belady" else policy_for(pol, s, top_k or k) for _, s, pol in jobs]
    weight = np.array([p.weight for p in pols], dtype=np.int64)
    half = np.array([p.half_life for p in pols], dtype=np.int64)
    width = int(slots.max())
    job = np.arange(b)
    at_e, at_s = job * num_experts, job * width  # where a job's row starts in the flat state below
    valid = np.arange(width)[None, :] < slots[:, None]
    big = np.iinfo(np.int64).max  # the key of the slots a job does not have: never a victim
    expert_slot = np.full(b * num_experts, -1, dtype=np.int64)  # [b, E] flat
    slot_expert = np.full(b * width, -1, dtype=np.int64)  # [b, width] flat
    stamp = np.full(b * width, -1, dtype=np.int64)
    freq = np.zeros(b * num_experts, dtype=np.int64)
    fepoch = np.zeros(b * num_experts, dtype=np.int64)
    # empty slots: key -1 (Belady -(n + 1)), below every used one, so they fill first in slot order
    key = np.where(valid, np.where(belady, -(n + 1), -1)[:, None], big).reshape(-1)
    nxt = _next_use(ids) if belady.any() else None
    epoch = np.zeros(b, dtype=np.int64)
    decays = half > 0
    counted = np.flatnonzero(weight > 0)
    hits, misses, overflow = (np.zeros(b, dtype=np.int64) for _ in range(3))
    for t in range(n):
        need = ids[t][layer]  # [b, k]
        at_need = need + at_e[:, None]
        slot = expert_slot[at_need]
        hit = slot >= 0
        hb, hj = np.nonzero(hit)
        ep = np.where(decays, t // np.maximum(half, 1), 0)
        if (ep != epoch).any():  # every resident key of these jobs decays at an epoch boundary
            r = np.flatnonzero(ep != epoch)
            cells = at_s[r][:, None] + np.arange(width)
            e = slot_expert[cells]
            at = np.maximum(e, 0) + at_e[r][:, None]
            decayed = freq[at] >> np.minimum(ep[r][:, None] - fepoch[at], 31)
            rebuilt = np.where(e < 0, -1, stamp[cells] + weight[r][:, None] * decayed)
            key[cells] = np.where(valid[r], rebuilt, big)
            epoch = ep
        n_hit = hit.sum(1)
        n_miss = k - n_hit
        n_vict = np.minimum(n_miss, slots - n_hit)  # the rest overflow: read without a slot
        victims = np.zeros((b, k), dtype=np.int64)
        if n_vict.any():  # victims: the jobs that need most first, each round one victim per job
            order = np.argsort(-n_vict, kind="stable")
            order = order[: np.count_nonzero(n_vict)]
            free = key.reshape(b, width)[order]
            fb, fj = np.nonzero(hit[order])
            free[fb, slot[order][fb, fj]] = big  # never a slot the step uses
            left = np.count_nonzero(n_vict[order][None, :] > np.arange(k)[:, None], axis=1)
            for v in range(int(n_vict.max())):
                m = left[v]
                pick = free[:m].argmin(1)
                victims[order[:m], v] = pick
                free[np.arange(m), pick] = big
        rank = np.cumsum(~hit, axis=1) - 1  # the r-th miss of the step takes the r-th victim
        mb, mj = np.nonzero(~hit & (rank < n_vict[:, None]))
        vs = victims[mb, rank[mb, mj]]
        es = need[mb, mj]
        old = slot_expert[at_s[mb] + vs]
        gone = old >= 0
        expert_slot[at_e[mb[gone]] + old[gone]] = -1
        expert_slot[at_e[mb] + es] = vs
        slot_expert[at_s[mb] + vs] = es
        hits += n_hit
        misses += n_vict
        overflow += n_miss - n_vict
        # the used slots' new keys, as simulate_policy and simulate_belady push them after the step
        if counted.size:  # LFU and LFRU jobs: decayed uses + 1
            a, e_ = at_need[counted], ep[counted][:, None]
            freq[a] = (freq[a] >> np.minimum(e_ - fepoch[a], 31)) + 1
            fepoch[a] = e_
        ub, uj = np.concatenate([hb, mb]), np.concatenate([hj, mj])
        used = at_s[ub] + np.concatenate([slot[hb, hj], vs])
        stamp[used] = t
        lru_key = t + weight[ub] * freq[at_need[ub, uj]]
        key[used] = lru_key if nxt is None else np.where(belady[ub], -nxt[t, layer[ub], uj], lru_key)
        if progress is not None and ((t + 1) % 512 == 0 or t + 1 == n):
            progress(t + 1)
    return [Counts(int(hits[i]), int(misses[i]), int(overflow[i]), n) for i in range(b)]


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
