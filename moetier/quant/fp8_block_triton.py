"""The Triton side of block-scaled FP8 (quant/fp8_block.py has the rule and the torch reference):
the jit helpers kernels call to turn a tile of float8 bytes into values.

    dequant_tile(w, scale_ptr, n, nm, kk, km, k0, K_BLOCKS, DOT, EMULATE, BLOCK_K) -> [BLOCK_N, BLOCK_K]
        fp32(q) times its 128 x 128 block's scale, rounded once to DOT: fp8_block.dequantize's
        weights exactly (round-to-nearest-even emulated under the interpreter, which truncates).
        Callers: experts/kernels/grouped_gemm.py (decode and large-step expert GEMMs) and
        layers/fp8_linear_triton.py (dense projections kept in FP8).

K tiles are aligned to the scale blocks: a BLOCK_K dividing 128 reads one scale per weight row, a
multiple of 128 gathers a scale per element; callers refuse any other BLOCK_K.
"""

from __future__ import annotations

import triton
import triton.language as tl

from moetier.quant.dot import to_dot


@triton.jit
def dequant_tile(w, scale_ptr, n, nm, kk, km, k0, K_BLOCKS: tl.constexpr, DOT: tl.constexpr, EMULATE: tl.constexpr,
             BLOCK_K: tl.constexpr):
    # w [BLOCK_N, BLOCK_K] float8 bytes of rows n, columns kk = k0 + [0, BLOCK_K) -> DOT: fp32(w) times
    # its block's scale (float32 grid [ceil(N/128), K_BLOCKS] at byte pointer scale_ptr), rounded once.
    # BLOCK_K divides 128: one scale per row (column k0 // 128); a multiple of 128: one per element.
    sp = scale_ptr.to(tl.pointer_type(tl.float32), bitcast=True)
    if BLOCK_K <= 128:
        s = tl.load(sp + (n // 128) * K_BLOCKS + k0 // 128, mask=nm, other=0.0)[:, None]
    else:
        s = tl.load(sp + (n // 128)[:, None] * K_BLOCKS + (kk // 128)[None, :], mask=nm[:, None] & km[None, :],
                    other=0.0)
    return to_dot(w.to(tl.float8e4nv, bitcast=True).to(tl.float32) * s, DOT, EMULATE)
