"""The paged KV pool on the device, behind a small interface: a model says what one token of one
layer holds (a KVSpec) and the engine allocates the pool from it, sized once, never moved (the
decode graph reads it in place). Which request owns which page is plain CPU bookkeeping
(engine/pages.py); attention reads the pages through the page table (layers/attention.py).

A request's tokens live in the pages of its page table, in order; token t sits in page
table[t // page_size] at offset t % page_size, in every layer.

    GqaKVSpec -> GqaKVCache   k, v: [num_layers, num_pages, page_size, num_kv_heads, head_dim]

A latent (MLA) cache implements the same two classes with one [kv_lora_rank + rope_dim] row per
token and layer.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch


class KVCache(ABC):
    """num_pages pages of page_size tokens for every layer, on one device."""

    num_pages: int
    page_size: int

    @abstractmethod
    def nbytes(self) -> int:
        """Device bytes the pool holds."""


@dataclass(frozen=True)
class KVSpec(ABC):
    """What the KV of one token holds, for every layer of a model."""

    num_layers: int

    @abstractmethod
    def bytes_per_token(self, dtype: torch.dtype) -> int:
        """Bytes one token's KV takes, summed over layers."""

    @abstractmethod
    def allocate(self, num_pages: int, page_size: int, dtype: torch.dtype, device: torch.device | str) -> KVCache:
        ...


def check_page_size(page_size: int) -> None:
    if page_size < 1 or page_size & (page_size - 1):
        raise ValueError(f"page_size must be a power of two, got {page_size}")


@dataclass(frozen=True)
class GqaKVSpec(KVSpec):
    """Grouped-query attention: a key and a value of num_kv_heads x head_dim per token and layer."""

    num_kv_heads: int
    head_dim: int

    def bytes_per_token(self, dtype: torch.dtype) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype.itemsize

    def allocate(self, num_pages, page_size, dtype, device) -> GqaKVCache:
        return GqaKVCache(self.num_layers, num_pages, page_size, self.num_kv_heads, self.head_dim, dtype, device)


class GqaKVCache(KVCache):
    def __init__(self, num_layers: int, num_pages: int, page_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str):
        check_page_size(page_size)
        shape = (num_layers, num_pages, page_size, num_kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.num_pages, self.page_size = num_pages, page_size

    def nbytes(self) -> int:
        return 2 * self.k.numel() * self.k.element_size()
