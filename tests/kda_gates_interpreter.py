"""Runs KDA's decode-gates kernel (layers/kda_gates_triton.py) in Triton's interpreter on the CPU
against the torch ops it replaces (kda.KdaAttention.projections' up-projections, kda.log_decay,
torch.sigmoid). Run as a script (TRITON_INTERPRET must be set before triton is imported);
test_kda.py does that in a subprocess. float32: g, gate and beta to float32 rounding; bfloat16: the
up-projections' sums run in another order than the batched GEMM's, so gate within one bf16 rounding
and g within what that rounding moves; beta (no sum) equal. Bounded and softplus forget gates, a
token count that is not a block's, heads not a power of two.
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402

from moetier.layers.kda import log_decay  # noqa: E402
from moetier.layers.kda_gates_triton import kda_gates  # noqa: E402

TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def case(n: int, heads: int, d: int, lower_bound: float | None, dtype: torch.dtype, seed: int) -> str:
    g_ = torch.Generator().manual_seed(seed)
    inner = heads * d
    proj = torch.randn(n, 3 * inner + 2 * d + heads + 7, generator=g_).to(dtype)[:, : 3 * inner + 2 * d + heads]
    up = (torch.randn(2, inner, d, generator=g_) * d ** -0.5).to(dtype)
    dt_bias = torch.randn(inner, generator=g_)
    a_log = torch.randn(heads, generator=g_) * 0.5
    low = proj[:, 3 * inner: 3 * inner + 2 * d].reshape(n, 2, d).transpose(0, 1)
    want_up = torch.bmm(low, up.transpose(1, 2))
    want_g = log_decay(want_up[0], dt_bias, a_log, lower_bound)
    want_beta = torch.sigmoid(proj[:, 3 * inner + 2 * d:])
    g, gate, beta = kda_gates(proj, up, dt_bias, a_log, lower_bound, inner)
    assert g.shape == want_g.shape and g.dtype == torch.float32 and gate.dtype == beta.dtype == dtype
    errs = rel(g, want_g), rel(gate, want_up[1]), rel(beta, want_beta)
    assert max(errs) <= TOL[dtype], (n, heads, d, lower_bound, dtype, errs)
    if dtype == torch.bfloat16:
        assert torch.equal(beta, want_beta), (beta, want_beta)
    return (f"kda_gates n={n} heads={heads} d={d} bounded={lower_bound is not None} {str(dtype)[6:]} "
            f"errs={max(errs):.1e}")


def main() -> None:
    lines = [case(3, 4, 16, -5.0, torch.float32, 0), case(19, 3, 32, None, torch.float32, 1),
             case(5, 4, 16, -5.0, torch.bfloat16, 2), case(17, 6, 16, None, torch.bfloat16, 3)]
    print("\n".join(lines))


if __name__ == "__main__":
    main()
