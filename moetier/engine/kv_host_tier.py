"""The host KV tier's bookkeeping: slots of pinned host memory that hold KV pages evicted from the GPU
pool, keyed by the same page hash as the GPU prefix cache, with their own LRU. Plain CPU (no torch).

The bytes never pass through here. Every move is a copy the runner executes: a GPU page written to a
host slot when the GPU prefix cache evicts it (write-back: a page goes to the host only when the GPU
drops it, so pages that live and die on the GPU cost no link time), and a host slot copied into a
fresh GPU page when a prefix match continues past the GPU tier. A host copy stays after a load, so a
page evicted from the GPU again while its hash is still on the host costs no second copy.

Copies accumulate as a plan between two take_copies() calls (one per step). The plan's order rule:
every to_host copy runs before every to_gpu copy of the same layer, and both before the step writes
that layer's KV (a page evicted to the host may be the page a load or the step then overwrites).
So that no to_host copy can overwrite a slot the same plan still reads, the slots a plan loads from
are pinned until the plan is taken; a slot evicted before its pending to_host copy ran loses that
copy from the plan.

Invariants (check()): free + occupied == capacity; hash <-> slot maps inverse of each other; the
LRU holds exactly the occupied slots; pinned and pending-copy slots are occupied.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from dataclasses import dataclass, field


@dataclass
class CopyPlan:
    """The copies one step's runner executes, in this order per layer: to_host, then to_gpu."""

    to_host: list[tuple[int, int]] = field(default_factory=list)  # (GPU page, host slot)
    to_gpu: list[tuple[int, int]] = field(default_factory=list)  # (host slot, GPU page)

    def __bool__(self) -> bool:
        return bool(self.to_host or self.to_gpu)


@dataclass
class HostTierMetrics:
    """Counters since start, in pages (bytes = pages * the page's bytes over all layers, which the
    engine knows and this bookkeeping does not)."""

    hits: int = 0  # pages a prefix match found on the host tier (and brought back)
    pages_to_host: int = 0  # GPU -> host copies handed to the runner (take_copies)
    pages_to_gpu: int = 0  # host -> GPU copies handed to the runner
    evictions: int = 0  # pages dropped from the host tier to make room
    rejected: int = 0  # GPU evictions the host could not take (every slot pinned): dropped

    def as_dict(self) -> dict[str, int]:
        return {"kv_host_hit_pages": self.hits, "kv_host_pages_to_host": self.pages_to_host,
                "kv_host_pages_to_gpu": self.pages_to_gpu, "kv_host_evictions": self.evictions,
                "kv_host_rejected": self.rejected}


