"""DeepSeek sparse attention's lightning indexer (GLM-5; DeepSeek-V3.2 differs in its rotary
layout): for each new token, the positions of the index_topk earlier tokens its attention reads.

    q_resid [N, q_lora] -> wq_b -> q [N, Hi, D]; its first `rope` dims roped (interleaved)
    x [N, H] -> wk -> LayerNorm (k_norm, eps 1e-6) -> k [N, D], first `rope` dims roped; written to the
      layer's index_k pages (layers/kv_cache.MlaKVCache) at the step's slots
    x -> weights_proj (float32) * Hi^-1/2 -> w [N, Hi]
    score(n, j) = sum_h w[n, h] * relu(D^-1/2 * q[n, h] . k[j])        (float32)
    -> top index_topk keys among the causal ones (0 .. the token's position) -> [N, index_topk] int32
       positions, -1 where the context holds fewer keys (fixed width for graphs)

The reference (CPU, prefill) uses the same ops in the same order as transformers' GlmMoeDsaIndexer
and the same torch.topk over one sequence's row of scores, so exact ties (relu makes many scores
exactly 0) break the same way. Decode and verify steps on CUDA score the keys in place
(layers/dsa_select_triton.py, graph-safe; its oracle here is key_scores_fixed), then topk.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from moetier.layers.attention import AttnBatch, query_chunks, sequence_rows
from moetier.layers.kv_cache import MlaKVCache
from moetier.layers.param import param
from moetier.layers.quant_linear import linear
from moetier.layers.rotary import apply_rope_interleave
from moetier.spec.config import MAX_SPECULATIVE_TOKENS

K_NORM_EPS = 1e-6  # the reference's nn.LayerNorm(head_dim, eps=1e-6)
# On CUDA, steps of at most this many rows a sequence (decode: 1; a verify step: k + 1) score in place
# (dsa_select_triton.key_scores, graph-safe, [N, S] float32 scores); longer ones (prefill) take the
# reference, whose transient query_chunks bounds.
IN_PLACE_ROWS = MAX_SPECULATIVE_TOKENS + 1


def select_topk_reference(q: torch.Tensor, w: torch.Tensor, index_k: torch.Tensor, batch: AttnBatch, topk: int,
                          scale: float) -> torch.Tensor:
    """q: [N, Hi, D] (roped); w: [N, Hi] float32 head weights; index_k: [pages, page_size, D] of one
    layer, this step's keys written. -> [N, topk] int32 positions within each sequence, -1 padded.

    A per-sequence loop over host integers (batch.query_start_host): not graph-safe; the CPU path
    and the oracle, whose torch.topk over exactly one sequence's row breaks ties as transformers'
    does. Decode and verify steps on CUDA score with layers/dsa_select_triton.py, then topk_positions."""
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        raise RuntimeError("select_topk_reference loops over host integers and cannot be captured in a CUDA "
                           "graph; decode steps go through dsa_select_triton.key_scores")
    out = torch.full((q.shape[0], topk), -1, dtype=torch.int32, device=q.device)
    qs, lens = batch.query_start_host, batch.seq_lens_host
    for i in range(batch.num_seqs):
        a, b, ctx = qs[i], qs[i + 1], lens[i]
        if a == b:
            continue
        keys = sequence_rows(index_k, batch, i).float()  # [ctx, D]
        for c, d in query_chunks(a, b, q.shape[1] * ctx * 4):
            scores = F.relu(torch.matmul(q[c:d].float(), keys.t()) * scale)  # [T, Hi, ctx]
            index = torch.matmul(w[c:d, None, :], scores).squeeze(1)  # [T, ctx]
            pos = torch.arange(ctx - (b - c), ctx - (b - d), device=q.device)
            causal = torch.arange(ctx, device=q.device)[None, :] <= pos[:, None]
            index = index.masked_fill(~causal, float("-inf"))
            k = min(topk, ctx)
            vals, ids = index.topk(k, dim=-1)
            out[c:d, :k] = torch.where(vals == float("-inf"), -1, ids).to(torch.int32)
    return out


def key_scores_fixed(q: torch.Tensor, w: torch.Tensor, index_k: torch.Tensor, batch: AttnBatch,
                     scale: float) -> torch.Tensor:
    """The indexer's scores in fixed shapes from device tensors only (graph-safe) -> [N, W * page_size]
    float32: every token scores all W * page_size rows of its sequence's page table ([N, Hi, W *
    page_size] float32 products), -inf past its own position. For decode and verify steps, where N is a
    few rows a sequence; a prefill would materialise N copies of the keys. The oracle of
    dsa_select_triton.key_scores, which CUDA decode and verify run instead (it reads the keys in
    place). Ties (relu zeroes many) may leave topk in another order than select_topk_reference's,
    whose rows end at the context length."""
    n = q.shape[0]
    seq_of = torch.searchsorted(batch.query_start[1:].long(), torch.arange(n, device=q.device), right=True)
    keys = index_k[batch.page_table.long()[seq_of]].flatten(1, 2)  # [N, W * page_size, D]
    scores = F.relu(torch.einsum("nhd,nsd->nhs", q.float(), keys.float()) * scale)
    index = torch.einsum("nh,nhs->ns", w, scores)
    past = torch.arange(keys.shape[1], device=q.device)[None, :] > batch.positions[:, None]
    return index.masked_fill(past, float("-inf"))


def topk_positions(scores: torch.Tensor, topk: int) -> torch.Tensor:
    """scores [N, S] float32 (-inf: not a key) -> [N, topk] int32 positions, best first, -1 unused."""
    k = min(topk, scores.shape[1])
    vals, ids = scores.topk(k, dim=-1)
    out = torch.full((scores.shape[0], topk), -1, dtype=torch.int32, device=scores.device)
    out[:, :k] = torch.where(vals == float("-inf"), -1, ids).to(torch.int32)
    return out


class DsaIndexer(nn.Module):
    def __init__(self, layer: int, hidden: int, q_lora_rank: int, num_heads: int, head_dim: int, rope: int,
                 topk: int, dtype: torch.dtype, device: torch.device | str):
        super().__init__()
        self.layer, self.hi, self.d, self.rope, self.topk = layer, num_heads, head_dim, rope, topk
        self.wq_b = param(num_heads * head_dim, q_lora_rank, dtype=dtype, device=device)
        self.wk = param(head_dim, hidden, dtype=dtype, device=device)
        self.k_norm = param(head_dim, dtype=dtype, device=device)
        self.k_norm_bias = param(head_dim, dtype=dtype, device=device)
        # float32 whatever the model dtype: transformers lists it in _keep_in_fp32_modules (though its
        # bf16 from_pretrained still rounds it to bf16: a difference at bf16 rounding level)
        self.weights_proj = param(num_heads, hidden, dtype=torch.float32, device=device)

    def rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        # x: [N, heads, D]; rotary on the first `rope` dims, the rest pass (the reverse of MLA's q)
        rot, rest = x.split([self.rope, self.d - self.rope], dim=-1)
        return torch.cat([apply_rope_interleave(rot, cos, sin), rest], dim=-1)

    def forward(self, x: torch.Tensor, q_resid: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                batch: AttnBatch, kv: MlaKVCache) -> torch.Tensor:
        """x: [N, H] (the attention's normed input); q_resid: [N, q_lora]; cos, sin: [N, rope].
        Writes this step's keys, returns [N, topk] int32 positions (-1 unused)."""
        t = x.shape[0]
        q = self.rotate(linear(q_resid, self.wq_b).view(t, self.hi, self.d), cos, sin)
        k = F.layer_norm(linear(x, self.wk), (self.d,), self.k_norm, self.k_norm_bias, K_NORM_EPS)
        k = self.rotate(k[:, None], cos, sin)[:, 0]
        index_k = kv.index_k[kv.index_slot[self.layer]]
        index_k.view(-1, self.d)[batch.slot_mapping] = k
        w = linear(x.float(), self.weights_proj) * self.hi ** -0.5
        if q.is_cuda and batch.max_query_len <= IN_PLACE_ROWS:
            from moetier.layers.dsa_select_triton import key_scores

            return topk_positions(key_scores(q, w, index_k, batch, self.d ** -0.5), self.topk)
        return select_topk_reference(q, w, index_k, batch, self.topk, self.d ** -0.5)
