"""The clamped SwiGLU (GLM-5.3-Flash's swiglu_limit) inside the Triton expert kernels: the gate clamped
above at L, the up projection to [-L, L], on the fp32 accumulators after the last dot and before silu,
in moetier/activation.silu_mul's order (gate first, then up, the same min / max), so every kernel that
calls it computes the same clamp and backends sharing a kernel stay bit-exact.

    g, u = swiglu_clamp(acc_g, acc_u, HAS_LIMIT, LIMIT)   # in a kernel; both constexpr
    kernel[grid](..., **limit_args(layout.swiglu_limit))  # at the launch: HAS_LIMIT / LIMIT

HAS_LIMIT False (limit None, every family but glm5_next): the branch is resolved at compile time, so the
kernel is exactly the one compiled without a limit (no instruction added). NaN propagates as in torch's
clamp (PropagateNan.ALL): a NaN accumulator stays NaN.
"""

from __future__ import annotations

import triton
import triton.language as tl

from moetier.activation import checked_limit


@triton.jit
def swiglu_clamp(acc_g, acc_u, HAS_LIMIT: tl.constexpr, LIMIT: tl.constexpr):
    # acc_g, acc_u: fp32 [.., N] gate and up accumulators -> the same, clamped when HAS_LIMIT
    if HAS_LIMIT:
        acc_g = tl.minimum(acc_g, LIMIT, propagate_nan=tl.PropagateNan.ALL)
        acc_u = tl.minimum(tl.maximum(acc_u, -LIMIT, propagate_nan=tl.PropagateNan.ALL), LIMIT,
                           propagate_nan=tl.PropagateNan.ALL)
    return acc_g, acc_u


def limit_args(limit: float | None) -> dict:
    """The constexprs of swiglu_clamp for a RowLayout.swiglu_limit: none for None, else HAS_LIMIT and
    LIMIT (activation.checked_limit)."""
    if limit is None:
        return dict(HAS_LIMIT=False, LIMIT=0.0)
    return dict(HAS_LIMIT=True, LIMIT=checked_limit(limit))
