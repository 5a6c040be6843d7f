"""The Triton side of the 4-bit formats (quant/nvfp4.py and quant/int4.py have the rules and the
torch references): the jit helper kernels call to turn a tile of packed codes into weights.

    dequant4_tile(codes, row_bytes, scales, scale_row, n, nm, k0, K, gscale, NVFP4, GROUP, DOT, EMULATE, BLOCK_K)
        -> [BLOCK_N, BLOCK_K] weights of rows n, columns k0.., rounded once to DOT:
        NVFP4  e2m1(code) * (float32(e4m3 scale) * gscale)      (nvfp4.dequantize's products)
        INT4   (code - 8) * float32(bf16 scale)                 (int4.dequantize's)
        Callers: experts/kernels/grouped_gemm.py (decode and large-step expert GEMMs).

Codes sit two per byte, the even element in the low nibble, `row_bytes` bytes per weight row; the
scales [N, scale_row] one per GROUP elements along K. BLOCK_K and GROUP are powers of two, so a K tile
holds whole groups or lies inside one. Weight-only: nothing here touches the activations.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _e2m1(code):
    # E2M1 code (int32 0..15) -> float32: bit 3 the sign, bits 2..1 the exponent (bias 1), bit 0 the
    # mantissa; exponent 0 is subnormal (0 or 0.5). Built from bits: exact, -0.0 for code 8.
    mag = code & 7
    e = mag >> 1
    m = mag & 1
    normal = (((e + 126) << 23) | (m << 22)).to(tl.float32, bitcast=True)
    v = tl.where(e == 0, m.to(tl.float32) * 0.5, normal)
    return tl.where(code >= 8, -v, v)


@triton.jit
def dequant4_tile(codes, row_bytes, scales, scale_row, n, nm, k0, K, gscale, NVFP4: tl.constexpr,
                  GROUP: tl.constexpr, DOT: tl.constexpr, EMULATE: tl.constexpr, BLOCK_K: tl.constexpr):
    # codes, scales: byte pointers to this projection's codes [N, row_bytes] and scales [N, scale_row];
    # the tile is columns [k0, k0 + BLOCK_K) of rows n, k0 a multiple of BLOCK_K. Loads are whole
    # tiles: the tile's bytes [BLOCK_N, BLOCK_K / 2] (one load, contiguous per row), its scales
    # [BLOCK_N, BLOCK_K / GROUP] (or one per row when a group spans the tile), then the nibbles are
    # interleaved and each group multiplied by its scale in registers (a gather per element, byte and
    # scale each, made the GEMMs instruction-bound: docs/quant4.md has the before and after).
    HALF: tl.constexpr = BLOCK_K // 2
    kb = k0 // 2 + tl.arange(0, HALF)
    b = tl.load(codes + n[:, None].to(tl.int64) * row_bytes + kb[None, :],
                mask=nm[:, None] & (kb < K // 2)[None, :], other=0).to(tl.int32)
    code = tl.reshape(tl.join(b & 15, (b >> 4) & 15), [n.shape[0], BLOCK_K])  # element 2j: low nibble
    if NVFP4:
        v = _e2m1(code)
    else:
        v = (code - 8).to(tl.float32)
    if BLOCK_K >= GROUP:
        NG: tl.constexpr = BLOCK_K // GROUP
        g = k0 // GROUP + tl.arange(0, NG)
        at = n[:, None].to(tl.int64) * scale_row + g[None, :]
        sm = nm[:, None] & (g < scale_row)[None, :]
    else:  # one group over the whole tile (BLOCK_K divides GROUP)
        at = n.to(tl.int64) * scale_row + k0 // GROUP
        sm = nm
    if NVFP4:
        sc = tl.load(scales + at, mask=sm, other=0).to(tl.float8e4nv, bitcast=True).to(tl.float32) * gscale
    else:
        sc = tl.load(scales.to(tl.pointer_type(tl.bfloat16), bitcast=True) + at, mask=sm, other=0.0).to(tl.float32)
    if BLOCK_K >= GROUP:
        v = tl.reshape(tl.reshape(v, [n.shape[0], NG, GROUP]) * sc[:, :, None], [n.shape[0], BLOCK_K])
    else:
        v = v * sc[:, None]
    if EMULATE:
        if DOT == tl.bfloat16:  # the interpreter truncates fp32 -> bf16; round to nearest even as the GPU does
            u = v.to(tl.uint32, bitcast=True)
            v = ((u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000).to(tl.float32, bitcast=True)
    return v.to(DOT)
