"""Scattered KV pages between the device pool and the host KV tier in one Triton launch per page
tensor row (engine/kv_moves.py).

A plan's pages are wherever the pool and the tier had them free, so after some churn a run of
consecutive pages is one or two long: one cudaMemcpyAsync per run and per layer row meant tens of
thousands of small copies for one admission's host hits, each paying a launch on the host and a
descriptor on the copy engine. Here the pairs' indices go to the device once per step, and each row
moves all of its pages in one kernel that reads and writes the host side through unified addressing
(pinned, registered memory: the same address on the device), at the link's rate.

    src [num_src_pages, words], dst [num_dst_pages, words] (one row of a page tensor, as words)
    dst[dst_idx[i]] = src[src_idx[i]]  for i < n

The oracle is the copy along runs in engine/kv_moves.py (torch, the CPU path); tests/page_copy_interpreter.py
and tests/test_gpu_prefix_cache.py hold the kernel to it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 1024  # words (4 KiB as int32) a program moves: a GQA page of 16 tokens is 4 of them


@triton.jit
def _copy_pages(src_ptr, dst_ptr, src_idx_ptr, dst_idx_ptr, words, BLOCK: tl.constexpr):
    # program (pair i, chunk c): BLOCK words of page src_idx[i] to page dst_idx[i]
    i = tl.program_id(0)
    c = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    a = tl.load(src_idx_ptr + i).to(tl.int64)
    b = tl.load(dst_idx_ptr + i).to(tl.int64)
    m = c < words
    tl.store(dst_ptr + b * words + c, tl.load(src_ptr + a * words + c, mask=m), mask=m)


def word_dtype(page_bytes: int) -> torch.dtype:
    """The widest word that divides a page: the kernel's loads and stores move words, not bytes."""
    for dtype in (torch.int32, torch.int16):
        if page_bytes % dtype.itemsize == 0:
            return dtype
    return torch.uint8


def as_words(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A contiguous page tensor [rows, pages, ...] -> [rows, pages * words] of `dtype` (a view)."""
    if not t.is_contiguous():
        raise ValueError("a page tensor must be contiguous to be copied as words")
    return t.view(torch.uint8).reshape(t.shape[0], -1).view(dtype)


def word_rows(device: list[torch.Tensor], host: list[torch.Tensor], layer_rows: dict[int, list[tuple[int, int]]]
              ) -> dict[int, list[tuple[torch.Tensor, torch.Tensor, int]]]:
    """Per model layer, its page tensor rows as copy_pages takes them: (device row, host row, words per
    page), the rows as words of the widest type that divides a page. device, host: the pool's page
    tensors [rows, pages, ...] and the tier's [rows, capacity, ...]; layer_rows: KVCache.layer_rows()."""
    out: dict[int, list[tuple[torch.Tensor, torch.Tensor, int]]] = {}
    for layer, rows in layer_rows.items():
        for t, r in rows:
            d, h = device[t], host[t]
            dtype = word_dtype(d[0, 0].numel() * d.element_size())
            dw = as_words(d, dtype)
            out.setdefault(layer, []).append((dw[r], as_words(h, dtype)[r], dw.shape[1] // d.shape[1]))
    return out


def copy_pages(src, dst, src_idx: torch.Tensor, dst_idx: torch.Tensor, words: int) -> None:
    """dst page dst_idx[i] <- src page src_idx[i] for every i (int32 index tensors on the device).

    src, dst: one row of a page tensor as words (as_words(t)[row]), a device tensor, or pinned host
    memory handed as a device pointer (experts/cache/store.DevicePointer); `words` per page. Runs on
    the current stream; pages named twice on the destination side are a caller's error."""
    n = src_idx.numel()
    if n:
        _copy_pages[(n, triton.cdiv(words, BLOCK))](src, dst, src_idx, dst_idx, words, BLOCK=BLOCK,
                                                    num_warps=4)
