"""The per-layer HBM slot cache: which experts sit in which slots, and what one step must move.

State (device tensors, updated in place so a CUDA graph can replay the step):
    expert_slot [E] int32   slot holding each expert, -1 when absent
    slot_expert [S] int32   expert in each slot, -1 when empty
    stamp       [S] int64   step of each slot's last use (-1: never), for least-recently-used
    clock       [1] int64   steps taken
    stats       [5] int64   hits, misses (filled), overflow (read over the link), steps, pinned hits
    freq        [E] int32   uses of each expert, halved every half_life steps (LFRU only)
    fepoch      [E] int32   the half-life epoch freq was last brought up to date in

One step, given topk_ids [T, k] (semantics shared by the torch reference here and the fused Triton
kernel in slot_kernels.py, which tests hold to each other):
  1. needed = the distinct experts of the step, in order of first appearance.
  2. A needed expert already in a slot is a hit. The others are misses, ranked by first appearance.
  3. Victims are the slots no needed expert holds, in order of (key, slot): empty slots first
     (key -1), then the least recently used. Under LRU key = stamp; under LFRU (frequency-weighted
     LRU) key = stamp + weight * freq of the slot's expert, so each use buys `weight` steps of life.
     Miss r takes victim r; its row is copied in from the host store.
  4. When misses outnumber victims, the rest overflow: read over the link for this step only, so
     no expert is ever unreachable and no slot the step uses is ever evicted.
  5. Every slot the step uses gets stamp = clock; every needed expert's freq += 1 (decayed first:
     freq >> (clock // half_life - fepoch)); clock += 1.
Output: slot ids [T, k] (-1 for overflow pairs) and the miss list (expert, slot) for the fill.

Pinned experts (experts/cache/split.py): the P experts of the layer that live on the GPU for good sit
at rows S..S+P-1 of the device block, after the S slots, and expert_slot maps them there permanently
(reset() puts them back). So the lookup finds them as hits, the GEMMs read them like slots, and
nothing else sees them: a row >= S is never marked used, never stamped and never a victim (victims
are slots 0..S-1 only), and slot_expert covers the slots alone. Their hits count in `hits` and again
in `pinned` (stats[4]): slot hits are hits - pinned.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

HITS, MISSES, OVERFLOW, STEPS, PINNED = range(5)
STATE = ("expert_slot", "slot_expert", "stamp", "clock", "stats", "freq", "fepoch")


@dataclass(frozen=True)
class CachePolicy:
    """Victim order. weight 0 is LRU; a huge weight with no decay is LFU (simulator only)."""

    name: str = "lru"
    weight: int = 0  # steps of life each use of an expert buys
    half_life: int = 0  # steps after which uses count half; 0: never

    @property
    def uses_freq(self) -> bool:
        return self.weight > 0

    def epoch(self, clock: int) -> int:
        return clock // self.half_life if self.half_life else 0


def lfru(num_slots: int, top_k: int, lives: int = 1, half_lives: int = 16) -> CachePolicy:
    """LFRU scaled to the cache: a use buys `lives` LRU lifetimes (S / k steps each); uses count
    half after `half_lives` lifetimes."""
    life = max(1, num_slots // top_k)
    return CachePolicy("lfru", weight=lives * life, half_life=half_lives * life)


def policy_for(name: str, num_slots: int, top_k: int) -> CachePolicy:
    if name == "lru":
        return CachePolicy()
    if name == "lfru":
        return lfru(num_slots, top_k)
    if name == "lfu":
        return CachePolicy("lfu", weight=1 << 40)
    raise ValueError(f"unknown cache policy {name!r}; choose lru or lfru")


@dataclass
class MissList:
    """Rows to copy this step: host row `expert[r]` into slot `slot[r]` for r < count."""

    expert: torch.Tensor  # [max_misses] int32
    slot: torch.Tensor  # [max_misses] int32
    count: torch.Tensor  # [1] int32


class SlotCache:
    def __init__(self, num_experts: int, num_slots: int, device: torch.device | str = "cpu",
                 policy: CachePolicy = CachePolicy(), pinned: tuple[int, ...] = ()):
        pinned = tuple(sorted(pinned))
        if len(set(pinned)) != len(pinned) or any(not 0 <= e < num_experts for e in pinned):
            raise ValueError(f"pinned experts must be distinct ids in 0..{num_experts - 1}, got {pinned}")
        if not 1 <= num_slots <= num_experts - len(pinned):
            raise ValueError(f"slots must be in 1..{num_experts - len(pinned)} ({len(pinned)} of {num_experts} "
                             f"experts pinned), got {num_slots}")
        self.num_experts, self.num_slots, self.policy = num_experts, num_slots, policy
        self.pinned = pinned  # local ids, ascending: pinned[j] lives at device row num_slots + j
        self._pinned_ids = torch.tensor(pinned, dtype=torch.long, device=device)
        self._pinned_rows = torch.arange(num_slots, num_slots + len(pinned), dtype=torch.int32, device=device)
        self.expert_slot = torch.full((num_experts,), -1, dtype=torch.int32, device=device)
        self.expert_slot[self._pinned_ids] = self._pinned_rows
        self.slot_expert = torch.full((num_slots,), -1, dtype=torch.int32, device=device)
        self.stamp = torch.full((num_slots,), -1, dtype=torch.int64, device=device)
        self.clock = torch.zeros(1, dtype=torch.int64, device=device)
        self.stats = torch.zeros(5, dtype=torch.int64, device=device)
        self.freq = torch.zeros(num_experts, dtype=torch.int32, device=device)
        self.fepoch = torch.zeros(num_experts, dtype=torch.int32, device=device)

    @property
    def num_pinned(self) -> int:
        return len(self.pinned)

    @property
    def num_rows(self) -> int:
        """Device rows the slot ids index: the S slots, then the P pinned experts."""
        return self.num_slots + len(self.pinned)

    def reset(self) -> None:
        self.freq.zero_()
        self.fepoch.zero_()
        self.expert_slot.fill_(-1)
        self.expert_slot[self._pinned_ids] = self._pinned_rows
        self.slot_expert.fill_(-1)
        self.stamp.fill_(-1)
        self.clock.zero_()
        self.stats.zero_()

    def state(self) -> dict[str, torch.Tensor]:
        return {k: getattr(self, k).clone() for k in STATE}

    def load_state(self, state: dict[str, torch.Tensor]) -> None:
        for k, v in state.items():
            getattr(self, k).copy_(v)

    def read_stats(self) -> dict[str, int]:
        """One host read of the counters (a sync; call between steps, never inside one)."""
        h, m, o, s, p = self.stats.tolist()
        return {"hits": h, "misses": m, "overflow": o, "steps": s, "pinned": p}

    def check(self) -> None:
        """Integrity: the two maps are inverses, no expert sits in two slots, stamps within the clock,
        every pinned expert at its row after the slots."""
        es, se = self.expert_slot.cpu(), self.slot_expert.cpu()
        s = self.num_slots
        for j, expert in enumerate(self.pinned):
            assert es[expert] == s + j, f"pinned expert {expert} maps to {int(es[expert])}, not its row {s + j}"
            assert expert not in se.tolist(), f"pinned expert {expert} also sits in a slot"
        es = es.clone()
        es[self._pinned_ids.cpu()] = -1  # the slots' part of the map
        resident = se[se >= 0]
        assert resident.unique().numel() == resident.numel(), "an expert is resident in two slots"
        for slot, expert in enumerate(se.tolist()):
            if expert >= 0:
                assert es[expert] == slot, f"slot {slot} holds expert {expert} but the map says {int(es[expert])}"
        for expert, slot in enumerate(es.tolist()):
            if slot >= 0:
                assert 0 <= slot < self.num_slots and se[slot] == expert, f"expert {expert} -> slot {slot} is stale"
        assert int((es >= 0).sum()) == resident.numel(), "maps disagree on how many experts are resident"
        clock = int(self.clock)
        assert bool((self.stamp.cpu() < clock).all()), "a stamp is ahead of the clock"

    @torch.no_grad()
    def step_reference(self, topk_ids: torch.Tensor, stats: torch.Tensor | None = None
                       ) -> tuple[torch.Tensor, MissList]:
        """The torch reference of one step (CPU or GPU; syncs freely). -> slot ids [T, k], misses.
        stats: the [5] counters this step adds to (default the cache's own; a prefetch step keeps its own,
        experts/prefetch.py)."""
        ids = topk_ids.reshape(-1).long()
        # Negative ids (experts/parallel/ep.NOT_MINE: another rank's expert) are no expert of this cache: they
        # take no slot, count nowhere, and get slot id -1.
        valid = ids >= 0
        flat = ids[valid]
        # 1. distinct experts in order of first appearance
        uniq, inverse = torch.unique(flat, return_inverse=True)
        first = torch.full((uniq.numel(),), flat.numel(), dtype=torch.long, device=flat.device)
        first.scatter_reduce_(0, inverse, torch.arange(flat.numel(), device=flat.device), "amin")
        needed = uniq[torch.argsort(first)]
        # 2. hits and misses
        slot_of = self.expert_slot[needed].long()
        hit = slot_of >= 0
        pinned = slot_of >= self.num_slots  # rows after the slots: never used, stamped or evicted
        misses = needed[~hit]
        # 3. victims: slots not used this step, by (key, slot)
        used = torch.zeros(self.num_slots, dtype=torch.bool, device=flat.device)
        used[slot_of[hit & ~pinned]] = True
        free = (~used).nonzero().flatten()
        key = self.stamp[free]
        clock, pol = int(self.clock), self.policy
        epoch = pol.epoch(clock)
        if pol.uses_freq:
            held = self.slot_expert[free].long()
            live = held >= 0
            f = torch.zeros_like(key)
            h = held[live]
            f[live] = (self.freq[h] >> (epoch - self.fepoch[h]).clamp(max=31)).long()
            key = torch.where(live, key + pol.weight * f, key)
        order = torch.argsort((key + 1) * self.num_slots + free)
        victims = free[order]
        n_fill = min(misses.numel(), victims.numel())
        fill_expert, fill_slot = misses[:n_fill], victims[:n_fill]
        if pol.uses_freq:
            self.freq[needed] = (self.freq[needed] >> (epoch - self.fepoch[needed]).clamp(max=31)) + 1
            self.fepoch[needed] = epoch
        # 4. update the maps
        old = self.slot_expert[fill_slot].long()
        self.expert_slot[old[old >= 0]] = -1
        self.expert_slot[fill_expert] = fill_slot.int()
        self.slot_expert[fill_slot] = fill_expert.int()
        # 5. stamps, clock, stats
        slots = torch.full_like(ids, -1)
        slots[valid] = self.expert_slot[flat].long()
        self.stamp[slots[(slots >= 0) & (slots < self.num_slots)]] = self.clock
        self.clock += 1
        (self.stats if stats is None else stats).add_(
            torch.tensor([int(hit.sum()), n_fill, misses.numel() - n_fill, 1, int(pinned.sum())], device=flat.device))
        cap = ids.numel()
        miss = MissList(
            expert=torch.full((cap,), -1, dtype=torch.int32, device=flat.device),
            slot=torch.full((cap,), -1, dtype=torch.int32, device=flat.device),
            count=torch.tensor([n_fill], dtype=torch.int32, device=flat.device),
        )
        miss.expert[:n_fill] = fill_expert.int()
        miss.slot[:n_fill] = fill_slot.int()
        return slots.int().view_as(topk_ids), miss

    def warm(self, experts: list[int]) -> MissList:
        """Place experts into slots as if one step had asked for them (for benchmarks and tests)."""
        ids = torch.tensor(experts, dtype=torch.int64, device=self.expert_slot.device)[None]
        stats = self.stats.clone()
        miss = self.step_reference(ids)[1]
        self.stats.copy_(stats)
        return miss
