"""The paged KV pool on the device, behind a small interface: a model says what one token of one
layer holds (a KVSpec) and the engine allocates the pool from it, sized once, never moved (the
decode graph reads it in place). Which request owns which page is plain CPU bookkeeping
(engine/pages.py); attention reads the pages through the page table (layers/attention.py).

A request's tokens live in the pages of its page table, in order; token t sits in page
table[t // page_size] at offset t % page_size, in every layer.

    GqaKVSpec -> GqaKVCache   k, v: [num_layers, num_pages, page_size, num_kv_heads, head_dim]

    MlaKVSpec -> MlaKVCache   latent: [attention layers, num_pages, page_size, kv_lora_rank + rope_dim]
                              index_k: [num_index_layers, num_pages, page_size, index_dim] (DSA only)

MLA keeps one latent row per token and layer, [normed c_kv (kv_lora_rank) | roped k_pe (rope_dim)],
instead of full K and V (layers/latent_attention.py attends over it); DeepSeek sparse attention
adds its lightning indexer's key (index_dim) for the layers that run their own indexer.
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

    @abstractmethod
    def page_tensors(self) -> list[torch.Tensor]:
        """The tensors that hold pages, each [rows, num_pages, page_size, ...]: what a copy of one page
        (the prefix cache's host tier) moves."""

    @abstractmethod
    def layer_rows(self) -> dict[int, list[tuple[int, int]]]:
        """Per model layer with pages, its (index into page_tensors(), row) pairs, in layer order."""


@dataclass(frozen=True)
class KVSpec(ABC):
    """What the KV of one token holds, for every layer of a model."""

    num_layers: int

    @abstractmethod
    def bytes_per_token(self, dtype: torch.dtype) -> int:
        """Bytes one token's KV takes, summed over layers."""

    def state_bytes_per_seq(self, dtype: torch.dtype) -> int:
        """Bytes of recurrent state one running sequence holds, summed over layers (linear-attention
        layers, layers/state_cache.py); 0 for models of attention only."""
        return 0

    @abstractmethod
    def allocate(self, num_pages: int, page_size: int, dtype: torch.dtype, device: torch.device | str,
                 state_slots: int = 1) -> KVCache:
        """state_slots: sequences whose recurrent state the pool holds (ignored without state)."""


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

    def allocate(self, num_pages, page_size, dtype, device, state_slots: int = 1) -> GqaKVCache:
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

    def page_tensors(self) -> list[torch.Tensor]:
        return [self.k, self.v]

    def layer_rows(self) -> dict[int, list[tuple[int, int]]]:
        return {layer: [(0, layer), (1, layer)] for layer in range(self.k.shape[0])}


@dataclass(frozen=True)
class MlaKVSpec(KVSpec):
    """Multi-head latent attention: one [kv_lora_rank + rope_dim] row per token and layer (of
    latent_layers when given: hybrid models hold latents for their attention layers only), plus the
    DSA indexer's key for each layer in index_layers (their order is index_k's first axis)."""

    kv_lora_rank: int
    rope_dim: int
    index_dim: int = 0
    index_layers: tuple[int, ...] = ()
    latent_layers: tuple[int, ...] | None = None  # None: every layer

    @property
    def attention_layers(self) -> tuple[int, ...]:
        return tuple(range(self.num_layers)) if self.latent_layers is None else self.latent_layers

    def bytes_per_token(self, dtype: torch.dtype) -> int:
        latent = len(self.attention_layers) * (self.kv_lora_rank + self.rope_dim)
        return (latent + len(self.index_layers) * self.index_dim) * dtype.itemsize

    def allocate(self, num_pages, page_size, dtype, device, state_slots: int = 1) -> MlaKVCache:
        return MlaKVCache(self, num_pages, page_size, dtype, device)


class MlaKVCache(KVCache):
    def __init__(self, spec: MlaKVSpec, num_pages: int, page_size: int, dtype: torch.dtype,
                 device: torch.device | str):
        check_page_size(page_size)
        width = spec.kv_lora_rank + spec.rope_dim
        layers = spec.attention_layers
        self.latent = torch.zeros((len(layers), num_pages, page_size, width), dtype=dtype, device=device)
        self.latent_slot = {layer: i for i, layer in enumerate(layers)}  # model layer -> row of latent
        self.index_k = torch.zeros((len(spec.index_layers), num_pages, page_size, spec.index_dim), dtype=dtype,
                                   device=device)
        # model layer -> row of index_k (layers that run their own indexer)
        self.index_slot = {layer: i for i, layer in enumerate(spec.index_layers)}
        self.num_pages, self.page_size = num_pages, page_size

    def nbytes(self) -> int:
        return self.latent.numel() * self.latent.element_size() + self.index_k.numel() * self.index_k.element_size()

    def page_tensors(self) -> list[torch.Tensor]:
        return [self.latent, self.index_k]

    def layer_rows(self) -> dict[int, list[tuple[int, int]]]:
        rows: dict[int, list[tuple[int, int]]] = {}
        for t, slots in enumerate((self.latent_slot, self.index_slot)):
            for layer, row in slots.items():
                rows.setdefault(layer, []).append((t, row))
        return dict(sorted(rows.items()))
