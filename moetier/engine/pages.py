"""Which request owns which KV page: a free list and owners, plain CPU (no torch). The scheduler asks
the pool for pages before a step; the device pool itself is layers/kv_cache.py."""

from __future__ import annotations

import heapq


class PagePool:
    """Free list and owners of the pages; check() is the integrity test of the two."""

    def __init__(self, num_pages: int):
        if num_pages < 1:
            raise ValueError(f"the KV pool needs at least one page, got {num_pages}")
        self.num_pages = num_pages
        # a min-heap: the lowest free ids go out first, so a request's pages tend to be consecutive (the
        # CPU's host-tier copies go along runs, engine/kv_moves.py); after churn the runs are short, which
        # is why CUDA moves a step's pages in one kernel per row instead
        self._free = list(range(num_pages))
        self._owner: dict[int, str] = {}

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return len(self._owner)

    def usage(self) -> float:
        return self.num_used / self.num_pages

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free)

    def allocate(self, n: int, owner: str) -> list[int]:
        if not self.can_allocate(n):
            raise RuntimeError(f"asked for {n} pages with {len(self._free)} free; call can_allocate first")
        pages = [heapq.heappop(self._free) for _ in range(n)]
        for p in pages:
            self._owner[p] = owner
        return pages

    def free(self, pages: list[int], owner: str) -> None:
        for p in pages:
            if self._owner.get(p) != owner:
                raise RuntimeError(f"page {p} is owned by {self._owner.get(p)!r}, not {owner!r}")
            del self._owner[p]
            heapq.heappush(self._free, p)

    def check(self) -> None:
        """free + used == total, no page both free and owned, no page free twice."""
        free = set(self._free)
        assert len(free) == len(self._free), "a page is on the free list twice"
        assert not free & self._owner.keys(), "a page is both free and owned"
        assert len(free) + len(self._owner) == self.num_pages, "pages went missing"
        assert all(0 <= p < self.num_pages for p in free | self._owner.keys()), "a page id is out of range"
