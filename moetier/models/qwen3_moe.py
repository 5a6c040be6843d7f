"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B) in our own code: its config fields, its checkpoint
names, its decoder.

Decoder layer: x + attn(rms(x)); then h + mlp(rms(h)), where mlp is a routed MoE (softmax top-k
router, optional renormalisation) or, for mlp_only_layers and off the sparse step, a dense SwiGLU.
Attention is GQA with RMSNorm on each head's q and k before rotary (layers/gqa_attention.py).

Weights are fused where that saves launches (qkv, gate_up); param() maps checkpoint names onto them.
With cfg.dense_quant set (EngineConfig.dense_weights "keep") the attention and dense MLP projections
are held in the checkpoint's format where it allows (layers/gqa_attention.py, layers/mlp.py say when;
modules the checkpoint leaves unquantized stay in the model dtype: CausalLM.hold_excluded_plain).
Routed experts are stored per expert (published checkpoints) or fused (transformers 5); either way
they go to the expert tiers, not to this module.

MTP: qwen3_moe has no MTP layer of its own; a checkpoint may store one in DeepSeek-V3's shape
(models/mtp.py: layer num_hidden_layers + d, `num_nextn_predict_layers` in config.json; the embedded
tiny-stdlib ships one, scripts/train_mtp.py). Its decoder layer is a qwen3_moe MoE layer; the layers
are optional weights, skipped unless cfg.mtp_layers says to load them (speculative method mtp).

Tensor parallelism (par.tp > 1, docs/parallel.md): attention split by heads and the dense MLP by
columns (layers/gqa_attention.py, layers/mlp.py; Weight.split says which checkpoint dim each rank
slices); the embedding, norms, router and LM head are replicated; the KV cache holds this rank's
kv heads only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from moetier.config import Fields, ModelConfig
from moetier.layers.attention import AttnBatch
from moetier.layers.gqa_attention import GqaAttention
from moetier.layers.kv_cache import GqaKVCache, GqaKVSpec
from moetier.layers.mlp import SwigluMLP
from moetier.layers.moe import MoEBlock
from moetier.layers.norm import add_rms_norm
from moetier.layers.param import param
from moetier.layers.rotary import rope_cos_sin, rope_inv_freq
from moetier.layers.router import SoftmaxTopK
from moetier.models.base import CausalLM, Weight, routed_expert_weights
from moetier.models.mtp import MtpHead, layer_of, mtp_weights
from moetier.parallel import Parallel

