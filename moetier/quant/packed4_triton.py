"""The Triton side of the 4-bit formats (quant/nvfp4.py and quant/int4.py have the rules and the
torch references): the jit helper kernels call to turn a tile of packed codes into weights.

    dequant4_tile(codes, row_bytes, scales, scale_row, n, nm, k0, K, gscale, NVFP4, GROUP, DOT, EMULATE, BLOCK_K,
                  zeros=None, ZERO=False)
        -> [BLOCK_N, BLOCK_K] weights of rows n, columns k0.., rounded once to DOT:
        NVFP4  e2m1(code) * (float32(e4m3 scale) * gscale)      (nvfp4.dequantize's products, to the bit)
        INT4   (code - 8) * float32(bf16 scale)                 (int4.dequantize's)
               (code - zcode) * float32(bf16 scale)             with ZERO: asymmetric rows, zeros the
                                                                 uint8 zero codes [N, scale_row]
        Callers: experts/kernels/grouped_gemm.py (decode and large-step expert GEMMs),
        layers/packed4_linear_triton.py.
    dot4_tile(codes, row_bytes, scales, scale_row, n, nm, k0, K, gscale, xe, xo, NVFP4, GROUP, BLOCK_K,
              zeros=None, ZERO=False)
        -> [BLOCK_N] float32: the tile's rows dotted with the activations (xe, xo: float32 at its even and
        odd columns), each group's code sum scaled once; no tl.dot, no interleave. Caller:
        experts/kernels/q4_gemv.py (one-token steps).

Codes sit two per byte, the even element in the low nibble, `row_bytes` bytes per weight row; the
scales [N, scale_row] one per GROUP elements along K. BLOCK_K and GROUP are powers of two, so a K tile
holds whole groups or lies inside one. Weight-only: nothing here touches the activations.
"""

from __future__ import annotations

import triton
import triton.language as tl

from moetier.quant.dot import to_dot


# E2M1 -> float16 bits: sign to bit 15, the exponent's two bits and the mantissa bit just below
# float16's exponent LSB (bits 11..9). Every code then reads as its value / 2^14 exactly: a normal
# 2^(e-1)(1 + m/2) becomes 2^(e-15)(1 + m/2), e = 0 a float16 subnormal m * 2^-15 (0.5 or 0), code 8
# -0.0. dequant4_tile folds the 2^14 into the scale, so each product is the same real number as
# e2m1 * scale, rounded once: the bits of nvfp4.dequantize's products. Fewer integer ops per weight
# than decoding sign, exponent and mantissa separately, and no select.


@triton.jit
def _e2m1_f16_bits(b, SHIFT: tl.constexpr):
    # the nibble at bit SHIFT (0 low, 4 high) of bytes b (int32) -> its float16 bits (int32)
    return (((b >> SHIFT) & 7) << 9) | (((b >> SHIFT) & 8) << 12)


