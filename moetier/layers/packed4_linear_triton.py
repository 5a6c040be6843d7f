"""The Triton kernels of layers/packed4_linear.py (CUDA; Triton's interpreter in the tests).

    q4_mm(x [M, K], codes uint8 [N, K/2], scale [N, G], scale_2 float32 [N] or None, quant, bias)
        -> [M, N] in x.dtype. Grid (M blocks of BLOCK_M, N blocks, K splits), as fp8_mm
        (layers/fp8_linear_triton.py, whose split rule and second pass this shares): one split adds
        the bias and rounds in the program; several write fp32 partials [S, M, N], summed in split
        order by fp8_linear_triton.sum_splits.
    dequantize(codes, scale, scale_2, quant, dtype) -> [N, K]: the weight as the format's torch
        reference makes it (the prefill path's transient).

Tiles come from quant/packed4_triton.dequant4_tile, the helper the expert GEMMs use: one load of the
tile's packed bytes, one of its group scales, nibbles interleaved and groups scaled in registers,
rounded once to the dot type. BLOCK_K (128) holds whole groups of every 4-bit format (16, 32, 128).
NVFP4's tensor scale is per row here (scale_2 [N]): each row's group scales times its own;
asymmetric INT4 passes its zero codes [N, G] (the helper subtracts each group's own, ZERO).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moetier.layers.fp8_linear_triton import BLOCK_K, BLOCK_M, BLOCK_N, NUM_STAGES, NUM_WARPS, PROGRAMS, outputs
from moetier.layers.fp8_linear_triton import store_tile as _store_tile
from moetier.layers.fp8_linear_triton import sum_splits
from moetier.layers.fp8_linear_triton import tile as _tile
from moetier.quant import int4, packed4
from moetier.quant.registry import GROUP_SCALES, GROUPS
from moetier.quant.dot import dot_type as _dot_type
from moetier.quant.dot import mma as _mma
from moetier.quant.packed4_triton import dequant4_tile as _dequant4


@triton.jit
def _row_scales(g_ptr, n, nm, NVFP4: tl.constexpr):
    # NVFP4: each row's float32 tensor scale as a column [BLOCK_N, 1] (it multiplies the tile's group
    # scales [BLOCK_N, BLOCK_K / GROUP]); INT4 has none
    gscale = 1.0
    if NVFP4:
        gscale = tl.load(g_ptr + n, mask=nm, other=1.0)[:, None]
    return gscale


@triton.jit
def _q4_mm(x_ptr, c_ptr, s_ptr, g_ptr, z_ptr, b_ptr, y_ptr, part_ptr, M, N, K, stride_x, G,
           TILES: tl.constexpr, SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr, NVFP4: tl.constexpr, ZERO: tl.constexpr,
           GROUP: tl.constexpr, DOT: tl.constexpr, PRECISION: tl.constexpr, EMULATE: tl.constexpr,
           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    # program (mb, nb, s): rows [mb BM, +BM) x columns [nb BN, +BN) over K tiles [s TILES, +TILES)
    s, m, mm, n, nm = _tile(M, N, BLOCK_M, BLOCK_N)
    gscale = _row_scales(g_ptr, n, nm, NVFP4)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for t in range(TILES):  # NOTE: a constexpr bound (the interpreter cannot loop to an argument)
        k0 = (s * TILES + t) * BLOCK_K
        kk = k0 + tl.arange(0, BLOCK_K)
        xa = tl.load(x_ptr + m[:, None].to(tl.int64) * stride_x + kk[None, :], mask=mm[:, None] & (kk < K)[None, :],
                     other=0.0)
        # past K (the last split's tail) the codes and scales load as zeros: the tile adds nothing
        w = _dequant4(c_ptr, K // 2, s_ptr, G, n, nm, k0, K, gscale, NVFP4, GROUP, DOT, EMULATE, BLOCK_K, z_ptr, ZERO)
        acc = _mma(xa, w, acc, DOT, PRECISION, EMULATE)
    _store_tile(acc, b_ptr, y_ptr, part_ptr, s, m, mm, n, nm, M, N, SPLIT, HAS_BIAS)


@triton.jit
def _dequant_rows(c_ptr, s_ptr, g_ptr, z_ptr, y_ptr, N, K, G, NVFP4: tl.constexpr, ZERO: tl.constexpr,
                  GROUP: tl.constexpr, DOT: tl.constexpr, EMULATE: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_K: tl.constexpr):
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    nm = n < N
    k0 = tl.program_id(1) * BLOCK_K
    kk = k0 + tl.arange(0, BLOCK_K)
    w = _dequant4(c_ptr, K // 2, s_ptr, G, n, nm, k0, K, _row_scales(g_ptr, n, nm, NVFP4), NVFP4, GROUP, DOT,
                  EMULATE, BLOCK_K, z_ptr, ZERO)
    tl.store(y_ptr + n[:, None].to(tl.int64) * K + kk[None, :], w.to(y_ptr.dtype.element_ty),
             mask=nm[:, None] & (kk < K)[None, :])


def _check(codes: torch.Tensor, scale: torch.Tensor, scale_2: torch.Tensor | None, quant: str,
           zero: torch.Tensor | None) -> tuple[int, int]:
    """(N, K) of a 4-bit weight, or one ValueError line naming what does not fit."""
    n, k = codes.shape[0], 2 * codes.shape[1]
    want = (n, packed4.cdiv(k, GROUPS[quant]))
    if (codes.dtype != torch.uint8 or scale.dtype != GROUP_SCALES[quant] or tuple(scale.shape) != want
            or not codes.is_contiguous() or not scale.is_contiguous()):
        raise ValueError(f"a {quant} weight needs contiguous uint8 codes [N, K/2] and {GROUP_SCALES[quant]} scales "
                         f"{list(want)}, got {codes.dtype} {list(codes.shape)} and {scale.dtype} {list(scale.shape)}")
    if (scale_2 is None) != (quant != "nvfp4") or (scale_2 is not None and tuple(scale_2.shape) != (n,)):
        what = "a float32 tensor scale per row" if quant == "nvfp4" else "no tensor scale"
        raise ValueError(f"a {quant} weight of {n} rows takes {what}")
    asym = quant in int4.ASYMMETRIC
    if (zero is not None) != asym or (asym and (zero.dtype != torch.uint8 or zero.shape != scale.shape
                                                 or not zero.is_contiguous())):
        what = f"contiguous uint8 zero codes {list(want)}" if asym else "no zero codes"
        raise ValueError(f"a {quant} weight takes {what}")
    return n, k


def _scales(scale: torch.Tensor, scale_2: torch.Tensor | None, zero: torch.Tensor | None
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    # the helper reads the group scales through a byte pointer; the scales stand in for an absent
    # tensor scale or zero codes (never read then)
    s = scale.view(torch.uint8)
    return s, scale_2 if scale_2 is not None else scale, zero if zero is not None else s


def q4_mm(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, scale_2: torch.Tensor | None, quant: str,
          bias: torch.Tensor | None = None, zero: torch.Tensor | None = None, block_n: int = BLOCK_N,
          programs: int = PROGRAMS) -> torch.Tensor:
    """x [M, K] (unit stride along K) @ dequant(codes, scale, scale_2, zero)^T (+ bias [N]) -> [M, N] in x.dtype."""
    n, k = _check(codes, scale, scale_2, quant, zero)
    m = x.shape[0]
    if x.shape[1] != k or x.stride(1) != 1:
        raise ValueError(f"x {list(x.shape)} (stride {x.stride()}) does not multiply a 4-bit weight [{n}, {k}]")
    dot, precision, emulate = _dot_type(x.dtype)
    y, part, per, grid = outputs(x, n, k, block_n, BLOCK_K, programs)
    s, g, z = _scales(scale, scale_2, zero)
    _q4_mm[grid](x, codes, s, g, z, bias if bias is not None else y, y, part, m, n, k, x.stride(0), scale.shape[1],
                 TILES=per, SPLIT=grid[2], HAS_BIAS=bias is not None, NVFP4=quant == "nvfp4", ZERO=zero is not None,
                 GROUP=GROUPS[quant],
                 DOT=dot, PRECISION=precision, EMULATE=emulate, BLOCK_M=BLOCK_M, BLOCK_N=block_n, BLOCK_K=BLOCK_K,
                 num_warps=NUM_WARPS, num_stages=NUM_STAGES)
    return sum_splits(part, bias, y)


def dequantize(codes: torch.Tensor, scale: torch.Tensor, scale_2: torch.Tensor | None, quant: str,
               dtype: torch.dtype, zero: torch.Tensor | None = None) -> torch.Tensor:
    """-> [N, K] in dtype, equal to Packed4Weight.dequantize (the format's reference; a fresh buffer)."""
    n, k = _check(codes, scale, scale_2, quant, zero)
    dot, _, emulate = _dot_type(dtype)
    y = torch.empty(n, k, dtype=dtype, device=codes.device)
    s, g, z = _scales(scale, scale_2, zero)
    _dequant_rows[(triton.cdiv(n, 64), triton.cdiv(k, BLOCK_K))](
        codes, s, g, z, y, n, k, scale.shape[1], NVFP4=quant == "nvfp4", ZERO=zero is not None,
        GROUP=GROUPS[quant], DOT=dot, EMULATE=emulate, BLOCK_N=64, BLOCK_K=BLOCK_K)
    return y
