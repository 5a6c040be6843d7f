"""Inference weights: uninitialised parameters without gradients, filled by the loader; and the base
of the dense weights kept in a quantized checkpoint's format (layers/quant_linear.py)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

DECODE_MAX_M = 64  # up to this many rows a kept weight's decode kernel; above: dequantize + F.linear


def param(*shape: int, dtype: torch.dtype, device: torch.device | str) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)


class KeptWeight(nn.Module):
    """A dense [N, K] weight held as a quantized checkpoint stores it (layers/fp8_linear.Fp8Weight,
    layers/packed4_linear.Packed4Weight). Each gives `shape`, `dequantize(dtype)` (its format's torch
    reference) and two CUDA kernels: `decode_mm(x2, bias)` for steps of up to DECODE_MAX_M rows and
    `dequantize_cuda(dtype)` (the reference's values, a fresh transient) for larger ones."""

    shape: torch.Size

    def reference(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """The CPU path and the oracle: the weight dequantized to x.dtype, then F.linear."""
        return F.linear(x, self.dequantize(x.dtype), bias)

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x [..., K] -> [..., N] in x.dtype: the reference on the CPU; on CUDA the decode kernel up to
        DECODE_MAX_M rows, else the weight dequantized into a transient and multiplied by cuBLAS (a
        many-token step is compute-bound; the plan counts the largest transient)."""
        if not x.is_cuda:
            return self.reference(x, bias)
        n, k = self.shape
        x2 = x.reshape(-1, k)
        if x2.stride(1) != 1:
            x2 = x2.contiguous()
        if x2.shape[0] > DECODE_MAX_M:
            y = F.linear(x2, self.dequantize_cuda(x.dtype), bias)
        else:
            y = self.decode_mm(x2, bias)
        return y.reshape(*x.shape[:-1], n)

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        raise NotImplementedError

    def decode_mm(self, x2: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        raise NotImplementedError

    def dequantize_cuda(self, dtype: torch.dtype) -> torch.Tensor:
        raise NotImplementedError
