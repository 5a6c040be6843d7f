"""The kpool indexer's decode and verify selection on CUDA: two launches around torch.topk, in place of
the some fifty small torch ops of its fixed-shape form (layers/kpool_indexer.select_pools_fixed, the reference
these are tested against, and what the CPU runs).

    pool_scores(q [N, Hi, D], w [N, Hi] fp32, index_k [pages, page_size, 2D], ape [kpool, D], batch,
                kpool, scale) -> [N, P] fp32
        every pool of each query row's sequence's page-table window (P = W * page_size // kpool, W the
        table's width) scored as select_pools_fixed scores it: the pool's key (softmax over its
        kpool tokens of gate + ape, per channel, weighting their keys), then
        sum_h w[h] relu(scale q[h] . key); pools that end after the row's position masked to
        float32's lowest (they sort last)
    pool_tokens(picked [N, S] int64 (topk of the scores, best first) or None, positions [N], kpool,
                width) -> [N, width] int32
        the picked pools' tokens (the visible ones, which come first), then the token's own
        incomplete pool (place_tail's layout), -1 after

Programs: pool_scores one per (sequence, block of BLOCK_P pools, query row r of the sequence), r below
the step's most rows a sequence (decode: one; a verify step: its k + 1 positions; a sequence with fewer,
or none, leaves at once), its block's tokens loaded in one tile (a loop over a pool's tokens, rolled
or unrolled, measured 28 and 40 us a call on the H100 in the 8-layer batch-1 profile: a chain of
dependent loads, docs/models.md); a
block whose pools all end after the token stores the mask and loads nothing (the graphs' windows
are wider than short contexts). pool_tokens one per token. Rounding follows the torch form (to nearest even, under the
interpreter too: quant/dot.to_dot): softmax in fp32, probabilities and their products with the keys
rounded to the keys' dtype, each pool's key summed in fp32 and rounded to it, scores in fp32. The
sums run in another order (and exp is Triton's), so scores agree to float32 rounding, not bit for bit:
pools whose scores tie to within that may come out of topk in another order.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moetier.layers.attention import AttnBatch
from moetier.layers.dsa_select_triton import head_weighted_scores
from moetier.quant.dot import dot_type as _dot_type
from moetier.quant.dot import to_dot

BLOCK_P = 4  # pools a program scores: [BLOCK_P * kpool, D] keys and gates loaded at once
H_CHUNK = 8  # heads scored together ([H_CHUNK, BLOCK_P, D] products)


@triton.jit
def _pool_scores(q_ptr, w_ptr, k_ptr, ape_ptr, pos_ptr, query_start_ptr, page_table_ptr, out_ptr,
                 P, stride_pt, stride_qn, stride_qh, scale,
                 HI: tl.constexpr, D: tl.constexpr, KPOOL: tl.constexpr, PAGE: tl.constexpr,
                 HI_B: tl.constexpr, D_B: tl.constexpr, KP_B: tl.constexpr, H_CHUNK: tl.constexpr,
                 BLOCK_P: tl.constexpr, EMULATE: tl.constexpr):
    # HI_B, D_B, KP_B: heads, channels and a pool's tokens padded to powers of two
    b = tl.program_id(0)
    n = tl.load(query_start_ptr + b) + tl.program_id(2)  # the sequence's query row r = program_id(2)
    if tl.load(query_start_ptr + b + 1) > n:
        pos = tl.load(pos_ptr + n)
        p0 = tl.program_id(1) * BLOCK_P
        p = p0 + tl.arange(0, BLOCK_P)  # [BP] pools
        pm = p < P
        low = -3.4028234663852886e38  # float32's lowest: masked pools sort last
        if (p0 + 1) * KPOOL - 1 > pos:  # every pool of the block ends after the token: no loads
            tl.store(out_ptr + n.to(tl.int64) * P + p, tl.full([BLOCK_P], low, tl.float32), mask=pm)
        else:
            # the block's tokens in one tile [BP * KP_B, D_B]: every load in flight at once
            i = tl.arange(0, KP_B)
            t = (p[:, None] * KPOOL + i[None, :]).reshape(BLOCK_P * KP_B)
            lane = (tl.zeros([BLOCK_P, KP_B], tl.int32) + i[None, :]).reshape(BLOCK_P * KP_B) < KPOOL
            tm = lane & (t < P * KPOOL)
            table = page_table_ptr + b.to(tl.int64) * stride_pt  # a graph's narrow bucket: a view of the wide table
            row = (tl.load(table + t // PAGE, mask=tm, other=0).to(tl.int64) * PAGE + t % PAGE) * (2 * D)
            d = tl.arange(0, D_B)
            dm = d < D
            m2 = tm[:, None] & dm[None, :]
            k = tl.load(k_ptr + row[:, None] + d[None, :], mask=m2, other=0.0)
            z = tl.load(k_ptr + row[:, None] + D + d[None, :], mask=m2, other=0.0).to(tl.float32)
            ape = tl.load(ape_ptr + i[:, None] * D + d[None, :], mask=(i < KPOOL)[:, None] & dm[None, :], other=0.0)
            z = z.reshape(BLOCK_P, KP_B, D_B) + ape.to(tl.float32)[None, :, :]
            z = tl.where((i < KPOOL)[None, :, None], z, float("-inf"))  # padded lanes: no weight
            e = tl.exp(z - tl.max(z, axis=1)[:, None, :])
            dt = k_ptr.dtype.element_ty
            prob = to_dot(e / tl.sum(e, axis=1)[:, None, :], dt, EMULATE).to(tl.float32)  # softmax, rounded
            prod = to_dot(prob * k.reshape(BLOCK_P, KP_B, D_B).to(tl.float32), dt, EMULATE).to(tl.float32)
            key = to_dot(tl.sum(prod, axis=1), dt, EMULATE).to(tl.float32)  # [BP, D_B]: the pool keys
            # the heads a chunk at a time: [HC, BP, D_B]
            index = head_weighted_scores(q_ptr, w_ptr, n, key, stride_qn, stride_qh, scale, HI, D, HI_B, D_B, H_CHUNK,
                                         BLOCK_P)
            visible = (p + 1) * KPOOL - 1 <= pos
            tl.store(out_ptr + n.to(tl.int64) * P + p, tl.where(visible, index, low), mask=pm)


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
    grid = (batch.query_start.shape[0] - 1, triton.cdiv(p, BLOCK_P), max(batch.max_query_len, 1))
    _pool_scores[grid](q, w, index_k, ape, batch.positions, batch.query_start, batch.page_table, out, p,
                       batch.page_table.stride(0),
                       q.stride(0), q.stride(1), scale, HI=hi, D=d, KPOOL=kpool, PAGE=page,
                       HI_B=max(H_CHUNK, triton.next_power_of_2(hi)), D_B=triton.next_power_of_2(d),
                       KP_B=triton.next_power_of_2(kpool), H_CHUNK=H_CHUNK, BLOCK_P=BLOCK_P,
                       EMULATE=_dot_type(index_k.dtype)[2], num_warps=8)
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
