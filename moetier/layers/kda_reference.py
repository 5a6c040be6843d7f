"""Kimi Delta Attention's recurrence (KDA, the gated delta rule with a per-channel forget gate), in
plain torch: the CPU path and the oracle for the kernels. All in float32, whatever the model dtype.

One head, with state S [dk, dv] (fp32), per token t (q, k l2-normalised; q scaled by dk^-1/2):

    S   = S * exp(g_t)[:, None]              g_t [dk] <= 0: the per-channel forget gate, in log space
    S   = S + k_t (beta_t (v_t - k_t^T S))   the delta rule: write v_t where k_t points, at rate beta_t
    o_t = q_t^T S                            [dv]

kda_step runs that for one token per sequence (decode); kda_chunked runs it over a sequence in
chunks of CHUNK tokens (prefill), exactly in math and with the chunk's work as matrix products:
inside a chunk, with G = the cumulative sum of g over the chunk's tokens (per channel),

    L[i, j] = beta_i sum_d k_i[d] k_j[d] exp(G_i[d] - G_j[d])      (j < i; 0 elsewhere)
    T       = (I + L)^-1                                           (unit lower triangular)
    u       = T (beta v)            w = T (beta k exp(G))          (the WY form of the chunk's writes)
    v'      = u - w S                                              (what the chunk writes, given S)
    o       = (q exp(G)) S + (M o (q k^T with exp(G_i - G_j))) v'   M: j <= i
    S'      = S exp(G_last) + (k exp(G_last - G))^T v'

which is the algorithm of flash-linear-attention's chunk_kda and of transformers' reference
(same chunking from the start of each call, so a whole prompt agrees with them to rounding); the
triangular inverse is a triangular solve here instead of their row-by-row substitution. A prompt
split over several steps computes the same recurrence from a carried-in state, chunked from each
step's first token: equal up to float reassociation.

The causal depthwise convolution in front of q, k, v keeps its last width - 1 inputs as its state.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

CHUNK = 64
L2_EPS = 1e-6


def l2_normalize(x: torch.Tensor) -> torch.Tensor:
    # x / sqrt(sum x^2 + eps), as flash-linear-attention's l2norm (eps added, not a max)
    return x / torch.sqrt((x * x).sum(dim=-1, keepdim=True) + L2_EPS)


def causal_conv(x: torch.Tensor, state: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [T, C] new inputs; state: [C, W - 1] the previous inputs (zeros for a fresh sequence);
    weight: [C, 1, W] float32 depthwise. -> (silu(conv) [T, C] in x.dtype, new state [C, W - 1])."""
    t, w = x.shape[0], weight.shape[-1]
    full = torch.cat([state.to(x.dtype), x.t()], dim=-1)  # [C, W - 1 + T]
    out = F.conv1d(full.to(weight.dtype)[None], weight, groups=weight.shape[0])[0]  # [C, T]
    return F.silu(out).t().to(x.dtype), full[:, full.shape[1] - (w - 1):]


def causal_conv_step(x: torch.Tensor, state: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per sequence. x: [B, C]; state: [B, C, W - 1]; weight: [C, 1, W] float32
    -> (silu(conv) [B, C] in x.dtype, new state [B, C, W - 1])."""
    full = torch.cat([state.to(x.dtype), x[:, :, None]], dim=-1)  # [B, C, W]
    out = (full.to(weight.dtype) * weight[:, 0]).sum(-1)
    return F.silu(out).to(x.dtype), full[:, :, 1:]


def _prepare(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor):
    # -> float32 q (normalised and scaled), k (normalised), v, g, beta
    q, k = l2_normalize(q.float()), l2_normalize(k.float())
    return q * q.shape[-1] ** -0.5, k, v.float(), g.float(), beta.float()


def kda_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
             state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of B sequences. q, k, g: [B, H, dk]; v: [B, H, dv]; beta: [B, H]; state: [B, H, dk, dv]
    float32 -> (o [B, H, dv] in q.dtype, new state [B, H, dk, dv] float32)."""
    dtype = q.dtype
    q, k, v, g, beta = _prepare(q, k, v, g, beta)
    s = state.float() * g.exp()[..., None]
    delta = (v - (s * k[..., None]).sum(dim=-2)) * beta[..., None]  # [B, H, dv]
    s = s + k[..., None] * delta[..., None, :]
    return (s * q[..., None]).sum(dim=-2).to(dtype), s


def kda_recurrent(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                  state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The token-by-token recurrence over one sequence (the oracle of kda_chunked). q, k, g: [T, H, dk];
    v: [T, H, dv]; beta: [T, H]; state: [H, dk, dv] -> (o [T, H, dv], final state)."""
    out = []
    for t in range(q.shape[0]):
        o, state = kda_step(q[t:t + 1], k[t:t + 1], v[t:t + 1], g[t:t + 1], beta[t:t + 1], state[None])
        state = state[0]
        out.append(o)
    return torch.cat(out), state


def kda_chunked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                state: torch.Tensor, chunk: int = CHUNK) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's tokens. q, k, g: [T, H, dk]; v: [T, H, dv]; beta: [T, H]; state: [H, dk, dv]
    float32 (zeros for a fresh sequence) -> (o [T, H, dv] in q.dtype, final state float32)."""
    dtype, n = q.dtype, q.shape[0]
    q, k, v, g, beta = (x.transpose(0, 1) for x in _prepare(q, k, v, g, beta))  # heads first: [H, T, .]
    s = state.float()
    out = torch.empty_like(v)
    for a in range(0, n, chunk):
        b = min(a + chunk, n)
        o, s = _chunk(q[:, a:b], k[:, a:b], v[:, a:b], g[:, a:b], beta[:, a:b], s)
        out[:, a:b] = o
    return out.transpose(0, 1).to(dtype), s


def _chunk(q, k, v, g, beta, s):
    """One chunk of C tokens, heads first: q, k, g [H, C, dk]; v [H, C, dv]; beta [H, C]; s [H, dk, dv]."""
    c = q.shape[1]
    gc = g.cumsum(dim=1)  # [H, C, dk]
    lower = torch.ones(c, c, dtype=torch.bool, device=q.device).tril()  # j <= i
    strict = lower & ~torch.eye(c, dtype=torch.bool, device=q.device)
    # exp(G_i - G_j) for j <= i, 0 above: masked before exp (above the diagonal the exponent is > 0)
    diff = gc[:, :, None, :] - gc[:, None, :, :]  # [H, C(i), C(j), dk]
    decay = diff.masked_fill(~lower[None, :, :, None], float("-inf")).exp()
    kb = k * beta[..., None]
    ell = torch.einsum("hid,hjd,hijd->hij", kb, k, decay).masked_fill(~strict, 0)
    eye = torch.eye(c, dtype=q.dtype, device=q.device).expand_as(ell)
    t = torch.linalg.solve_triangular(eye + ell, eye, upper=False, unitriangular=True)
    u = t @ (v * beta[..., None])
    w = t @ (kb * gc.exp())
    v_new = u - w @ s
    qk = torch.einsum("hid,hjd,hijd->hij", q, k, decay).masked_fill(~lower, 0)
    o = (q * gc.exp()) @ s + qk @ v_new
    last = gc[:, -1:, :]  # [H, 1, dk]
    s = s * last.transpose(1, 2).exp() + (k * (last - gc).exp()).transpose(1, 2) @ v_new
    return o, s
