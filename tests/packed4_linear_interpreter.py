"""Runs the 4-bit dense linear kernels (layers/packed4_linear_triton.py) in Triton's interpreter on the
CPU. Run as a script (TRITON_INTERPRET must be set before triton is imported); test_packed4_linear.py
does that in a subprocess. For nvfp4, int4, int4-g32 and int4-asym each case checks:

  - q4_mm against the torch reference (Packed4Weight.dequantize into x.dtype, then a float64 matmul):
    fp32 1e-5, bf16 1e-2 relative; with one K split and with several (the fixed-order second pass),
    with and without a bias, M from 1 to 64;
  - the prefill path's dequantize kernel equal, bit for bit, to the reference;
  - a row's result without its batch: rows of M against the M = 1 call on each, within the dtype's
    tolerance (the launches differ in shape and the interpreter's tl.dot is numpy's matmul:
    tests/interpreter.py), bit-equal where the launch is the very same (M = 1 twice).
Shapes are ragged: N 200 (not a multiple of the 32-row tile), K 328 (every format's last group
ragged, the last K tile partly past K). NVFP4 weights are two parts with their own tensor scales
(a fused weight's q and k): each row multiplies its own.
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402

from moetier.layers import packed4_linear_triton as kernels  # noqa: E402
from moetier.layers.fp8_linear_triton import splits  # noqa: E402
from moetier.layers.packed4_linear import Packed4Weight  # noqa: E402
from moetier.quant import int4, nvfp4  # noqa: E402

TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}
QUANTS = ("nvfp4", "int4", "int4-g32", "int4-asym")


def weight(quant: str, n: int, k: int, g: torch.Generator) -> Packed4Weight:
    w = torch.randn(n, k, generator=g) * 0.05
    w[:, : min(40, k)] *= 8.0  # groups of different magnitude: every scale matters
    out = Packed4Weight(n, k, "cpu", quant)
    if quant == "nvfp4":  # two parts, quantized apart: their own tensor scales
        cut = n // 3
        for a, b, scale in ((0, cut, 1.0), (cut, n, 5.0)):
            out.rows(a, b).copy_(*nvfp4.quantize(w[a:b] * scale), "w")
        assert out.scale_2[0] != out.scale_2[-1]
    else:  # asymmetric: shifted weights, zero codes of their own per group
        asym = out.zero is not None
        codes, scale, *zero = int4.quantize(w + (0.02 if asym else 0.0), out.group, asym)
        out.rows().copy_(codes, scale, None, "w", *zero)
    return out


def oracle(x: torch.Tensor, w: Packed4Weight, bias: torch.Tensor | None) -> torch.Tensor:
    y = x.double() @ w.dequantize(x.dtype).double().T
    return y if bias is None else y + bias.double()


def mm(x, w, b, programs):
    return kernels.q4_mm(x, w.codes, w.scale, w.scale_2, w.quant, b, w.zero, programs=programs)


def case(quant: str, m: int, n: int, k: int, dtype: torch.dtype, programs: int, seed: int, bias: bool = False) -> str:
    g = torch.Generator().manual_seed(seed)
    w = weight(quant, n, k, g)
    x = torch.randn(m, k, generator=g).to(dtype)
    b = (torch.randn(n, generator=g) * 0.1).to(dtype) if bias else None
    split, _ = splits(n, k, programs=programs)
    y = mm(x, w, b, programs)
    ref = oracle(x, w, b)
    err = ((y.double() - ref).norm() / ref.norm()).item()
    assert y.dtype == dtype and y.shape == (m, n) and err <= TOL[dtype], (quant, m, n, k, dtype, split, err)
    rows = sorted({0, m // 2, m - 1})
    alone = torch.stack([mm(x[i:i + 1], w, b, programs)[0] for i in rows])
    head = f"q4_mm {quant} m={m} n={n} k={k} {str(dtype)[6:]} split={split} bias={bias} err={err:.2e}"
    if m == 1:  # the very same launch on the same bytes: bit-equal under any BLAS
        assert torch.equal(alone, y), (quant, n, k, dtype)
        return head + " rows_alone=exact"
    rows_err = ((alone.double() - y[rows].double()).norm() / y[rows].double().norm()).item()
    assert rows_err <= TOL[dtype], (quant, m, n, k, dtype, split, rows_err)
    return head + f" rows_alone_err={rows_err:.2e}"


def dequantize_case(quant: str, n: int, k: int, dtype: torch.dtype) -> str:
    w = weight(quant, n, k, torch.Generator().manual_seed(n + k))
    got = kernels.dequantize(w.codes, w.scale, w.scale_2, quant, dtype, w.zero)
    assert torch.equal(got, w.dequantize(dtype)), (quant, n, k, dtype)
    return f"dequantize {quant} n={n} k={k} {str(dtype)[6:]} exact"


def refuses() -> str:
    w = weight("nvfp4", 64, 64, torch.Generator().manual_seed(0))
    i = weight("int4", 64, 64, torch.Generator().manual_seed(0))
    for bad in (lambda: kernels.q4_mm(torch.zeros(1, 64), w.codes, w.scale[:, :1], w.scale_2, "nvfp4"),
                lambda: kernels.q4_mm(torch.zeros(1, 64), w.codes, w.scale, None, "nvfp4"),
                lambda: kernels.q4_mm(torch.zeros(1, 64), i.codes, i.scale, w.scale_2, "int4"),
                lambda: kernels.q4_mm(torch.zeros(1, 64), i.codes, i.scale, None, "int4-asym"),  # no zero codes
                lambda: kernels.q4_mm(torch.zeros(1, 32), w.codes, w.scale, w.scale_2, "nvfp4")):
        try:
            bad()
        except ValueError:
            continue
        raise AssertionError("accepted a bad 4-bit weight or operand")
    return "q4_mm refuses bad input"


def main() -> None:
    lines = []
    for quant in QUANTS:
        for dtype in (torch.bfloat16, torch.float32):
            for m, programs in ((1, 1), (17, 1024), (64, 1024)):
                lines.append(case(quant, m, 200, 328, dtype, programs, seed=m))
            lines.append(case(quant, 5, 72, 136, dtype, 1, seed=6, bias=True))
            lines.append(case(quant, 5, 72, 136, dtype, 1024, seed=5, bias=True))
            lines.append(dequantize_case(quant, 200, 328, dtype))
    lines.append(refuses())
    print("\n".join(lines))


if __name__ == "__main__":
    main()
