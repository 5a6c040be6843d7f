"""The large-step (prefill) path of the grouped expert GEMM: the pairs of a step sorted by the row
they read on the device (torch.argsort, then one single-program kernel that writes each row's chunks
of up to block_m pairs and the list of chunk starts), then grouped_gemm.py's gate_up / down /
combine kernels over a grid bounded by the chunk count. No host sync anywhere (docs/bench-prefill.md).

A pair with a negative expert id (experts/parallel/ep.NOT_MINE) takes the key max_rows, above every row key, so
the skipped pairs sort last as one run that starts no chunk: no program works for them, their h and y
rows stay unwritten and the combine skips them (grouped_gemm._combine).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moetier.experts.kernels.gemm_config import GemmConfig, compute_dtype, h_dtype
from moetier.experts.kernels.grouped_gemm import _experts

@triton.jit
def _max_combine(a, b):
    return tl.maximum(a, b)


@triton.jit(do_not_specialize=["n", "shift"])  # values that change per step and per layer
def _plan_sorted(keys_ptr, order_ptr, counts_ptr, chunk_end_ptr, starts_ptr, n, shift,
                 BLOCK_M: tl.constexpr, BLOCK: tl.constexpr):
    # One program walks the sorted positions BLOCK at a time, carrying the open row's first position
    # and the chunks so far: per position its row's run [begin, begin + count), a chunk start every
    # BLOCK_M of the run, chunk_end as the decode plan writes it, and the starts listed in order.
    # Key `shift` (== max_rows) is the skipped pairs' run: no chunk starts in it.
    carry_begin = tl.full([], 0, tl.int32)
    carry_chunks = tl.full([], 0, tl.int32)
    b0 = tl.full([], 0, tl.int32)
    while b0 < n:  # NOTE: a loop on a device value: Triton's interpreter takes no argument as a range bound
        pos = b0 + tl.arange(0, BLOCK)
        m = pos < n
        k = tl.load(keys_ptr + tl.load(order_ptr + pos, mask=m, other=0), mask=m, other=0)
        prev = tl.load(keys_ptr + tl.load(order_ptr + tl.maximum(pos - 1, 0), mask=m, other=0), mask=m, other=0)
        first = ((k != prev) | (pos == 0)) & m
        begin = tl.maximum(tl.associative_scan(tl.where(first, pos, -1), 0, _max_combine), carry_begin)
        end = begin + tl.load(counts_ptr + (k + shift), mask=m, other=0).to(tl.int32)
        start = ((pos - begin) % BLOCK_M == 0) & m & (k != shift)
        chunk = tl.cumsum(start.to(tl.int32), 0) + carry_chunks - 1
        tl.store(chunk_end_ptr + pos, tl.where(start, tl.minimum(pos + BLOCK_M, end), 0), mask=m)
        tl.store(starts_ptr + chunk, pos, mask=start)
        carry_begin = tl.max(tl.where(m, begin, 0), 0)
        carry_chunks += tl.sum(start.to(tl.int32), 0)
        b0 += BLOCK


def plan_large(slot_ids: torch.Tensor, topk_ids: torch.Tensor, block_m: int, max_rows: int
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The plan of a large step: a device sort (the O(P^2) plan kernel is for decode sizes), then one
    single-program kernel over the sorted positions. -> order [P] int32 (pair ids by (row key, pair
    id)), chunk_end [P] int32 (as the decode plan: per sorted position, the end of the chunk of up to
    block_m pairs starting there, else 0), starts [C] int32 (the chunk starts in sorted order, then
    -1), C = P // block_m + min(P, max_rows): each row's run adds at most one partial chunk. Keys are
    slot ids (>= 0, below max_rows) or -1 - expert; max_rows bounds the experts too, and is the key of
    a skipped pair (expert id < 0, whatever its slot id). No host sync; about ten launches."""
    ids = topk_ids.long()
    keys = torch.where(ids < 0, max_rows, torch.where(slot_ids >= 0, slot_ids.long(), -1 - ids)).reshape(-1)
    p = keys.numel()
    order = torch.argsort(keys, stable=True)
    shift = max_rows  # keys + shift in [0, 2 max_rows]: host keys reach -max_rows at most, skipped max_rows
    # NOTE: not torch.bincount, which reads the largest key back to the host (a sync)
    counts = torch.zeros(2 * max_rows + 1, dtype=torch.int32, device=keys.device)
    counts.scatter_add_(0, keys + shift, torch.ones_like(keys, dtype=torch.int32))
    chunk_end = torch.empty(p, dtype=torch.int32, device=keys.device)
    cap = p // block_m + min(p, max_rows)
    starts = torch.full((cap,), -1, dtype=torch.int32, device=keys.device)
    _plan_sorted[(1,)](keys, order, counts, chunk_end, starts, p, shift, BLOCK_M=block_m, BLOCK=1024, num_warps=8)
    return order.int(), chunk_end, starts


def grouped_expert_mlp_large(x: torch.Tensor, slot_ids: torch.Tensor, topk_ids: torch.Tensor,
                             topk_weights: torch.Tensor, dev_rows: torch.Tensor, host_rows, hidden: int, inter: int,
                             max_rows: int, config: GemmConfig = GemmConfig(),
                             quant: str | None = None, h: torch.Tensor | None = None,
                             y: torch.Tensor | None = None, limit: float | None = None) -> torch.Tensor:
    """The same SwiGLU experts for a step of any size (prefill): the plan by a device sort, chunks of
    config.large_blocks' block_m pairs of one row (a row read over the link crosses once per chunk), the grid
    bounded by the chunk count. Arguments as grouped_expert_mlp (limit: the SwiGLU clamp); max_rows:
    distinct rows possible (slots + host experts). Scratch is allocated per call (eager). -> out [T, H] in x.dtype.
    With y ([T*k, H] float32; h [T*k, I] in gemm_config.h_dtype with it, or one is allocated): no combine; the pair
    outputs of the pairs whose id is >= 0 land in y (the other rows untouched) and y is returned,
    for a caller that computes a step in several passes and combines once (experts/prefill/ring.py)."""
    t, k = topk_ids.shape
    bm, gate_up, down = config.large_blocks(t * k)
    order, chunk_end, starts = plan_large(slot_ids, topk_ids, bm, max_rows)
    passes = y is not None
    if h is None:
        h = torch.empty(t * k, inter, dtype=h_dtype(compute_dtype(x.dtype, dev_rows.dtype, quant)), device=x.device)
    if y is None:
        y = torch.empty(t * k, hidden, dtype=torch.float32, device=x.device)
    out = y if passes else torch.empty(t, hidden, dtype=x.dtype, device=x.device)
    _experts(x, slot_ids, topk_ids, topk_weights, dev_rows, host_rows, hidden, inter, order, chunk_end, starts,
             starts.numel(), h, y, out, bm, gate_up, down, listed=True, quant=quant,
             combine=not passes, limit=limit)
    return out
