"""Runs the FP8 dense linear kernels (layers/fp8_linear_triton.py) in Triton's interpreter on the CPU.
Run as a script (TRITON_INTERPRET must be set before triton is imported); test_fp8_linear.py does
that in a subprocess. Each case checks:

  - fp8_mm against the torch reference (fp8.dequantize into x.dtype, then F.linear in float64):
    fp32 1e-5, bf16 1e-2 relative; with one K split and with several (the fixed-order second pass);
  - the prefill path's dequantize kernel equal, bit for bit, to fp8.dequantize;
  - a row's result without its batch: row i of M rows equal to the M = 1 call on row i. Claimed
    bitwise here only where the interpreter's BLAS keeps it (see tests/interpreter.py): the case
    prints whether it held, and tests/test_fp8_linear.py's GPU test holds the compiled kernel to it.
Shapes are ragged on purpose: N and K not multiples of 128, so tiles cross scale blocks' edges.
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402

from moetier.layers import fp8_linear_triton as kernels  # noqa: E402
from moetier.quant import fp8_block as fp8  # noqa: E402

TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


def weight(n: int, k: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    w = torch.randn(n, k, generator=g) * 0.05
    w[:, : min(64, k)] *= 8.0  # blocks of different magnitude: every scale matters
    return fp8.quantize(w)


def oracle(x, q, s, bias):
    y = x.double() @ fp8.dequantize(q, s, x.dtype).double().T
    return y if bias is None else y + bias.double()


def case(m: int, n: int, k: int, dtype: torch.dtype, programs: int, seed: int, bias: bool = False) -> str:
    g = torch.Generator().manual_seed(seed)
    q, s = weight(n, k, g)
    x = torch.randn(m, k, generator=g).to(dtype)
    b = (torch.randn(n, generator=g) * 0.1).to(dtype) if bias else None
    split, _ = kernels.splits(n, k, programs=programs)
    y = kernels.fp8_mm(x, q, s, b, programs=programs)
    ref = oracle(x, q, s, b)
    err = ((y.double() - ref).norm() / ref.norm()).item()
    assert y.dtype == dtype and y.shape == (m, n) and err <= TOL[dtype], (m, n, k, dtype, split, err)
    rows = all(torch.equal(kernels.fp8_mm(x[i:i + 1], q, s, b, programs=programs)[0], y[i]) for i in range(m))
    return f"fp8_mm m={m} n={n} k={k} {str(dtype)[6:]} split={split} err={err:.2e} rows_alone_equal={rows}"


def dequantize_case(n: int, k: int, dtype: torch.dtype) -> str:
    q, s = weight(n, k, torch.Generator().manual_seed(n + k))
    assert torch.equal(kernels.dequantize(q, s, dtype), fp8.dequantize(q, s, dtype)), (n, k, dtype)
    return f"dequantize n={n} k={k} {str(dtype)[6:]} exact"


def refuses() -> str:
    q, s = weight(64, 64, torch.Generator().manual_seed(0))
    for bad in (lambda: kernels.fp8_mm(torch.zeros(1, 64), q, s, block_k=96),
                lambda: kernels.fp8_mm(torch.zeros(1, 64), q, s[:, :0]),
                lambda: kernels.fp8_mm(torch.zeros(1, 32), q, s)):
        try:
            bad()
        except ValueError:
            continue
        raise AssertionError("accepted a bad FP8 weight or operand")
    return "fp8_mm refuses bad input"


def main() -> None:
    lines = []
    for dtype in (torch.bfloat16, torch.float32):
        # N 200 = 128 + 72, K 328 = 2 x 128 + 72: ragged scale blocks on both axes
        for m, programs in ((1, 1), (3, 1024), (17, 1024)):
            lines.append(case(m, 200, 328, dtype, programs, seed=m))
        lines.append(case(5, 72, 136, dtype, 1024, seed=5, bias=True))
        lines.append(case(5, 72, 136, dtype, 1, seed=6, bias=True))
        lines.append(dequantize_case(200, 328, dtype))
    lines.append(refuses())
    print("\n".join(lines))


if __name__ == "__main__":
    main()
