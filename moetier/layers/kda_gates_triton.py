"""KDA's decode gates in one launch (CUDA; Triton's interpreter in the tests): what a decode step of
layers/kda.KdaAttention does between its fused input projection and the recurrence, in place of
three launches (the low-rank up-projections' batched GEMM, layers/fused.kda_forget_gate and the
sigmoid of beta). A decode step's KDA layer is some ten launches of 1-5 us beside its two GEMMs
(docs/models.md), so each launch saved is time saved.

    kda_gates(proj [N, 3 inner + 2 d + heads], up [2, inner, d], dt_bias [inner], A_log [heads],
              lower_bound, inner) -> (g [N, heads, inner / heads] float32, gate [N, inner], beta [N, heads])

proj is the input projection's output, its columns [q k v | f_a | g_a | b] (kda.KdaAttention.in_proj's
rows); up holds [f_b, g_b]. Per token: low = f_b(f_a) and gate = g_b(g_a) as the batched GEMM makes
them (bf16 products exact, sums in float32, rounded once to x's dtype: the same terms, summed in
another order), g = kda.log_decay(low) in the order of fused._kda_forget_gate (libdevice's exp and
log, as torch's kernels), beta = sigmoid(b) in float32 rounded to x's dtype, as torch.sigmoid rounds.

Grid (token blocks of BLOCK_T, column blocks of BLOCK_C): each program multiplies its tokens' f_a and
g_a [BLOCK_T, d] by the [BLOCK_C, d] rows of f_b and g_b on the tensor cores, so up's 4 MiB (GLM-5.3-
Flash) is read once per token block; column block 0 also writes beta. Decode steps only (up to
kda.GATES_TOKENS tokens); a prefill step keeps the three launches, which read up once for all tokens.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from moetier.layers.fused import _exp, _log  # libdevice's exp and log, as torch's kernels (numpy's, interpreted)
from moetier.quant.dot import dot_type, mma, to_dot

BLOCK_T, BLOCK_C = 16, 128  # tokens (tl.dot's least M), columns of inner a program


@triton.jit
def _kda_gates(proj_ptr, up_ptr, bias_ptr, alog_ptr, g_ptr, gate_ptr, beta_ptr, N, stride_p, lower_bound,
               INNER: tl.constexpr, D: tl.constexpr, HEADS: tl.constexpr, HEADS_B: tl.constexpr,
               BOUNDED: tl.constexpr, DOT: tl.constexpr, PRECISION: tl.constexpr, EMULATE: tl.constexpr,
               INTERPRET: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr):
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    tm = t < N
    rows = proj_ptr + t.to(tl.int64)[:, None] * stride_p
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    cm = c < INNER
    k = tl.arange(0, D)
    f_a = tl.load(rows + 3 * INNER + k[None, :], mask=tm[:, None], other=0.0)  # [T, d]
    g_a = tl.load(rows + 3 * INNER + D + k[None, :], mask=tm[:, None], other=0.0)
    f_b = tl.load(up_ptr + c[:, None] * D + k[None, :], mask=cm[:, None], other=0.0)  # [C, d]
    g_b = tl.load(up_ptr + INNER * D + c[:, None] * D + k[None, :], mask=cm[:, None], other=0.0)
    dt = gate_ptr.dtype.element_ty
    low = to_dot(mma(f_a, f_b, tl.zeros([BLOCK_T, BLOCK_C], tl.float32), DOT, PRECISION, EMULATE), dt, EMULATE)
    gate = to_dot(mma(g_a, g_b, tl.zeros([BLOCK_T, BLOCK_C], tl.float32), DOT, PRECISION, EMULATE), dt, EMULATE)
    out = t.to(tl.int64)[:, None] * INNER + c[None, :]
    ok = tm[:, None] & cm[None, :]
    tl.store(gate_ptr + out, gate, mask=ok)
    # the forget gate: kda.log_decay, as fused._kda_forget_gate computes it
    g = low.to(tl.float32) + tl.load(bias_ptr + c, mask=cm, other=0.0)[None, :]
    rate = _exp(tl.load(alog_ptr + c // (INNER // HEADS), mask=cm, other=0.0), INTERPRET)[None, :]
    if BOUNDED:
        g = lower_bound * (1.0 / (1.0 + _exp(-(rate * g), INTERPRET)))
    else:
        g = -rate * tl.where(g > 20.0, g, _log(1.0 + _exp(g, INTERPRET), INTERPRET))
    tl.store(g_ptr + out, g, mask=ok)
    if tl.program_id(1) == 0:
        h = tl.arange(0, HEADS_B)
        hm = tm[:, None] & (h < HEADS)[None, :]
        b = tl.load(rows + 3 * INNER + 2 * D + h[None, :], mask=hm, other=0.0).to(tl.float32)
        beta = to_dot(1.0 / (1.0 + _exp(-b, INTERPRET)), dt, EMULATE)
        tl.store(beta_ptr + t.to(tl.int64)[:, None] * HEADS + h[None, :], beta, mask=hm)


def kda_gates(proj: torch.Tensor, up: torch.Tensor, dt_bias: torch.Tensor, a_log: torch.Tensor,
              lower_bound: float | None, inner: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """-> (g [N, heads, inner / heads] float32, gate [N, inner], beta [N, heads]) in proj's dtype (module
    doc). proj [N, 3 inner + 2 d + heads] with unit column stride; up [2, inner, d] contiguous, d a
    power of two of at least 16."""
    n = proj.shape[0]
    heads = a_log.shape[0]
    d = up.shape[2]
    if (proj.shape[1] != 3 * inner + 2 * d + heads or proj.stride(1) != 1 or not up.is_contiguous()
            or up.shape[:2] != (2, inner) or d < 16 or d & (d - 1) or inner % heads):
        raise ValueError(f"kda_gates: projection {tuple(proj.shape)} and up-projections {tuple(up.shape)} do not "
                         f"fit {heads} heads of an inner width {inner}")
    g = torch.empty(n, inner, dtype=torch.float32, device=proj.device)
    gate = torch.empty(n, inner, dtype=proj.dtype, device=proj.device)
    beta = torch.empty(n, heads, dtype=proj.dtype, device=proj.device)
    if n:
        dot, precision, emulate = dot_type(proj.dtype)
        _kda_gates[(triton.cdiv(n, BLOCK_T), triton.cdiv(inner, BLOCK_C))](
            proj, up, dt_bias.contiguous(), a_log.contiguous(), g, gate, beta, n, proj.stride(0),
            0.0 if lower_bound is None else lower_bound, INNER=inner, D=d, HEADS=heads,
            HEADS_B=triton.next_power_of_2(heads), BOUNDED=lower_bound is not None, DOT=dot, PRECISION=precision,
            EMULATE=emulate, INTERPRET=os.environ.get("TRITON_INTERPRET") == "1", BLOCK_T=BLOCK_T, BLOCK_C=BLOCK_C)
    return g.view(n, heads, inner // heads), gate, beta
