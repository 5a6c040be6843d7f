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
                   stores its block of collapsed[h] = sum_s pre[s] x[s, h] (float32, stored in x's dtype).
                   Above MAX_ROWS tokens a program takes FINISH_TOKENS tokens and FINISH_STEPS column
                   blocks: a program per token and block ran the Sinkhorn's 40 small reductions
                   H / BLOCK_H times a token, the larger part of a prefill step's mHC time
                   (docs/models.md has the profile)

Why split: one program per token reads fn's R x S*H weights (786 KB at GLM-5.3-Flash's width) on one
SM, so a batch-1 step ran a single program per call; the split spreads the read over up to
MAX_SPLIT programs per token, and a token's partials depend on the token alone (batch invariant).
fn's rows are read once per token, so only steps of up to MAX_ROWS tokens (decode) take
_mhc_partials; a larger step (prefill) takes

    _mhc_project   grid (N / BLOCK_T, SPLIT): program (b, j) takes BLOCK_T tokens and columns
                   [j PROJECT_CHUNK, (j + 1) PROJECT_CHUNK): x tile [BLOCK_T, BLOCK_K] . fn^T tile
                   [BLOCK_K, R_PAD] on the tensor cores (bf16 products are exact in float32, sums in
                   float32; float32 inputs multiply in IEEE float32), the same partials as _mhc_partials

