"""Runs the 16-bit dense decode kernel (layers/dense_linear_triton.py) in Triton's interpreter on the
CPU. Run as a script (TRITON_INTERPRET must be set before triton is imported); test_dense_linear.py
does that in a subprocess. Each case checks dense_mm against F.linear in float64 (bf16 1e-2, fp16
1e-3 relative), with one K split and several (the fixed-order second pass), with and without a bias,
on a strided weight (rows of a fused weight); a row alone against the same row in a batch within the
dtype's tolerance (the interpreter's tl.dot sums in its BLAS kernel's order: tests/interpreter.py),
bit-equal for the very same launch. Shapes are ragged: N and K not multiples of the blocks.
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402

from moetier.layers import dense_linear_triton as kernels  # noqa: E402
from moetier.layers.fp8_linear_triton import splits  # noqa: E402

TOL = {torch.bfloat16: 1e-2, torch.float16: 1e-3}


def case(m: int, n: int, k: int, dtype: torch.dtype, programs: int, seed: int, bias: bool = False) -> str:
    g = torch.Generator().manual_seed(seed)
    fused = (torch.randn(n + 24, k, generator=g) * k ** -0.5).to(dtype)
    w = fused[24:]  # a row block of a fused weight: stride(0) = K, offset 24 rows
    x = torch.randn(m, k, generator=g).to(dtype)
    b = (torch.randn(n, generator=g) * 0.1).to(dtype) if bias else None
    split, _ = splits(n, k, kernels.BLOCK_N, kernels.BLOCK_K, programs)
    y = kernels.dense_mm(x, w, b, programs=programs)
    ref = x.double() @ w.double().T + (b.double() if bias else 0.0)
    err = ((y.double() - ref).norm() / ref.norm()).item()
    assert y.dtype == dtype and y.shape == (m, n) and err <= TOL[dtype], (m, n, k, dtype, split, err)
    alone = torch.stack([kernels.dense_mm(x[i:i + 1], w, b, programs=programs)[0] for i in range(m)])
    if m == 1:
        assert torch.equal(alone, y), (n, k, dtype)
        tail = "rows_alone=exact"
    else:
        rows_err = ((alone.double() - y.double()).norm() / y.double().norm()).item()
        assert rows_err <= TOL[dtype], (m, n, k, dtype, split, rows_err)
        tail = f"rows_alone_err={rows_err:.2e}"
    return f"dense_mm m={m} n={n} k={k} {str(dtype)[6:]} split={split} bias={bias} err={err:.2e} {tail}"


def refuses() -> str:
    w = torch.zeros(64, 64, dtype=torch.bfloat16)
    for bad in (lambda: kernels.dense_mm(torch.zeros(1, 32, dtype=torch.bfloat16), w),
                lambda: kernels.dense_mm(torch.zeros(1, 64, dtype=torch.float16), w),
                lambda: kernels.dense_mm(torch.zeros(1, 64, dtype=torch.bfloat16), w.T)):
        try:
            bad()
        except ValueError:
            continue
        raise AssertionError("accepted a weight that does not fit")
    return "dense_mm refuses bad input"


def main() -> None:
    lines = []
    for dtype in (torch.bfloat16, torch.float16):
        # N 72 (2 blocks of 32, the second ragged), K 600 = 2 x 256 + 88
        for m, programs in ((1, 1), (3, 1024), (8, 1024)):
            lines.append(case(m, 72, 600, dtype, programs, seed=m))
        lines.append(case(5, 40, 300, dtype, 1024, seed=5, bias=True))
        lines.append(case(5, 40, 300, dtype, 1, seed=6, bias=True))
    lines.append(refuses())
    print("\n".join(lines))


if __name__ == "__main__":
    main()
