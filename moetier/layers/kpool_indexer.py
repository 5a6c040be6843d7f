"""GLM-5.3-Flash's DSA indexer with kpool: the lightning indexer of layers/dsa_indexer.py, scoring
groups of `kpool` consecutive keys instead of single keys, for NoPE attention (no rotary anywhere).

    q_resid [N, q_lora] -> wq_b -> q [N, Hi, D]
    x [N, H] -> wk -> LayerNorm (k_norm, eps 1e-6) -> k [N, D];  x -> gate = x W_gate^T [N, D]
      [k | gate] written to the layer's index_k pages (2D wide) at the step's slots
    pool p = tokens p*kpool .. (p+1)*kpool - 1 (complete pools only):
      pool_key[p] = sum_t softmax_t(gate[t] + ape[t - p*kpool]) * k[t]     (per channel, over the pool)
    x -> weights_proj * Hi^-1/2 -> w [N, Hi]  (float32)
    score(n, p) = sum_h w[n, h] relu(D^-1/2 q[n, h] . pool_key[p])
    a query at position s may pick pool p when the pool ends at or before s; it takes the best
    index_topk / kpool of those, expanded to their tokens, plus the tail: the tokens of its own
    incomplete pool (s - s % kpool .. s, when (s + 1) % kpool != 0).
    -> [N, index_topk + kpool - 1] int32 positions, -1 where unused (fixed width for graphs), the
       valid ones first: the visible pools' tokens by score, then the tail (place_tail), so a row
       holds at most s + 1 valid entries, all before column s + 1 (the attention's walk stops there)

The reference (CPU, and prefill on CUDA) uses the same ops in the same order as transformers'
Glm5NextTextIndexer, with one sequence's row of scores over the complete pools of its context (as
transformers' row for one sequence), so equal scores break the same way. Decode on CUDA takes
select_pools_cuda: the same scores in fixed shapes from device tensors only (graph-safe), two Triton
launches around torch.topk whose torch form, select_pools_fixed, is their oracle.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from moetier.layers.attention import AttnBatch, query_chunks, sequence_rows
from moetier.layers.dsa_indexer import IN_PLACE_ROWS, K_NORM_EPS
from moetier.layers.kv_cache import MlaKVCache
from moetier.layers.param import param
from moetier.layers.quant_linear import linear


def pool_keys(rows: torch.Tensor, ape: torch.Tensor, kpool: int) -> torch.Tensor:
    """rows: [..., ctx, 2D] a sequence's [k | gate] (leading dims: several); ape: [kpool, D]
    -> [..., ctx // kpool, D] the complete pools' keys, in rows' dtype."""
    d = ape.shape[1]
    n = rows.shape[-2] // kpool
    grouped = rows[..., : n * kpool, :].reshape(*rows.shape[:-2], n, kpool, 2 * d)
    keys, gate = grouped[..., :d], grouped[..., d:]
    probs = (gate.float() + ape.float()).softmax(dim=-2).to(keys.dtype)
    return (probs * keys).sum(dim=-2)


def tail_positions(pos: torch.Tensor, kpool: int) -> torch.Tensor:
    """pos [T] -> [T, kpool - 1]: the tokens of each query's incomplete pool (itself included), -1 after."""
    offsets = torch.arange(kpool - 1, device=pos.device)
    count = (pos + 1) % kpool  # tokens in the query's incomplete pool, itself included
    tail = (pos + 1 - count)[:, None] + offsets[None, :]
    return tail.masked_fill(offsets[None, :] >= count[:, None], -1)


def place_tail(out: torch.Tensor, visible: torch.Tensor, pos: torch.Tensor, kpool: int) -> None:
    """Writes each row's tail (tail_positions) right after its visible picked pools' tokens: out
    [T, topk + kpool - 1] int32 (picked pools' tokens first, by score, invisible ones -1; the rest
    -1); visible [T] how many picks are visible pools (they come first: masked scores sort last)."""
    if kpool > 1:
        cols = visible.long()[:, None] * kpool + torch.arange(kpool - 1, device=out.device)  # [T, kpool - 1]
        out.scatter_(1, cols, tail_positions(pos, kpool).to(out.dtype))


def select_pools_reference(q: torch.Tensor, w: torch.Tensor, index_k: torch.Tensor, ape: torch.Tensor,
                           batch: AttnBatch, topk: int, kpool: int, scale: float) -> torch.Tensor:
    """q: [N, Hi, D]; w: [N, Hi] float32; index_k: [pages, page_size, 2D] of one layer, this step's rows
    written. -> [N, topk + kpool - 1] int32 positions within each sequence, -1 padded. A loop over host
    integers: the CPU path and the oracle."""
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        raise RuntimeError("select_pools_reference loops over host integers and cannot be captured in a CUDA "
                           "graph; decode steps go through select_pools_fixed")
    n, width = q.shape[0], topk + kpool - 1
    out = torch.full((n, width), -1, dtype=torch.int32, device=q.device)
    qs, lens = batch.query_start_host, batch.seq_lens_host
    offsets = torch.arange(kpool, device=q.device)
    for i in range(batch.num_seqs):
        a, b, ctx = qs[i], qs[i + 1], lens[i]
        if a == b:
            continue
        keys = pool_keys(sequence_rows(index_k, batch, i), ape, kpool)  # [P, D]
        ends = torch.arange(1, keys.shape[0] + 1, device=q.device) * kpool - 1  # last token of each pool
        select = min(topk // kpool, keys.shape[0])
        for c, d in query_chunks(a, b, q.shape[1] * max(keys.shape[0], 1) * 4):
            pos = torch.arange(ctx - (b - c), ctx - (b - d), device=q.device)  # [T]
            if select:
                scores = F.relu(torch.matmul(q[c:d].float(), keys.float().t()) * scale)  # [T, Hi, P]
                index = torch.matmul(w[c:d, None, :], scores).squeeze(1)  # [T, P]
                visible = ends[None, :] <= pos[:, None]
                index = index.masked_fill(~visible, torch.finfo(index.dtype).min)
                picked = index.topk(select, dim=-1).indices  # [T, select]
                ok = visible.gather(1, picked)
                seen = ok.sum(-1)
                tokens = picked[..., None] * kpool + offsets  # [T, select, kpool]
                tokens = tokens.masked_fill(~ok[..., None], -1).flatten(1)
                out[c:d, : tokens.shape[1]] = tokens.to(torch.int32)
            else:
                seen = torch.zeros(d - c, dtype=torch.long, device=q.device)
            place_tail(out[c:d], seen, pos, kpool)
    return out


def select_pools_fixed(q: torch.Tensor, w: torch.Tensor, index_k: torch.Tensor, ape: torch.Tensor,
                       batch: AttnBatch, topk: int, kpool: int, scale: float) -> torch.Tensor:
    """select_pools_reference in fixed shapes from device tensors only (graph-safe): every token
    scores the pools of all W * page_size rows of its sequence's page table, those that end past its
    position masked. For decode and verify steps (a few rows a sequence): a prefill would gather N
    copies of the keys.
    NOTE: equal scores may break differently from the reference (its rows end at the context).
    The torch form of the CUDA kernels (select_pools_cuda) and their test oracle."""
    return pool_tokens_fixed(pool_scores_fixed(q, w, index_k, ape, batch, kpool, scale), batch.positions,
                             topk, kpool)


def pool_scores_fixed(q: torch.Tensor, w: torch.Tensor, index_k: torch.Tensor, ape: torch.Tensor,
                      batch: AttnBatch, kpool: int, scale: float) -> torch.Tensor:
    """-> [N, P] float32: each token's score of every pool of its page-table window (P = W *
    page_size // kpool), pools that end after its position at float32's lowest."""
    n = q.shape[0]
    seq_of = torch.searchsorted(batch.query_start[1:].long(), torch.arange(n, device=q.device), right=True)
    rows = index_k[batch.page_table.long()[seq_of]].flatten(1, 2)  # [N, W * page_size, 2D]
    keys = pool_keys(rows, ape, kpool)  # [N, P, D]
    scores = F.relu(torch.einsum("nhd,npd->nhp", q.float(), keys.float()) * scale)
    index = torch.einsum("nh,nhp->np", w, scores)
    ends = torch.arange(1, keys.shape[1] + 1, device=q.device) * kpool - 1
    visible = ends[None, :] <= batch.positions[:, None]
    return index.masked_fill(~visible, torch.finfo(index.dtype).min)


def pool_tokens_fixed(index: torch.Tensor, positions: torch.Tensor, topk: int, kpool: int) -> torch.Tensor:
    """index [N, P] (pool_scores_fixed) -> [N, topk + kpool - 1] int32: the best topk / kpool pools'
    tokens (the visible ones: masked scores sort last), then the tail (place_tail), -1 after."""
    n, width = index.shape[0], topk + kpool - 1
    out = torch.full((n, width), -1, dtype=torch.int32, device=index.device)
    select = min(topk // kpool, index.shape[1])
    if select:
        picked = index.topk(select, dim=-1).indices
        ok = (picked + 1) * kpool - 1 <= positions[:, None]  # the pick is visible
        seen = ok.sum(-1)
        tokens = picked[..., None] * kpool + torch.arange(kpool, device=index.device)
        out[:, : select * kpool] = tokens.masked_fill(~ok[..., None], -1).flatten(1).to(torch.int32)
    else:
        seen = torch.zeros(n, dtype=torch.long, device=index.device)
    place_tail(out, seen, positions, kpool)
    return out


def select_pools_cuda(q: torch.Tensor, w: torch.Tensor, index_k: torch.Tensor, ape: torch.Tensor,
                      batch: AttnBatch, topk: int, kpool: int, scale: float) -> torch.Tensor:
    """select_pools_fixed in two Triton launches around torch.topk (layers/kpool_select_triton.py):
    decode and verify steps on CUDA (graph-safe). Scores agree with the torch form to float32 rounding."""
    from moetier.layers import kpool_select_triton as kernels  # Triton: CUDA (or the interpreter)

    index = kernels.pool_scores(q, w.contiguous(), index_k, ape, batch, kpool, scale)
    select = min(topk // kpool, index.shape[1])
    picked = index.topk(select, dim=-1).indices if select else None
    return kernels.pool_tokens(picked, batch.positions, kpool, topk + kpool - 1)


class KpoolIndexer(nn.Module):
    def __init__(self, layer: int, hidden: int, q_lora_rank: int, num_heads: int, head_dim: int, topk: int,
                 kpool: int, dtype: torch.dtype, device: torch.device | str):
        super().__init__()
        if topk % kpool:
            raise ValueError(f"index_topk {topk} must be a multiple of index_kpool {kpool}")
        self.layer, self.hi, self.d, self.topk, self.kpool = layer, num_heads, head_dim, topk, kpool
        self.wq_b = param(num_heads * head_dim, q_lora_rank, dtype=dtype, device=device)
        # rows [wk; index_kpool_compress_gate; weights_proj]: x's three projections in one GEMM (a
        # decode step paid a launch for each); the checkpoint's tensors are its row blocks
        self.x_proj = param(2 * head_dim + num_heads, hidden, dtype=dtype, device=device)
        self.k_norm = param(head_dim, dtype=dtype, device=device)
        self.k_norm_bias = param(head_dim, dtype=dtype, device=device)
        self.ape = param(kpool, head_dim, dtype=dtype, device=device)  # index_kpool_compress_ape

    def part(self, name: str) -> torch.Tensor | None:
        d = self.d
        return {"wq_b.weight": self.wq_b, "wk.weight": self.x_proj[:d], "k_norm.weight": self.k_norm,
                "k_norm.bias": self.k_norm_bias, "weights_proj.weight": self.x_proj[2 * d:],
                "index_kpool_compress_ape": self.ape, "index_kpool_compress_gate": self.x_proj[d: 2 * d]}.get(name)

    def forward(self, x: torch.Tensor, q_resid: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                batch: AttnBatch, kv: MlaKVCache) -> torch.Tensor:
        """x: [N, H] (the attention's normed input); q_resid: [N, q_lora]; cos, sin unused (NoPE).
        Writes this step's [k | gate] rows, returns [N, topk + kpool - 1] int32 positions (-1 unused)."""
        t, d = x.shape[0], self.d
        q = linear(q_resid, self.wq_b).view(t, self.hi, d)
        proj = linear(x, self.x_proj)  # [T, 2D + Hi]: k before its norm, the pool gate, the head weights
        k = F.layer_norm(proj[:, :d], (d,), self.k_norm, self.k_norm_bias, K_NORM_EPS)
        index_k = kv.index_k[kv.index_slot[self.layer]]
        index_k.view(-1, 2 * d)[batch.slot_mapping] = torch.cat([k, proj[:, d: 2 * d]], dim=-1)
        w = proj[:, 2 * d:].float() * self.hi ** -0.5
        select = select_pools_cuda if q.is_cuda and batch.max_query_len <= IN_PLACE_ROWS else select_pools_reference
        return select(q, w, index_k, self.ape, batch, self.topk, self.kpool, self.d ** -0.5)
