"""The dense SwiGLU MLP (dense layers, and later the shared experts of the DeepSeek family).

Tensor parallelism (layers/parallel.Parallel): rank r holds columns [r I/tp, (r+1) I/tp) of gate
and of up (w13 = [gate_r; up_r]) and the same rows of down's input dimension; each rank's output
is a partial sum [T, H], summed by one all-reduce.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from moetier.layers.activation import silu_mul
from moetier.layers.parallel import Parallel
from moetier.layers.param import param


class SwigluMLP(nn.Module):
    def __init__(self, hidden: int, inter: int, dtype: torch.dtype, device: torch.device | str,
                 par: Parallel = Parallel()):
        super().__init__()
        self.par = par
        self.inter = inter = par.tp_split(inter, "intermediate_size")  # this rank's columns
        self.w13 = param(2 * inter, hidden, dtype=dtype, device=device)  # [gate; up]
        self.w2 = param(hidden, inter, dtype=dtype, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.par.all_reduce(F.linear(silu_mul(F.linear(x, self.w13)), self.w2), "tp")
