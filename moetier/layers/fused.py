"""Fused Triton kernels for the small per-layer operations of a decoder step on CUDA.

At decode every operation of a layer touches a few kilobytes, so its cost is the launch (about
1.5 us per kernel even in a replayed CUDA graph), not the bytes. In plain torch one RMSNorm is
eight elementwise kernels, the q/k head norms, rotary and KV write are some thirty more, and the
router another five; here each group is one launch:

    rms_norm        (x [+ residual]) -> RMSNorm, and the sum for the residual stream
    qk_norm_rope_kv qkv -> q normed and roped; k normed, roped and written to the cache; v written
    route_topk      router logits -> softmax, top-k, optional renormalisation
    gated_rms_norm  KDA's output: per head RMSNorm, weight and sigmoid gate
    kda_forget_gate KDA's log decay from its low-rank projection: bias, rate, bounded sigmoid or softplus
    silu_mul        the dense and shared MLPs' SwiGLU, clamped where the model says (swiglu_limit)

The oracles are the plain-torch code these replace, which stays the CPU path: norm.rms_norm
after torch's add, gqa_attention.qk_norm_rope_kv_reference, router.route_reference,
kda.gated_rms_norm, kda.log_decay and activation.silu_mul. Each kernel rounds to the model dtype
wherever the reference does (every torch elementwise op rounds its result), so outputs differ from
the reference only by the float32 reduction order and the last bit of exp (and, in the router, by a
tie between equal logits). Outputs are allocated at fixed shapes and no value is read
back to the host, so all are safe inside a captured CUDA graph.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice


@triton.jit
def _rms_norm(x_ptr, r_ptr, w_ptr, y_ptr, s_ptr, H, stride_x, stride_r, stride_y, stride_s, eps,
              HAS_RES: tl.constexpr, BLOCK_H: tl.constexpr):
    # One program per row. x, r, y, s: [T, H] (unit stride along H); w: [H].
    row = tl.program_id(0).to(tl.int64)
    h = tl.arange(0, BLOCK_H)
    ok = h < H
    x = tl.load(x_ptr + row * stride_x + h, mask=ok, other=0.0)
    if HAS_RES:
        # Round the sum to the dtype as torch's `x + r` does; the norm reads the rounded sum.
        x = (x.to(tl.float32) + tl.load(r_ptr + row * stride_r + h, mask=ok, other=0.0).to(tl.float32))
        x = x.to(s_ptr.dtype.element_ty)
        tl.store(s_ptr + row * stride_s + h, x, mask=ok)
    xf = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(xf * xf, axis=0) / H + eps)
    y = (xf * rstd).to(y_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + h, mask=ok, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * stride_y + h, (w * y).to(y_ptr.dtype.element_ty), mask=ok)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """x, residual: [T, H]; weight: [H], all one dtype -> (rms_norm(s), s) with s = x + residual
    (s is x itself without a residual)."""
    assert x.dim() == 2 and x.stride(1) == 1 and weight.dtype == x.dtype and weight.is_contiguous()
    t, h = x.shape
    y = torch.empty_like(x, memory_format=torch.contiguous_format)
    s = x if residual is None else torch.empty_like(y)
    r = x if residual is None else residual
    assert r.shape == x.shape and r.stride(1) == 1 and r.dtype == x.dtype
    block = triton.next_power_of_2(h)
    _rms_norm[(t,)](x, r, weight, y, s, h, x.stride(0), r.stride(0), y.stride(0), s.stride(0), eps,
                    HAS_RES=residual is not None, BLOCK_H=block,
                    num_warps=max(1, min(16, block // 256)))
    return y, s


@triton.jit
def _qk_norm_rope_kv(qkv_ptr, qn_ptr, kn_ptr, cos_ptr, sin_ptr, q_ptr, kc_ptr, vc_ptr, slot_ptr,
                     stride_qkv, stride_cos, stride_sin, stride_qt, stride_qh,
                     stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh, eps,
                     HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, PAGE_SIZE: tl.constexpr,
                     BLOCK_D: tl.constexpr):
    # Program (t, head): head < HQ is query head `head`, then HKV key heads, then HKV value heads,
    # the order of the qkv row. Each head is D contiguous values of the row.
    t = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    HALF: tl.constexpr = D // 2
    d = tl.arange(0, BLOCK_D)
    ok = d < D
    src = qkv_ptr + t * stride_qkv + head * D
    slot = tl.load(slot_ptr + t)
    page, offset = slot // PAGE_SIZE, slot % PAGE_SIZE
    if head < HQ + HKV:
        # Rotate-half: value d pairs with d + HALF (mod D), taken with a minus sign for d < HALF.
        # The partner is normed on its own load so no lane exchange is needed.
        partner = (d + HALF) % D
        x = tl.load(src + d, mask=ok, other=0.0).to(tl.float32)
        xp = tl.load(src + partner, mask=ok, other=0.0).to(tl.float32)
        if head < HQ:
            w = tl.load(qn_ptr + d, mask=ok, other=0.0).to(tl.float32)
            wp = tl.load(qn_ptr + partner, mask=ok, other=0.0).to(tl.float32)
        else:
            w = tl.load(kn_ptr + d, mask=ok, other=0.0).to(tl.float32)
            wp = tl.load(kn_ptr + partner, mask=ok, other=0.0).to(tl.float32)
        dt = q_ptr.dtype.element_ty
        rstd = tl.rsqrt(tl.sum(x * x, axis=0) / D + eps)
        # Each product is rounded to the dtype as its torch op would be.
        y = (w * (x * rstd).to(dt).to(tl.float32)).to(dt).to(tl.float32)
        yp = (wp * (xp * rstd).to(dt).to(tl.float32)).to(dt).to(tl.float32)
        rot = tl.where(d < HALF, -yp, yp)
        c = tl.load(cos_ptr + t * stride_cos + d, mask=ok, other=0.0).to(tl.float32)
        s = tl.load(sin_ptr + t * stride_sin + d, mask=ok, other=0.0).to(tl.float32)
        out = ((y * c).to(dt).to(tl.float32) + (rot * s).to(dt).to(tl.float32)).to(dt)
        if head < HQ:
            tl.store(q_ptr + t * stride_qt + head * stride_qh + d, out, mask=ok)
        else:
            kh = head - HQ
            tl.store(kc_ptr + page * stride_kp + offset * stride_ks + kh * stride_kh + d, out, mask=ok)
    else:
        vh = head - HQ - HKV
        v = tl.load(src + d, mask=ok, other=0.0)
        tl.store(vc_ptr + page * stride_vp + offset * stride_vs + vh * stride_vh + d, v, mask=ok)


def qk_norm_rope_kv(qkv: torch.Tensor, q_norm: torch.Tensor, k_norm: torch.Tensor, cos: torch.Tensor,
                    sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    slot_mapping: torch.Tensor, num_heads: int, num_kv_heads: int, eps: float
                    ) -> torch.Tensor:
    """qkv: [T, (Hq + 2 Hkv) * D] rows [q heads | k heads | v heads]; q_norm, k_norm: [D];
    cos, sin: [T, D] (rope_cos_sin); k_cache, v_cache: [P, page_size, Hkv, D] of one layer;
    slot_mapping: [T] int64 flat slots (page * page_size + offset).
    -> q [T, Hq, D], normed and roped; writes k (normed, roped) and v at the slots."""
    t = qkv.shape[0]
    _, page_size, hkv, d = k_cache.shape
    assert hkv == num_kv_heads and d % 2 == 0 and qkv.shape[1] == (num_heads + 2 * hkv) * d
    assert qkv.stride(1) == 1 and cos.stride(1) == 1 and sin.stride(1) == 1
    assert k_cache.stride(3) == 1 and v_cache.stride(3) == 1 and slot_mapping.dtype == torch.int64
    assert q_norm.is_contiguous() and k_norm.is_contiguous() and k_cache.dtype == qkv.dtype
    q = torch.empty(t, num_heads, d, dtype=qkv.dtype, device=qkv.device)
    block = triton.next_power_of_2(d)
    _qk_norm_rope_kv[(t, num_heads + 2 * hkv)](
        qkv, q_norm, k_norm, cos, sin, q, k_cache, v_cache, slot_mapping,
        qkv.stride(0), cos.stride(0), sin.stride(0), q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), eps,
        HQ=num_heads, HKV=hkv, D=d, PAGE_SIZE=page_size, BLOCK_D=block,
        num_warps=max(1, min(4, block // 64)))
    return q


@triton.jit
def _route(logits_ptr, ids_ptr, w_ptr, E, stride_l, stride_i, stride_w, K: tl.constexpr,
           RENORM: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr):
    # One program per token. logits: [T, E]; ids, w: [T, K].
    row = tl.program_id(0).to(tl.int64)
    e = tl.arange(0, BLOCK_E)
    ok = e < E
    logit = tl.load(logits_ptr + row * stride_l + e, mask=ok, other=float("-inf")).to(tl.float32)
    ex = tl.where(ok, tl.exp(logit - tl.max(logit, axis=0)), 0.0)
    prob = ex / tl.sum(ex, axis=0)
    # Select on the logits, not the probabilities: softmax is monotonic, and the logits are exact
    # where two probabilities might round together. Equal logits go lowest index first.
    kk = tl.arange(0, BLOCK_K)
    ids = tl.zeros([BLOCK_K], dtype=tl.int32)
    ws = tl.zeros([BLOCK_K], dtype=tl.float32)
    free = ok
    for i in tl.static_range(K):
        best = tl.max(tl.where(free, logit, float("-inf")), axis=0)
        idx = tl.min(tl.where(free & (logit == best), e, BLOCK_E), axis=0)
        pick = e == idx
        ids = tl.where(kk == i, idx, ids)
        ws = tl.where(kk == i, tl.sum(tl.where(pick, prob, 0.0), axis=0), ws)
        free = free & ~pick
    if RENORM:
        ws = ws / tl.sum(ws, axis=0)  # lanes >= K hold 0
    kok = kk < K
    tl.store(ids_ptr + row * stride_i + kk, ids.to(tl.int64), mask=kok)
    tl.store(w_ptr + row * stride_w + kk, ws.to(w_ptr.dtype.element_ty), mask=kok)


def route_topk(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """logits: [T, E] -> ids [T, k] int64 (descending probability), weights [T, k] in logits.dtype:
    the float32 softmax probabilities of the top k, divided by their sum when renormalize."""
    t, e = logits.shape
    assert logits.stride(1) == 1 and 0 < top_k <= e
    ids = torch.empty(t, top_k, dtype=torch.int64, device=logits.device)
    weights = torch.empty(t, top_k, dtype=logits.dtype, device=logits.device)
    block = triton.next_power_of_2(e)
    _route[(t,)](logits, ids, weights, e, logits.stride(0), ids.stride(0), weights.stride(0),
                 K=top_k, RENORM=renormalize, BLOCK_E=block, BLOCK_K=triton.next_power_of_2(top_k),
                 num_warps=1 if block <= 128 else 2)
    return ids, weights


@triton.jit
def _gated_rms_norm(x_ptr, g_ptr, w_ptr, y_ptr, D, eps, BLOCK_D: tl.constexpr):
    # One program per row of D (a head). The order of layers/kda.gated_rms_norm: float32 norm, then the
    # float32 weight times it, then the sigmoid gate, one rounding at the end.
    row = tl.program_id(0).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    ok = d < D
    x = tl.load(x_ptr + row * D + d, mask=ok, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + row * D + d, mask=ok, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + d, mask=ok, other=0.0).to(tl.float32)
    xn = x * tl.rsqrt(tl.sum(x * x, axis=0) / D + eps)
    tl.store(y_ptr + row * D + d, (w * xn * tl.sigmoid(g)).to(y_ptr.dtype.element_ty), mask=ok)


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x, gate [..., D] (one shape), weight [D] -> [..., D] in x's dtype: KDA's gated output norm in one
    launch where its torch form (layers/kda.gated_rms_norm, the oracle) takes about ten."""
    assert gate.shape == x.shape and weight.shape == (x.shape[-1],)
    d = x.shape[-1]
    x2, g2 = x.reshape(-1, d).contiguous(), gate.reshape(-1, d).contiguous()
    y = torch.empty_like(x2)
    if x2.shape[0]:
        _gated_rms_norm[(x2.shape[0],)](x2, g2, weight.contiguous(), y, d, eps, BLOCK_D=triton.next_power_of_2(d))
    return y.view(x.shape)


