"""mHC's Triton kernels (CUDA): the mixing weights (layers/mhc.HyperConnection.weights: the small
projection, Sinkhorn and the collapse) in two launches, and the expand in one (layers/mhc.expand's
torch form, five launches, is its oracle). Every step takes them; the torch form of the weights, its
oracle, is some 150 small ops (Sinkhorn's rounds one op each), which a prefill step paid per
hyper-connection, two a layer.

Per token n, over its streams row x = streams[n] flattened ([S*H], S = hc_mult), R = (2 + S) * S:

    _mhc_partials  grid (N, SPLIT): program (n, j) takes columns [j CHUNK, (j + 1) CHUNK) of x and
                   writes its partial sum x^2 and its R partial dot products with fn's rows (float32)
    _mhc_finish    grid (N, H / BLOCK_H): every program sums token n's SPLIT partials (the same
                   order in each, so all agree), scales by rsqrt(mean x^2 + eps) (the RMS norm commutes
                   with the projection), adds scale and base, takes the sigmoids, the softmax of
                   comb's rows and Sinkhorn in registers; program 0 stores post and comb, each
                   stores its block of collapsed[h] = sum_s pre[s] x[s, h] (float32, stored in x's dtype)

Why split: one program per token reads fn's R x S*H weights (786 KB at GLM-5.3-Flash's width) on one
SM, so a batch-1 step ran a single program per call; the split spreads the read over up to
MAX_SPLIT programs per token, and a token's partials depend on the token alone (batch invariant).
fn's rows are read once per token, so only steps of up to MAX_ROWS tokens (decode) take
_mhc_partials; a larger step (prefill) projects its rows in one float32 GEMM, x @ fn^T [N, R] and
the sums of x^2 [N], which _mhc_finish takes as a single partial (SPLIT 1). The two projections
round differently (sums in another order), as the torch form does from both. S must be a power of
two (hc_mult 4 in GLM-5.3-Flash).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

BLOCK = 128  # columns of x per loop step of _mhc_partials
BLOCK_H = 256  # hidden columns collapsed per _mhc_finish program
MAX_SPLIT = 64  # programs per token reading fn
MAX_ROWS = 64  # steps of more tokens project in one GEMM instead of _mhc_partials


def supported(streams: torch.Tensor) -> bool:
    """Whether the weights and the expand run here: CUDA, a stream count the kernels take."""
    s = streams.shape[1]
    return streams.is_cuda and s >= 1 and s & (s - 1) == 0  # the kernels' stream count is a power of two


def split_of(sh: int) -> tuple[int, int]:
    """(CHUNK columns per program, SPLIT programs per token) for a flattened row of sh columns."""
    chunk = BLOCK * max(1, triton.cdiv(sh, BLOCK * MAX_SPLIT))
    return chunk, triton.cdiv(sh, chunk)


@triton.jit
def _mhc_partials(x_ptr, fn_ptr, part_ptr, sq_ptr, SH, CHUNK, SPLIT,
                  R: tl.constexpr, R_PAD: tl.constexpr, BLOCK: tl.constexpr):
    n = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1)
    r = tl.arange(0, R_PAD)
    rm = r < R
    acc = tl.zeros([R_PAD], dtype=tl.float32)
    sq = tl.zeros([BLOCK], dtype=tl.float32)
    for off in range(0, CHUNK, BLOCK):
        cols = j * CHUNK + off + tl.arange(0, BLOCK)
        m = cols < SH
        x = tl.load(x_ptr + n * SH + cols, mask=m, other=0.0).to(tl.float32)
        sq += x * x
        w = tl.load(fn_ptr + r[:, None] * SH + cols[None, :], mask=rm[:, None] & m[None, :], other=0.0)
        acc += tl.sum(w.to(tl.float32) * x[None, :], axis=1)
    tl.store(part_ptr + (n * SPLIT + j) * R_PAD + r, acc)
    tl.store(sq_ptr + n * SPLIT + j, tl.sum(sq, axis=0))


@triton.jit
def _mhc_finish(x_ptr, part_ptr, sq_ptr, base_ptr, scale_ptr, post_ptr, comb_ptr, out_ptr, H, SPLIT,
                norm_eps, hc_eps, S: tl.constexpr, R_PAD: tl.constexpr, SPLIT_PAD: tl.constexpr,
                ITERS: tl.constexpr, BLOCK_H: tl.constexpr):
    n = tl.program_id(0).to(tl.int64)
    hb = tl.program_id(1)
    s = tl.arange(0, S)
    j = tl.arange(0, SPLIT_PAD)
    jm = j < SPLIT
    parts = part_ptr + n * SPLIT * R_PAD + j * R_PAD  # [SPLIT_PAD] row starts
    comb_rows = 2 * S + s[:, None] * S + s[None, :]  # [S, S]: fn rows of comb, row-major
    acc_pre = tl.sum(tl.load(parts[:, None] + s[None, :], mask=jm[:, None], other=0.0), axis=0)
    acc_post = tl.sum(tl.load(parts[:, None] + S + s[None, :], mask=jm[:, None], other=0.0), axis=0)
    acc_comb = tl.sum(tl.load(parts[:, None, None] + comb_rows[None, :, :], mask=jm[:, None, None], other=0.0),
                      axis=0)
    sh = S * H
    sumsq = tl.sum(tl.load(sq_ptr + n * SPLIT + j, mask=jm, other=0.0), axis=0)
    rstd = tl.rsqrt(sumsq / sh + norm_eps)
    pre = tl.sigmoid(acc_pre * rstd * tl.load(scale_ptr) + tl.load(base_ptr + s)) + hc_eps
    post = 2.0 * tl.sigmoid(acc_post * rstd * tl.load(scale_ptr + 1) + tl.load(base_ptr + S + s))
    logit = acc_comb * rstd * tl.load(scale_ptr + 2) + tl.load(base_ptr + comb_rows)
    e = tl.exp(logit - tl.max(logit, axis=1)[:, None])
    comb = e / tl.sum(e, axis=1)[:, None] + hc_eps
    comb = comb / (tl.sum(comb, axis=0)[None, :] + hc_eps)  # columns first, as layers/mhc.sinkhorn
    for _ in tl.static_range(ITERS - 1):
        comb = comb / (tl.sum(comb, axis=1)[:, None] + hc_eps)
        comb = comb / (tl.sum(comb, axis=0)[None, :] + hc_eps)
    if hb == 0:
        tl.store(post_ptr + n * S + s, post)
        tl.store(comb_ptr + n * S * S + s[:, None] * S + s[None, :], comb)
    cols = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    m = cols < H
    xs = tl.load(x_ptr + n * sh + s[:, None] * H + cols[None, :], mask=m[None, :], other=0.0).to(tl.float32)
    y = tl.sum(pre[:, None] * xs, axis=0)
    tl.store(out_ptr + n * H + cols, y.to(out_ptr.dtype.element_ty), mask=m)


def projected(x: torch.Tensor, fn: torch.Tensor, r_pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [N, S, H] contiguous, fn [R, S*H] -> (x @ fn^T [N, R_PAD] float32, zero past R; sum of x^2 [N]
    float32): _mhc_finish's one partial per token, for steps above MAX_ROWS tokens."""
    xf = x.reshape(x.shape[0], -1).float()
    part = F.linear(xf, F.pad(fn.float(), (0, 0, 0, r_pad - fn.shape[0])))
    return part, xf.square().sum(-1)


