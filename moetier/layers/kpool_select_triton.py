"""The kpool indexer's decode selection on CUDA: two launches around torch.topk, in place of the some
forty small torch ops of its fixed-shape form (layers/kpool_indexer.select_pools_fixed, the reference
these are tested against, and what the CPU runs).

    pool_scores(q [N, Hi, D], w [N, Hi] fp32, index_k [pages, page_size, 2D], ape [kpool, D], batch,
                kpool, scale) -> [N, P] fp32
        every pool of the token's sequence's page-table window (P = W * page_size // kpool, W the
        table's width) scored as select_pools_fixed scores it: the pool's key (softmax over its
        kpool tokens of gate + ape, per channel, weighting their keys), then
        sum_h w[h] relu(scale q[h] . key); pools that end after the token's position masked to
        float32's lowest (they sort last)
    pool_tokens(picked [N, S] int64 (topk of the scores, best first) or None, positions [N], kpool,
                width) -> [N, width] int32
        the picked pools' tokens (the visible ones, which come first), then the token's own
        incomplete pool (place_tail's layout), -1 after

Programs: pool_scores one per (sequence, block of pools), reading the sequence's one query row (decode
steps: at most one token a sequence; a sequence without one returns at once); pool_tokens one per
token. Rounding follows the torch form (to nearest even, under the interpreter too: quant/dot.to_dot): softmax in fp32, probabilities and their products with the
keys rounded to the keys' dtype, each pool's key summed in fp32 and rounded to it, scores in fp32. The
sums run in another order (and exp is Triton's), so scores agree to float32 rounding, not bit for bit:
pools whose scores tie to within that may come out of topk in another order.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moetier.layers.attention import AttnBatch
from moetier.quant.dot import dot_type as _dot_type
from moetier.quant.dot import to_dot

BLOCK_P = 16  # pools a program scores


@triton.jit
def _row(table, p, pm, i, KPOOL: tl.constexpr, PAGE: tl.constexpr, D: tl.constexpr):
    # [BP] element offsets of token i of pools p in one layer's index_k ([k | gate] rows of 2D)
    t = p * KPOOL + i
    return (tl.load(table + t // PAGE, mask=pm, other=0).to(tl.int64) * PAGE + t % PAGE) * (2 * D)


@triton.jit
def _logit(k_ptr, ape_ptr, row, pm, i, D: tl.constexpr, D_B: tl.constexpr):
    # [BP, D_B] fp32: gate + ape of token i of each pool, the softmax's argument (0 past D)
    d = tl.arange(0, D_B)
    m = pm[:, None] & (d < D)[None, :]
    z = tl.load(k_ptr + row[:, None] + D + d[None, :], mask=m, other=0.0).to(tl.float32)
    return z + tl.load(ape_ptr + i * D + d, mask=d < D, other=0.0).to(tl.float32)[None, :]


@triton.jit
def _pool_scores(q_ptr, w_ptr, k_ptr, ape_ptr, pos_ptr, query_start_ptr, page_table_ptr, out_ptr,
                 P, W, stride_qn, stride_qh, scale,
                 HI: tl.constexpr, D: tl.constexpr, KPOOL: tl.constexpr, PAGE: tl.constexpr,
                 HI_B: tl.constexpr, D_B: tl.constexpr, BLOCK_P: tl.constexpr, EMULATE: tl.constexpr):
    # HI_B, D_B: the heads and channels padded to powers of two of at least 16 (tl.dot's smallest)
    b = tl.program_id(0)
    n = tl.load(query_start_ptr + b)
    if tl.load(query_start_ptr + b + 1) > n:  # the sequence's one query row this step
        pos = tl.load(pos_ptr + n)
        p = tl.program_id(1) * BLOCK_P + tl.arange(0, BLOCK_P)  # [BP] pools
        pm = p < P
        d = tl.arange(0, D_B)
        table = page_table_ptr + b.to(tl.int64) * W
        # passes over the pools' tokens: the softmax's max, its sum (per pool and channel), then the
        # keys weighted by their rounded probabilities ([BP, D] fp32 each, no [BP, KPOOL, D] tile);
        # unrolled, so each pass's KPOOL loads are in flight together (a rolled loop waited on each)
        top = tl.full([BLOCK_P, D_B], float("-inf"), tl.float32)
        for i in tl.static_range(KPOOL):
            row = _row(table, p, pm, i, KPOOL, PAGE, D)
            top = tl.maximum(top, _logit(k_ptr, ape_ptr, row, pm, i, D, D_B))
        total = tl.zeros([BLOCK_P, D_B], tl.float32)
        for i in tl.static_range(KPOOL):
            total += tl.exp(_logit(k_ptr, ape_ptr, _row(table, p, pm, i, KPOOL, PAGE, D), pm, i, D, D_B) - top)
        dt = k_ptr.dtype.element_ty
        key = tl.zeros([BLOCK_P, D_B], tl.float32)
        for i in tl.static_range(KPOOL):
            row = _row(table, p, pm, i, KPOOL, PAGE, D)
            prob = to_dot(tl.exp(_logit(k_ptr, ape_ptr, row, pm, i, D, D_B) - top) / total, dt, EMULATE)
            k = tl.load(k_ptr + row[:, None] + d[None, :], mask=pm[:, None] & (d < D)[None, :], other=0.0)
            key += to_dot(prob.to(tl.float32) * k.to(tl.float32), dt, EMULATE).to(tl.float32)
        key = to_dot(key, dt, EMULATE).to(tl.float32)  # [BP, D]: the pool keys as the torch form rounds them
        h = tl.arange(0, HI_B)
        q = tl.load(q_ptr + n.to(tl.int64) * stride_qn + h[:, None] * stride_qh + d[None, :],
                    mask=(h < HI)[:, None] & (d < D)[None, :], other=0.0).to(tl.float32)
        s = tl.dot(q, tl.trans(key), input_precision="ieee")  # [HI, BP] fp32
        s = tl.maximum(s * scale, 0.0)
        w = tl.load(w_ptr + n.to(tl.int64) * HI + h, mask=h < HI, other=0.0)
        index = tl.sum(w[:, None] * s, axis=0)  # [BP]
        visible = (p + 1) * KPOOL - 1 <= pos
        index = tl.where(visible, index, -3.4028234663852886e38)
        tl.store(out_ptr + n.to(tl.int64) * P + p, index, mask=p < P)


@triton.jit
def _pool_tokens(picked_ptr, pos_ptr, out_ptr, S, KPOOL: tl.constexpr, WIDTH: tl.constexpr,
                 S_BLOCK: tl.constexpr, BLOCK: tl.constexpr):
    n = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + n)
    j = tl.arange(0, S_BLOCK)
    jm = j < S
    first = tl.load(picked_ptr + n * S + j, mask=jm, other=0)
    seen = tl.sum((jm & ((first + 1) * KPOOL - 1 <= pos)).to(tl.int32), axis=0)  # visible picks (first)
    count = (pos + 1) % KPOOL  # tokens of the token's incomplete pool, itself included
    for c0 in range(0, WIDTH, BLOCK):
        c = c0 + tl.arange(0, BLOCK)
        mine = c < seen * KPOOL
        pick = tl.load(picked_ptr + n * S + c // KPOOL, mask=mine, other=0)
        i = c - seen * KPOOL  # the tail's column
        tail = tl.where((i >= 0) & (i < KPOOL - 1) & (i < count), pos + 1 - count + i, -1)
        val = tl.where(mine, pick * KPOOL + c % KPOOL, tail)
        tl.store(out_ptr + n * WIDTH + c, val.to(tl.int32), mask=c < WIDTH)


def pool_scores(q: torch.Tensor, w: torch.Tensor, index_k: torch.Tensor, ape: torch.Tensor, batch: AttnBatch,
                kpool: int, scale: float) -> torch.Tensor:
    """-> [N, P] fp32 (module doc). q: [N, Hi, D] (unit stride along D); w [N, Hi] fp32 contiguous;
    index_k: one layer's [pages, page_size, 2D] contiguous; ape [kpool, D] contiguous."""
    n, hi, d = q.shape
    page = index_k.shape[1]
    width = batch.page_table.shape[1]
    p = width * page // kpool
    out = torch.empty(n, p, dtype=torch.float32, device=q.device)
    if n == 0 or p == 0:
        return out
    if q.stride(2) != 1 or not (w.is_contiguous() and index_k.is_contiguous() and ape.is_contiguous()):
        raise ValueError("pool_scores needs q unit-stride along D and contiguous w, index_k and ape")
    grid = (batch.query_start.shape[0] - 1, triton.cdiv(p, BLOCK_P))
    _pool_scores[grid](q, w, index_k, ape, batch.positions, batch.query_start, batch.page_table, out, p, width,
                       q.stride(0), q.stride(1), scale, HI=hi, D=d, KPOOL=kpool, PAGE=page,
                       HI_B=max(16, triton.next_power_of_2(hi)), D_B=max(16, triton.next_power_of_2(d)),
                       BLOCK_P=BLOCK_P, EMULATE=_dot_type(index_k.dtype)[2])
    return out


def pool_tokens(picked: torch.Tensor | None, positions: torch.Tensor, kpool: int, width: int) -> torch.Tensor:
    """-> [N, width] int32 (module doc); picked None: no pool picked (a window shorter than a pool)."""
    n = positions.shape[0]
    out = torch.empty(n, width, dtype=torch.int32, device=positions.device)
    if n == 0:
        return out
    s = 0 if picked is None else picked.shape[1]
    src = picked.contiguous() if picked is not None else positions  # never read without picks
    _pool_tokens[(n,)](src, positions, out, s, KPOOL=kpool, WIDTH=width,
                       S_BLOCK=triton.next_power_of_2(max(s, 1)), BLOCK=1024)
    return out
