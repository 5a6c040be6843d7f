"""The plain-torch expert computation: the CPU path of every backend, the large-step (prefill) path
on CUDA, and the oracle the Triton GEMMs are tested against.

    expert_pairs(hidden [T, H], keys [T, k], fetch) -> [T, k, H]   each pair's SwiGLU output
    combine(pair_out [T, k, H], topk_weights [T, k]) -> [T, H]      weighted sum, fixed order over k
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from moetier.activation import silu_mul
from moetier.quant.rows import RowLayout

Fetch = Callable[[int], tuple[torch.Tensor, torch.Tensor]]  # row key -> (w13 [2I, H], w2 [H, I])


def expert_pairs(hidden: torch.Tensor, keys: torch.Tensor, fetch: Fetch, limit: float | None = None) -> torch.Tensor:
    """Outputs of every (token, slot) pair, before weighting: [T, k, H].

    `keys` [T, k] names the row each pair reads; fetch(key) gives that row's weights. Rows are visited
    one at a time over the pairs that use them, pairs in flat order; a pair's result depends only on
    its token and its row's bytes, so which rows hold which expert never changes a bit.
    NOTE: host-side loop over used rows (syncs); the CUDA decode path is grouped_gemm.grouped_expert_mlp.
    A negative key (experts/parallel/ep.NOT_MINE: another rank's expert) reads no row; its output is zero.
    limit: the SwiGLU clamp (RowLayout.swiglu_limit, GLM-5.3-Flash), None for the plain SwiGLU.
    """
    t, k = keys.shape
    flat = keys.reshape(-1)
    tok = torch.arange(t, device=hidden.device).repeat_interleave(k)
    out = hidden.new_empty(t * k, hidden.shape[-1])
    order = torch.argsort(flat, stable=True)
    uniq, counts = torch.unique_consecutive(flat[order], return_counts=True)
    begin = 0
    for key, n in zip(uniq.tolist(), counts.tolist()):
        pairs = order[begin:begin + n]
        begin += n
        if key < 0:
            out[pairs] = 0
            continue
        w13, w2 = fetch(key)
        out[pairs] = F.linear(silu_mul(F.linear(hidden[tok[pairs]], w13), limit), w2)
    return out.view(t, k, -1)


def combine(pair_out: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
    # pair_out: [T, k, H], topk_weights: [T, k] -> [T, H]; a fixed reduction order over k.
    return (pair_out * topk_weights[..., None].to(pair_out.dtype)).sum(dim=1)


def row_fetch(rows: torch.Tensor, layout: RowLayout, dtype: torch.dtype | None = None) -> Fetch:
    """Fetch from a rows tensor [N, R], where it lives. Weights come in `dtype` (the hidden states'):
    views of unquantized rows, FP8 rows dequantized (RowLayout.weights), so every backend that reads
    the same row bytes computes with the same weights."""
    def fetch(key: int) -> tuple[torch.Tensor, torch.Tensor]:
        w13, w2 = layout.weights(rows[key:key + 1], dtype or rows.dtype)
        return w13[0], w2[0]
    return fetch