class KVHostTier:
    """Host slots 0..capacity-1, each empty or holding one page (by hash); LRU among the occupied."""

    def __init__(self, capacity: int):
        if capacity < 1:
            raise ValueError(f"the host KV tier needs at least one page of capacity, got {capacity}")
        self.capacity = capacity
        self._free = list(range(capacity))  # a min-heap: the lowest free slots go out first (runs, as pages.py)
        self._slot_of: dict[bytes, int] = {}
        self._hash_of: dict[int, bytes] = {}
        self._lru: OrderedDict[int, None] = OrderedDict()  # occupied slots, least recently used first
        self._pinned: set[int] = set()  # slots the pending plan loads from
        self._to_host: dict[int, int] = {}  # pending: host slot -> the GPU page copied into it
        self._to_gpu: list[tuple[int, int]] = []  # pending: (host slot, GPU page)
        self._dropped: list[bytes] = []  # hashes evicted from this tier since take_dropped()
        self.metrics = HostTierMetrics()

    @property
    def num_used(self) -> int:
        return len(self._hash_of)

    def __contains__(self, page_hash: bytes) -> bool:
        return page_hash in self._slot_of

    def hashes(self) -> set[bytes]:
        return set(self._slot_of)

    def slot_of(self, page_hash: bytes) -> int | None:
        return self._slot_of.get(page_hash)

    def store(self, page_hash: bytes, gpu_page: int) -> int | None:
        """The GPU evicts gpu_page holding page_hash: plan its copy into a host slot, evicting the host's
        least recently used unpinned page if full. Returns the slot written, or None when no copy is
        needed (already on the host: only its recency is refreshed) or possible (every slot pinned)."""
        slot = self._slot_of.get(page_hash)
        if slot is not None:
            self._lru.move_to_end(slot)
            return None
        if not self._free and not self._evict_one():
            self.metrics.rejected += 1
            return None
        slot = heapq.heappop(self._free)
        self._slot_of[page_hash], self._hash_of[slot] = slot, page_hash
        self._lru[slot] = None
        self._to_host[slot] = gpu_page
        return slot

    def store_many(self, pages: list[tuple[bytes, int]]) -> None:
        """store() each (page_hash, gpu_page) in the given order (the host's recency follows it), then
        give the slots written here to the pages in ascending GPU-page order: the cache evicts a chain
        leaf first, and ascending slots along ascending pages make one copy run (engine/kv_moves.py)."""
        fresh = [(h, p, slot) for h, p in pages if (slot := self.store(h, p)) is not None]
        fresh = [(h, p, slot) for h, p, slot in fresh if self._hash_of.get(slot) == h and slot not in self._pinned]
        if len(fresh) < 2:
            return
        slots = sorted(slot for _, _, slot in fresh)
        for slot in slots:
            del self._lru[slot]
        by_page = {h: slot for (h, _, _), slot in zip(sorted(fresh, key=lambda f: f[1]), slots)}
        for h, p, _ in fresh:  # recency in the order stored
            slot = by_page[h]
            self._slot_of[h], self._hash_of[slot], self._to_host[slot] = slot, h, p
            self._lru[slot] = None

    def _evict_one(self) -> bool:
        victim = next((s for s in self._lru if s not in self._pinned), None)
        if victim is None:
            return False
        del self._lru[victim]
        h = self._hash_of.pop(victim)
        del self._slot_of[h]
        self._to_host.pop(victim, None)  # its copy had not run: nothing to write any more
        heapq.heappush(self._free, victim)
        self._dropped.append(h)
        self.metrics.evictions += 1
        return True

    def pin(self, hashes: list[bytes]) -> None:
        """Keep these pages from eviction until the plan is taken (a match is about to load them)."""
        for h in hashes:
            self._pinned.add(self._slot_of[h])

    def load(self, page_hash: bytes, gpu_page: int) -> int:
        """Plan the copy of page_hash's slot into gpu_page (a prefix hit on this tier); the host keeps
        its copy, now most recently used and pinned until the plan is taken."""
        slot = self._slot_of[page_hash]
        self._lru.move_to_end(slot)
        self._pinned.add(slot)
        self._to_gpu.append((slot, gpu_page))
        self.metrics.hits += 1
        return slot

    def cancel_load(self, gpu_page: int) -> None:
        """gpu_page was given back before its load ran (its request ended in the same step)."""
        self._to_gpu = [(s, p) for s, p in self._to_gpu if p != gpu_page]

    def is_loading(self, gpu_page: int) -> bool:
        return any(p == gpu_page for _, p in self._to_gpu)

    def take_copies(self) -> CopyPlan:
        """The copies planned since the last call, for this step's runner; unpins the loaded slots."""
        plan = CopyPlan(sorted((p, s) for s, p in self._to_host.items()), sorted(self._to_gpu))
        self._to_host, self._to_gpu = {}, []
        self._pinned.clear()
        self.metrics.pages_to_host += len(plan.to_host)
        self.metrics.pages_to_gpu += len(plan.to_gpu)
        return plan

    def take_dropped(self) -> list[bytes]:
        """Hashes this tier evicted since the last call (the prefix cache drops their checkpoints when
        no tier holds them any more)."""
        out, self._dropped = self._dropped, []
        return out

    def check(self) -> None:
        free = set(self._free)
        assert len(free) == len(self._free), "a host slot is on the free list twice"
        assert not free & self._hash_of.keys(), "a host slot is both free and occupied"
        assert len(free) + len(self._hash_of) == self.capacity, "host slots went missing"
        assert all(0 <= s < self.capacity for s in free | self._hash_of.keys()), "a host slot is out of range"
        assert len(self._slot_of) == len(self._hash_of), "the host hash and slot maps differ in size"
        assert all(self._hash_of[s] == h for h, s in self._slot_of.items()), "host maps are not inverse"
        assert self._lru.keys() == self._hash_of.keys(), "the host LRU does not hold exactly the occupied slots"
        assert self._pinned <= self._hash_of.keys(), "a pinned host slot is empty"
        assert self._to_host.keys() <= self._hash_of.keys(), "a pending copy targets an empty host slot"
        assert all(s in self._pinned for s, _ in self._to_gpu), "a pending load reads an unpinned slot"
