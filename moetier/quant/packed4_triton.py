"""The Triton side of the 4-bit formats (quant/nvfp4.py and quant/int4.py have the rules and the
torch references): the jit helper kernels call to turn a tile of packed codes into weights.

    dequant4_tile(codes, row_bytes, scales, scale_row, n, nm, kk, km, gscale, NVFP4, GROUP, DOT, EMULATE)
        -> [BLOCK_N, BLOCK_K] weights of rows n, columns kk, rounded once to DOT:
        NVFP4  e2m1(code) * (float32(e4m3 scale) * gscale)      (nvfp4.dequantize's products)
        INT4   (code - 8) * float32(bf16 scale)                 (int4.dequantize's)
        Callers: experts/kernels/grouped_gemm.py (decode and large-step expert GEMMs).

Codes sit two per byte, the even element in the low nibble, `row_bytes` bytes per weight row; the
scales [N, scale_row] one per GROUP elements along K. Each element gathers its byte and its scale:
any BLOCK_K works and a K tile may cross groups. Weight-only: nothing here touches the activations.
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
def dequant4_tile(codes, row_bytes, scales, scale_row, n, nm, kk, km, gscale, NVFP4: tl.constexpr,
                  GROUP: tl.constexpr, DOT: tl.constexpr, EMULATE: tl.constexpr):
    # codes, scales: byte pointers to this projection's codes [N, row_bytes] and scales [N, scale_row]
    wm = nm[:, None] & km[None, :]
    b = tl.load(codes + n[:, None].to(tl.int64) * row_bytes + (kk // 2)[None, :], mask=wm, other=0).to(tl.int32)
    code = (b >> ((kk & 1) * 4)[None, :]) & 15
    at = n[:, None].to(tl.int64) * scale_row + (kk // GROUP)[None, :]
    if NVFP4:
        s = tl.load(scales + at, mask=wm, other=0).to(tl.float8e4nv, bitcast=True).to(tl.float32)
        v = _e2m1(code) * (s * gscale)
    else:
        sp = scales.to(tl.pointer_type(tl.bfloat16), bitcast=True)
        s = tl.load(sp + at, mask=wm, other=0.0).to(tl.float32)
        v = (code - 8).to(tl.float32) * s
    if EMULATE:
        if DOT == tl.bfloat16:  # the interpreter truncates fp32 -> bf16; round to nearest even as the GPU does
            u = v.to(tl.uint32, bitcast=True)
            v = ((u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000).to(tl.float32, bitcast=True)
    return v.to(DOT)
