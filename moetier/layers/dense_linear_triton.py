"""16-bit dense linears at decode sizes on CUDA (Triton's interpreter in the tests): the kernel that
layers/quant_linear.linear takes instead of cuBLAS for a step of at most GEMV_MAX_M rows.

    dense_mm(x [M, K], w [N, K] (unit stride along K), bias) -> [M, N] in x.dtype
        grid (M blocks of BLOCK_M, N blocks, K splits), M blocks fastest, as the kept formats'
        decode kernels (layers/fp8_linear_triton.fp8_mm, whose tile, split rule and second pass this
        shares): one split adds the bias and rounds in the program; several write fp32 partials
        [S, M, N], summed in split order by one second launch.

Why: at M <= 8 a linear reads its weight once and does almost no arithmetic, so it should run at HBM
speed; cuBLAS picks split-K GEMM tiles there whose reduce is a second kernel and whose tiles leave the
small layers short of HBM rate (docs/bench-decode.md has the measurement this rule came from). The
split count comes from the weight's shape alone, never from M: a row's bits do not depend on the
batch it shares a step with (up to GEMV_MAX_M rows; cuBLAS above, as a prefill step).

Products are exact (16-bit operands on the tensor cores) and sums fp32, as cuBLAS's: results agree
with F.linear to the summation order, not bit for bit.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moetier.layers.fp8_linear_triton import BLOCK_M, outputs, store_tile, sum_splits, tile
from moetier.quant.dot import dot_type as _dot_type
from moetier.quant.dot import mma as _mma

GEMV_MAX_M = 8  # rows up to which quant_linear.linear takes dense_mm on CUDA (measured; module doc)
BLOCK_N, BLOCK_K = 32, 256  # a [32, 256] bf16 weight tile: 16 KiB a stage
PROGRAMS = 4 * 132  # K-split target: about four programs per SM of a 132-SM card
NUM_WARPS, NUM_STAGES = 4, 4


@triton.jit
def _dense_mm(x_ptr, w_ptr, b_ptr, y_ptr, part_ptr, M, N, K, stride_x, stride_w,
              TILES: tl.constexpr, SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr,
              DOT: tl.constexpr, PRECISION: tl.constexpr, EMULATE: tl.constexpr,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    # program (mb, nb, s): rows [mb BM, +BM) x columns [nb BN, +BN) over K tiles [s TILES, +TILES)
    s, m, mm, n, nm = tile(M, N, BLOCK_M, BLOCK_N)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for t in range(TILES):  # NOTE: a constexpr bound (the interpreter cannot loop to an argument)
        kk = (s * TILES + t) * BLOCK_K + tl.arange(0, BLOCK_K)
        km = kk < K  # tiles past K (the last split's tail) load zeros and add nothing
        xa = tl.load(x_ptr + m[:, None].to(tl.int64) * stride_x + kk[None, :], mask=mm[:, None] & km[None, :],
                     other=0.0)
        w = tl.load(w_ptr + n[:, None].to(tl.int64) * stride_w + kk[None, :], mask=nm[:, None] & km[None, :],
                    other=0.0)
        acc = _mma(xa, w, acc, DOT, PRECISION, EMULATE)
    store_tile(acc, b_ptr, y_ptr, part_ptr, s, m, mm, n, nm, M, N, SPLIT, HAS_BIAS)


def takes(x2: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether dense_mm serves x2 [M, K] @ w^T: CUDA, 16-bit, at most GEMV_MAX_M rows, unit strides
    along K."""
    return (x2.is_cuda and x2.shape[0] <= GEMV_MAX_M and x2.dtype in (torch.bfloat16, torch.float16)
            and w.dtype == x2.dtype and w.dim() == 2 and w.stride(1) == 1 and x2.stride(1) == 1)


def dense_mm(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None, block_n: int = BLOCK_N,
             block_k: int = BLOCK_K, programs: int = PROGRAMS, num_warps: int = NUM_WARPS,
             num_stages: int = NUM_STAGES) -> torch.Tensor:
    """x [M, K] @ w [N, K]^T (+ bias [N]) -> [M, N] in x.dtype; both unit stride along K."""
    m, k = x.shape
    n = w.shape[0]
    if w.shape[1] != k or x.stride(1) != 1 or w.stride(1) != 1 or w.dtype != x.dtype:
        raise ValueError(f"x {list(x.shape)} {x.dtype} (stride {x.stride()}) does not multiply a weight "
                         f"{list(w.shape)} {w.dtype} (stride {w.stride()})")
    dot, precision, emulate = _dot_type(x.dtype)
    y, part, per, grid = outputs(x, n, k, block_n, block_k, programs)
    _dense_mm[grid](x, w, bias if bias is not None else y, y, part, m, n, k, x.stride(0), w.stride(0),
                    TILES=per, SPLIT=grid[2], HAS_BIAS=bias is not None, DOT=dot, PRECISION=precision,
                    EMULATE=emulate, BLOCK_M=BLOCK_M, BLOCK_N=block_n, BLOCK_K=block_k,
                    num_warps=num_warps, num_stages=num_stages)
    return sum_splits(part, bias, y)