@triton.jit
def _bytes4(codes, row_bytes, n, nm, k0, K, BLOCK_K: tl.constexpr):
    # the tile's bytes [BLOCK_N, BLOCK_K / 2] as int32: one load, contiguous per row (a gather per
    # element made the GEMMs instruction-bound: docs/quant4.md has the before and after)
    kb = k0 // 2 + tl.arange(0, BLOCK_K // 2)
    return tl.load(codes + n[:, None].to(tl.int64) * row_bytes + kb[None, :],
                   mask=nm[:, None] & (kb < K // 2)[None, :], other=0).to(tl.int32)


@triton.jit
def _nibble4(b, SHIFT: tl.constexpr, NVFP4: tl.constexpr, ZERO: tl.constexpr):
    # the codes at bit SHIFT of bytes b (0: the even elements, 4: the odd ones) as exact float32:
    # NVFP4 e2m1 / 2^14, INT4 code - 8 (ZERO: the raw code, its group's zero subtracted by the caller)
    if NVFP4:
        return _e2m1_f16_bits(b, SHIFT).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
    code = (b >> SHIFT) & 15
    return code.to(tl.float32) if ZERO else (code - 8).to(tl.float32)


@triton.jit
def _scales4(scales, scale_row, n, nm, k0, gscale, NVFP4: tl.constexpr, GROUP: tl.constexpr, BLOCK_K: tl.constexpr,
             zeros, ZERO: tl.constexpr):
    # -> (sc, zc) float32: the tile's group scales (NVFP4: times gscale and the 2^14 _nibble4 took out)
    # and zero codes (ZERO; else 0.0), [BLOCK_N, BLOCK_K / GROUP] when the tile holds whole groups,
    # [BLOCK_N] when one group spans it
    if BLOCK_K >= GROUP:
        NG: tl.constexpr = BLOCK_K // GROUP
        g = k0 // GROUP + tl.arange(0, NG)
        at = n[:, None].to(tl.int64) * scale_row + g[None, :]
        sm = nm[:, None] & (g < scale_row)[None, :]
    else:  # one group over the whole tile (BLOCK_K divides GROUP)
        at = n.to(tl.int64) * scale_row + k0 // GROUP
        sm = nm
    zc = 0.0
    if NVFP4:
        sc = tl.load(scales + at, mask=sm, other=0).to(tl.float8e4nv, bitcast=True).to(tl.float32) * gscale
        sc = sc * 16384.0  # 2^14: exact; the codes hold e2m1 / 2^14
    else:
        sc = tl.load(scales.to(tl.pointer_type(tl.bfloat16), bitcast=True) + at, mask=sm, other=0.0).to(tl.float32)
        if ZERO:  # the group's zero code: (code - zcode) exact in float32 (integers below 16)
            zc = tl.load(zeros + at, mask=sm, other=0).to(tl.float32)
    return sc, zc


@triton.jit
def dequant4_tile(codes, row_bytes, scales, scale_row, n, nm, k0, K, gscale, NVFP4: tl.constexpr,
                  GROUP: tl.constexpr, DOT: tl.constexpr, EMULATE: tl.constexpr, BLOCK_K: tl.constexpr,
                  zeros=None, ZERO: tl.constexpr = False):
    # codes, scales: byte pointers to this projection's codes [N, row_bytes] and scales [N, scale_row];
    # the tile is columns [k0, k0 + BLOCK_K) of rows n, k0 a multiple of BLOCK_K; each group multiplied
    # by its scale in registers, rounded once to DOT. The scales meet the even and the odd codes before
    # they are interleaved, each half tile [N, BLOCK_K / 2] against its groups' scales repeated
    # GROUP / 2 times (a small broadcast), so the full tile is reshaped once, by the interleave.
    b = _bytes4(codes, row_bytes, n, nm, k0, K, BLOCK_K)
    lo, hi = _nibble4(b, 0, NVFP4, ZERO), _nibble4(b, 4, NVFP4, ZERO)
    sc, zc = _scales4(scales, scale_row, n, nm, k0, gscale, NVFP4, GROUP, BLOCK_K, zeros, ZERO)
    if BLOCK_K >= GROUP:
        NG: tl.constexpr = BLOCK_K // GROUP
        G2: tl.constexpr = GROUP // 2
        sc = tl.reshape(tl.broadcast_to(sc[:, :, None], [n.shape[0], NG, G2]), [n.shape[0], BLOCK_K // 2])
        if ZERO:
            zc = tl.reshape(tl.broadcast_to(zc[:, :, None], [n.shape[0], NG, G2]), [n.shape[0], BLOCK_K // 2])
    else:
        sc = sc[:, None]
        if ZERO:
            zc = zc[:, None]
    if ZERO:
        lo = lo - zc
        hi = hi - zc
    v = tl.reshape(tl.join(lo * sc, hi * sc), [n.shape[0], BLOCK_K])
    return to_dot(v, DOT, EMULATE)


@triton.jit
def dot4_tile(codes, row_bytes, scales, scale_row, n, nm, k0, K, gscale, xe, xo, NVFP4: tl.constexpr,
              GROUP: tl.constexpr, BLOCK_K: tl.constexpr, zeros=None, ZERO: tl.constexpr = False):
    # [BLOCK_N] float32: sum over the tile's columns of w[n, k] * x[k]; xe, xo [BLOCK_K / 2] float32: the
    # activations at the tile's even and odd columns (zeros past K). The low nibbles meet xe, the high
    # ones xo, so the codes are never interleaved; each group's sum is scaled once: no weight is rounded
    # (the dequantize-then-dot path rounds each to DOT), fewer multiplies per weight.
    b = _bytes4(codes, row_bytes, n, nm, k0, K, BLOCK_K)
    lo, hi = _nibble4(b, 0, NVFP4, ZERO), _nibble4(b, 4, NVFP4, ZERO)
    sc, zc = _scales4(scales, scale_row, n, nm, k0, gscale, NVFP4, GROUP, BLOCK_K, zeros, ZERO)
    # one return after both branches: Triton's code generator goes on past a return inside a constexpr
    # `if`, so the branch's 3-D `lo` would reach the 2-D sum below
    if BLOCK_K >= GROUP:
        NG: tl.constexpr = BLOCK_K // GROUP
        G2: tl.constexpr = GROUP // 2
        lo3 = tl.reshape(lo, [n.shape[0], NG, G2])
        hi3 = tl.reshape(hi, [n.shape[0], NG, G2])
        if ZERO:
            lo3 = lo3 - zc[:, :, None]
            hi3 = hi3 - zc[:, :, None]
        part = tl.sum(lo3 * tl.reshape(xe, [NG, G2])[None, :, :] + hi3 * tl.reshape(xo, [NG, G2])[None, :, :], axis=2)
        acc = tl.sum(part * sc, axis=1)  # part [BLOCK_N, NG]
    else:
        if ZERO:
            lo = lo - zc[:, None]
            hi = hi - zc[:, None]
        acc = tl.sum(lo * xe[None, :] + hi * xo[None, :], axis=1) * sc
    return acc
