"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B) in our own code.

Decoder layer: x + attn(rms(x)); then h + mlp(rms(h)), where mlp is a routed MoE (softmax top-k
router, optional renormalisation) or, for mlp_only_layers and off the sparse step, a dense SwiGLU.
Attention is GQA with RMSNorm on each head's q and k before rotary.

Weights are fused where that saves launches (qkv, gate_up); the loader maps checkpoint names onto
them (moetier.loader). Routed experts live in an ExpertBackend chosen after loading. On CUDA the
small per-layer operations are fused Triton kernels (moetier.models.fused: norm with the residual
add, q/k norm with rotary and the KV write, router); the CPU path is the plain torch they mirror.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from moetier.config import ModelConfig
from moetier.experts.backends import ExpertBackend
from moetier.experts.placement import ExpertOptions, ExpertPlacement
from moetier.experts.store import RowLayout
from moetier.attention import AttnBatch, paged_attention, write_kv
from moetier.kv import KVCache
from moetier.models.layers import apply_rope, rms_norm, rope_cos_sin, rope_inv_freq, silu_mul


def _param(*shape: int, dtype: torch.dtype, device: torch.device | str) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    # x, delta: [N, H] -> (rms_norm(x + delta), x + delta); x itself when delta is None.
    if x.is_cuda:
        from moetier.models import fused

        return fused.rms_norm(x, weight, eps, delta)
    if delta is not None:
        x = x + delta
    return rms_norm(x, weight, eps), x


def qk_norm_rope_kv_reference(qkv: torch.Tensor, q_norm: torch.Tensor, k_norm: torch.Tensor, cos: torch.Tensor,
                              sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                              slot_mapping: torch.Tensor, num_heads: int, num_kv_heads: int, eps: float
                              ) -> torch.Tensor:
    # qkv: [N, (Hq + 2 Hkv) * D] -> q [N, Hq, D]; writes k and v into the caches at slot_mapping.
    t, d = qkv.shape[0], k_cache.shape[-1]
    q, k, v = qkv.split([num_heads * d, num_kv_heads * d, num_kv_heads * d], dim=-1)
    q = rms_norm(q.view(t, num_heads, d), q_norm, eps)
    k = rms_norm(k.view(t, num_kv_heads, d), k_norm, eps)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    write_kv(k_cache, v_cache, k, v.view(t, num_kv_heads, d), slot_mapping)
    return q


