"""Triton MLA attention in latent space over the paged latent cache, for a step that mixes decode
tokens and prefill chunks; the oracle is latent_attention.latent_attention_reference (same
arguments, same result to rounding).

MLA is MQA in latent space: every query head reads the same latent row, [c_kv (R) | k_pe (P)],
as its key and its first R values as its value. So a program takes BLOCK_H heads of BLOCK_T tokens
(BLOCK_M = BLOCK_T * BLOCK_H rows: row r = token r // BLOCK_H, head r % BLOCK_H) and streams each
latent tile once for all of them, with tensor-core products
    S [M, BLOCK_N] = q_nope [M, R] . c_kv^T + q_pe [M, P] . k_pe^T      (R + P = 576 split 512 + 64)
    acc [M, R]    += P [M, BLOCK_N] . c_kv [BLOCK_N, R]                  (the tile loaded for S)
R and P are padded to powers of two (>= 16, for tl.dot) with masks; P = 0 drops the second product.

Program (seq * num_q_blocks + qb, head block, split); tile_config picks the tiles. Decode
(max_query_len 1): BLOCK_T 1, BLOCK_H 32 at Hq >= 32, else 16 (Hq < 16 padded with idle rows).
Prefill chunks without DSA: BLOCK_T tokens share the key tiles, so that the float32 accumulator
stays at 32 x 512. Keys are split over the grid's third axis (flash-decoding) so that decode at batch
1 fills the GPU; _combine merges the partials by log-sum-exp. compile_variants compiles every
specialization a step can reach at startup, so no step of a new shape waits for Triton.

DSA (topk [N, K], token positions, -1 unused): BLOCK_T is 1 (each token has its own list) and the
program walks the K entries of its token's row instead of the positions 0 .. kv_end, gathering each
row through the page table; an entry counts when 0 <= entry <= the token's position, as in the
reference. Valid entries of a row must be distinct (torch.topk's are): a repeated position would
weigh twice here and once in the reference. A token with no valid entry gets zeros (the reference
gets NaN).

Online softmax in float32 in base 2. Per-sequence values come from device tensors only; host ints
(max_query_len, the number of sequences and tokens, K, the longest context) pick the grid, the
block sizes and the split count, so a decode step can be captured in a CUDA graph and replayed at
other context lengths up to the one it was captured for (engine/graphs.py captures at the longest).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from moetier.layers.paged_attention_triton import LOG2E, _dot, _sm_count

MAX_SPLITS = 64
# H200 (bench/results/h200-latent-attention-*.json): at batch 1, 64 splits of 32 keys beat 16 of 128
# by 2x (topk 2048) and 32 of 128 by 1.5x (4k context): the partials mostly stay in L2
MIN_KEYS_PER_SPLIT = 32


@triton.jit
def _rows(pt_row, topk_row, start, hi, pos_max, stride_lp, stride_ls, BLOCK_N: tl.constexpr,
          PAGE_SIZE: tl.constexpr, TOPK: tl.constexpr):
    # Where the tile of entries [start, start + BLOCK_N) of the walk (cut at hi) reads: its keys'
    # positions, whether each counts, and their latent rows' offsets
    idx = start + tl.arange(0, BLOCK_N)
    if TOPK:
        key = tl.load(topk_row + idx, mask=idx < hi, other=-1).to(tl.int32)
        ok = (key >= 0) & (key <= pos_max)  # pos_max < ctx, so the page-table read stays in the row
    else:
        key = idx
        ok = idx < hi
    page = tl.load(pt_row + key // PAGE_SIZE, mask=ok, other=0).to(tl.int64)
    return key, ok, page * stride_lp + (key % PAGE_SIZE).to(tl.int64) * stride_ls


@triton.jit
def _tile(q_nope, q_pe, m_i, l_i, acc, latent_ptr, key, ok, row_off, pos, qk_scale, R: tl.constexpr,
          P: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr, PRECISION: tl.constexpr,
          UPCAST: tl.constexpr):
    # One tile of keys (_rows): S, the online softmax, P . V
    r = tl.arange(0, BLOCK_R)
    kv = tl.load(latent_ptr + row_off[:, None] + r[None, :], mask=ok[:, None] & (r < R)[None, :],
                 other=0.0)  # [BLOCK_N, BLOCK_R]: keys' c_kv and the values
    s = _dot(q_nope, tl.trans(kv), PRECISION, UPCAST)
    if P > 0:
        e = tl.arange(0, BLOCK_P)
        k_pe = tl.load(latent_ptr + row_off[:, None] + R + e[None, :], mask=ok[:, None] & (e < P)[None, :],
                       other=0.0)  # [BLOCK_N, BLOCK_P]
        s += _dot(q_pe, tl.trans(k_pe), PRECISION, UPCAST)
    s = tl.where((key[None, :] <= pos[:, None]) & ok[None, :], s * qk_scale, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    p = tl.exp2(s - m_new[:, None])
    alpha = tl.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    # p in the latent's dtype, as the reference rounds its probabilities to q.dtype before P @ V
    acc = acc * alpha[:, None] + _dot(p.to(kv.dtype), kv, PRECISION, UPCAST)
    return m_new, l_i, acc


# as paged_attention_triton._attn: no specialization on ints that change from step to step (each new
# "== 1" or "% 16 == 0" of them was a compile in the middle of serving): the query blocks and the page
# table's width, and the top-k rows' width (kpool's index_topk + kpool - 1 is rarely "% 16", so the
# startup's launches could not meet its specialization). The partials' strides stay specialized:
# their rows are padded to a multiple of 16, so they are always "% 16" (without that, the 64 x 32
# tile's stores cost registers it lacks).
@triton.jit(do_not_specialize=["num_q_blocks", "num_entries", "stride_tk", "stride_pt"])
def _mla(q_ptr, latent_ptr, topk_ptr, o_ptr, lse_ptr, query_start_ptr, seq_lens_ptr, page_table_ptr,
         qk_scale, num_q_blocks, num_entries, stride_qn, stride_qh, stride_lp, stride_ls, stride_tk,
         stride_os, stride_on, stride_oh, stride_lses, stride_lsen, stride_pt,
         HQ: tl.constexpr, R: tl.constexpr, P: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_T: tl.constexpr,
         BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr, PAGE_SIZE: tl.constexpr,
         SPLIT: tl.constexpr, TOPK: tl.constexpr, INTERPRET: tl.constexpr, PRECISION: tl.constexpr,
         UPCAST: tl.constexpr, PREFETCH: tl.constexpr):
    # SPLIT: the grid's third axis splits the keys (partials and their log-sum-exp out); the count is
    # the grid's, so one kernel serves every count
    BLOCK_M: tl.constexpr = BLOCK_T * BLOCK_H
    num_splits = tl.num_programs(2)
    seq = tl.program_id(0) // num_q_blocks
    q_block = tl.program_id(0) % num_q_blocks
    split = tl.program_id(2)
    q_start = tl.load(query_start_ptr + seq)
    q_len = tl.load(query_start_ptr + seq + 1) - q_start
    ctx = tl.load(seq_lens_ptr + seq)

    rows = tl.arange(0, BLOCK_M)
    tok = q_block * BLOCK_T + rows // BLOCK_H  # token index within the sequence's chunk
    head = tl.program_id(1) * BLOCK_H + rows % BLOCK_H
    row_ok = (tok < q_len) & (head < HQ)
    pos = ctx - q_len + tok  # the token's position: it sees keys 0 .. pos
    n_tok = (q_start + tok).to(tl.int64)  # row of q / out in the step's token axis
    q_rows = q_ptr + n_tok[:, None] * stride_qn + head[:, None] * stride_qh
    r = tl.arange(0, BLOCK_R)
    q_nope = tl.load(q_rows + r[None, :], mask=row_ok[:, None] & (r < R)[None, :], other=0.0)
    if P > 0:
        e = tl.arange(0, BLOCK_P)
        q_pe = tl.load(q_rows + R + e[None, :], mask=row_ok[:, None] & (e < P)[None, :], other=0.0)
    else:
        q_pe = q_nope  # unused

    # The walk: DSA entries 0 .. min(K, position + 1) of the token's topk row (the selections put their
    # valid entries first, at most position + 1 of them: dsa_indexer, kpool_indexer.place_tail), or
    # keys 0 .. (position of the block's last token); empty for a block past the chunk. Split s takes
    # [s * split_len, +split_len), split_len a multiple of BLOCK_N, so without DSA split 0 holds key 0
    # and every live row ends with l > 0.
    live_block = q_block * BLOCK_T < q_len
    if TOPK:  # BLOCK_T == 1
        pos_max = ctx - q_len + q_block
        kv_end = tl.where(live_block, tl.minimum(num_entries, pos_max + 1), 0)
        topk_row = topk_ptr + (q_start + q_block).to(tl.int64) * stride_tk
    else:
        kv_end = tl.where(live_block, tl.minimum(ctx, ctx - q_len + (q_block + 1) * BLOCK_T), 0)
        topk_row = topk_ptr
        pos_max = kv_end - 1
    split_len = tl.cdiv(tl.cdiv(kv_end, num_splits), BLOCK_N) * BLOCK_N
    lo = split * split_len
    hi = tl.minimum(lo + split_len, kv_end)

    # m starts finite: a row whose keys are all masked in a tile gets p = 0 and alpha = 1, not NaN.
    m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_R], tl.float32)
    pt_row = page_table_ptr + seq.to(tl.int64) * stride_pt
    if INTERPRET:  # the interpreter cannot take a loaded value as a `range` bound
        walk_lo, walk_hi = int(lo), int(hi)
    else:  # loaded bounds: the compiler pipelines the `for` loop's latent loads (num_stages)
        walk_lo, walk_hi = lo, hi
    # PREFETCH: the next tile's rows resolved while this one computes (_rows' two loads leave the chain)
    if PREFETCH:
        key, ok, row_off = _rows(pt_row, topk_row, lo, hi, pos_max, stride_lp, stride_ls, BLOCK_N, PAGE_SIZE, TOPK)
    for start in range(walk_lo, walk_hi, BLOCK_N):
        if PREFETCH:
            key_n, ok_n, off_n = _rows(pt_row, topk_row, start + BLOCK_N, hi, pos_max, stride_lp, stride_ls, BLOCK_N,
                                       PAGE_SIZE, TOPK)
        else:
            key, ok, row_off = _rows(pt_row, topk_row, start, hi, pos_max, stride_lp, stride_ls, BLOCK_N, PAGE_SIZE,
                                     TOPK)
        m_i, l_i, acc = _tile(q_nope, q_pe, m_i, l_i, acc, latent_ptr, key, ok, row_off, pos, qk_scale, R, P, BLOCK_R,
                              BLOCK_P, PRECISION, UPCAST)
        if PREFETCH:
            key, ok, row_off = key_n, ok_n, off_n

    live = l_i > 0  # false for an empty split, a dead row, or a DSA row with no valid entry here
    o = acc / tl.where(live, l_i, 1.0)[:, None]
    o_ptrs = o_ptr + split.to(tl.int64) * stride_os + n_tok[:, None] * stride_on + head[:, None] * stride_oh
    tl.store(o_ptrs + r[None, :], o.to(o_ptr.dtype.element_ty), mask=row_ok[:, None] & (r < R)[None, :])
    if SPLIT:
        lse = tl.where(live, m_i + tl.log2(tl.where(live, l_i, 1.0)), float("-inf"))
        tl.store(lse_ptr + split.to(tl.int64) * stride_lses + n_tok * stride_lsen + head, lse, mask=row_ok)


@triton.jit(do_not_specialize=["num_splits"])
def _combine(o_part_ptr, lse_ptr, out_ptr, num_splits, stride_ps, stride_lses, stride_on, stride_oh,
             HQ: tl.constexpr, R: tl.constexpr, SPLITS_PAD: tl.constexpr, BLOCK_C: tl.constexpr):
    # program = (token * HQ + head, chunk of BLOCK_C latent columns); partials o_part [S, N, Hq, R]
    # float32, lse [S, N, Hq] (base 2). All splits of the chunk load at once (SPLITS_PAD * BLOCK_C
    # <= 4096 values): no serial chain of loads, which at S 64 would be 64 memory latencies.
    row = tl.program_id(0)
    tok = row // HQ
    head = row % HQ
    s = tl.arange(0, SPLITS_PAD)
    s_ok = s < num_splits
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    c_ok = c < R
    lse = tl.load(lse_ptr + s * stride_lses + row, mask=s_ok, other=float("-inf"))
    m = tl.max(lse, 0)
    m = tl.where(m == float("-inf"), 0.0, m)  # no split saw a key (DSA row with no entry): zeros out
    w = tl.exp2(lse - m)
    total = tl.sum(w, 0)
    o = tl.load(o_part_ptr + s[:, None].to(tl.int64) * stride_ps + row.to(tl.int64) * R + c[None, :],
                mask=s_ok[:, None] & c_ok[None, :], other=0.0)
    res = tl.sum(w[:, None] * o, 0) / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + tok.to(tl.int64) * stride_on + head * stride_oh + c, res.to(out_ptr.dtype.element_ty),
             mask=c_ok)


def default_num_splits(programs: int, keys: int, device: torch.device) -> int:
    """Key splits for a grid of `programs` (sequence, query block, head block) programs that walk at
    most `keys` keys (the longest context, or K with DSA). Below one program per SM, split to about
    four per SM (a power of two, as for GQA in paged_attention_triton), but keep at least
    MIN_KEYS_PER_SPLIT keys per split: every split adds a float32 partial of Hq x R per token that
    _combine reads back (256 KiB written and read at Hq 64, R 512, mostly in L2), against the
    147 KiB of 128 latent rows of 576 bf16. Depends on host ints only: a graph captured at the
    longest context keeps its split count at every replay."""
    if device.type != "cuda":
        return 1
    sms = _sm_count(device.index if device.index is not None else torch.cuda.current_device())
    if programs >= sms:
        return 1
    want = min(MAX_SPLITS, triton.next_power_of_2(triton.cdiv(4 * sms, programs)))
    return max(1, min(want, triton.cdiv(keys, MIN_KEYS_PER_SPLIT)))


def tile_config(hq: int, r: int, max_q: int, dsa: bool, dtype: torch.dtype, block_h: int | None = None,
                block_n: int | None = None) -> tuple[int, int, int, int, int, bool]:
    """-> (block_h, block_t, block_n, num_warps, num_stages, prefetch) for Hq heads, kv_lora_rank r and
    the step's longest query chunk. Register counts from ptxas for sm_90a at R 512, P 64, bf16, no spills
    (tests/test_latent_attention.py holds them there): block_h 16, block_n 16, 4 warps: 139
    registers, 3 programs per SM; block_h 32, block_n 16, 8 warps: 128 registers, 2 per SM, and
    each latent tile read by Hq / 32 programs instead of Hq / 16 (the re-reads hit L2, but at Hq 64
    four of them would ask L2 for 4x the HBM rate). Float32 (tests): block_n 16, 8 warps and one
    stage, or [BLOCK_N, 512] float32 tiles spill or crowd shared memory."""
    wide = r > 128
    if block_h is None:  # >= 16: tl.dot's smallest M. H200 sweep at Hq 64: 64x32 tiles 1.6-2.3x faster than 32x16
        block_h = 16 if dtype == torch.float32 else 64 if hq >= 64 else 32 if hq >= 32 else 16
    assert block_h >= 16 and block_h & (block_h - 1) == 0, f"block_h {block_h} must be a power of two >= 16"
    if max_q == 1 or dsa:  # decode, or DSA (a key list per token)
        block_t = 1
    else:  # prefill chunks: tokens share key tiles; accumulator [block_t * block_h, R] float32
        block_t = max(1, min(triton.next_power_of_2(max_q), (32 if wide else 64) // block_h))
    # DSA prefill (a key list per token, chunks of many tokens): 64-key tiles with each tile's rows
    # resolved a tile ahead (the walk's prefetch) beat 32-key tiles by 1.3x at 8,192 tokens
    # (docs/models.md); decode keeps 32, its measured best, and so its own bits
    dsa_prefill = dsa and max_q > 1 and dtype != torch.float32
    if block_n is None:
        block_n = 16 if wide and dtype == torch.float32 else 64 if dsa_prefill or not wide else 32
    wide_acc = block_t * block_h * max(16, triton.next_power_of_2(r)) >= 32 * 512
    num_warps = 8 if wide_acc or (wide and dtype == torch.float32) else 4
    return block_h, block_t, block_n, num_warps, 1 if dtype == torch.float32 else 2, dsa_prefill


def combine_config(num_splits: int, r: int) -> tuple[int, int, int]:
    """-> (SPLITS_PAD, BLOCK_C, num_warps) of _combine: a [SPLITS_PAD, BLOCK_C] float32 block <= 4096."""
    splits_pad = triton.next_power_of_2(num_splits)
    block_c = max(16, min(triton.next_power_of_2(r), 4096 // splits_pad))
    return splits_pad, block_c, 4 if splits_pad * block_c >= 2048 else 1


def variant_runs(hq: int, r: int, dtype: torch.dtype, dsa: bool) -> list[tuple[int, bool, int]]:
    """(chunk tokens, with a top-k list, key splits) of one launch per specialization: _mla's are
    (tile_config, TOPK, split or not), the tiles a function of the longest chunk; _combine's its
    combine_config, a function of the split count (up to MAX_SPLITS, the default's bound)."""
    tiles: dict[tuple, int] = {}  # (tiles, TOPK) -> the shortest chunk that takes them
    for topk in (False, True) if dsa else (False,):
        for q_len in (1 << i for i in range(8)):  # block_t stops growing at 64 // block_h <= 4 tokens
            tiles.setdefault((tile_config(hq, r, q_len, topk, dtype), topk), q_len)
    runs = [(q_len, topk, splits) for (_, topk), q_len in tiles.items() for splits in (1, 2)]
    pads: dict[tuple, int] = {combine_config(2, r): 2}
    for splits in range(3, MAX_SPLITS + 1):
        pads.setdefault(combine_config(splits, r), splits)
    return runs + [(1, False, splits) for splits in pads.values() if splits != 2]


def compile_variants(hq: int, r: int, p: int, page_size: int, dtype: torch.dtype, device: torch.device,
                     dsa: bool) -> int:
    """Compile, before serving, every specialization of _mla and _combine that a step of this
    attention can reach (variant_runs; dsa: with the DSA top-k walk too), by launches on tiny dummy
    tensors of the model's layout (q [T, Hq, R + P], a latent [pages, page_size, R + P], int32 top-k
    rows). Otherwise the first step of a new shape compiles one in the middle of serving
    (docs/prefix-cache.md). Returns the launches made."""
    from moetier.layers.attention import make_batch

    runs = variant_runs(hq, r, dtype, dsa)
    for q_len, topk, splits in runs:
        pages = -(-q_len // page_size)
        latent = torch.zeros((pages, page_size, r + p), dtype=dtype, device=device)
        q = torch.zeros((q_len, hq, r + p), dtype=dtype, device=device)
        rows = torch.zeros((q_len, 16), dtype=torch.int32, device=device) if topk else None
        latent_attention_triton(q, latent, make_batch([(0, q_len, list(range(pages)))], page_size, device), 1.0,
                                r, rows, num_splits=splits)
    return len(runs)


def latent_attention_triton(q: torch.Tensor, latent: torch.Tensor, batch, scale: float, kv_lora_rank: int,
                            topk: torch.Tensor | None = None, out: torch.Tensor | None = None,
                            num_splits: int | None = None, *, block_h: int | None = None,
                            block_n: int | None = None, num_warps: int | None = None, num_stages: int | None = None,
                            prefetch: bool | None = None) -> torch.Tensor:
    """q: [N, Hq, R + P]; latent: [pages, page_size, R + P] of one layer (this step's rows already
    written); batch: attention.AttnBatch; topk: None or [N', K] int32/int64 token positions (-1
    unused), N' >= batch.num_tokens. -> [N, Hq, R] in q.dtype; rows past batch.num_tokens are not
    written. num_splits: key splits per program (None: default_num_splits); out: optional
    [N, Hq, R] buffer (CUDA graphs). block_h, block_n, num_warps, num_stages, prefetch (each tile's rows
    resolved a tile ahead): tile_config's unless given, for tuning."""
    assert q.dim() == 3 and latent.dim() == 3, f"q {tuple(q.shape)} must be [N, Hq, R+P], latent " \
        f"{tuple(latent.shape)} [pages, page_size, R+P]"
    n, hq, width = q.shape
    r = kv_lora_rank
    p = width - r
    assert 0 < r <= width, f"kv_lora_rank {r} does not fit q's last dim {width} (R + P)"
    assert latent.shape[2] == width, f"latent rows are {latent.shape[2]} wide, q's {width} (R + P)"
    page_size = latent.shape[1]
    assert page_size & (page_size - 1) == 0, f"page_size {page_size} is not a power of two"
    assert latent.dtype == q.dtype, f"latent {latent.dtype} and q {q.dtype} differ"
    assert latent.stride(2) == 1, "latent rows must be contiguous"
    if q.stride(2) != 1:
        q = q.contiguous()
    if out is None:
        out = torch.empty((n, hq, r), dtype=q.dtype, device=q.device)
    assert out.shape == (n, hq, r) and out.dtype == q.dtype and out.stride(2) == 1, \
        f"out {tuple(out.shape)} {out.dtype} must be [{n}, {hq}, {r}] {q.dtype}, last dim contiguous"
    num_seqs, num_tokens, max_q = batch.num_seqs, batch.num_tokens, batch.max_query_len
    if topk is not None:
        assert topk.dim() == 2 and topk.shape[0] >= num_tokens and topk.shape[1] > 0, \
            f"topk {tuple(topk.shape)} must be [N >= {num_tokens} tokens, K > 0]"
        assert topk.dtype in (torch.int32, torch.int64), f"topk must hold integer positions, not {topk.dtype}"
        if topk.stride(1) != 1:
            topk = topk.contiguous()
    if num_seqs == 0 or num_tokens == 0 or max_q == 0:
        return out

    block_r = max(16, triton.next_power_of_2(r))
    block_p = max(16, triton.next_power_of_2(p)) if p else 16
    block_h, block_t, block_n, warps, stages, ahead = tile_config(hq, r, max_q, topk is not None, q.dtype, block_h,
                                                                 block_n)
    num_warps, num_stages = num_warps or warps, num_stages or stages
    prefetch = ahead if prefetch is None else prefetch
    num_q_blocks = triton.cdiv(max_q, block_t)
    head_blocks = triton.cdiv(hq, block_h)
    if num_splits is None:
        # with a selection: its width alone (fixed per model), so that an eager step and a graph replay
        # (whose host lists say every context is the longest) split, and so sum, the same way
        keys = topk.shape[1] if topk is not None else max(batch.seq_lens_host)
        num_splits = default_num_splits(num_seqs * num_q_blocks * head_blocks, keys, q.device)
    assert 1 <= num_splits <= 4 * MAX_SPLITS, f"num_splits {num_splits} must be 1 to {4 * MAX_SPLITS}"
    interpret = os.environ.get("TRITON_INTERPRET") == "1"
    upcast = q.dtype == torch.bfloat16 and interpret
    precision = "ieee" if q.dtype == torch.float32 or upcast else "tf32"  # ignored for 16-bit inputs

    if num_splits == 1:
        o, lse, o_strides, lse_strides = out, out, (0, out.stride(0), out.stride(1)), (0, 0)
    else:  # partials [S, N, Hq, R] and their log-sum-exp [S, N, Hq], sized by host ints only
        # rows padded to a multiple of 16, so that the split strides are always "% 16" (one
        # specialization, and the partials' stores keep their alignment)
        o = torch.empty((num_splits, -(-n // 16) * 16, hq, r), dtype=torch.float32, device=q.device)
        lse = torch.empty((num_splits, -(-n // 16) * 16, hq), dtype=torch.float32, device=q.device)
        o_strides, lse_strides = (o.stride(0), o.stride(1), o.stride(2)), (lse.stride(0), lse.stride(1))
    topk_arg = topk if topk is not None else batch.query_start  # any device pointer: never read
    _mla[(num_seqs * num_q_blocks, head_blocks, num_splits)](
        q, latent, topk_arg, o, lse, batch.query_start, batch.seq_lens, batch.page_table,
        scale * LOG2E, num_q_blocks, topk.shape[1] if topk is not None else 0, q.stride(0), q.stride(1),
        latent.stride(0), latent.stride(1), topk.stride(0) if topk is not None else 0,
        *o_strides, *lse_strides, batch.page_table.stride(0),
        HQ=hq, R=r, P=p, BLOCK_H=block_h, BLOCK_T=block_t, BLOCK_N=block_n, BLOCK_R=block_r, BLOCK_P=block_p,
        PAGE_SIZE=page_size, SPLIT=num_splits > 1, TOPK=topk is not None, INTERPRET=interpret,
        PRECISION=precision, UPCAST=upcast, PREFETCH=prefetch, num_warps=num_warps, num_stages=num_stages)
    if num_splits > 1:
        splits_pad, block_c, warps = combine_config(num_splits, r)
        _combine[(num_tokens * hq, triton.cdiv(r, block_c))](
            o, lse, out, num_splits, o.stride(0), lse.stride(0), out.stride(0), out.stride(1), HQ=hq, R=r,
            SPLITS_PAD=splits_pad, BLOCK_C=block_c, num_warps=warps)
    return out
