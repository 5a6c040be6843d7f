"""Multi-head latent attention (DeepSeek-V2/V3, GLM-5) over the paged latent cache
(layers/kv_cache.MlaKVCache), with the absorbed weights.

    x [N, H] -> q: q_b(rms(q_a(x))) (low-rank path) or q_proj(x)  -> [N, Hq, nope + rope]
             -> kv_a_proj_with_mqa(x) = [c_kv (R) | k_pe (P)]; c_kv normed, k_pe roped (one head,
                shared by all query heads) -> the latent row [c_kv | k_pe] written to the cache
             -> q_nope absorbed through W_UK (kv_b_proj's key rows): [N, Hq, R], next to roped q_pe
             -> latent_attention (optionally over the DSA indexer's top-k positions) -> [N, Hq, R]
             -> W_UV (kv_b_proj's value rows) per head -> [N, Hq, v] -> o_proj -> [N, H]

Every token, prefill and decode alike, goes through the absorbed path: keys and values are never
expanded to full heads. That is what decode wants (the latent is read once per token of context);
for long prefills expanding kv_b per head can be cheaper in FLOPs, which is not done yet.

The arithmetic equals transformers' DeepseekV3Attention / GlmMoeDsaAttention up to float
reassociation: (q_nope W_UK) . c_kv instead of q_nope . (W_UK c_kv), and W_UV after the weighted sum
instead of before. qk_rope_head_dim may be 0 (no position part: the latent is c_kv alone).

Tensor parallelism (moetier/parallel.Parallel, tp ranks; as DeepSeek's and vLLM's MLA): rank r holds
query heads [r Hq/tp, (r+1) Hq/tp): q_b (or q_proj) column-split by those heads, kv_b's rows (so
W_UK and W_UV) by the same heads, o_proj row-split by them; the partial o_proj outputs are summed by
one all-reduce and o_proj's bias is added once, after it. q_a, kv_a and their norms are replicated:
the latent row is per token, shared by every head, so every rank computes and writes the same
latent into a whole (replicated) latent cache: MLA tensor parallelism does not shrink the KV cache.
The DSA indexer is replicated too (every rank computes the same top-k from replicated inputs).

Dense weights kept in the checkpoint's format (held: ModelConfig.dense_quant, layers/quant_linear.py):
q_a, q_b (or q_proj), kv_a and o, each one checkpoint tensor (no fusion, so ragged shapes are exact
too); kv_b stays in the model dtype, since it is used through its per-head views W_UK and W_UV, not
as a linear layer. Under tensor parallelism FP8 q_b (q_proj) stays FP8 only when a rank's rows
(Hq/tp x qk) end on scale blocks and o when its columns (Hq/tp x v) do (as in DeepSeek-V3 and GLM-5
up to tp 8), else dequantized at load; a 4-bit o whose rank's columns cut a group is refused.
"""

from __future__ import annotations

import torch
from torch import nn

from moetier.layers.attention import AttnBatch
from moetier.layers.quant_linear import dense_weight, linear
from moetier.layers.kv_cache import MlaKVCache
from moetier.layers.latent_attention import latent_attention, write_latent
from moetier.layers.norm import model_rms_norm
from moetier.layers.param import param
from moetier.layers.rotary import apply_rope, apply_rope_interleave
from moetier.parallel import Parallel

# q_a_layernorm and kv_a_layernorm are built without an eps argument in the reference (and in
# DeepSeek's own code), so they use 1e-6 whatever rms_norm_eps says (GLM-5.3-Flash's use rms_norm_eps:
# latent_eps).
LATENT_NORM_EPS = 1e-6


