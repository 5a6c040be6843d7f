"""The Triton kernels of layers/fp8_linear.py (CUDA; Triton's interpreter in the tests).

    fp8_mm(x [M, K], q [N, K] float8, scale [ceil(N/128), ceil(K/128)], bias) -> [M, N] in x.dtype
        grid (M blocks of BLOCK_M, N blocks, K splits), M blocks fastest: the programs that share a
        weight tile run side by side (the second reads it from L2). One split: the program adds the
        bias and rounds. Several: fp32 partials [S, M, N], summed in split order by _sum_splits.
    dequantize(q, scale, dtype) -> [N, K]: the weight as fp8.dequantize makes it (the prefill path).

Tiles use the format's helpers, shared with the grouped expert GEMM: _dequant (quant/fp8_block_triton
.dequant_tile: fp32(q) * its block's scale, rounded once to the dot type; round-to-nearest-even
emulated under the interpreter, which truncates) and _mma (quant/dot.mma: tl.dot with fp32
accumulation; operands widened under the interpreter, which multiplies the raw bits of bf16). BLOCK_K divides 128, so each K tile reads one scale column.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moetier.quant import fp8_block as fp8
from moetier.quant.dot import dot_type as _dot_type
from moetier.quant.dot import mma as _mma
from moetier.quant.fp8_block_triton import dequant_tile as _dequant

BLOCK_M = 16  # rows per tl.dot (its smallest M); fixed so that no row's bits depend on the batch
BLOCK_N, BLOCK_K = 32, 128  # BLOCK_K = the scale block: one scale column per K tile
PROGRAMS = 4 * 132  # K-split target: about four programs per SM of a 132-SM card per M block
NUM_WARPS, NUM_STAGES = 4, 4


@triton.jit
def tile(M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    # program (mb, nb, s): rows [mb BM, +BM) x columns [nb BN, +BN) over K tiles of split s
    # -> (s, rows m, their mask, columns n, their mask); the dense kernels' (this file's, packed4's) grid
    s = tl.program_id(2)
    m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    return s, m, m < M, n, n < N


@triton.jit
def store_tile(acc, b_ptr, y_ptr, part_ptr, s, m, mm, n, nm, M, N, SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr):
    # one split: acc (+ bias) rounded once into y; several: acc into split s's fp32 partials [S, M, N]
    out = m[:, None].to(tl.int64) * N + n[None, :]
    om = mm[:, None] & nm[None, :]
    if SPLIT == 1:
        if HAS_BIAS:
            acc += tl.load(b_ptr + n, mask=nm, other=0.0).to(tl.float32)[None, :]
        tl.store(y_ptr + out, acc.to(y_ptr.dtype.element_ty), mask=om)
    else:
        tl.store(part_ptr + s.to(tl.int64) * M * N + out, acc, mask=om)


@triton.jit
def _fp8_mm(x_ptr, w_ptr, s_ptr, b_ptr, y_ptr, part_ptr, M, N, K, stride_x, KB,
            TILES: tl.constexpr, SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr,
            DOT: tl.constexpr, PRECISION: tl.constexpr, EMULATE: tl.constexpr,
            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    # program (mb, nb, s): rows [mb BM, +BM) x columns [nb BN, +BN) over K tiles [s TILES, +TILES)
    s, m, mm, n, nm = tile(M, N, BLOCK_M, BLOCK_N)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for t in range(TILES):  # NOTE: a constexpr bound (the interpreter cannot loop to an argument)
        k0 = (s * TILES + t) * BLOCK_K
        kk = k0 + tl.arange(0, BLOCK_K)
        km = kk < K  # tiles past K (the last split's tail) load zeros and add nothing
        xa = tl.load(x_ptr + m[:, None].to(tl.int64) * stride_x + kk[None, :], mask=mm[:, None] & km[None, :],
                     other=0.0)
        w = tl.load(w_ptr + n[:, None].to(tl.int64) * K + kk[None, :], mask=nm[:, None] & km[None, :], other=0)
        # past K the scale column is clamped to the last (the tile is zeros: any finite scale will do)
        w = _dequant(w, s_ptr, n, nm, kk, km, tl.minimum(k0, K - 1), KB, DOT, EMULATE, BLOCK_K)
        acc = _mma(xa, w, acc, DOT, PRECISION, EMULATE)
    store_tile(acc, b_ptr, y_ptr, part_ptr, s, m, mm, n, nm, M, N, SPLIT, HAS_BIAS)


@triton.jit
def _sum_splits(part_ptr, b_ptr, y_ptr, M, N, SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
    # y[m, n] = sum over s = 0..SPLIT-1, in that order, of part[s, m, n] (+ bias[n]), rounded once
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = i < M * N
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for s in tl.static_range(SPLIT):
        acc += tl.load(part_ptr + s * M * N + i, mask=ok, other=0.0)
    if HAS_BIAS:
        acc += tl.load(b_ptr + i % N, mask=ok, other=0.0).to(tl.float32)
    tl.store(y_ptr + i, acc.to(y_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _dequant_rows(w_ptr, s_ptr, y_ptr, N, K, KB, DOT: tl.constexpr, EMULATE: tl.constexpr,
                  BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    nm = n < N
    k0 = tl.program_id(1) * BLOCK_K
    kk = k0 + tl.arange(0, BLOCK_K)
    km = kk < K
    at = n[:, None].to(tl.int64) * K + kk[None, :]
    w = tl.load(w_ptr + at, mask=nm[:, None] & km[None, :], other=0)
    w = _dequant(w, s_ptr, n, nm, kk, km, k0, KB, DOT, EMULATE, BLOCK_K)
    tl.store(y_ptr + at, w.to(y_ptr.dtype.element_ty), mask=nm[:, None] & km[None, :])


def splits(n: int, k: int, block_n: int = BLOCK_N, block_k: int = BLOCK_K,
           programs: int = PROGRAMS) -> tuple[int, int]:
    """(K splits, K tiles per split) for an [N, K] weight: about `programs` programs per M block,
    from the shape alone (never from M: a row's bits must not depend on the batch)."""
    tiles = triton.cdiv(k, block_k)
    want = max(1, min(tiles, triton.cdiv(programs, triton.cdiv(n, block_n))))
    per = triton.cdiv(tiles, want)
    return triton.cdiv(tiles, per), per


def _check(q: torch.Tensor, scale: torch.Tensor, block_k: int) -> None:
    if q.dtype != fp8.FP8 or scale.dtype != torch.float32 or not q.is_contiguous() or not scale.is_contiguous():
        raise ValueError(f"an FP8 weight needs contiguous float8_e4m3fn q and float32 scale, got {q.dtype} "
                         f"and {scale.dtype}")
    if tuple(scale.shape) != fp8.scale_shape(tuple(q.shape)):
        raise ValueError(f"scale {list(scale.shape)} does not fit an FP8 weight {list(q.shape)}")
    if fp8.BLOCK % block_k:
        raise ValueError(f"BLOCK_K {block_k} must divide {fp8.BLOCK} (one scale column per K tile)")


def fp8_mm(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None,
           block_n: int = BLOCK_N, block_k: int = BLOCK_K, programs: int = PROGRAMS) -> torch.Tensor:
    """x [M, K] (unit stride along K) @ dequant(q, scale)^T (+ bias [N]) -> [M, N] in x.dtype."""
    _check(q, scale, block_k)
    m, k = x.shape
    n = q.shape[0]
    if q.shape[1] != k or x.stride(1) != 1:
        raise ValueError(f"x {list(x.shape)} (stride {x.stride()}) does not multiply an FP8 weight {list(q.shape)}")
    dot, precision, emulate = _dot_type(x.dtype)
    y, part, per, grid = outputs(x, n, k, block_n, block_k, programs)
    _fp8_mm[grid](x, q.view(torch.uint8), scale, bias if bias is not None else y, y, part, m, n, k, x.stride(0),
                  scale.shape[1], TILES=per, SPLIT=grid[2], HAS_BIAS=bias is not None, DOT=dot, PRECISION=precision,
                  EMULATE=emulate, BLOCK_M=BLOCK_M, BLOCK_N=block_n, BLOCK_K=block_k,
                  num_warps=NUM_WARPS, num_stages=NUM_STAGES)
    return sum_splits(part, bias, y)


def outputs(x: torch.Tensor, n: int, k: int, block_n: int, block_k: int, programs: int
            ) -> tuple[torch.Tensor, torch.Tensor, int, tuple[int, int, int]]:
    """(y [M, N] in x.dtype, the fp32 split partials [S, M, N] (y itself with one split), K tiles per
    split, the grid (M blocks, N blocks, S)) of one dense-kernel call: this file's and
    layers/packed4_linear_triton.py's."""
    m = x.shape[0]
    split, per = splits(n, k, block_n, block_k, programs)
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    part = torch.empty(split, m, n, dtype=torch.float32, device=x.device) if split > 1 else y
    return y, part, per, (triton.cdiv(m, BLOCK_M), triton.cdiv(n, block_n), split)


def sum_splits(part: torch.Tensor, bias: torch.Tensor | None, y: torch.Tensor) -> torch.Tensor:
    """y [M, N] = the fp32 partials part [S, M, N] summed in split order (+ bias), rounded once (the
    second pass of a K-split call; nothing to do with one split, whose programs wrote y)."""
    if part is y:
        return y
    split, m, n = part.shape
    block = 1024
    _sum_splits[(triton.cdiv(m * n, block),)](part, bias if bias is not None else y, y, m, n, SPLIT=split,
                                              HAS_BIAS=bias is not None, BLOCK=block)
    return y


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """-> [N, K] in dtype, equal to fp8.dequantize(q, scale, dtype) (a fresh buffer each call)."""
    _check(q, scale, BLOCK_K)
    n, k = q.shape
    dot, _, emulate = _dot_type(dtype)
    y = torch.empty(n, k, dtype=dtype, device=q.device)
    grid = (triton.cdiv(n, 64), triton.cdiv(k, BLOCK_K))
    _dequant_rows[grid](q.view(torch.uint8), scale, y, n, k, scale.shape[1], DOT=dot, EMULATE=emulate,
                        BLOCK_N=64, BLOCK_K=BLOCK_K)
    return y
