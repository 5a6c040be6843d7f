"""KV cache for one sequence: a contiguous block per layer.

The paged pool of the serving engine replaces this; the model talks to it through `write` and
`read`, so the attention code does not care which one it has.
"""

from __future__ import annotations

import torch

from moetier.errors import MoetierError


class KVCache:
    """k and v per layer, [max_len, num_kv_heads, head_dim]; positions [0, length) are valid."""

    def __init__(self, num_layers: int, max_len: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str = "cpu"):
        shape = (num_layers, max_len, num_kv_heads, head_dim)
        self.k = torch.empty(shape, dtype=dtype, device=device)
        self.v = torch.empty(shape, dtype=dtype, device=device)
        self.max_len = max_len
        self.length = 0  # tokens whose k and v every layer holds

    @staticmethod
    def nbytes_for(num_layers: int, max_len: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * num_layers * max_len * num_kv_heads * head_dim * dtype.itemsize

    def check_room(self, new_tokens: int) -> None:
        if self.length + new_tokens > self.max_len:
            raise MoetierError(
                f"the sequence needs {self.length + new_tokens} tokens of KV cache but it holds "
                f"{self.max_len}; shorten the prompt or --max-tokens"
            )

    def write(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        # k, v: [T, num_kv_heads, head_dim] for positions [start, start + T)
        self.k[layer, start:start + k.shape[0]] = k
        self.v[layer, start:start + v.shape[0]] = v

    def read(self, layer: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        # -> k, v: [end, num_kv_heads, head_dim]
        return self.k[layer, :end], self.v[layer, :end]

    def advance(self, tokens: int) -> None:
        self.length += tokens

    def reset(self) -> None:
        self.length = 0
