"""Attention over the paged KV pool, for a step that mixes sequences: decode tokens and prefill
chunks, flattened into one token axis.

A step holds B sequences. Sequence i brings q_len_i new tokens (tokens query_start[i] to
query_start[i + 1] of the step) and, after this step, seq_lens[i] tokens of context; its new tokens
sit at positions seq_lens[i] - q_len_i ... seq_lens[i] - 1, and token j sees keys 0 .. its position.
The keys of sequence i live in pages page_table[i, 0], page_table[i, 1], ... of page_size tokens.

This file holds the metadata (AttnBatch, make_batch) and the plain-torch reference (the CPU path and
the test oracle); the Triton kernel for CUDA is paged_attention_triton.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import chain

import numpy as np
import torch
import torch.nn.functional as F


@dataclass
class AttnBatch:
    """What attention needs to know about one step. Device tensors, plus host copies of the few
    integers the CPU path loops over (so it never reads a device tensor back)."""

    positions: torch.Tensor  # [N] int64, position of each new token in its sequence
    slot_mapping: torch.Tensor  # [N] int64, flat KV slot (page * page_size + offset) each new token writes
    query_start: torch.Tensor  # [B + 1] int32
    seq_lens: torch.Tensor  # [B] int32, context length after this step
    page_table: torch.Tensor  # [B, max_pages] int32 (unused entries 0)
    query_start_host: list[int]
    seq_lens_host: list[int]
    max_query_len: int
    # the state slot of each sequence (linear-attention layers, layers/state_cache.py); None: sequence
    # i uses slot i (a model without state, or one sequence over a pool of its own)
    state_slots: torch.Tensor | None = None  # [B] int64
    state_slots_host: list[int] | None = None

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_host)

    @property
    def num_tokens(self) -> int:
        return self.query_start_host[-1]


def make_batch(seqs: list[tuple[int, int, list[int]]], page_size: int, device: torch.device | str,
               state_slots: list[int] | None = None) -> AttnBatch:
    """AttnBatch for sequences given as (tokens before this step, new tokens, page table), and their
    state slots for models with recurrent state."""
    # numpy over the step's tokens and pages, no Python loop per token: this runs on the host every
    # eager step (prefill chunks of thousands of tokens), serially with the GPU
    n = len(seqs)
    done = np.fromiter((d for d, _, _ in seqs), dtype=np.int64, count=n)
    new = np.fromiter((q for _, q, _ in seqs), dtype=np.int64, count=n)
    num_pages = np.fromiter((len(pages) for _, _, pages in seqs), dtype=np.int64, count=n)
    if (done + new > num_pages * page_size).any():
        raise ValueError("a sequence's page table is shorter than its context after the step")
    width = int(num_pages.max())
    table = np.zeros((n, width), dtype=np.int32)
    # row i's first num_pages[i] entries, in row-major order: the page lists one after another
    table[np.arange(width) < num_pages[:, None]] = np.fromiter(
        chain.from_iterable(pages for _, _, pages in seqs), dtype=np.int32, count=int(num_pages.sum()))
    starts = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(new, out=starts[1:])
    seq = np.repeat(np.arange(n), new)  # [N] the sequence of each new token
    positions = np.arange(starts[-1], dtype=np.int64) - starts[:-1][seq] + done[seq]
    slots = table[seq, positions // page_size].astype(np.int64) * page_size + positions % page_size
    lens = done + new
    starts, lens = starts.tolist(), lens.tolist()
    return AttnBatch(
        positions=torch.from_numpy(positions).to(device),
        slot_mapping=torch.from_numpy(slots).to(device),
        query_start=torch.tensor(starts, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(lens, dtype=torch.int32, device=device),
        page_table=torch.from_numpy(table).to(device),
        query_start_host=starts,
        seq_lens_host=lens,
        max_query_len=int(new.max()),
        state_slots=None if state_slots is None else torch.tensor(state_slots, dtype=torch.int64, device=device),
        state_slots_host=state_slots,
    )


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int) -> torch.Tensor:
    """q: [T, Hq, D] for positions [start, start + T); k, v: [start + T, Hkv, D] -> [T, Hq, D].

    Softmax in float32 as the reference does; query i sees keys 0..start+i.
    """
    t, hq, d = q.shape
    s, hkv, _ = k.shape
    group = hq // hkv
    # [Hkv, group, T, D] x [Hkv, D, S] -> [Hkv, group, T, S]
    qg = q.transpose(0, 1).reshape(hkv, group, t, d)
    scores = torch.matmul(qg, k.permute(1, 2, 0)[:, None]) * d**-0.5
    if t > 1:
        mask = torch.arange(s)[None, :] > (torch.arange(t)[:, None] + start)
        scores = scores.masked_fill(mask.to(scores.device), float("-inf"))
    probs = F.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    out = torch.matmul(probs, v.transpose(0, 1)[:, None])  # [Hkv, group, T, D]
    return out.reshape(hq, t, d).transpose(0, 1)


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """k_cache, v_cache: [P, page_size, Hkv, D] of one layer; k, v: [N, Hkv, D] new tokens."""
    hkv, d = k.shape[1], k.shape[2]
    k_cache.view(-1, hkv, d)[slot_mapping] = k
    v_cache.view(-1, hkv, d)[slot_mapping] = v


def sequence_rows(cache: torch.Tensor, batch: AttnBatch, i: int) -> torch.Tensor:
    """cache: [pages, page_size, ...] of one layer -> [ctx, ...], sequence i's rows in token order."""
    ctx, page_size = batch.seq_lens_host[i], cache.shape[1]
    pages = batch.page_table[i, : (ctx + page_size - 1) // page_size].long()
    return cache[pages].flatten(0, 1)[:ctx]


def query_chunks(a: int, b: int, row_bytes: int, budget: int = 1 << 28) -> list[tuple[int, int]]:
    """Tokens a..b of a step in runs whose float32 score rows (row_bytes each) stay within budget
    bytes: a long prefill's [T, context] scores are never materialised whole."""
    step = max(1, budget // max(row_bytes, 1))
    return [(c, min(c + step, b)) for c in range(a, b, step)]


def paged_attention_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                              batch: AttnBatch) -> torch.Tensor:
    """q: [N, Hq, D]; k_cache, v_cache: [P, page_size, Hkv, D] (this step's keys already written).
    -> [N, Hq, D]. Gathers each sequence's pages and runs the same causal attention as a contiguous
    cache would, so paging changes no bit."""
    page_size = k_cache.shape[1]
    out = torch.empty_like(q)
    qs, lens = batch.query_start_host, batch.seq_lens_host
    for i in range(batch.num_seqs):
        q_len, ctx = qs[i + 1] - qs[i], lens[i]
        if q_len == 0:
            continue
        pages = batch.page_table[i, : (ctx + page_size - 1) // page_size].long()
        k = k_cache[pages].flatten(0, 1)[:ctx]
        v = v_cache[pages].flatten(0, 1)[:ctx]
        out[qs[i]:qs[i + 1]] = causal_attention(q[qs[i]:qs[i + 1]], k, v, ctx - q_len)
    return out
