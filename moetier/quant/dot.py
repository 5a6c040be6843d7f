"""The dot of a weight-only GEMM, for every format: what type the products run in, and tl.dot with
the operands rounded to it. The kernels that call these (experts/kernels/grouped_gemm.py, layers/
fp8_linear_triton.py) dequantize a weight tile first (quant/<format>_triton.py), then mma it against
the activations; bf16 rows skip the dequantize and share the same dot.

    dot_type(dtype) -> (DOT, PRECISION, EMULATE): the constexprs the kernels take for a compute dtype
    mma(a, b, acc, DOT, PRECISION, EMULATE): acc [M, N] += a [M, K] @ b [N, K]^T in fp32
    mma_kn(a, b, acc, DOT, PRECISION, EMULATE): acc [M, N] += a [M, K] @ b [K, N], b loaded K-major
    to_dot(v, DOT, EMULATE): float32 v rounded to DOT, to nearest even under the interpreter too
    operand(v, DOT, EMULATE): v as the dot takes it (rounded to DOT; fp32 again under the interpreter)

Under Triton's interpreter (TRITON_INTERPRET=1, the CPU tests) 16-bit products are emulated: the
interpreter multiplies the raw bits of bf16, so the operands are rounded to DOT and widened to fp32.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl


def dot_type(dtype: torch.dtype) -> tuple[tl.dtype, str, bool]:
    # 16-bit weights: tensor cores on 16-bit operands (x and h rounded to it, as torch's F.linear does);
    # anything else: fp32 operands with IEEE products (no tf32).
    if dtype not in (torch.bfloat16, torch.float16):
        return tl.float32, "ieee", False
    dot = tl.bfloat16 if dtype == torch.bfloat16 else tl.float16
    if os.environ.get("TRITON_INTERPRET") == "1":
        return dot, "ieee", True
    return dot, "tf32", False  # the precision of 16-bit operands is their own; "tf32" is the default


@triton.jit
def to_dot(v, DOT: tl.constexpr, EMULATE: tl.constexpr):
    # float32 v -> DOT; the interpreter truncates fp32 -> bf16, so round to nearest even as the GPU does
    if EMULATE:
        if DOT == tl.bfloat16:
            u = v.to(tl.uint32, bitcast=True)
            v = ((u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000).to(tl.float32, bitcast=True)
    return v.to(DOT)


@triton.jit
def operand(v, DOT: tl.constexpr, EMULATE: tl.constexpr):
    # v rounded to DOT as a dot operand (to nearest even, also under the interpreter: a float32 value
    # rounded here and one stored in DOT before agree); under the interpreter, which multiplies the raw
    # bits of bf16, widened back to fp32 after the rounding
    if v.dtype == tl.float32:
        v = to_dot(v, DOT, EMULATE)
    v = v.to(DOT)
    if EMULATE:
        v = v.to(tl.float32)
    return v


@triton.jit
def mma(a, b, acc, DOT: tl.constexpr, PRECISION: tl.constexpr, EMULATE: tl.constexpr):
    # acc [M, N] += a [M, K] @ b[N, K]^T with both operands rounded to DOT
    return tl.dot(operand(a, DOT, EMULATE), tl.trans(operand(b, DOT, EMULATE)), acc, input_precision=PRECISION)


@triton.jit
def mma_kn(a, b, acc, DOT: tl.constexpr, PRECISION: tl.constexpr, EMULATE: tl.constexpr):
    # acc [M, N] += a [M, K] @ b [K, N], as mma with b loaded already K-major (no tl.trans in the kernel)
    return tl.dot(operand(a, DOT, EMULATE), operand(b, DOT, EMULATE), acc, input_precision=PRECISION)
