"""The DSA indexer's decode and verify scores on CUDA (GLM-5, glm_moe_dsa): one launch that reads the
keys of each sequence's page-table window in place and skips the keys after the token, in place of
the torch form's gather of the whole window ([N, W * page_size, D] copied) and its [N, Hi, W *
page_size] float32 products (layers/dsa_indexer.key_scores_fixed, which stays the oracle).

    key_scores(q [N, Hi, D], w [N, Hi] fp32, index_k [pages, page_size, D], batch, scale) -> [N, S] fp32
        S = W * page_size (W the table's width); for each query row n of the step,
        score(n, j) = sum_h w[n, h] relu(scale q[n, h] . k[j]) for its sequence's window key j <= the
        row's position, -inf after (what key_scores_fixed computes); the indexer takes their
        dsa_indexer.topk_positions

Programs: one per (sequence, block of BLOCK_S keys, query row r of the sequence), r below the step's
most rows a sequence (decode: one; a verify step: its k + 1 positions; a sequence with fewer rows, or
none, leaves at once); a block whose keys all lie after the row's token stores -inf and loads nothing
(a graph's window is wider than a short context). A sequence's rows read the same keys, the rows after
the first from L2 (a few rows a step). The heads run H_CHUNK at a time over the block's keys
([H_CHUNK, BLOCK_S, D] products: head_weighted_scores). Products of the bf16 inputs are exact in
float32, as in the torch form; the sums run in another order, so scores agree to float32 rounding, not
bit for bit: keys whose scores tie to within that may leave topk in another order.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moetier.layers.attention import AttnBatch

BLOCK_S = 16  # keys a program scores
H_CHUNK = 8  # heads scored together
# at GLM-5's indexer shape (32 heads of 128) compiled for sm_90a: 104 registers a thread with 8 warps, 184
# with 4, neither spilling (tests/test_mla.py)
NUM_WARPS = 8


@triton.jit
def head_weighted_scores(q_ptr, w_ptr, n, keys, stride_qn, stride_qh, scale, HI: tl.constexpr, D: tl.constexpr,
                         HI_B: tl.constexpr, D_B: tl.constexpr, H_CHUNK: tl.constexpr, BLOCK: tl.constexpr):
    """The indexer score of BLOCK keys [BLOCK, D_B] float32 for query row n: sum_h w[n, h] relu(scale
    q[n, h] . key) -> [BLOCK] float32, the heads H_CHUNK at a time ([H_CHUNK, BLOCK, D_B] products).
    Shared by this kernel and the kpool indexer's pool scores (layers/kpool_select_triton.py)."""
    d = tl.arange(0, D_B)
    dm = d < D
    index = tl.zeros([BLOCK], tl.float32)
    for h0 in tl.static_range(0, HI_B, H_CHUNK):
        h = h0 + tl.arange(0, H_CHUNK)
        hm = h < HI
        q = tl.load(q_ptr + n.to(tl.int64) * stride_qn + h[:, None] * stride_qh + d[None, :],
                    mask=hm[:, None] & dm[None, :], other=0.0).to(tl.float32)
        s = tl.maximum(tl.sum(q[:, None, :] * keys[None, :, :], axis=2) * scale, 0.0)  # [HC, BLOCK]
        w = tl.load(w_ptr + n.to(tl.int64) * HI + h, mask=hm, other=0.0)
        index += tl.sum(w[:, None] * s, axis=0)
    return index


@triton.jit
def _key_scores(q_ptr, w_ptr, k_ptr, pos_ptr, query_start_ptr, page_table_ptr, out_ptr, S, stride_pt, stride_qn,
                stride_qh, scale, HI: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr, HI_B: tl.constexpr,
                D_B: tl.constexpr, H_CHUNK: tl.constexpr, BLOCK_S: tl.constexpr):
    # HI_B, D_B: heads and channels padded to powers of two
    b = tl.program_id(0)
    n = tl.load(query_start_ptr + b) + tl.program_id(2)  # the sequence's query row r = program_id(2)
    if tl.load(query_start_ptr + b + 1) > n:
        pos = tl.load(pos_ptr + n)
        s0 = tl.program_id(1) * BLOCK_S
        j = s0 + tl.arange(0, BLOCK_S)  # [BS] positions in the window
        jm = j < S
        if s0 > pos:  # every key of the block lies after the token: no loads
            tl.store(out_ptr + n.to(tl.int64) * S + j, tl.full([BLOCK_S], float("-inf"), tl.float32), mask=jm)
        else:
            table = page_table_ptr + b.to(tl.int64) * stride_pt  # a graph's narrow bucket: a view of the wide table
            row = (tl.load(table + j // PAGE, mask=jm, other=0).to(tl.int64) * PAGE + j % PAGE) * D
            d = tl.arange(0, D_B)
            dm = d < D
            k = tl.load(k_ptr + row[:, None] + d[None, :], mask=jm[:, None] & dm[None, :], other=0.0).to(tl.float32)
            index = head_weighted_scores(q_ptr, w_ptr, n, k, stride_qn, stride_qh, scale, HI, D, HI_B, D_B, H_CHUNK,
                                         BLOCK_S)
            tl.store(out_ptr + n.to(tl.int64) * S + j, tl.where(j <= pos, index, float("-inf")), mask=jm)


def key_scores(q: torch.Tensor, w: torch.Tensor, index_k: torch.Tensor, batch: AttnBatch, scale: float
               ) -> torch.Tensor:
    """-> [N, S] fp32 (module doc); rows of no sequence's query are not written. q: [N, Hi, D] (unit
    stride along D); w [N, Hi] fp32 contiguous; index_k: one layer's [pages, page_size, D] contiguous."""
    n, hi, d = q.shape
    page = index_k.shape[1]
    s = batch.page_table.shape[1] * page
    out = torch.empty(n, s, dtype=torch.float32, device=q.device)
    if n == 0 or s == 0:
        return out
    if q.stride(2) != 1 or not (w.is_contiguous() and index_k.is_contiguous()):
        raise ValueError("key_scores needs q unit-stride along D and contiguous w and index_k")
    if index_k.shape[2] != d:
        raise ValueError(f"index_k rows are {index_k.shape[2]} wide, q's heads {d}")
    grid = (batch.query_start.shape[0] - 1, triton.cdiv(s, BLOCK_S), max(batch.max_query_len, 1))
    _key_scores[grid](q, w, index_k, batch.positions, batch.query_start, batch.page_table, out, s,
                      batch.page_table.stride(0), q.stride(0), q.stride(1), scale, HI=hi, D=d, PAGE=page,
                      HI_B=max(H_CHUNK, triton.next_power_of_2(hi)), D_B=triton.next_power_of_2(d),
                      H_CHUNK=H_CHUNK, BLOCK_S=BLOCK_S, num_warps=NUM_WARPS)
    return out