def route_reference(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    # logits: [T, E] -> ids [T, k] int64, weights [T, k] in logits.dtype
    probs = F.softmax(logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return ids, weights.to(logits.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device: torch.device | str):
        super().__init__()
        self.hq, self.hkv, self.d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.eps = cfg.rms_norm_eps
        h = cfg.hidden_size
        self.qkv = _param((self.hq + 2 * self.hkv) * self.d, h, dtype=dtype, device=device)  # [q; k; v] rows
        self.o = _param(h, self.hq * self.d, dtype=dtype, device=device)
        self.qkv_bias = _param((self.hq + 2 * self.hkv) * self.d, dtype=dtype, device=device) if cfg.attention_bias else None
        self.o_bias = _param(h, dtype=dtype, device=device) if cfg.attention_bias else None
        self.q_norm = _param(self.d, dtype=dtype, device=device)
        self.k_norm = _param(self.d, dtype=dtype, device=device)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, batch: AttnBatch, kv: KVCache,
                layer: int) -> torch.Tensor:
        # x: [N, H], the new tokens of every sequence in the step
        t = x.shape[0]
        qkv = F.linear(x, self.qkv, self.qkv_bias)
        args = (qkv, self.q_norm, self.k_norm, cos, sin, kv.k[layer], kv.v[layer], batch.slot_mapping,
                self.hq, self.hkv, self.eps)
        if qkv.is_cuda:
            from moetier.models import fused

            q = fused.qk_norm_rope_kv(*args)
        else:
            q = qk_norm_rope_kv_reference(*args)
        out = paged_attention(q, kv.k[layer], kv.v[layer], batch)  # [N, Hq, D]
        return F.linear(out.reshape(t, self.hq * self.d), self.o, self.o_bias)


class DenseMLP(nn.Module):
    def __init__(self, hidden: int, inter: int, dtype: torch.dtype, device: torch.device | str):
        super().__init__()
        self.w13 = _param(2 * inter, hidden, dtype=dtype, device=device)  # [gate; up]
        self.w2 = _param(hidden, inter, dtype=dtype, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(silu_mul(F.linear(x, self.w13)), self.w2)


RouteHook = Callable[[int, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


class MoE(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, dtype: torch.dtype, device: torch.device | str,
                 placement: ExpertPlacement):
        super().__init__()
        self.layer = layer
        self.top_k, self.norm_topk = cfg.top_k, cfg.norm_topk_prob
        self.gate = _param(cfg.num_experts, cfg.hidden_size, dtype=dtype, device=device)
        self.layout: RowLayout = placement.layout
        # Filled by the loader (device memory or the host store), then handed to the backend.
        self.rows: torch.Tensor | None = placement.rows(layer)  # [E, R]
        self.experts: ExpertBackend | None = None
        self.route_hook: RouteHook | None = None  # sees (layer, ids, weights); may replace them

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # x: [T, H] -> topk_ids [T, k] int64, topk_weights [T, k] in x.dtype
        logits = F.linear(x, self.gate)
        if logits.is_cuda:
            from moetier.models import fused

            return fused.route_topk(logits, self.top_k, self.norm_topk)
        return route_reference(logits, self.top_k, self.norm_topk)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ids, weights = self.route(x)
        if self.route_hook is not None:
            ids, weights = self.route_hook(self.layer, ids, weights)
        return self.experts.forward(x, ids, weights)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, dtype: torch.dtype, device: torch.device | str,
                 placement: ExpertPlacement):
        super().__init__()
        self.layer, self.eps = layer, cfg.rms_norm_eps
        self.input_norm = _param(cfg.hidden_size, dtype=dtype, device=device)
        self.post_norm = _param(cfg.hidden_size, dtype=dtype, device=device)
        self.attn = Attention(cfg, dtype, device)
        self.mlp: MoE | DenseMLP = (
            MoE(cfg, layer, dtype, device, placement) if cfg.is_moe_layer(layer)
            else DenseMLP(cfg.hidden_size, cfg.intermediate_size, dtype, device)
        )

    def forward(self, x: torch.Tensor, delta: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
                batch: AttnBatch, kv: KVCache) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual stream enters as x + delta (delta: the previous layer's MLP output, None
        before the first layer) and leaves the same way, so each add shares a launch with a norm."""
        h, x = add_rms_norm(x, delta, self.input_norm, self.eps)
        h, x = add_rms_norm(x, self.attn(h, cos, sin, batch, kv, self.layer), self.post_norm, self.eps)
        return x, self.mlp(h)


class Qwen3MoeForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device: torch.device | str = "cpu",
                 experts: ExpertOptions | None = None):
        super().__init__()
        self.cfg, self.dtype, self.device = cfg, dtype, torch.device(device)
        self.placement = ExpertPlacement(cfg, dtype, self.device, experts or ExpertOptions())
        self.embed = _param(cfg.vocab_size, cfg.hidden_size, dtype=dtype, device=device)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, dtype, device, self.placement)
                                    for i in range(cfg.num_layers))
        self.norm = _param(cfg.hidden_size, dtype=dtype, device=device)
        self.lm_head = self.embed if cfg.tie_word_embeddings else _param(
            cfg.vocab_size, cfg.hidden_size, dtype=dtype, device=device)
        self.register_buffer("inv_freq", rope_inv_freq(cfg.head_dim, cfg.rope_theta).to(device), persistent=False)

    def moe_blocks(self) -> list[MoE]:
        return [layer.mlp for layer in self.layers if isinstance(layer.mlp, MoE)]

    def build_experts(self) -> None:
        """After loading: hand each MoE layer's rows to its backend."""
        for moe in self.moe_blocks():
            if moe.rows is None:
                raise RuntimeError("expert backends are already built")
            moe.experts = self.placement.build(moe.layer, moe.rows)
            moe.rows = None

    def expert_stats(self) -> dict[str, int]:
        """Cache counters summed over layers (one host read per layer; call between steps)."""
        total = {"hits": 0, "misses": 0, "overflow": 0, "steps": 0, "bypassed": 0}
        for moe in self.moe_blocks():
            cache = getattr(moe.experts, "cache", None)
            if cache is not None:
                for k, v in cache.read_stats().items():
                    total[k] += v
            total["bypassed"] += moe.experts.bypassed
        return total

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, batch: AttnBatch, kv: KVCache) -> torch.Tensor:
        """input_ids: [N], the new tokens of the step's sequences -> last hidden states [N, H].

        Writes the new tokens' keys and values into their pages (batch.slot_mapping) first.
        """
        cos, sin = rope_cos_sin(batch.positions, self.inv_freq, self.dtype)
        x, delta = F.embedding(input_ids, self.embed), None
        for layer in self.layers:
            x, delta = layer(x, delta, cos, sin, batch, kv)
        return add_rms_norm(x, delta, self.norm, self.cfg.rms_norm_eps)[0]

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        # hidden: [T, H] -> [T, V] float32
        return F.linear(hidden, self.lm_head).float()
