"""GLM-5.3-Flash (glm5_next, transformers' Glm5NextForConditionalGeneration) in our own code: the
language model of the multimodal checkpoint; the vision tower's tensors are known and skipped
(text-only serving), as are MTP layers (checkpoint layers from num_hidden_layers on).

Decoder layer i, over the mHC residual of hc_mult streams (layers/mhc.py), S [N, hc_mult, H]:

    post, comb, h = attn_hc(S);  S = expand(attn(rms(h)), post, comb, S)
    post, comb, h = ffn_hc(S);   S = expand(mlp(rms(h)), post, comb, S)

attn: KDA linear attention (layer_types "linear_attention", layers/kda.py, state in the KV pool's
state slots) or MLA with NoPE and the kpool indexer ("indexed_attention", layers/mla_attention.py
+ layers/kpool_indexer.py; a "shared" layer reuses the top-k of the indexed layer just before it).
mlp: a dense SwiGLU (mlp_layer_types "dense") or a MoEBlock (sigmoid router with correction bias,
the routed experts through the expert backend, a shared expert), every SwiGLU clamped by
swiglu_limit. The embedding enters as hc_mult copies; the head is rms(mean of the streams).
"""

from __future__ import annotations

import re

import torch
import torch.nn.functional as F
from torch import nn

from moetier.layers.attention import AttnBatch
from moetier.layers.kda import KdaAttention
from moetier.layers.kda_cuda import fla_kda
from moetier.layers.kpool_indexer import KpoolIndexer
from moetier.layers.mhc import HyperConnection, expand, hyper_head
from moetier.layers.mla_attention import MlaAttention
from moetier.layers.mlp import SwigluMLP
from moetier.layers.moe import MoEBlock
from moetier.layers.norm import model_rms_norm
from moetier.layers.param import param
from moetier.layers.router import GroupedSigmoidTopK
from moetier.layers.state_cache import HybridKVCache, HybridKVSpec, KdaStateSpec
from moetier.models.base import CausalLM, Weight, routed_expert_weights
from moetier.models.glm5_next_config import Glm5NextConfig
from moetier.models.mla_model import _swiglu_weights as _swiglu
from moetier.models.mla_model import mlp_param
from moetier.parallel import Parallel

PREFIX = "model.language_model."
_LAYER = re.compile(re.escape(PREFIX) + r"layers\.(\d+)\.(.+)")
_SKIPPED = re.compile(r"model\.visual\..*|.*\.shared_head\..*")  # the vision tower; MTP heads

__all__ = ["Glm5NextConfig", "Glm5NextForConditionalGeneration"]


