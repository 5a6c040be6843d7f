"""16-bit dense linears at decode sizes (layers/dense_linear_triton.py): the kernel in Triton's
interpreter against F.linear, and on CUDA where layers/quant_linear.linear takes it (up to
GEMV_MAX_M rows): within bf16 of F.linear, deterministic, a row's bits independent of its batch, the
same under graph replay; above GEMV_MAX_M rows F.linear itself."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from moetier.layers.dense_linear_triton import GEMV_MAX_M, takes
from moetier.layers.quant_linear import linear


def test_kernel_in_the_interpreter():
    pytest.importorskip("triton")
    from tests.interpreter import run_script

    out = run_script("dense_linear_interpreter.py")
    lines = [line for line in out.splitlines() if line.startswith("dense_mm m=")]
    assert len(lines) == 10, out
    assert any("split=1 " in line for line in lines) and any("split=3 " in line for line in lines), out
    assert sum("rows_alone=exact" in line for line in lines) == 2, out
    assert "dense_mm refuses bad input" in out


def test_the_cpu_and_other_dtypes_keep_f_linear():
    w = torch.randn(16, 32)
    x = torch.randn(2, 32)
    assert not takes(x, w) and not takes(x.bfloat16(), w.bfloat16())  # not CUDA
    assert torch.equal(linear(x, w), F.linear(x, w))


@pytest.mark.parametrize("n,k", [(5120, 2048), (4096, 8192), (24896, 4096), (128, 4096)])
@pytest.mark.parametrize("m", [1, 3, GEMV_MAX_M, GEMV_MAX_M + 1])
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_decode_linear_on_cuda(m, n, k):
    g = torch.Generator("cuda").manual_seed(m + n)
    w = (torch.randn(n, k, generator=g, device="cuda") * k ** -0.5).bfloat16()
    x = torch.randn(m, k, generator=g, device="cuda").bfloat16()
    y = linear(x, w)
    ref = x.double() @ w.double().T
    assert ((y.double() - ref).norm() / ref.norm()).item() < 1e-2
    if m > GEMV_MAX_M:
        assert not takes(x, w) and torch.equal(y, F.linear(x, w))
        return
    assert takes(x, w) and torch.equal(linear(x, w), y)
    assert all(torch.equal(linear(x[i:i + 1], w)[0], y[i]) for i in range(m))
    graph, static = torch.cuda.CUDAGraph(), x.clone()
    linear(static, w)  # compile outside the capture
    with torch.cuda.graph(graph):
        out = linear(static, w)
    static.copy_(x)
    graph.replay()
    assert torch.equal(out, y)
