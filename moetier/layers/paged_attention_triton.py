"""Triton paged attention for a step that mixes decode tokens and prefill chunks; the oracle is
attention.paged_attention_reference (same arguments, same result to rounding).

One launch covers the whole step. Program (seq * num_q_blocks + qb, kv_head, split) owns query
tokens [qb * BLOCK_T, +BLOCK_T) of sequence seq, all GROUP query heads of kv_head, and keys
[lo, hi) of split `split`. Its BLOCK_M = BLOCK_T * GROUP_PAD rows are (token, head) pairs:
row r = token r // GROUP_PAD, head r % GROUP_PAD. So each K/V tile is read once for every query
head that shares it, and both products are tl.dot with M = BLOCK_M >= 16.

Decode (max_query_len 1): BLOCK_T = max(1, 16 // GROUP_PAD), the head group padded to 16 rows
(Qwen3-30B's group of 8: 8 live rows of 16, token 0 of the block only). Padding for tl.dot rather
than broadcast-multiply + tl.sum: the latter holds a [GROUP, BLOCK_N, D] float32 product in
registers (64K values for 8 x 64 x 128) and spills, while padded rows only idle tensor-core lanes;
decode is bound by K/V bytes, which padding does not change. Prefill chunks: BLOCK_T up to
128 // GROUP_PAD tokens per program, same code; a decode token in a mixed step takes one block.
When the grid has fewer programs than SMs (small decode batches at long context), the keys are
split over the grid's third axis (flash-decoding; the count is the grid's, not a constexpr) and
_combine merges the partials by log-sum-exp. compile_variants compiles, at startup, every
specialization a step can reach, so no step of a new shape waits for Triton.

Online softmax in float32 in base 2 (scores pre-multiplied by log2(e)); no [q_len, ctx] matrix
exists anywhere. Keys are walked through the page table, BLOCK_N at a time across pages, so any
power-of-two page_size works, including pages smaller than a tile. Per-sequence values come from
the device tensors only; host lists pick the grid and block sizes, so a decode step can be captured
in a CUDA graph and replayed with other context lengths (the key loop is a while loop on device
values: Triton's interpreter cannot take a loaded value as a `range` bound, the compiler takes both).
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634
MAX_SPLITS = 64


@triton.jit
def _dot(a, b, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    # UPCAST only under TRITON_INTERPRET with bfloat16: the interpreter multiplies bfloat16 bit
    # patterns in tl.dot (triton-lang/triton#11584). Same value either way: bf16 products are exact
    # in float32 and both accumulate in float32.
    if UPCAST:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    return tl.dot(a, b, input_precision=PRECISION)


# Ints that change from step to step are not specialized (Triton would compile a kernel for each
# value of "== 1" and "% 16 == 0" it meets, a second or so each, in the middle of serving): the query
# blocks and the page table's width. The partials' strides follow the step's tokens too, but their
# rows are padded to a multiple of 16 (below): always "% 16", and their stores stay aligned.
@triton.jit(do_not_specialize=["num_q_blocks", "stride_pt"])
def _attn(q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr, query_start_ptr, seq_lens_ptr, page_table_ptr,
          qk_scale, num_q_blocks, stride_qn, stride_qh, stride_kp, stride_ks, stride_kh,
          stride_vp, stride_vs, stride_vh, stride_os, stride_on, stride_oh, stride_ls, stride_ln,
          stride_pt, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_T: tl.constexpr,
          BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_DIM: tl.constexpr,
          PAGE_SIZE: tl.constexpr, SPLIT: tl.constexpr, PRECISION: tl.constexpr,
          UPCAST: tl.constexpr):
    # SPLIT: the grid's third axis splits the keys (partials and their log-sum-exp out); the split
    # count is the grid's, not a constexpr, so one kernel serves every count
    BLOCK_M: tl.constexpr = BLOCK_T * GROUP_PAD
    num_splits = tl.num_programs(2)
    seq = tl.program_id(0) // num_q_blocks
    q_block = tl.program_id(0) % num_q_blocks
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    q_start = tl.load(query_start_ptr + seq)
    q_len = tl.load(query_start_ptr + seq + 1) - q_start
    ctx = tl.load(seq_lens_ptr + seq)

    rows = tl.arange(0, BLOCK_M)
    tok = q_block * BLOCK_T + rows // GROUP_PAD  # token index within the sequence's chunk
    g = rows % GROUP_PAD
    row_ok = (tok < q_len) & (g < GROUP)
    pos = ctx - q_len + tok  # the token's position: it sees keys 0 .. pos
    head = kv_head * GROUP + g
    n_tok = (q_start + tok).to(tl.int64)  # row of q / out in the step's token axis
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    q = tl.load(q_ptr + n_tok[:, None] * stride_qn + head[:, None] * stride_qh + d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)

    # Keys this block needs: 0 .. position of its last token (none if the block is past the chunk);
    # split s takes [s * split_len, +split_len), split_len a multiple of BLOCK_N, so split 0 always
    # holds key 0 and every live row ends with l > 0.
    kv_end = tl.minimum(ctx, ctx - q_len + (q_block + 1) * BLOCK_T)
    kv_end = tl.where(q_block * BLOCK_T < q_len, kv_end, 0)
    split_len = tl.cdiv(tl.cdiv(kv_end, num_splits), BLOCK_N) * BLOCK_N
    lo = split * split_len
    hi = tl.minimum(lo + split_len, kv_end)

    # m starts finite: a row whose keys are all masked in a tile gets p = 0 and alpha = 1, not NaN.
    m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    pt_row = page_table_ptr + seq.to(tl.int64) * stride_pt
    start = lo
    while start < hi:
        n = start + tl.arange(0, BLOCK_N)
        n_ok = n < hi
        page = tl.load(pt_row + n // PAGE_SIZE, mask=n_ok, other=0).to(tl.int64)
        slot = n % PAGE_SIZE
        k_off = page * stride_kp + slot * stride_ks + kv_head * stride_kh
        kt = tl.load(k_ptr + k_off[None, :] + d[:, None], mask=n_ok[None, :] & d_ok[:, None], other=0.0)
        s = _dot(q, kt, PRECISION, UPCAST) * qk_scale  # [BLOCK_M, BLOCK_N], log2 units
        s = tl.where((n[None, :] <= pos[:, None]) & n_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        v_off = page * stride_vp + slot * stride_vs + kv_head * stride_vh
        v = tl.load(v_ptr + v_off[:, None] + d[None, :], mask=n_ok[:, None] & d_ok[None, :], other=0.0)
        # p in V's dtype, as the reference rounds its probabilities to q.dtype before P @ V
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, PRECISION, UPCAST)
        m_i = m_new
        start += BLOCK_N

    live = l_i > 0  # false only for an empty split (or a dead row)
    o = acc / tl.where(live, l_i, 1.0)[:, None]
    o_ptrs = (o_ptr + split.to(tl.int64) * stride_os + n_tok[:, None] * stride_on + head[:, None] * stride_oh
              + d[None, :])
    tl.store(o_ptrs, o.to(o_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
    if SPLIT:
        lse = tl.where(live, m_i + tl.log2(tl.where(live, l_i, 1.0)), float("-inf"))
        tl.store(lse_ptr + split.to(tl.int64) * stride_ls + n_tok * stride_ln + head, lse, mask=row_ok)


@triton.jit
def _combine(o_part_ptr, lse_ptr, out_ptr, stride_ps, stride_ls, stride_on, stride_oh,
             HQ: tl.constexpr, NUM_SPLITS: tl.constexpr, SPLITS_PAD: tl.constexpr,
             BLOCK_D: tl.constexpr, HEAD_DIM: tl.constexpr):
    # program = (token, head); partials o_part [S, N, Hq, D] float32, lse [S, N, Hq] (base 2)
    row = tl.program_id(0)
    tok = row // HQ
    head = row % HQ
    s = tl.arange(0, SPLITS_PAD)
    d = tl.arange(0, BLOCK_D)
    s_ok = s < NUM_SPLITS
    d_ok = d < HEAD_DIM
    lse = tl.load(lse_ptr + s * stride_ls + row, mask=s_ok, other=float("-inf"))
    w = tl.exp2(lse - tl.max(lse, 0))  # split 0 is never empty for a live token: max is finite
    o = tl.load(o_part_ptr + s[:, None].to(tl.int64) * stride_ps + row * HEAD_DIM + d[None, :],
                mask=s_ok[:, None] & d_ok[None, :], other=0.0)
    res = tl.sum(w[:, None] * o, 0) / tl.sum(w, 0)
    tl.store(out_ptr + tok.to(tl.int64) * stride_on + head * stride_oh + d, res.to(out_ptr.dtype.element_ty),
             mask=d_ok)


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def default_num_splits(programs: int, device: torch.device) -> int:
    """Key splits for a grid of `programs` (sequence, query block, kv head) programs. Below one
    program per SM, split to about four per SM, rounded up to a power of two: on an H200 at
    Hq 32 / Hkv 4 / D 128 and 32k context, batch 8 reads 2.2 TB/s with 9 splits and 3.3 TB/s with
    8 or 16 (a partial last wave of long programs costs more than extra splits); batch 64 is as fast
    unsplit. Depends on the grid only, not on context lengths, so a graph captured at short
    context stays fast at long."""
    if device.type != "cuda":
        return 1
    sms = _sm_count(device.index if device.index is not None else torch.cuda.current_device())
    if programs >= sms:
        return 1
    return min(MAX_SPLITS, triton.next_power_of_2(triton.cdiv(4 * sms, programs)))


def _blocks(max_q: int, group_pad: int, block_d: int) -> tuple[int, int, int]:
    """(BLOCK_T, BLOCK_N, num_warps) of a step whose longest chunk is max_q tokens."""
    if max_q == 1:  # decode: the head group padded to 16 rows, long key tiles
        block_t = max(1, 16 // group_pad)
        block_n = 128 if block_d <= 128 else 64
    else:  # prefill chunks (decode tokens in the same step take one mostly idle block each)
        block_t = max(1, min(triton.next_power_of_2(max_q), 128 // group_pad), 16 // group_pad)
        block_n = 64
    return block_t, block_n, 8 if block_t * group_pad * block_d >= 128 * 128 else 4


def variant_runs(hq: int, hkv: int, dim: int) -> list[tuple[int, int]]:
    """(chunk tokens, key splits) of one launch per specialization: _attn's are (BLOCK_T, split or
    not), BLOCK_T a function of the longest chunk (_blocks); _combine's the split count."""
    group_pad = triton.next_power_of_2(hq // hkv)
    block_d = max(16, triton.next_power_of_2(dim))
    lengths: dict[tuple[int, int], int] = {}  # (BLOCK_T, decode or not) -> the shortest chunk that takes it
    for q_len in (1 << i for i in range(0, 8)):  # BLOCK_T stops growing at 128 // GROUP_PAD <= 128 tokens
        lengths.setdefault((_blocks(q_len, group_pad, block_d)[0], q_len == 1), q_len)
    runs = [(q_len, splits) for q_len in lengths.values() for splits in (1, 2)]
    return runs + [(2, 1 << i) for i in range(2, MAX_SPLITS.bit_length())]  # the other counts' _combine


def compile_variants(hq: int, hkv: int, dim: int, page_size: int, dtype: torch.dtype, device: torch.device) -> int:
    """Compile, before serving, every specialization of the kernels that a step of this attention can
    reach: _attn at each BLOCK_T a chunk takes, split and unsplit, and _combine at each split count.
    Otherwise the first step of a new shape (a few tokens over a cached prefix, say) compiles one, a
    second or so on a machine that has not run it yet (docs/prefix-cache.md). Launches on tiny dummy
    tensors of the model's strides (q [T, Hq, D], a cache [P, page_size, Hkv, D]); returns how many."""
    from moetier.layers.attention import make_batch

    runs = variant_runs(hq, hkv, dim)
    for q_len, splits in runs:
        pages = -(-q_len // page_size)
        cache = torch.zeros((pages, page_size, hkv, dim), dtype=dtype, device=device)
        q = torch.zeros((q_len, hq, dim), dtype=dtype, device=device)
        paged_attention_triton(q, cache, cache, make_batch([(0, q_len, list(range(pages)))], page_size, device),
                               num_splits=splits)
    return len(runs)


def paged_attention_triton(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch,
                           num_splits: int | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """q: [N, Hq, D]; k_cache, v_cache: [P, page_size, Hkv, D] (this step's keys already written);
    batch: attention.AttnBatch. -> [N, Hq, D] in q.dtype; rows past batch.num_tokens are not written.
    num_splits: key splits per program (None: default_num_splits); out: optional [N, Hq, D] buffer."""
    n, hq, dim = q.shape
    page_size, hkv = k_cache.shape[1], k_cache.shape[2]
    assert hq % hkv == 0, f"Hq {hq} is not a multiple of Hkv {hkv}"
    assert page_size & (page_size - 1) == 0, f"page_size {page_size} is not a power of two"
    assert k_cache.shape == v_cache.shape and k_cache.shape[3] == dim
    assert k_cache.dtype == v_cache.dtype == q.dtype, (q.dtype, k_cache.dtype, v_cache.dtype)
    if q.stride(2) != 1:
        q = q.contiguous()
    assert k_cache.stride(3) == 1 and v_cache.stride(3) == 1, "K/V cache rows must be contiguous"
    if out is None:
        out = torch.empty((n, hq, dim), dtype=q.dtype, device=q.device)
    assert out.shape == q.shape and out.dtype == q.dtype and out.stride(2) == 1
    num_seqs, num_tokens, max_q = batch.num_seqs, batch.num_tokens, batch.max_query_len
    if num_seqs == 0 or num_tokens == 0 or max_q == 0:
        return out

    group = hq // hkv
    group_pad = triton.next_power_of_2(group)
    block_d = max(16, triton.next_power_of_2(dim))
    block_t, block_n, num_warps = _blocks(max_q, group_pad, block_d)
    num_q_blocks = triton.cdiv(max_q, block_t)
    if num_splits is None:
        num_splits = default_num_splits(num_seqs * num_q_blocks * hkv, q.device)
    upcast = q.dtype == torch.bfloat16 and os.environ.get("TRITON_INTERPRET") == "1"
    precision = "ieee" if q.dtype == torch.float32 or upcast else "tf32"  # ignored for 16-bit inputs

    if num_splits == 1:
        o, lse, o_strides, lse_strides = out, out, (0, out.stride(0), out.stride(1)), (0, 0)
    else:  # partials [S, N, Hq, D] and their log-sum-exp [S, N, Hq], sized by host ints only
        # rows padded to a multiple of 16, so that the split strides are always "% 16" (one
        # specialization, and the partials' stores keep their alignment)
        o = torch.empty((num_splits, -(-n // 16) * 16, hq, dim), dtype=torch.float32, device=q.device)
        lse = torch.empty((num_splits, -(-n // 16) * 16, hq), dtype=torch.float32, device=q.device)
        o_strides, lse_strides = (o.stride(0), o.stride(1), o.stride(2)), (lse.stride(0), lse.stride(1))
    _attn[(num_seqs * num_q_blocks, hkv, num_splits)](
        q, k_cache, v_cache, o, lse, batch.query_start, batch.seq_lens, batch.page_table,
        dim**-0.5 * LOG2E, num_q_blocks, q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        *o_strides, *lse_strides, batch.page_table.stride(0),
        GROUP=group, GROUP_PAD=group_pad, BLOCK_T=block_t, BLOCK_N=block_n, BLOCK_D=block_d,
        HEAD_DIM=dim, PAGE_SIZE=page_size, SPLIT=num_splits > 1, PRECISION=precision,
        UPCAST=upcast, num_warps=num_warps)
    if num_splits > 1:
        _combine[(num_tokens * hq,)](
            o, lse, out, o.stride(0), lse.stride(0), out.stride(0), out.stride(1), HQ=hq,
            NUM_SPLITS=num_splits, SPLITS_PAD=triton.next_power_of_2(num_splits), BLOCK_D=block_d,
            HEAD_DIM=dim, num_warps=4 if block_d >= 128 else 1)
    return out
