"""mHC's mixing weights in one Triton launch (decode steps on CUDA): the small projection, Sinkhorn
and the collapse of layers/mhc.HyperConnection.weights, whose torch ops are the oracle.

One program per token n, over its streams row x = streams[n] flattened ([S*H], S = hc_mult):

    pass 1 over x in blocks:  sum x^2, and the (2 + S) * S dot products with fn's rows (float32),
                              kept as pre [S], post [S], comb [S, S] accumulators
    in registers:             times rsqrt(mean x^2 + eps) (the RMS norm commutes with the projection),
                              scale and base, sigmoids, the softmax of comb's rows, Sinkhorn
    pass 2 over H in blocks:  collapsed[h] = sum_s pre[s] x[s, h] (float32, stored in x's dtype)

fn's rows are read once per token: the launch is meant for decode batches (a prefill step keeps the
torch path, whose projection is one GEMM). S must be a power of two (hc_mult 4 in GLM-5.3-Flash).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 256
MAX_ROWS = 64  # steps of more tokens take the torch path (layers/mhc.py)


def fused_supported(streams: torch.Tensor) -> bool:
    n, s = streams.shape[0], streams.shape[1]
    return streams.is_cuda and n <= MAX_ROWS and s >= 1 and s & (s - 1) == 0


@triton.jit
def _mhc_weights_kernel(x_ptr, fn_ptr, base_ptr, scale_ptr, post_ptr, comb_ptr, out_ptr, H, norm_eps, hc_eps,
                        S: tl.constexpr, ITERS: tl.constexpr, BLOCK: tl.constexpr):
    n = tl.program_id(0).to(tl.int64)
    sh = S * H
    x_row = x_ptr + n * sh
    s = tl.arange(0, S)
    comb_rows = 2 * S + s[:, None] * S + s[None, :]  # [S, S]: fn rows of comb, row-major
    acc_pre = tl.zeros([S], dtype=tl.float32)
    acc_post = tl.zeros([S], dtype=tl.float32)
    acc_comb = tl.zeros([S, S], dtype=tl.float32)
    sq = tl.zeros([BLOCK], dtype=tl.float32)
    for off in range(0, sh, BLOCK):
        cols = off + tl.arange(0, BLOCK)
        m = cols < sh
        x = tl.load(x_row + cols, mask=m, other=0.0).to(tl.float32)
        sq += x * x
        w = tl.load(fn_ptr + s[:, None] * sh + cols[None, :], mask=m[None, :], other=0.0).to(tl.float32)
        acc_pre += tl.sum(w * x[None, :], axis=1)
        w = tl.load(fn_ptr + (S + s)[:, None] * sh + cols[None, :], mask=m[None, :], other=0.0).to(tl.float32)
        acc_post += tl.sum(w * x[None, :], axis=1)
        w3 = tl.load(fn_ptr + comb_rows[:, :, None] * sh + cols[None, None, :], mask=m[None, None, :],
                     other=0.0).to(tl.float32)
        acc_comb += tl.sum(w3 * x[None, None, :], axis=2)
    rstd = tl.rsqrt(tl.sum(sq, axis=0) / sh + norm_eps)
    pre = tl.sigmoid(acc_pre * rstd * tl.load(scale_ptr) + tl.load(base_ptr + s)) + hc_eps
    post = 2.0 * tl.sigmoid(acc_post * rstd * tl.load(scale_ptr + 1) + tl.load(base_ptr + S + s))
    logit = acc_comb * rstd * tl.load(scale_ptr + 2) + tl.load(base_ptr + comb_rows)
    e = tl.exp(logit - tl.max(logit, axis=1)[:, None])
    comb = e / tl.sum(e, axis=1)[:, None] + hc_eps
    comb = comb / (tl.sum(comb, axis=0)[None, :] + hc_eps)  # columns first, as layers/mhc.sinkhorn
    for _ in tl.static_range(ITERS - 1):
        comb = comb / (tl.sum(comb, axis=1)[:, None] + hc_eps)
        comb = comb / (tl.sum(comb, axis=0)[None, :] + hc_eps)
    tl.store(post_ptr + n * S + s, post)
    tl.store(comb_ptr + n * S * S + s[:, None] * S + s[None, :], comb)
    for off in range(0, H, BLOCK):
        cols = off + tl.arange(0, BLOCK)
        m = cols < H
        xs = tl.load(x_row + s[:, None] * H + cols[None, :], mask=m[None, :], other=0.0).to(tl.float32)
        y = tl.sum(pre[:, None] * xs, axis=0)
        tl.store(out_ptr + n * H + cols, y.to(out_ptr.dtype.element_ty), mask=m)


def mhc_weights_fused(streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor,
                      iters: int, hc_eps: float, norm_eps: float
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """streams [N, S, H]; fn [(2 + S) * S, S*H] (model dtype); base [(2 + S) * S], scale [3] float32
    -> (post [N, S] float32, comb [N, S, S] float32, block input [N, H] in streams' dtype)."""
    n, s, h = streams.shape
    x = streams.contiguous()
    post = torch.empty(n, s, dtype=torch.float32, device=x.device)
    comb = torch.empty(n, s, s, dtype=torch.float32, device=x.device)
    out = torch.empty(n, h, dtype=x.dtype, device=x.device)
    if n:
        _mhc_weights_kernel[(n,)](x, fn.contiguous(), base.float().contiguous(), scale.float().contiguous(), post,
                                  comb, out, h, norm_eps, hc_eps, S=s, ITERS=max(iters, 1), BLOCK=BLOCK)
    return post, comb, out