class MlaAttention(nn.Module):
    """One layer's MLA. q_lora_rank 0: a plain q_proj. indexer: a layers/dsa_indexer.DsaIndexer
    for DSA layers that pick their own keys (None: every causal key, or the top-k handed in)."""

    def __init__(self, layer: int, hidden: int, num_heads: int, q_lora_rank: int, kv_lora_rank: int, nope: int,
                 rope: int, v_dim: int, bias: bool, scale: float, interleave: bool, dtype: torch.dtype,
                 device: torch.device | str, indexer: nn.Module | None = None, held: str | None = None,
                 par: Parallel = Parallel(), latent_eps: float = LATENT_NORM_EPS):
        super().__init__()
        self.par, self.latent_eps = par, latent_eps
        num_heads = par.tp_split(num_heads, "num_attention_heads")  # this rank's heads (all without TP)
        self.layer, self.hq, self.r, self.nope, self.rope, self.v = layer, num_heads, kv_lora_rank, nope, rope, v_dim
        self.scale, self.interleave = scale, interleave
        qk, split = nope + rope, par.tp > 1

        def opt_bias(n: int) -> nn.Parameter | None:
            return param(n, dtype=dtype, device=device) if bias else None

        if q_lora_rank:
            self.q_a = dense_weight(q_lora_rank, hidden, dtype, device, held)
            self.q_a_bias = opt_bias(q_lora_rank)
            self.q_a_norm = param(q_lora_rank, dtype=dtype, device=device)
            self.q_b = dense_weight(num_heads * qk, q_lora_rank, dtype, device, held, split=split)
            self.q_proj = None
        else:
            self.q_a = self.q_a_bias = self.q_a_norm = self.q_b = None
            self.q_proj = dense_weight(num_heads * qk, hidden, dtype, device, held, split=split)
        self.kv_a = dense_weight(kv_lora_rank + rope, hidden, dtype, device, held)
        self.kv_a_bias = opt_bias(kv_lora_rank + rope)
        self.kv_a_norm = param(kv_lora_rank, dtype=dtype, device=device)
        # rows per head: [k_nope (nope) | v (v_dim)], each a map from the latent (R); this rank's heads
        self.kv_b = param(num_heads * (nope + v_dim), kv_lora_rank, dtype=dtype, device=device)
        self.o = dense_weight(hidden, num_heads * v_dim, dtype, device, held, k_split=split)
        self.o_bias = opt_bias(hidden)
        self.indexer = indexer

    def part(self, name: str) -> torch.Tensor | None:
        """Where checkpoint tensor self_attn.<name> goes (the indexer's are its own)."""
        return {"q_a_proj.weight": self.q_a, "q_a_proj.bias": self.q_a_bias, "q_a_layernorm.weight": self.q_a_norm,
                "q_b_proj.weight": self.q_b, "q_proj.weight": self.q_proj, "kv_a_proj_with_mqa.weight": self.kv_a,
                "kv_a_proj_with_mqa.bias": self.kv_a_bias, "kv_a_layernorm.weight": self.kv_a_norm,
                "kv_b_proj.weight": self.kv_b, "o_proj.weight": self.o, "o_proj.bias": self.o_bias}.get(name)

    @property
    def w_uk(self) -> torch.Tensor:
        # [Hq, nope, R]: head h's key = W_UK[h] @ c_kv
        return self.kv_b.view(self.hq, self.nope + self.v, self.r)[:, : self.nope]

    @property
    def w_uv(self) -> torch.Tensor:
        # [Hq, v, R]: head h's value = W_UV[h] @ c_kv
        return self.kv_b.view(self.hq, self.nope + self.v, self.r)[:, self.nope:]

    def rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        # x: [N, heads, rope]
        return (apply_rope_interleave if self.interleave else apply_rope)(x, cos, sin)

    def project(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                ) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor]:
        """x: [N, H] -> (q_resid [N, q_lora] or None, q [N, Hq, R + P] absorbed and roped,
        latent rows [N, R + P] = [normed c_kv | roped k_pe])."""
        t = x.shape[0]
        if self.q_proj is None:
            q_resid = model_rms_norm(linear(x, self.q_a, self.q_a_bias), self.q_a_norm, self.latent_eps)
            q = linear(q_resid, self.q_b)
        else:
            q_resid, q = None, linear(x, self.q_proj)
        q_nope, q_pe = q.view(t, self.hq, self.nope + self.rope).split([self.nope, self.rope], dim=-1)
        c_kv, k_pe = linear(x, self.kv_a, self.kv_a_bias).split([self.r, self.rope], dim=-1)
        c_kv = model_rms_norm(c_kv, self.kv_a_norm, self.latent_eps)
        q_abs = torch.einsum("nhd,hdr->nhr", q_nope, self.w_uk)  # a view, heads outermost: any n/h strides
        if self.rope == 0:  # NoPE (glm5_next): nothing to rotate or append, so no copy of either
            return q_resid, q_abs, c_kv  # (latent_attention takes q's token and head strides as they come)
        k_pe = self.rotate(k_pe[:, None], cos, sin)[:, 0]
        q = torch.cat([q_abs, self.rotate(q_pe, cos, sin)], dim=-1)
        return q_resid, q, torch.cat([c_kv, k_pe], dim=-1)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, batch: AttnBatch, kv: MlaKVCache,
                topk: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """x: [N, H]; cos, sin: [N, rope]; topk: [N, K] int32 positions chosen by an earlier layer's
        indexer (DSA 'shared' layers) or None. -> (out [N, H], the top-k this layer attended over)."""
        q_resid, q, rows = self.project(x, cos, sin)
        latent = kv.latent[kv.latent_slot[self.layer]]
        write_latent(latent, rows, batch.slot_mapping)
        if self.indexer is not None:
            topk = self.indexer(x, q_resid, cos, sin, batch, kv)
        out = latent_attention(q, latent, batch, self.scale, self.r, topk)  # [N, Hq, R]
        out = torch.einsum("nhr,hvr->nhv", out, self.w_uv).reshape(x.shape[0], self.hq * self.v)
        if self.par.tp == 1:
            return linear(out, self.o, self.o_bias), topk
        # a partial sum over this rank's heads [N, H]; the bias joins once, after the sum
        part = self.par.all_reduce(linear(out, self.o), "tp")
        return (part if self.o_bias is None else part + self.o_bias), topk