so x is read once and fn once per BLOCK_T tokens. A float32 GEMM instead (cuBLAS on x.float(), the
torch form's projection) wrote and read x in float32 and ran at a fraction of HBM speed with its
R = 24 columns (docs/models.md has both timed). The split depends on the row width alone, so a
token's partials do not depend on the step's other tokens. The projections of the two paths round
differently (sums in another order), as the torch form does from both. S must be a power of two
(hc_mult 4 in GLM-5.3-Flash).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moetier.quant.dot import dot_type, mma_kn

BLOCK = 128  # columns of x per loop step of _mhc_partials
BLOCK_H = 256  # hidden columns collapsed per _mhc_finish program (decode)
FINISH_WARPS = 1  # warps of a decode _mhc_finish program (its Sinkhorn's reductions stay in one warp)
MAX_SPLIT = 64  # programs per token reading fn
MAX_ROWS = 64  # steps of more tokens take _mhc_project instead of _mhc_partials
BLOCK_T, BLOCK_K = 64, 128  # _mhc_project's tile: tokens, columns per loop step
PROJECT_CHUNK = 2048  # columns per _mhc_project program (GLM-5.3-Flash's S*H = 16,384: a split of 8)
# _mhc_finish above MAX_ROWS tokens: tokens a program, hidden columns a block, blocks a program
FINISH_TOKENS, FINISH_H, FINISH_STEPS = 16, 64, 8


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


@triton.jit(do_not_specialize=["N"])  # the step's tokens (a decode graph's batch, a prefill chunk)
def _mhc_finish(x_ptr, part_ptr, sq_ptr, base_ptr, scale_ptr, post_ptr, comb_ptr, out_ptr, N, H, SPLIT,
                norm_eps, hc_eps, S: tl.constexpr, R_PAD: tl.constexpr, SPLIT_PAD: tl.constexpr,
                ITERS: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, H_STEPS: tl.constexpr):
    # program (b, hb): tokens [b BLOCK_T, (b + 1) BLOCK_T), hidden columns [hb H_STEPS BLOCK_H, ...) in
    # H_STEPS blocks; every token's Sinkhorn in registers, [BLOCK_T, S, S] at once
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    tm = t < N
    t64 = t.to(tl.int64)
    hb = tl.program_id(1)
    s = tl.arange(0, S)
    j = tl.arange(0, SPLIT_PAD)
    pm = tm[:, None] & (j < SPLIT)[None, :]  # [T, J]
    parts = part_ptr + (t64[:, None] * SPLIT + j[None, :]) * R_PAD  # [T, J] row starts
    comb_rows = 2 * S + s[:, None] * S + s[None, :]  # [S, S]: fn rows of comb, row-major
    acc_pre = tl.sum(tl.load(parts[:, :, None] + s[None, None, :], mask=pm[:, :, None], other=0.0), axis=1)
    acc_post = tl.sum(tl.load(parts[:, :, None] + S + s[None, None, :], mask=pm[:, :, None], other=0.0), axis=1)
    acc_comb = tl.sum(tl.load(parts[:, :, None, None] + comb_rows[None, None, :, :], mask=pm[:, :, None, None],
                              other=0.0), axis=1)  # [T, S, S]
    sh = S * H
    sumsq = tl.sum(tl.load(sq_ptr + t64[:, None] * SPLIT + j[None, :], mask=pm, other=0.0), axis=1)  # [T]
    rstd = tl.rsqrt(sumsq / sh + norm_eps)
    pre = tl.sigmoid(acc_pre * rstd[:, None] * tl.load(scale_ptr) + tl.load(base_ptr + s)[None, :]) + hc_eps
    post = 2.0 * tl.sigmoid(acc_post * rstd[:, None] * tl.load(scale_ptr + 1) + tl.load(base_ptr + S + s)[None, :])
    logit = acc_comb * rstd[:, None, None] * tl.load(scale_ptr + 2) + tl.load(base_ptr + comb_rows)[None, :, :]
    e = tl.exp(logit - tl.max(logit, axis=2)[:, :, None])
    comb = e / tl.sum(e, axis=2)[:, :, None] + hc_eps  # each row's softmax
    comb = comb / (tl.sum(comb, axis=1)[:, None, :] + hc_eps)  # columns first, as layers/mhc.sinkhorn
    for _ in tl.static_range(ITERS - 1):
        comb = comb / (tl.sum(comb, axis=2)[:, :, None] + hc_eps)
        comb = comb / (tl.sum(comb, axis=1)[:, None, :] + hc_eps)
    if hb == 0:
        tl.store(post_ptr + t64[:, None] * S + s[None, :], post, mask=tm[:, None])
        tl.store(comb_ptr + t64[:, None, None] * S * S + s[None, :, None] * S + s[None, None, :], comb,
                 mask=tm[:, None, None])
    for i in tl.static_range(H_STEPS):
        cols = (hb * H_STEPS + i) * BLOCK_H + tl.arange(0, BLOCK_H)
        m = cols < H
        xs = tl.load(x_ptr + t64[:, None, None] * sh + s[None, :, None] * H + cols[None, None, :],
                     mask=tm[:, None, None] & m[None, None, :], other=0.0).to(tl.float32)  # [T, S, BLOCK_H]
        y = tl.sum(pre[:, :, None] * xs, axis=1)
        tl.store(out_ptr + t64[:, None] * H + cols[None, :], y.to(out_ptr.dtype.element_ty),
                 mask=tm[:, None] & m[None, :])


@triton.jit(do_not_specialize=["N"])  # the step's tokens: one kernel for every count (a compile each, else)
def _mhc_project(x_ptr, fn_ptr, part_ptr, sq_ptr, N, SH, CHUNK, SPLIT, R: tl.constexpr, R_PAD: tl.constexpr,
                 BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr, DOT: tl.constexpr, PRECISION: tl.constexpr,
                 EMULATE: tl.constexpr):
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    j = tl.program_id(1)
    tm = t < N
    t64 = t.to(tl.int64)
    r = tl.arange(0, R_PAD)
    rm = r < R
    acc = tl.zeros([BLOCK_T, R_PAD], dtype=tl.float32)
    sq = tl.zeros([BLOCK_T], dtype=tl.float32)
    for off in range(0, CHUNK, BLOCK_K):
        cols = j * CHUNK + off + tl.arange(0, BLOCK_K)
        m = cols < SH
        x = tl.load(x_ptr + t64[:, None] * SH + cols[None, :], mask=tm[:, None] & m[None, :], other=0.0)
        w = tl.load(fn_ptr + r[None, :] * SH + cols[:, None], mask=rm[None, :] & m[:, None], other=0.0)
        acc = mma_kn(x, w, acc, DOT, PRECISION, EMULATE)  # [BLOCK_T, R_PAD] += x . fn^T ([BLOCK_K, R_PAD] tile)
        xf = x.to(tl.float32)
        sq += tl.sum(xf * xf, axis=1)
    tl.store(part_ptr + (t64[:, None] * SPLIT + j) * R_PAD + r[None, :], acc, mask=tm[:, None])
    tl.store(sq_ptr + t64 * SPLIT + j, sq, mask=tm)


def projected(x: torch.Tensor, fn: torch.Tensor, r: int, r_pad: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """x [N, S*H] contiguous, fn [R, S*H] contiguous -> (partials [N, SPLIT, R_PAD] float32, zero past R;
    sums of x^2 [N, SPLIT] float32; SPLIT): _mhc_partials' outputs, for steps above MAX_ROWS tokens."""
    n, sh = x.shape
    block_k = max(16, min(BLOCK_K, triton.next_power_of_2(sh)))
    chunk = min(PROJECT_CHUNK, triton.cdiv(sh, block_k) * block_k)  # PROJECT_CHUNK: a multiple of block_k
    split = triton.cdiv(sh, chunk)
    part = torch.empty(n, split, r_pad, dtype=torch.float32, device=x.device)
    sq = torch.empty(n, split, dtype=torch.float32, device=x.device)
    # 16-bit operands of one dtype go to the tensor cores as they are (exact products, float32 sums);
    # float32, or two dtypes, multiply in IEEE float32 (quant/dot.py)
    dot, precision, emulate = dot_type(x.dtype if x.dtype == fn.dtype else torch.float32)
    _mhc_project[(triton.cdiv(n, BLOCK_T), split)](
        x, fn, part, sq, n, sh, chunk, split, R=r, R_PAD=r_pad, BLOCK_T=BLOCK_T, BLOCK_K=block_k,
        DOT=dot, PRECISION=precision, EMULATE=emulate,
        # NOTE: one stage, no software pipelining of the loads: pipelined (2 or 3 stages, Triton 3.6 on
        # the H100) a few tokens of every large call came out wrong by up to 8% (docs/models.md)
        num_stages=1)
    return part, sq, split


def mhc_weights_fused(streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor,
                      iters: int, hc_eps: float, norm_eps: float
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """streams [N, S, H]; fn [(2 + S) * S, S*H] (model dtype); base [(2 + S) * S], scale [3] float32
    -> (post [N, S] float32, comb [N, S, S] float32, block input [N, H] in streams' dtype)."""
    n, s, h = streams.shape
    x = streams.contiguous()
    r = (2 + s) * s
    r_pad = max(16, triton.next_power_of_2(r))  # 16: tl.dot's least width (_mhc_project)
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
            part, sq, split = projected(x.view(n, s * h), fn.contiguous(), r, r_pad)
        # decode: a program per token and hidden block (the blocks side by side, each taking the
        # Sinkhorn, which costs a step nothing at a few tokens); larger steps: FINISH_TOKENS tokens a
        # program, their Sinkhorn once, FINISH_STEPS blocks of FINISH_H columns each
        bt, bh, steps = (1, BLOCK_H, 1) if n <= MAX_ROWS else (FINISH_TOKENS, FINISH_H, FINISH_STEPS)
        _mhc_finish[(triton.cdiv(n, bt), triton.cdiv(h, bh * steps))](
            x, part, sq, base.float().contiguous(), scale.float().contiguous(), post, comb, out, n, h, split,
            norm_eps, hc_eps, S=s, R_PAD=r_pad, SPLIT_PAD=triton.next_power_of_2(split), ITERS=max(iters, 1),
            BLOCK_T=bt, BLOCK_H=bh, H_STEPS=steps, num_warps=FINISH_WARPS if n <= MAX_ROWS else 4)
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
