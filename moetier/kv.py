"""The paged KV cache: one device pool of fixed-size pages per layer, and the CPU bookkeeping of
which request owns which page.

    KVCache.k, KVCache.v: [num_layers, num_pages, page_size, num_kv_heads, head_dim]

A request's keys live in the pages of its page table, in order; token t sits in page
table[t // page_size] at offset t % page_size. The scheduler asks PagePool for pages before a step;
attention reads them through the page table (moetier.attention).
"""

from __future__ import annotations

import math

import torch

from moetier.attention import AttnBatch


class PagePool:
    """Free list and owners of the pages. Pure CPU; the integrity check is for tests."""

    def __init__(self, num_pages: int):
        if num_pages < 1:
            raise ValueError(f"the KV pool needs at least one page, got {num_pages}")
        self.num_pages = num_pages
        self._free = list(range(num_pages - 1, -1, -1))  # a stack: the lowest ids go out first
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
        pages = [self._free.pop() for _ in range(n)]
        for p in pages:
            self._owner[p] = owner
        return pages

    def free(self, pages: list[int], owner: str) -> None:
        for p in pages:
            if self._owner.get(p) != owner:
                raise RuntimeError(f"page {p} is owned by {self._owner.get(p)!r}, not {owner!r}")
            del self._owner[p]
            self._free.append(p)

    def check(self) -> None:
        """free + used == total, no page both free and owned, no page free twice."""
        free = set(self._free)
        assert len(free) == len(self._free), "a page is on the free list twice"
        assert not free & self._owner.keys(), "a page is both free and owned"
        assert len(free) + len(self._owner) == self.num_pages, "pages went missing"
        assert all(0 <= p < self.num_pages for p in free | self._owner.keys()), "a page id is out of range"


class KVCache:
    """The device pool. Sized once; its tensors never move (the decode graph reads them in place)."""

    def __init__(self, num_layers: int, num_pages: int, page_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str):
        if page_size < 1 or page_size & (page_size - 1):
            raise ValueError(f"page_size must be a power of two, got {page_size}")
        shape = (num_layers, num_pages, page_size, num_kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.num_pages, self.page_size = num_pages, page_size

    def pages_for(self, tokens: int) -> int:
        return math.ceil(tokens / self.page_size)

    def nbytes(self) -> int:
        return 2 * self.k.numel() * self.k.element_size()


def make_batch(seqs: list[tuple[int, int, list[int]]], page_size: int, device: torch.device | str) -> AttnBatch:
    """AttnBatch for sequences given as (tokens before this step, new tokens, page table)."""
    positions, slots, starts, lens = [], [], [0], []
    width = max(len(pages) for _, _, pages in seqs)
    table = torch.zeros(len(seqs), width, dtype=torch.int32)
    for i, (done, new, pages) in enumerate(seqs):
        for pos in range(done, done + new):
            positions.append(pos)
            slots.append(pages[pos // page_size] * page_size + pos % page_size)
        starts.append(starts[-1] + new)
        lens.append(done + new)
        table[i, : len(pages)] = torch.tensor(pages, dtype=torch.int32)
    return AttnBatch(
        positions=torch.tensor(positions, dtype=torch.int64, device=device),
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        query_start=torch.tensor(starts, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(lens, dtype=torch.int32, device=device),
        page_table=table.to(device),
        query_start_host=starts,
        seq_lens_host=lens,
        max_query_len=max(new for _, new, _ in seqs),
    )


class Sequence:
    """One sequence over a KV cache of its own, for tests and scripts; the engine pages requests."""

    def __init__(self, model, max_len: int, page_size: int = 16):
        c = model.cfg
        self.model = model
        self.kv = KVCache(c.num_layers, math.ceil(max_len / page_size), page_size, c.num_kv_heads, c.head_dim,
                          model.dtype, model.device)
        self.pages = list(range(self.kv.num_pages))
        self.length = 0

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids [T] continuing the sequence -> last hidden states [T, H]."""
        n = input_ids.shape[0]
        if self.length + n > self.kv.num_pages * self.kv.page_size:
            raise ValueError(f"the sequence would hold {self.length + n} tokens, more than its cache")
        batch = make_batch([(self.length, n, self.pages)], self.kv.page_size, self.model.device)
        hidden = self.model.forward(input_ids.to(self.model.device), batch, self.kv)
        self.length += n
        return hidden
