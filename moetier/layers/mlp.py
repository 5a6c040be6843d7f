"""The dense SwiGLU MLP (dense layers, and later the shared experts of the DeepSeek family)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from moetier.layers.activation import silu_mul
from moetier.layers.param import param


class SwigluMLP(nn.Module):
    def __init__(self, hidden: int, inter: int, dtype: torch.dtype, device: torch.device | str):
        super().__init__()
        self.inter = inter
        self.w13 = param(2 * inter, hidden, dtype=dtype, device=device)  # [gate; up]
        self.w2 = param(hidden, inter, dtype=dtype, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(silu_mul(F.linear(x, self.w13)), self.w2)
