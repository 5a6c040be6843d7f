"""Helpers the tests share that the product does not need."""

from __future__ import annotations

import math

import torch

from moetier.layers.attention import make_batch
from moetier.models.base import CausalLM


class Sequence:
    """One sequence over a KV cache of its own, for tests and scripts; the engine pages requests."""

    def __init__(self, model: CausalLM, max_len: int, page_size: int = 16):
        self.model = model
        self.kv = model.kv_spec().allocate(math.ceil(max_len / page_size), page_size, model.dtype, model.device)
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
