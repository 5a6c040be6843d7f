"""Attention in MLA's latent space over the paged latent cache (layers/kv_cache.MlaKVCache), with
the absorbed weights: the query's no-position part is multiplied into the latent space once
(q_nope @ W_UK per head) so keys and values are never expanded, and the output stays latent
(the caller applies W_UV per head, then o_proj).

    q      [N, Hq, R + P]   per head: [absorbed q_nope (R = kv_lora_rank) | roped q_pe (P = rope_dim)]
    latent [pages, page_size, R + P] of one layer: per token [normed c_kv (R) | roped k_pe (P)]
    score(n, j) = scale * q[n] . latent[j]        (one dot product over R + P)
    out[n] = sum_j softmax_j(score) * latent[j, :R] -> [N, Hq, R]

Which keys a token sees: keys 0 .. its position (causal, the step layout of layers/attention.py),
and with DeepSeek sparse attention only the positions listed in its row of `topk` ([N, K] int32
token positions within the sequence; -1 marks an unused entry; every valid entry of a token's row
lies in its first position + 1 columns, as the selections make them: the kernel's walk stops
there). topk None: every causal key.

This file holds the plain-torch reference (the CPU path and the test oracle) and the dispatch; the
Triton kernel for CUDA is latent_attention_triton.py.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from moetier.layers.attention import AttnBatch, query_chunks, sequence_rows


def write_latent(latent: torch.Tensor, rows: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """latent: [pages, page_size, R + P] of one layer; rows: [N, R + P] of the step's new tokens."""
    latent.view(-1, latent.shape[-1])[slot_mapping] = rows


def latent_attention_reference(q: torch.Tensor, latent: torch.Tensor, batch: AttnBatch, scale: float,
                               kv_lora_rank: int, topk: torch.Tensor | None = None) -> torch.Tensor:
    """q: [N, Hq, R + P]; latent: [pages, page_size, R + P] (this step's rows already written);
    topk: None or [N, K] int32 positions (-1 unused). -> [N, Hq, R] in q.dtype.

    Scores and softmax in float32; probabilities rounded to q.dtype before they weigh the values,
    as layers/attention.causal_attention does."""
    out = q.new_empty(q.shape[0], q.shape[1], kv_lora_rank)
    qs, lens = batch.query_start_host, batch.seq_lens_host
    for i in range(batch.num_seqs):
        a, b, ctx = qs[i], qs[i + 1], lens[i]
        if a == b:
            continue
        rows = sequence_rows(latent, batch, i)  # [ctx, R + P]
        keys = torch.arange(ctx, device=q.device)
        for c, d in query_chunks(a, b, q.shape[1] * ctx * 4):
            scores = torch.einsum("thd,sd->hts", q[c:d].float(), rows.float()) * scale  # [Hq, T, ctx]
            pos = torch.arange(ctx - (b - c), ctx - (b - d), device=q.device)
            allowed = keys[None, :] <= pos[:, None]  # [T, ctx]
            if topk is not None:
                sel = topk[c:d].long()
                chosen = torch.zeros(d - c, ctx + 1, dtype=torch.bool, device=q.device)
                # -1 entries land in the spare last column, which is dropped
                chosen.scatter_(1, torch.where(sel < 0, ctx, sel.clamp(max=ctx)), True)
                allowed &= chosen[:, :ctx]
            scores = scores.masked_fill(~allowed[None], float("-inf"))
            probs = F.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
            out[c:d] = torch.einsum("hts,sr->thr", probs, rows[:, :kv_lora_rank])
    return out


def latent_attention(q: torch.Tensor, latent: torch.Tensor, batch: AttnBatch, scale: float, kv_lora_rank: int,
                     topk: torch.Tensor | None = None) -> torch.Tensor:
    if q.is_cuda:
        from moetier.layers.latent_attention_triton import latent_attention_triton

        return latent_attention_triton(q, latent, batch, scale, kv_lora_rank, topk)
    return latent_attention_reference(q, latent, batch, scale, kv_lora_rank, topk)