@dataclass(frozen=True, kw_only=True)
class Qwen3MoeConfig(ModelConfig):
    intermediate_size: int  # dense MLP width (mlp_only_layers and layers off the sparse step)
    num_heads: int
    num_kv_heads: int
    head_dim: int
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    rope_theta: float = 10000.0
    attention_bias: bool = False
    num_nextn_predict_layers: int = 0  # MTP layers stored after the decoder layers (models/mtp.py)
    mtp_layers: int = 0  # of those, how many the model holds (models/mtp.with_mtp; not in config.json)

    architecture: ClassVar[str] = "Qwen3MoeForCausalLM"

    def is_moe_layer(self, layer: int) -> bool:
        if layer >= self.num_layers:  # a loaded MTP layer: always MoE (as the DeepSeek-V3 family's)
            return layer < self.num_layers + self.mtp_layers and self.num_experts > 0
        # Same rule as transformers' Qwen3MoeDecoderLayer.
        return (layer not in self.mlp_only_layers and self.num_experts > 0
                and (layer + 1) % self.decoder_sparse_step == 0)

    @property
    def moe_layers(self) -> list[int]:
        return [i for i in range(self.num_layers + self.mtp_layers) if self.is_moe_layer(i)]

    @classmethod
    def parse(cls, f: Fields) -> dict[str, Any]:
        c = cls.common(f)
        hidden, layers = c["hidden_size"], c["num_layers"]
        heads = f.positive_int("num_attention_heads")
        kv_heads = f.positive_int("num_key_value_heads", default=heads or 1)
        head_dim = f.get("head_dim", default=None)
        if head_dim is None:
            head_dim = hidden // heads if heads and hidden % heads == 0 else 0
            if not head_dim:
                f.problems.append(f"head_dim is not given and hidden_size {hidden} is not divisible by "
                                  f"num_attention_heads {heads}")
        elif not isinstance(head_dim, int) or head_dim <= 0 or head_dim % 2:
            f.problems.append(f"head_dim must be a positive even integer (rotary halves it), got {head_dim!r}")
        if heads and kv_heads and heads % kv_heads:
            f.problems.append(f"num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads} "
                              "(GQA groups)")
        mlp_only = tuple(f.get("mlp_only_layers", default=[]) or [])
        bad = [i for i in mlp_only if not isinstance(i, int) or not 0 <= i < max(layers, 1)]
        if bad:
            f.problems.append(f"mlp_only_layers {bad} are outside 0..{layers - 1}")
        if f.get("hidden_act", default="silu") not in ("silu", "swish"):
            f.problems.append(f"hidden_act {f.get('hidden_act')!r} is not supported (only silu)")
        if f.get("use_sliding_window", default=False):
            f.problems.append("use_sliding_window=true is not supported; set it to false")
        mtp = f.get("num_nextn_predict_layers", default=0)
        if not isinstance(mtp, int) or mtp < 0:
            f.problems.append(f"num_nextn_predict_layers must be an integer >= 0, got {mtp!r}")
            mtp = 0
        rope = f.get("rope_parameters", "rope_scaling", default=None) or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type != "default":
            f.problems.append(f"rope type {rope_type!r} is not supported (only the default rotary)")
        return dict(
            c,
            intermediate_size=f.positive_int("intermediate_size"),
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim if isinstance(head_dim, int) else 0,
            norm_topk_prob=bool(f.get("norm_topk_prob", default=False)),
            decoder_sparse_step=f.positive_int("decoder_sparse_step", default=1),
            mlp_only_layers=mlp_only,
            rope_theta=float(rope.get("rope_theta", f.get("rope_theta", default=10000.0))),
            attention_bias=bool(f.get("attention_bias", default=False)),
            num_nextn_predict_layers=mtp,
        )

    def to_hf_dict(self) -> dict[str, Any]:
        return {
            **self.common_hf_dict(),
            "intermediate_size": self.intermediate_size,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "moe_intermediate_size": self.moe_intermediate_size,
            "num_experts": self.num_experts,
            "num_experts_per_tok": self.top_k,
            "norm_topk_prob": self.norm_topk_prob,
            "decoder_sparse_step": self.decoder_sparse_step,
            "mlp_only_layers": list(self.mlp_only_layers),
            "rope_theta": self.rope_theta,
            "attention_bias": self.attention_bias,
            "attention_dropout": 0.0,
            "hidden_act": "silu",
            "use_sliding_window": False,
            "sliding_window": None,
            **({"num_nextn_predict_layers": self.num_nextn_predict_layers} if self.num_nextn_predict_layers else {}),
        }

    def attention_activations(self, tokens: int, dtype: torch.dtype) -> list[int]:
        """q/k/v [T, (Hq + 2 Hkv) D] and q after rotary, attention output [T, Hq D], the paged
        attention's key-split partials (at most 64 splits, float32)."""
        t, d, hq, hkv, isz = tokens, self.head_dim, self.num_heads, self.num_kv_heads, dtype.itemsize
        splits = max(1, min(64, 4 * 132 // max(1, t * hkv)))  # paged_attention_triton.default_num_splits
        return [t * (hq + 2 * hkv) * d * isz, t * hq * d * isz, t * hq * d * isz, splits * t * hq * d * 4,
                splits * t * hq * 4]

    def num_parameters(self) -> int:
        h, d = self.hidden_size, self.head_dim
        attn = h * d * (self.num_heads * 2 + self.num_kv_heads * 2) + 2 * d + 2 * h
        if self.attention_bias:
            attn += d * (self.num_heads + 2 * self.num_kv_heads) + h
        total = self.vocab_size * h * (1 if self.tie_word_embeddings else 2) + h
        for i in range(self.num_layers + self.mtp_layers):
            # an MTP layer adds enorm, hnorm, eh_proj [H, 2H] and its head's norm (embedding, head: shared)
            total += attn + (3 * h + 2 * h * h if i >= self.num_layers else 0)
            if self.is_moe_layer(i):
                total += self.num_experts * h + self.num_experts * 3 * h * self.moe_intermediate_size
            else:
                total += 3 * h * self.intermediate_size
        return total


class DecoderLayer(nn.Module):
    def __init__(self, cfg: Qwen3MoeConfig, layer: int, dtype: torch.dtype, device: torch.device | str,
                 par: Parallel):
        super().__init__()
        self.layer, self.eps = layer, cfg.rms_norm_eps
        h = cfg.hidden_size
        self.input_norm = param(h, dtype=dtype, device=device)
        self.post_norm = param(h, dtype=dtype, device=device)
        self.attn = GqaAttention(layer, h, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.attention_bias,
                                 cfg.rms_norm_eps, dtype, device, par, cfg.dense_quant)
        self.mlp: MoEBlock | SwigluMLP = (
            MoEBlock(layer, SoftmaxTopK(cfg.num_experts, h, cfg.top_k, cfg.norm_topk_prob, dtype, device))
            if cfg.is_moe_layer(layer) else SwigluMLP(h, cfg.intermediate_size, dtype, device, par, cfg.dense_quant)
        )

    def forward(self, x: torch.Tensor, delta: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
                batch: AttnBatch, kv: GqaKVCache) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual stream enters as x + delta (delta: the previous layer's MLP output, None
        before the first layer) and leaves the same way, so each add shares a launch with a norm."""
        h, x = add_rms_norm(x, delta, self.input_norm, self.eps)
        h, x = add_rms_norm(x, self.attn(h, cos, sin, batch, kv), self.post_norm, self.eps)
        return x, self.mlp(h)


class Qwen3MoeForCausalLM(CausalLM):
    tensor_parallel = True

    def __init__(self, cfg: Qwen3MoeConfig, dtype: torch.dtype, device: torch.device | str = "cpu",
                 par: Parallel = Parallel()):
        super().__init__()
        self.cfg, self.dtype, self.device, self.par = cfg, dtype, torch.device(device), par
        self.embed = param(cfg.vocab_size, cfg.hidden_size, dtype=dtype, device=device)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, dtype, device, par) for i in range(cfg.num_layers))
        self.norm = param(cfg.hidden_size, dtype=dtype, device=device)
        self.lm_head = self.embed if cfg.tie_word_embeddings else param(
            cfg.vocab_size, cfg.hidden_size, dtype=dtype, device=device)
        n = cfg.num_layers
        self.mtp = nn.ModuleList(MtpHead(cfg.hidden_size, cfg.rms_norm_eps, DecoderLayer(cfg, n + d, dtype, device, par),
                                         dtype, device) for d in range(cfg.mtp_layers))
        self.register_buffer("inv_freq", rope_inv_freq(cfg.head_dim, cfg.rope_theta).to(device), persistent=False)
        self.hold_excluded_plain()

    @classmethod
    def layer_weights(cls, cfg: Qwen3MoeConfig, layer: int, present: set[str], moe: bool) -> list[Weight]:
        h, d, e = cfg.hidden_size, cfg.head_dim, cfg.num_experts
        p = f"model.layers.{layer}."
        out = [Weight(p + "input_layernorm.weight", (h,)), Weight(p + "post_attention_layernorm.weight", (h,))]
        a = p + "self_attn."
        for proj, heads in (("q_proj", cfg.num_heads), ("k_proj", cfg.num_kv_heads), ("v_proj", cfg.num_kv_heads)):
            out.append(Weight(a + proj + ".weight", (heads * d, h), split=0))  # by heads
            if cfg.attention_bias:
                out.append(Weight(a + proj + ".bias", (heads * d,), split=0))
        out.append(Weight(a + "o_proj.weight", (h, cfg.num_heads * d), split=1))  # its input: the heads
        if cfg.attention_bias:
            out.append(Weight(a + "o_proj.bias", (h,)))
        out += [Weight(a + "q_norm.weight", (d,)), Weight(a + "k_norm.weight", (d,))]
        m = p + "mlp."
        if not moe:
            return out + [Weight(m + "gate_proj.weight", (cfg.intermediate_size, h), split=0),
                          Weight(m + "up_proj.weight", (cfg.intermediate_size, h), split=0),
                          Weight(m + "down_proj.weight", (h, cfg.intermediate_size), split=1)]
        return out + [Weight(m + "gate.weight", (e, h))] + routed_expert_weights(
            m, layer, e, h, cfg.moe_intermediate_size, present)

    @classmethod
    def checkpoint_weights(cls, cfg: Qwen3MoeConfig, present: set[str]) -> list[Weight]:
        h = cfg.hidden_size
        out = [Weight("model.embed_tokens.weight", (cfg.vocab_size, h))]
        for layer in range(cfg.num_layers):
            out += cls.layer_weights(cfg, layer, present, cfg.is_moe_layer(layer))
        out.append(Weight("model.norm.weight", (h,)))
        # some exporters write the tied copy, most do not
        out.append(Weight("lm_head.weight", (cfg.vocab_size, h), optional=cfg.tie_word_embeddings))
        return out + mtp_weights(cls.layer_weights, cfg, present)

    def param(self, name: str) -> torch.Tensor | None:
        if (outer := self.outer_param(name)) is not False:
            return outer
        found = layer_of(self, name)
        if not isinstance(found, tuple):  # not a layer's tensor, or an MTP layer's own
            return found
        layer, rest = found
        if rest == "input_layernorm.weight":
            return layer.input_norm
        if rest == "post_attention_layernorm.weight":
            return layer.post_norm
        if rest.startswith("self_attn."):
            a = layer.attn
            proj, kind = rest[len("self_attn."):].split(".")
            if proj in ("q_proj", "k_proj", "v_proj"):
                return a.qkv_part(proj) if kind == "weight" else a.qkv_bias[a.qkv_rows(proj)]
            return {"o_proj": a.o if kind == "weight" else a.o_bias, "q_norm": a.q_norm, "k_norm": a.k_norm}.get(proj)
        if rest == "mlp.gate.weight":
            return layer.mlp.router.weight
        mlp = layer.mlp
        if isinstance(mlp, SwigluMLP) and rest.startswith("mlp.") and rest.endswith(".weight"):
            return mlp.part(rest[len("mlp."):-len(".weight")])  # this rank's columns
        return None

    @classmethod
    def kv_spec_of(cls, cfg: Qwen3MoeConfig, par: Parallel) -> GqaKVSpec:
        # this rank's kv heads only (all of them without tensor parallelism)
        # loaded MTP layers (cfg.mtp_layers) have KV rows of their own
        return GqaKVSpec(cfg.num_layers + cfg.mtp_layers, par.tp_split(cfg.num_kv_heads, "num_key_value_heads"), cfg.head_dim)

    def moe_blocks(self) -> list[MoEBlock]:
        layers = [*self.layers, *(head.block for head in self.mtp)]
        return [layer.mlp for layer in layers if isinstance(layer.mlp, MoEBlock)]

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, batch: AttnBatch, kv: GqaKVCache) -> torch.Tensor:
        """input_ids: [N], the new tokens of the step's sequences -> last hidden states [N, H].

        Writes the new tokens' keys and values into their pages (batch.slot_mapping) first.
        """
        cos, sin = rope_cos_sin(batch.positions, self.inv_freq, self.dtype)
        x, delta = F.embedding(input_ids, self.embed), None
        for layer in self.layers:
            x, delta = layer(x, delta, cos, sin, batch, kv)
        return add_rms_norm(x, delta, self.norm, self.cfg.rms_norm_eps)[0]

    @torch.inference_mode()
    def draft(self, input_ids: torch.Tensor, hidden: torch.Tensor, batch: AttnBatch, kv: GqaKVCache, depth: int = 0,
              rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """One MTP draft step, as MlaMoeForCausalLM.draft (models/mtp.py): input_ids [N], hidden [N, H]
        -> (logits [N or R, V] float32, the hidden state to chain [N or R, H])."""
        head = self.mtp[depth % len(self.mtp)]
        cos, sin = rope_cos_sin(batch.positions, self.inv_freq, self.dtype)
        x = head.project(F.embedding(input_ids, self.embed), hidden)
        out = head.finish(*head.block(x, None, cos, sin, batch, kv))
        if rows is not None:
            out = out[rows]
        return self.logits(out), out

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        # hidden: [T, H] -> [T, V] float32
        return F.linear(hidden, self.lm_head).float()
