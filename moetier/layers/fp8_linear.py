"""Weight-only block-scaled FP8 linear layers: the dense projections of an FP8 checkpoint kept in
FP8 (EngineConfig.dense_weights = "keep") instead of dequantized at load (docs/fp8.md); the layers
reach them through layers/quant_linear.py (dense_weight, rows_of, linear).

    Fp8Weight      q float8_e4m3fn [N, K] and scale float32 [ceil(N/128), ceil(K/128)], the
                   checkpoint's `weight` and `weight_scale_inv` unchanged (quant/fp8_block.py's block rule)
    Fp8Weight.linear(x, bias)   y [M, N] = x [M, K] @ dequant(w)^T (+ bias), in x.dtype (its dispatch:
                   layers/param.KeptWeight, shared with the 4-bit weights)
    Fp8Weight.fits the fused parts' row boundaries and a tensor-parallel rank's columns fall on scale
                   blocks (fusable); else the weight is dequantized at load: the fallback is per weight

Every path computes with fp8.dequantize's weights exactly: fp32(q) * scale rounded once to x.dtype.

    CPU           reference(): dequantize, then F.linear (the test oracle)
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

from dataclasses import dataclass, field

import torch

from moetier.layers.param import KeptWeight, param
from moetier.quant import fp8_block as fp8

class Fp8Weight(KeptWeight):
    """A dense weight held in FP8: q float8_e4m3fn [N, K], scale float32 [ceil(N/128), ceil(K/128)]
    (both parameters without gradients, so parameters() counts their bytes)."""

    def __init__(self, n: int, k: int, device: torch.device | str, quant: str = "fp8"):
        super().__init__()  # quant: always "fp8" (every kept format's constructor takes it)
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
        return Fp8Rows(self.q[start:stop], self.scale[start // fp8.BLOCK: fp8.cdiv(stop, fp8.BLOCK)], self)

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        return fp8.dequantize(self.q, self.scale, dtype)

    @classmethod
    def fits(cls, quant: str, n: int, k: int, parts: tuple[int, ...], split: bool, k_split: bool) -> bool:
        """Whether the weight can be held in FP8: its fused row parts (each split again by tensor
        parallelism when split) and a rank's K columns (k_split) start on scale blocks."""
        return fusable(parts, split) and (not k_split or k % fp8.BLOCK == 0)

    def decode_mm(self, x2: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        from moetier.layers import fp8_linear_triton as kernels

        return kernels.fp8_mm(x2, self.q, self.scale, bias)

    def dequantize_cuda(self, dtype: torch.dtype) -> torch.Tensor:
        from moetier.layers import fp8_linear_triton as kernels

        return kernels.dequantize(self.q, self.scale, dtype)

    def extra_repr(self) -> str:
        return f"{self.q.shape[0]}, {self.q.shape[1]}, fp8 blocks of {fp8.BLOCK}"


@dataclass(frozen=True)
class Fp8Rows:
    """Where a checkpoint's FP8 tensor and its block scale go (views into an Fp8Weight)."""

    q: torch.Tensor
    scale: torch.Tensor
    owner: Fp8Weight | None = field(default=None, compare=False, repr=False)  # the weight they are rows of

    @property
    def nbytes(self) -> int:
        """Bytes of these rows as held (float8 weights and float32 scales): what the plan counts."""
        return self.q.numel() + 4 * self.scale.numel()

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


