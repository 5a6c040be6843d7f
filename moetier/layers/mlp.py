"""The dense SwiGLU MLP (dense layers, and the shared experts of the DeepSeek family); swiglu_limit:
the clamped SwiGLU of GLM-5.3-Flash (moetier/activation.py).

Dense weights kept in the checkpoint's format (held: ModelConfig.dense_quant, layers/quant_linear.py):
FP8 w13 stays FP8 only when gate's rows end on a scale block (I a multiple of 128; under tensor
parallelism every rank's I/tp), w2 unless tensor parallelism splits its columns off the blocks;
otherwise that weight is dequantized at load. 4-bit w13 and w2 always stay 4-bit (a
tensor-parallel w2 whose columns cut a group is refused).

Tensor parallelism (moetier/parallel.Parallel): rank r holds columns [r I/tp, (r+1) I/tp) of gate
and of up (w13 = [gate_r; up_r]) and the same rows of down's input dimension; each rank's output
is a partial sum [T, H], summed by one all-reduce.
"""

from __future__ import annotations

import torch
from torch import nn

from moetier.activation import silu_mul
from moetier.layers.quant_linear import dense_weight, linear, rows_of
from moetier.parallel import Parallel


class SwigluMLP(nn.Module):
    def __init__(self, hidden: int, inter: int, dtype: torch.dtype, device: torch.device | str,
                 par: Parallel = Parallel(), held: str | None = None, what: str = "intermediate_size",
                 swiglu_limit: float | None = None):
        super().__init__()
        self.par, self.swiglu_limit = par, swiglu_limit
        self.inter = inter = par.tp_split(inter, what)  # this rank's columns; what: inter's name in errors
        split = par.tp > 1
        # [gate; up]
        self.w13 = dense_weight(2 * inter, hidden, dtype, device, held, (inter, inter), split)
        self.w2 = dense_weight(hidden, inter, dtype, device, held, k_split=split)

    def part(self, proj: str) -> object:
        """Where checkpoint projection gate_proj, up_proj or down_proj (this rank's part) goes."""
        i = self.inter
        if proj == "down_proj":
            return self.w2
        half = {"gate_proj": 0, "up_proj": 1}.get(proj)
        return None if half is None else rows_of(self.w13, half * i, (half + 1) * i)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = linear(x, self.w13)
        if h.is_cuda:
            from moetier.layers import fused  # one launch for the activation

            act = fused.silu_mul(h, self.swiglu_limit)
        else:
            act = silu_mul(h, self.swiglu_limit)
        return self.par.all_reduce(linear(act, self.w2), "tp")
