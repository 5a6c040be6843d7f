"""Weight-only block-scaled FP8 linear layers: the dense projections of an FP8 checkpoint kept in
FP8 (EngineConfig.fp8_dense = "fp8") instead of dequantized at load (docs/fp8.md).

    Fp8Weight      q float8_e4m3fn [N, K] and scale float32 [ceil(N/128), ceil(K/128)], the
                   checkpoint's `weight` and `weight_scale_inv` unchanged (quant/fp8_block.py's block rule)
    linear(x, w, bias)   y [M, N] = x [M, K] @ dequant(w)^T (+ bias), in x.dtype; the layers call it
                   instead of F.linear, whatever w is (a plain tensor goes to F.linear)
    dense_weight() a layer's weight: a parameter in the model dtype, or an Fp8Weight when FP8 dense
                   is on and the fused parts' row boundaries fall on scale blocks (fusable; else the
                   weight is dequantized at load as before: the fallback is per weight)

Every path computes with fp8.dequantize's weights exactly: fp32(q) * scale rounded once to x.dtype.

    CPU           linear_reference: dequantize, then F.linear (the test oracle)
    CUDA, M <= 64 (decode) _fp8_mm: programs (M block of 16 rows, N block, K split); each loads an
                  FP8 tile, scales and rounds it in registers (quant/fp8_block_triton) and tl.dots it
                  against x, accumulating in fp32. The K split is chosen from (N, K) alone so that
                  ~PROGRAMS programs fill the GPU whatever M; with more than one split the fp32
                  partials [S, M, N] are summed in split order by a second kernel (no atomics:
                  deterministic), which adds the bias and rounds. A row's result depends only on
                  its own x row: BLOCK_M, the split and the K order never depend on M or on the
                  other rows, and tl.dot rows are independent on the GPU.
    CUDA, M > 64  (prefill, eager) the weight is dequantized by one Triton kernel into a transient
                  [N, K] buffer of x.dtype, then F.linear (cuBLAS). A step of many tokens is
                  compute-bound, where cuBLAS beats an untuned Triton GEMM and the extra 3 bytes
                  per weight (read 1, write 2) are small against M*N*K flops; the buffer is freed at
                  once (the plan counts the largest one as a transient of the eager step).
Both CUDA paths allocate only through torch (graph-pool safe) and never read a value back: safe
inside a captured CUDA graph.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from moetier.layers.param import param
from moetier.quant import fp8_block as fp8

DECODE_MAX_M = 64  # up to this many rows: the FP8 kernel; above: dequantize + F.linear


class Fp8Weight(nn.Module):
    """A dense weight held in FP8: q float8_e4m3fn [N, K], scale float32 [ceil(N/128), ceil(K/128)]
    (both parameters without gradients, so parameters() counts their bytes)."""

    def __init__(self, n: int, k: int, device: torch.device | str):
        super().__init__()
        self.q = param(n, k, dtype=fp8.FP8, device=device)
        self.scale = param(*fp8.scale_shape((n, k)), dtype=torch.float32, device=device)

    @property
    def shape(self) -> torch.Size:
        return self.q.shape

    def rows(self, start: int = 0, stop: int | None = None) -> Fp8Rows:
        """Views of rows [start, stop) and their scale rows: a loader destination. The block rule
        cuts only at scale-block edges: start a multiple of 128, stop one too or the last row."""
        n = self.q.shape[0]
        stop = n if stop is None else stop
        if start % fp8.BLOCK or (stop % fp8.BLOCK and stop != n):
            raise ValueError(f"rows [{start}, {stop}) of an FP8 weight of {n} rows cut a {fp8.BLOCK}-row scale "
                             "block; such a fused weight must be dequantized at load")
        return Fp8Rows(self.q[start:stop], self.scale[start // fp8.BLOCK: fp8.cdiv(stop, fp8.BLOCK)])

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        return fp8.dequantize(self.q, self.scale, dtype)

    def extra_repr(self) -> str:
        return f"{self.q.shape[0]}, {self.q.shape[1]}, fp8 blocks of {fp8.BLOCK}"


@dataclass(frozen=True)
class Fp8Rows:
    """Where a checkpoint's FP8 tensor and its block scale go (views into an Fp8Weight)."""

    q: torch.Tensor
    scale: torch.Tensor

    def copy_(self, q: torch.Tensor, scale: torch.Tensor, name: str) -> None:
        if tuple(q.shape) != tuple(self.q.shape) or tuple(scale.shape) != tuple(self.scale.shape):
            raise ValueError(f"{name}: float8 {list(q.shape)} with scale {list(scale.shape)} does not fit its "
                             f"FP8 destination {list(self.q.shape)} with scale {list(self.scale.shape)}")
        with torch.no_grad():
            self.q.copy_(q)
            self.scale.copy_(scale)


def fusable(parts: tuple[int, ...], whole: bool = False) -> bool:
    """Whether weights stacked by rows in these part sizes can share one scale grid: every part but
    the last a multiple of 128 (all of them when whole, e.g. each part is split again by tensor
    parallelism), so that no 128 x 128 block mixes two parts."""
    cut = parts if whole else parts[:-1]
    return all(p % fp8.BLOCK == 0 for p in cut)


def dense_weight(n: int, k: int, dtype: torch.dtype, device: torch.device | str, fp8_dense: bool = False
                 ) -> nn.Parameter | Fp8Weight:
    """A layer's [N, K] weight: an Fp8Weight when fp8_dense, else a parameter in dtype. Callers pass
    fp8_dense only where the block rule holds for their fused parts and splits (fusable)."""
    return Fp8Weight(n, k, device) if fp8_dense else param(n, k, dtype=dtype, device=device)


def rows_of(w: torch.Tensor | Fp8Weight, start: int, stop: int) -> torch.Tensor | Fp8Rows:
    """Rows [start, stop) of a fused weight, as the loader's destination."""
    return w.rows(start, stop) if isinstance(w, Fp8Weight) else w[start:stop]


def linear_reference(x: torch.Tensor, w: Fp8Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The CPU path and the oracle: the weight dequantized to x.dtype, then F.linear."""
    return F.linear(x, w.dequantize(x.dtype), bias)


def linear(x: torch.Tensor, w: torch.Tensor | Fp8Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear for a plain weight or an Fp8Weight. x [..., K] -> [..., N] in x.dtype."""
    if not isinstance(w, Fp8Weight):
        return F.linear(x, w, bias)
    if not x.is_cuda:
        return linear_reference(x, w, bias)
    from moetier.layers import fp8_linear_triton as kernels

    n, k = w.shape
    x2 = x.reshape(-1, k)
    if x2.stride(1) != 1:
        x2 = x2.contiguous()
    if x2.shape[0] > DECODE_MAX_M:
        y = F.linear(x2, kernels.dequantize(w.q, w.scale, x.dtype), bias)
    else:
        y = kernels.fp8_mm(x2, w.q, w.scale, bias)
    return y.reshape(*x.shape[:-1], n)
