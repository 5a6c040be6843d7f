"""Recurrent state next to the paged KV: what a linear-attention (KDA) layer keeps per sequence
instead of pages, and the KV pool of a hybrid model that holds both.

    conv       [kda_layers, slots, conv_dim, conv_width - 1]  model dtype: the conv's last inputs
    recurrent  [kda_layers, slots, heads, k_dim, v_dim]       float32: the delta-rule state

A running sequence owns one state slot (the same index in every KDA layer), handed out and taken
back by the scheduler with the sequence (engine/scheduler.py; a preempted sequence loses it and is
recomputed). A sequence whose step starts at position 0 starts from zeros whatever its slot held,
so slots are never cleared. The engine's pool has max_num_seqs + 1 slots (the last one spare: the decode
graphs' padding rows read and write it) plus, with prefix caching, slots that hold state checkpoints (engine/kv_moves.py).

HybridKVSpec -> HybridKVCache: the MLA latent pages (layers/kv_cache.MlaKVCache, for the attention
layers only) plus the state pool. The state's bytes are per sequence, not per token: the memory
plan counts state_bytes_per_seq times the sequences it admits.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moetier.layers.kv_cache import MlaKVCache, MlaKVSpec


@dataclass(frozen=True)
class KdaStateSpec:
    layers: tuple[int, ...]  # the model layers that are KDA layers (their order is the pools' first axis)
    conv_dim: int  # channels of the conv: q, k and v of every head (3 * heads * head_dim)
    conv_width: int
    heads: int
    k_dim: int
    v_dim: int

    def tensor_bytes(self, dtype: torch.dtype, slots: int) -> list[int]:
        """Bytes of the pool's two tensors (conv, recurrent) for `slots` slots."""
        n = len(self.layers) * slots
        return [n * self.conv_dim * (self.conv_width - 1) * dtype.itemsize, n * self.heads * self.k_dim * self.v_dim * 4]

    def bytes_per_seq(self, dtype: torch.dtype) -> int:
        return sum(self.tensor_bytes(dtype, 1))


class KdaStateCache:
    def __init__(self, spec: KdaStateSpec, slots: int, dtype: torch.dtype, device: torch.device | str):
        if slots < 1:
            raise ValueError(f"the state pool needs at least one slot, got {slots}")
        n = len(spec.layers)
        self.conv = torch.zeros((n, slots, spec.conv_dim, spec.conv_width - 1), dtype=dtype, device=device)
        self.recurrent = torch.zeros((n, slots, spec.heads, spec.k_dim, spec.v_dim), dtype=torch.float32,
                                     device=device)
        self.state_slot = {layer: i for i, layer in enumerate(spec.layers)}  # model layer -> pool row
        self.num_slots = slots

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.conv, self.recurrent))


@dataclass(frozen=True)
class HybridKVSpec(MlaKVSpec):
    """MLA latent pages for `latent_layers` plus the KDA state of `state.layers`."""

    state: KdaStateSpec | None = None

    def state_bytes_per_seq(self, dtype: torch.dtype) -> int:
        return self.state.bytes_per_seq(dtype) if self.state else 0

    def allocate(self, num_pages, page_size, dtype, device, state_slots: int = 1) -> HybridKVCache:
        return HybridKVCache(self, num_pages, page_size, dtype, device, state_slots)


class HybridKVCache(MlaKVCache):
    def __init__(self, spec: HybridKVSpec, num_pages: int, page_size: int, dtype: torch.dtype,
                 device: torch.device | str, state_slots: int):
        super().__init__(spec, num_pages, page_size, dtype, device)
        self.state = KdaStateCache(spec.state, state_slots, dtype, device)

    def nbytes(self) -> int:
        return super().nbytes() + self.state.nbytes()