class Glm5NextLayer(nn.Module):
    def __init__(self, cfg: Glm5NextConfig, layer: int, dtype: torch.dtype, device: torch.device | str):
        super().__init__()
        self.layer, self.eps, h = layer, cfg.rms_norm_eps, cfg.hidden_size
        self.kda = cfg.layer_types[layer] == "linear_attention"
        self.input_norm = param(h, dtype=dtype, device=device)
        self.post_norm = param(h, dtype=dtype, device=device)
        hc = (h, cfg.hc_mult, cfg.hc_sinkhorn_iters, cfg.hc_eps, cfg.rms_norm_eps, dtype, device)
        self.attn_hc, self.ffn_hc = HyperConnection(*hc), HyperConnection(*hc)
        if self.kda:
            self.attn: nn.Module = KdaAttention(layer, h, cfg.linear_heads, cfg.linear_head_dim, cfg.linear_conv_width,
                                                cfg.linear_lower_bound, cfg.rms_norm_eps, dtype, device)
        else:
            indexer = (KpoolIndexer(layer, h, cfg.q_lora_rank, cfg.index_n_heads, cfg.index_head_dim, cfg.index_topk,
                                    cfg.index_kpool, dtype, device) if cfg.indexer_types[layer] == "full" else None)
            self.attn = MlaAttention(layer, h, cfg.num_heads, cfg.q_lora_rank, cfg.kv_lora_rank, cfg.qk_nope_head_dim,
                                     0, cfg.v_head_dim, cfg.attention_bias, cfg.softmax_scale, True, dtype, device,
                                     indexer, latent_eps=cfg.rms_norm_eps)
        limit = cfg.swiglu_limit
        if cfg.is_moe_layer(layer):
            router = GroupedSigmoidTopK(cfg.num_experts, h, cfg.top_k, cfg.n_group, cfg.topk_group,
                                        cfg.norm_topk_prob, cfg.routed_scaling_factor, device)
            shared = (SwigluMLP(h, cfg.moe_intermediate_size * cfg.n_shared_experts, dtype, device, swiglu_limit=limit)
                      if cfg.n_shared_experts else None)
            self.mlp: nn.Module = MoEBlock(layer, router, shared)
        else:
            self.mlp = SwigluMLP(h, cfg.intermediate_size, dtype, device, swiglu_limit=limit)

    def forward(self, streams: torch.Tensor, batch: AttnBatch, kv: HybridKVCache, topk: torch.Tensor | None,
                none: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """streams [N, S, H] -> (streams, the top-k an indexed layer attended over, else None).
        none: the empty [N, 0] cos/sin of NoPE."""
        post, comb, h = self.attn_hc.weights(streams)
        h = model_rms_norm(h, self.input_norm, self.eps)
        if self.kda:
            a, topk = self.attn(h, batch, kv.state), None
        else:
            a, topk = self.attn(h, none, none, batch, kv, topk)
        streams = expand(a, post, comb, streams)
        post, comb, h = self.ffn_hc.weights(streams)
        return expand(self.mlp(model_rms_norm(h, self.post_norm, self.eps)), post, comb, streams), topk


class Glm5NextForConditionalGeneration(CausalLM):
    cfg: Glm5NextConfig

    def __init__(self, cfg: Glm5NextConfig, dtype: torch.dtype, device: torch.device | str = "cpu"):
        super().__init__()
        self.cfg, self.dtype, self.device = cfg, dtype, torch.device(device)
        if self.device.type == "cuda" and cfg.kda_layers:
            fla_kda()  # fla-core missing: one clear line before any weight is made or read
        self.embed = param(cfg.vocab_size, cfg.hidden_size, dtype=dtype, device=device)
        self.layers = nn.ModuleList(Glm5NextLayer(cfg, i, dtype, device) for i in range(cfg.num_layers))
        self.norm = param(cfg.hidden_size, dtype=dtype, device=device)
        self.lm_head = self.embed if cfg.tie_word_embeddings else param(
            cfg.vocab_size, cfg.hidden_size, dtype=dtype, device=device)

    # -- checkpoint --

    @classmethod
    def attention_weights(cls, cfg: Glm5NextConfig, layer: int) -> list[Weight]:
        a, h = f"{PREFIX}layers.{layer}.self_attn.", cfg.hidden_size
        if cfg.layer_types[layer] == "linear_attention":
            hd, inner, w = cfg.linear_head_dim, cfg.linear_heads * cfg.linear_head_dim, cfg.linear_conv_width
            out = [Weight(a + f"{x}_proj.weight", (inner, h)) for x in "qkv"]
            out += [Weight(a + f"{x}_conv1d.weight", (inner, 1, w), float32=True) for x in "qkv"]
            return out + [Weight(a + "A_log", (cfg.linear_heads,), float32=True),
                          Weight(a + "dt_bias", (inner,), float32=True),
                          Weight(a + "f_a_proj.weight", (hd, h)), Weight(a + "f_b_proj.weight", (inner, hd)),
                          Weight(a + "b_proj.weight", (cfg.linear_heads, h)),
                          Weight(a + "g_a_proj.weight", (hd, h)), Weight(a + "g_b_proj.weight", (inner, hd)),
                          Weight(a + "o_norm.weight", (hd,)), Weight(a + "o_proj.weight", (h, inner))]
        hq, r, ql, qk = cfg.num_heads, cfg.kv_lora_rank, cfg.q_lora_rank, cfg.qk_head_dim
        out = [Weight(a + "q_a_proj.weight", (ql, h)), Weight(a + "q_a_layernorm.weight", (ql,)),
               Weight(a + "q_b_proj.weight", (hq * qk, ql)), Weight(a + "kv_a_proj_with_mqa.weight", (r, h)),
               Weight(a + "kv_a_layernorm.weight", (r,)),
               Weight(a + "kv_b_proj.weight", (hq * (cfg.qk_nope_head_dim + cfg.v_head_dim), r)),
               Weight(a + "o_proj.weight", (h, hq * cfg.v_head_dim))]
        if cfg.attention_bias:
            out += [Weight(a + "q_a_proj.bias", (ql,)), Weight(a + "kv_a_proj_with_mqa.bias", (r,)),
                    Weight(a + "o_proj.bias", (h,))]
        if cfg.indexer_types[layer] == "full":
            i, hi, d = a + "indexer.", cfg.index_n_heads, cfg.index_head_dim
            out += [Weight(i + "wq_b.weight", (hi * d, ql)), Weight(i + "wk.weight", (d, h)),
                    Weight(i + "k_norm.weight", (d,)), Weight(i + "k_norm.bias", (d,)),
                    Weight(i + "weights_proj.weight", (hi, h)),
                    Weight(i + "index_kpool_compress_ape", (cfg.index_kpool, d)),
                    Weight(i + "index_kpool_compress_gate", (d, h))]
        return out

    @classmethod
    def checkpoint_weights(cls, cfg: Glm5NextConfig, present: set[str]) -> list[Weight]:
        h, v = cfg.hidden_size, cfg.vocab_size
        out = [Weight(PREFIX + "embed_tokens.weight", (v, h))]
        for layer in range(cfg.num_layers):
            pre = f"{PREFIX}layers.{layer}."
            out += [Weight(pre + "input_layernorm.weight", (h,)), Weight(pre + "post_attention_layernorm.weight", (h,))]
            n = (2 + cfg.hc_mult) * cfg.hc_mult
            for hc in ("attn", "ffn"):
                out += [Weight(pre + f"hc_{hc}_fn", (n, cfg.hc_mult * h)),
                        Weight(pre + f"hc_{hc}_base", (n,), float32=True),
                        Weight(pre + f"hc_{hc}_scale", (3,), float32=True)]
            out += cls.attention_weights(cfg, layer)
            m = pre + "mlp."
            if not cfg.is_moe_layer(layer):
                out += _swiglu(m, h, cfg.intermediate_size)
                continue
            e, mi = cfg.num_experts, cfg.moe_intermediate_size
            out += [Weight(m + "gate.weight", (e, h), float32=True),
                    Weight(m + "gate.e_score_correction_bias", (e,), float32=True)]
            if cfg.n_shared_experts:
                out += _swiglu(m + "shared_experts.", h, mi * cfg.n_shared_experts)
            out += routed_expert_weights(m, layer, e, h, mi, present)
        out += [Weight(PREFIX + "norm.weight", (h,)),
                Weight("lm_head.weight", (v, h), optional=cfg.tie_word_embeddings)]
        known = {w.name for w in out}
        # the vision tower, MTP layers: known by name, never read
        for name in sorted(present - known):
            m = _LAYER.fullmatch(name)
            if _SKIPPED.fullmatch(name) or (m and int(m.group(1)) >= cfg.num_layers):
                out.append(Weight(name, (), optional=True, skipped=True))
        return out

    def param(self, name: str) -> torch.Tensor | None:
        if name == PREFIX + "embed_tokens.weight":
            return self.embed
        if name == PREFIX + "norm.weight":
            return self.norm
        if name == "lm_head.weight":
            return None if self.cfg.tie_word_embeddings else self.lm_head
        m = _LAYER.fullmatch(name)
        if not m or int(m.group(1)) >= self.cfg.num_layers:
            return None
        layer, rest = self.layers[int(m.group(1))], m.group(2)
        if rest.startswith("hc_"):
            hc, part = rest[3:].split("_", 1)
            return getattr(layer.attn_hc if hc == "attn" else layer.ffn_hc, part)
        if rest == "input_layernorm.weight":
            return layer.input_norm
        if rest == "post_attention_layernorm.weight":
            return layer.post_norm
        if rest.startswith("self_attn."):
            rest = rest[len("self_attn."):]
            a = layer.attn
            if layer.kda:
                return a.part(rest)
            if rest.startswith("indexer."):
                return a.indexer.part(rest[len("indexer."):]) if a.indexer is not None else None
            return a.part(rest)
        return mlp_param(layer.mlp, rest)

    # -- runtime --

    @classmethod
    def kv_spec_of(cls, cfg: Glm5NextConfig, par: Parallel) -> HybridKVSpec:
        state = KdaStateSpec(cfg.kda_layers, 3 * cfg.linear_heads * cfg.linear_head_dim, cfg.linear_conv_width,
                             cfg.linear_heads, cfg.linear_head_dim, cfg.linear_head_dim)
        return HybridKVSpec(cfg.num_layers, cfg.kv_lora_rank, 0, 2 * cfg.index_head_dim, cfg.index_layers,
                            cfg.attention_layers, state)

    def moe_blocks(self) -> list[MoEBlock]:
        return [layer.mlp for layer in self.layers if isinstance(layer.mlp, MoEBlock)]

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, batch: AttnBatch, kv: HybridKVCache) -> torch.Tensor:
        # input_ids: [N] -> last hidden states [N, H]
        x = F.embedding(input_ids, self.embed)
        streams = x[:, None, :].expand(-1, self.cfg.hc_mult, -1).contiguous()
        none = x.new_empty(x.shape[0], 0)
        topk = None
        for layer in self.layers:
            streams, topk = layer(streams, batch, kv, topk, none)
        return model_rms_norm(hyper_head(streams), self.norm, self.cfg.rms_norm_eps)

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        # hidden: [T, H] -> [T, V] float32
        return F.linear(hidden, self.lm_head).float()