def mhc_weights_fused(streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor,
                      iters: int, hc_eps: float, norm_eps: float
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """streams [N, S, H]; fn [(2 + S) * S, S*H] (model dtype); base [(2 + S) * S], scale [3] float32
    -> (post [N, S] float32, comb [N, S, S] float32, block input [N, H] in streams' dtype)."""
    n, s, h = streams.shape
    x = streams.contiguous()
    r = (2 + s) * s
    r_pad = triton.next_power_of_2(r)
    post = torch.empty(n, s, dtype=torch.float32, device=x.device)
    comb = torch.empty(n, s, s, dtype=torch.float32, device=x.device)
    out = torch.empty(n, h, dtype=x.dtype, device=x.device)
    if n:
        if n <= MAX_ROWS:
            chunk, split = split_of(s * h)
            part = torch.empty(n, split, r_pad, dtype=torch.float32, device=x.device)
            sq = torch.empty(n, split, dtype=torch.float32, device=x.device)
            _mhc_partials[(n, split)](x, fn.contiguous(), part, sq, s * h, chunk, split, R=r, R_PAD=r_pad,
                                      BLOCK=BLOCK)
        else:
            (part, sq), split = projected(x, fn, r_pad), 1
        _mhc_finish[(n, triton.cdiv(h, BLOCK_H))](
            x, part, sq, base.float().contiguous(), scale.float().contiguous(), post, comb, out, h, split,
            norm_eps, hc_eps, S=s, R_PAD=r_pad, SPLIT_PAD=triton.next_power_of_2(split), ITERS=max(iters, 1),
            BLOCK_H=BLOCK_H)
    return post, comb, out


@triton.jit
def _mhc_expand(out_ptr, post_ptr, comb_ptr, x_ptr, y_ptr, H, S: tl.constexpr, BLOCK_H: tl.constexpr):
    # Program (n, hb): y[n, :, block] = post[n] (x) out[n, block] + comb[n]^T @ x[n, :, block], rounded to
    # the dtype where the torch form rounds: post and comb cast first, each product term, then the sum.
    n = tl.program_id(0).to(tl.int64)
    hb = tl.program_id(1)
    s = tl.arange(0, S)
    cols = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    m = cols < H
    dt = y_ptr.dtype.element_ty
    xs = tl.load(x_ptr + n * S * H + s[:, None] * H + cols[None, :], mask=m[None, :], other=0.0).to(tl.float32)
    ct = tl.load(comb_ptr + n * S * S + s[None, :] * S + s[:, None]).to(dt).to(tl.float32)  # [s, t] = comb[t, s]
    mixed = tl.sum(ct[:, :, None] * xs[None, :, :], axis=1).to(dt).to(tl.float32)  # [S, BLOCK_H]
    p = tl.load(post_ptr + n * S + s).to(dt).to(tl.float32)
    o = tl.load(out_ptr + n * H + cols, mask=m, other=0.0).to(tl.float32)
    a = (p[:, None] * o[None, :]).to(dt).to(tl.float32)
    tl.store(y_ptr + n * S * H + s[:, None] * H + cols[None, :], (a + mixed).to(dt), mask=m[None, :])


def expand_fused(out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor, streams: torch.Tensor) -> torch.Tensor:
    """out [N, H], post [N, S] float32, comb [N, S, S] float32, streams [N, S, H] (S a power of two)
    -> streams' [N, S, H] in streams' dtype, as layers/mhc.expand."""
    n, s, h = streams.shape
    y = torch.empty(n, s, h, dtype=streams.dtype, device=streams.device)
    if n:
        _mhc_expand[(n, triton.cdiv(h, BLOCK_H))](out.contiguous(), post.contiguous(), comb.contiguous(),
                                                  streams.contiguous(), y, h, S=s, BLOCK_H=BLOCK_H)
    return y