@triton.jit
def _exp(x, INTERPRET: tl.constexpr):
    # libdevice's exp, the CUDA math library torch's own kernels call (tl.exp is the approximate
    # instruction); the interpreter has no libdevice, and numpy's exp is the exact one there.
    if INTERPRET:
        return tl.exp(x)
    else:
        return libdevice.exp(x)


@triton.jit
def _log(x, INTERPRET: tl.constexpr):
    if INTERPRET:
        return tl.log(x)
    else:
        return libdevice.log(x)


@triton.jit
def _kda_forget_gate(x_ptr, bias_ptr, alog_ptr, g_ptr, C, D, lower_bound,
                     BOUNDED: tl.constexpr, INTERPRET: tl.constexpr, BLOCK: tl.constexpr):
    # Program (n, block of C = heads * D channels): the order of kda.log_decay. Its float32 output is
    # not rounded to bf16, which would hide the last bits of approximate exp and log: hence libdevice.
    n = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = c < C
    g = tl.load(x_ptr + n * C + c, mask=ok, other=0.0).to(tl.float32) + tl.load(bias_ptr + c, mask=ok, other=0.0)
    rate = _exp(tl.load(alog_ptr + c // D, mask=ok, other=0.0), INTERPRET)
    if BOUNDED:
        out = lower_bound * (1.0 / (1.0 + _exp(-(rate * g), INTERPRET)))
    else:
        out = -rate * tl.where(g > 20.0, g, _log(1.0 + _exp(g, INTERPRET), INTERPRET))
    tl.store(g_ptr + n * C + c, out, mask=ok)


def kda_forget_gate(x: torch.Tensor, dt_bias: torch.Tensor, a_log: torch.Tensor, lower_bound: float | None
                    ) -> torch.Tensor:
    """x [N, heads * D] (f_b's output), dt_bias [heads * D] and A_log [heads] float32 -> the log decay
    [N, heads, D] float32 in one launch where the torch form takes about six."""
    n, c = x.shape
    heads = a_log.shape[0]
    assert dt_bias.shape == (c,) and c % heads == 0 and dt_bias.dtype == a_log.dtype == torch.float32
    x = x.contiguous()
    g = torch.empty(n, c, dtype=torch.float32, device=x.device)
    block = 1024
    if n:
        _kda_forget_gate[(n, triton.cdiv(c, block))](x, dt_bias.contiguous(), a_log.contiguous(), g, c, c // heads,
                                                     0.0 if lower_bound is None else lower_bound,
                                                     BOUNDED=lower_bound is not None,
                                                     INTERPRET=os.environ.get("TRITON_INTERPRET") == "1", BLOCK=block)
    return g.view(n, heads, c // heads)


@triton.jit
def _silu_mul(x_ptr, y_ptr, I, limit, LIMIT: tl.constexpr, BLOCK: tl.constexpr):
    # Program (row, block of I): y = silu(gate) * up over [gate | up], each rounded as activation.silu_mul's
    # torch ops round: clamps exact, silu in float32 rounded to the dtype, then the product.
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = c < I
    dt = y_ptr.dtype.element_ty
    gate = tl.load(x_ptr + row * 2 * I + c, mask=ok, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * 2 * I + I + c, mask=ok, other=0.0).to(tl.float32)
    if LIMIT:
        gate = tl.minimum(gate, limit)
        up = tl.minimum(tl.maximum(up, -limit), limit)
    act = (gate / (1.0 + tl.exp(-gate))).to(dt).to(tl.float32)
    tl.store(y_ptr + row * I + c, (act * up).to(dt), mask=ok)


def silu_mul(gate_up: torch.Tensor, limit: float | None = None) -> torch.Tensor:
    """gate_up [..., 2I] (gate first) -> [..., I]: activation.silu_mul (the oracle) in one launch where
    its torch form takes two, or four with the clamps."""
    i = gate_up.shape[-1] // 2
    x = gate_up.reshape(-1, 2 * i).contiguous()
    y = torch.empty(x.shape[0], i, dtype=x.dtype, device=x.device)
    block = 1024
    if x.shape[0]:
        _silu_mul[(x.shape[0], triton.cdiv(i, block))](x, y, i, 0.0 if limit is None else limit,
                                                      LIMIT=limit is not None, BLOCK=block)
    return y.view(*gate_up.shape[:-1], i)
