"""The config of GLM-5.3-Flash (glm5_next): the fields of config.json's text_config (the multimodal
config's language model; the vision tower's fields are read by nobody: text-only serving), parsed
with the DeepSeek-V3 family's MLA and routing fields (models/mla_config.py) plus its own:

    layer_types       per layer "linear_attention" (KDA, layers/kda.py) or "indexed_attention"
                      (MLA with NoPE and the kpool DSA indexer, layers/kpool_indexer.py); default
                      three KDA layers, then one indexed layer, repeating
    indexer_types     per layer "full" (runs its indexer) or "shared" (reuses the top-k of the
                      indexed layer just before it)
    swiglu_limit      the SwiGLU clamp of dense MLPs, shared and routed experts
    linear_*          the KDA heads, head size, conv width, forget-gate lower bound
    hc_*              the mHC streams, Sinkhorn iterations and epsilon (layers/mhc.py)
    index_kpool       the indexer's key group size (index_topk must be a multiple of it)

Defaults are transformers' Glm5NextTextConfig defaults. A flat config.json (text fields at the top
level, no text_config) is read the same way, and so is the original checkpoints' linear_attn_config
(head_dim, num_heads, short_conv_kernel_size, gate_lower_bound, safe_gate) over the linear_* fields.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from moetier.config import Fields
from moetier.experts.shape import MoeShape
from moetier.models.glm_moe_dsa import default_indexer_types
from moetier.models.mla_config import MlaMoeConfig

LAYER_TYPES = ("linear_attention", "indexed_attention")


@dataclass(frozen=True, kw_only=True)
class Glm5NextConfig(MlaMoeConfig):
    layer_types: tuple[str, ...] = ()
    indexer_types: tuple[str, ...] = ()
    index_topk: int = 2048
    index_head_dim: int = 128
    index_n_heads: int = 32
    index_kpool: int = 16
    swiglu_limit: float | None = 10.0
    linear_heads: int = 64
    linear_head_dim: int = 128
    linear_conv_width: int = 4
    linear_lower_bound: float | None = -5.0
    hc_mult: int = 4
    hc_eps: float = 1e-6
    hc_sinkhorn_iters: int = 20

    architecture: ClassVar[str] = "Glm5NextForConditionalGeneration"

    @property
    def kda_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == "linear_attention")

    @property
    def attention_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == "indexed_attention")

    @property
    def index_layers(self) -> tuple[int, ...]:
        """The indexed layers that run their own indexer (their keys live in the KV pool)."""
        return tuple(i for i in self.attention_layers if self.indexer_types[i] == "full")

    @property
    def moe_shape(self) -> MoeShape:
        return MoeShape(self.num_experts, self.top_k, self.hidden_size, self.moe_intermediate_size, self.quant,
                        self.swiglu_limit)

    @classmethod
    def parse(cls, f: Fields) -> dict[str, Any]:
        text = f.d.get("text_config")
        if text is not None and not isinstance(text, dict):
            f.problems.append(f"text_config must be a JSON object, got {type(text).__name__}")
            text = None
        # the top level's fields (dtype, quantization_config) under text_config's own
        top = {k: v for k, v in f.d.items() if k not in ("text_config", "vision_config")}
        fields = {**top, **(text or {}), "model_type": f.d.get("model_type")}
        lac = fields.get("linear_attn_config")
        if isinstance(lac, dict):  # the original checkpoints' form of the KDA fields (transformers reads it too)
            for key, name in (("head_dim", "linear_head_dim"), ("num_heads", "linear_num_heads"),
                              ("short_conv_kernel_size", "linear_conv_kernel_dim"),
                              ("gate_lower_bound", "linear_lower_bound")):
                if key in lac:
                    fields[name] = lac[key]
            if lac.get("safe_gate", True) and fields.get("linear_lower_bound", -5.0) is None:
                fields["linear_lower_bound"] = -5.0
        t = Fields(fields, f.source + (" text_config" if text is not None else ""))
        out = cls.parse_mla(t, first_k_dense_default=3, layer_types_field=True)
        layers = out["num_layers"]
        if out["qk_rope_head_dim"]:
            t.problems.append(f"qk_rope_head_dim {out['qk_rope_head_dim']} is not supported for glm5_next (its "
                              "indexed layers are NoPE: 0)")
        if not out["q_lora_rank"]:
            t.problems.append("q_lora_rank is required for glm5_next (the indexer reads the low-rank query)")
        types = t.get("layer_types", default=None)
        if types is None:
            types = ["indexed_attention" if i % 4 == 3 else "linear_attention" for i in range(layers)]
        types = ["indexed_attention" if x == "full_attention" else x for x in types] if isinstance(types, list) else types
        if not isinstance(types, list) or len(types) != layers or any(x not in LAYER_TYPES for x in types):
            t.problems.append(f"layer_types must list 'linear_attention' or 'indexed_attention' for each of the "
                              f"{layers} layers, got {types!r}")
            types = ["linear_attention"] * layers
        itypes = t.get("indexer_types", default=None)
        if itypes is None:
            itypes = default_indexer_types(t, layers)
        if not isinstance(itypes, list) or len(itypes) != layers or any(x not in ("full", "shared") for x in itypes):
            t.problems.append(f"indexer_types must list 'full' or 'shared' for each of the {layers} layers, "
                              f"got {itypes!r}")
            itypes = ["full"] * layers
        for i, x in enumerate(types):
            if x == "indexed_attention" and itypes[i] == "shared" and not (
                    i and types[i - 1] == "indexed_attention" and itypes[i - 1] == "full"):
                t.problems.append(f"layer {i} is a 'shared' indexed layer but layer {i - 1} is not a 'full' indexed "
                                  "layer (a shared layer reuses the top-k of the layer just before it)")
        topk = t.positive_int("index_topk", default=2048)
        kpool = t.positive_int("index_kpool", default=16)
        if topk and kpool and topk % kpool:
            t.problems.append(f"index_topk {topk} must be a multiple of index_kpool {kpool}")
        if t.get("index_kpool_always_select_tail", default=True) is not True:
            t.problems.append("index_kpool_always_select_tail false is not supported (the indexer always adds the "
                              "query's incomplete kpool group); remove the field")
        limit = t.number("swiglu_limit", default=10.0)  # as transformers: a positive number, no null
        # null is meaningful here (the softplus gate), not "absent": Fields.get would read it as the default
        lower = t.get("linear_lower_bound", default=-5.0) if t.d.get("linear_lower_bound", 0) is not None else None
        if lower is not None and (not isinstance(lower, (int, float)) or lower >= 0):
            t.problems.append(f"linear_lower_bound must be a negative number or null, got {lower!r}")
            lower = -5.0
        conv = t.positive_int("linear_conv_kernel_dim", default=4)
        if conv == 1:
            t.problems.append("linear_conv_kernel_dim must be at least 2")
        out.update(
            layer_types=tuple(types), indexer_types=tuple(itypes), index_topk=topk,
            index_head_dim=t.positive_int("index_head_dim", default=128),
            index_n_heads=t.positive_int("index_n_heads", default=32), index_kpool=kpool,
            swiglu_limit=limit,
            linear_heads=t.positive_int("linear_num_heads", default=64),
            linear_head_dim=t.positive_int("linear_head_dim", default=128), linear_conv_width=conv,
            linear_lower_bound=None if lower is None else float(lower),
            hc_mult=t.positive_int("hc_mult", default=4), hc_eps=t.number("hc_eps", default=1e-6),
            hc_sinkhorn_iters=t.positive_int("hc_sinkhorn_iters", default=20),
            tie_word_embeddings=bool(f.get("tie_word_embeddings", default=out["tie_word_embeddings"])),
            extra=f.d,
        )
        f.problems += t.problems
        return out

    def text_hf_dict(self) -> dict[str, Any]:
        d = self.mla_hf_dict()
        for key in ("architectures", "rope_parameters", "num_nextn_predict_layers", "first_k_dense_replace"):
            d.pop(key, None)
        return {**d, "model_type": "glm5_next_text", "mlp_layer_types": list(self.mlp_layer_types),
                "layer_types": list(self.layer_types), "indexer_types": list(self.indexer_types),
                "index_topk": self.index_topk, "index_head_dim": self.index_head_dim,
                "index_n_heads": self.index_n_heads, "index_kpool": self.index_kpool,
                "swiglu_limit": self.swiglu_limit, "linear_num_heads": self.linear_heads,
                "linear_head_dim": self.linear_head_dim, "linear_conv_kernel_dim": self.linear_conv_width,
                "linear_lower_bound": self.linear_lower_bound, "hc_mult": self.hc_mult, "hc_eps": self.hc_eps,
                "hc_sinkhorn_iters": self.hc_sinkhorn_iters}

    def to_hf_dict(self) -> dict[str, Any]:
        return {"architectures": [self.architecture], "model_type": self.model_type,
                "tie_word_embeddings": self.tie_word_embeddings, "torch_dtype": self.torch_dtype,
                "text_config": self.text_hf_dict()}

    def kda_parameters(self) -> int:
        h, hd, inner = self.hidden_size, self.linear_head_dim, self.linear_heads * self.linear_head_dim
        return (3 * inner * h + 3 * inner * self.linear_conv_width + 2 * (hd * h + inner * hd) + 2 * inner
                + self.linear_heads + self.linear_heads * h + hd + h * inner)

    def attention_parameters(self, layer: int) -> int:
        if self.layer_types[layer] == "linear_attention":
            return self.kda_parameters()
        n = super().attention_parameters(layer)
        if self.indexer_types[layer] == "full":
            h, hi, d = self.hidden_size, self.index_n_heads, self.index_head_dim
            n += self.q_lora_rank * hi * d + h * d + 2 * d + h * hi + self.index_kpool * d + d * h
        return n

    def num_parameters(self) -> int:
        hc = 2 * ((2 + self.hc_mult) * self.hc_mult * (self.hc_mult * self.hidden_size + 1) + 3)
        return super().num_parameters() + self.num_layers * hc

    def decode_selection_activations(self, rows: int, context: int, dtype: torch.dtype) -> list[int]:
        """layers/kpool_indexer.select_pools_cuda over P = C / kpool pools: the float32 scores [N, P],
        topk's values [N, S] float32 and indices [N, S] int64 (S = min(topk / kpool, P)), the tokens
        [N, topk + kpool - 1] int32 (the kernels read the [k | gate] rows in place: no gathered copy)."""
        if not self.index_layers:
            return []
        pools = context // self.index_kpool
        picks = min(self.index_topk // self.index_kpool, pools)
        width = self.index_topk + self.index_kpool - 1
        return [rows * pools * 4, rows * picks * 4, rows * picks * 8, rows * width * 4]

    def attention_activations(self, tokens: int, dtype: torch.dtype) -> list[int]:
        """The MLA layers' transients (mla_config) and a KDA layer's: qkv and its conv [T, 3D], the gates
        and output [T, D] float32 (the CPU reference's chunk scratch is not counted)."""
        inner, isz = self.linear_heads * self.linear_head_dim, dtype.itemsize
        kda = [tokens * 3 * inner * isz, tokens * 3 * inner * isz, tokens * inner * 4, tokens * inner * 4]
        return kda + super().attention_activations(tokens, dtype)
