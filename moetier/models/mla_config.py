"""The config fields the DeepSeek-V3 family shares (deepseek_v3, glm_moe_dsa): multi-head latent
attention, YaRN rotary, grouped sigmoid routing, shared experts, leading dense layers, MTP layers.

Field meanings (config.json names) are in docs/models.md. Derived here: which layers are MoE layers
(mlp_layer_types), the softmax scale (with YaRN's mscale), the rotary frequencies and cos/sin scale.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from moetier.config import Fields, ModelConfig
from moetier.layers.rotary import rope_inv_freq, yarn_inv_freq, yarn_mscale

ROPE_TYPES = ("default", "yarn")


@dataclass(frozen=True, kw_only=True)
class MlaMoeConfig(ModelConfig):
    intermediate_size: int  # the dense MLP of the leading dense layers
    num_heads: int
    q_lora_rank: int  # 0: no low-rank query path (q_proj)
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int  # may be 0
    v_head_dim: int
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0
    n_shared_experts: int = 0
    first_k_dense_replace: int = 0
    mlp_layer_types: tuple[str, ...] = ()  # per layer "dense" or "sparse"
    rope_theta: float = 10000.0
    rope_interleave: bool = True
    rope_type: str = "default"
    rope_factor: float = 1.0
    original_max_position_embeddings: int = 0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 0.0
    mscale_all_dim: float = 0.0
    attention_factor: float | None = None
    rope_truncate: bool = True
    attention_bias: bool = False
    num_nextn_predict_layers: int = 0  # MTP layers stored after the decoder layers
    # Of those, how many the model holds (models/mtp.with_mtp, for speculative decoding; not in
    # config.json). 0: skipped at load. Loaded MTP layers are MoE layers like the others: their
    # experts sit in the model's tiers and the plan, the placement and the traces count them.
    mtp_layers: int = 0

    def is_moe_layer(self, layer: int) -> bool:
        if layer >= self.num_layers:  # an MTP layer: always MoE (transformers' get_mtp_config says so too)
            return layer < self.num_layers + self.mtp_layers and self.num_experts > 0
        return self.mlp_layer_types[layer] == "sparse" and self.num_experts > 0

    @property
    def moe_layers(self) -> list[int]:
        return [i for i in range(self.num_layers + self.mtp_layers) if self.is_moe_layer(i)]

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def softmax_scale(self) -> float:
        # transformers' yarn_apply_mscale: the stretched context's temperature, squared (q and k)
        scale = self.qk_head_dim ** -0.5
        if self.rope_type != "default" and self.mscale_all_dim:
            m = yarn_mscale(self.rope_factor, self.mscale_all_dim)
            scale = scale * m * m
        return scale

    @property
    def rope_attention_factor(self) -> float:
        """YaRN's scale on cos and sin (1.0 for plain rotary, and for DeepSeek-V3, whose mscale equals
        mscale_all_dim)."""
        if self.rope_type == "default":
            return 1.0
        if self.attention_factor is not None:
            return self.attention_factor
        if self.mscale and self.mscale_all_dim:
            return yarn_mscale(self.rope_factor, self.mscale) / yarn_mscale(self.rope_factor, self.mscale_all_dim)
        return yarn_mscale(self.rope_factor)

    def inv_freq(self) -> torch.Tensor:
        # [qk_rope_head_dim / 2] float32
        d = self.qk_rope_head_dim
        if self.rope_type == "yarn":
            return yarn_inv_freq(d, self.rope_theta, self.rope_factor, self.original_max_position_embeddings,
                                 self.beta_fast, self.beta_slow, self.rope_truncate)
        return rope_inv_freq(d, self.rope_theta)

    @classmethod
    def parse_mla(cls, f: Fields, first_k_dense_default: int, layer_types_field: bool) -> dict[str, Any]:
        """The shared fields, read and checked (problems collected in f). layer_types_field: whether
        the family reads mlp_layer_types (glm_moe_dsa) or only first_k_dense_replace (deepseek_v3)."""
        c = cls.common(f)
        layers, experts = c["num_layers"], c["num_experts"]
        heads = f.positive_int("num_attention_heads")
        kv_heads = f.get("num_key_value_heads", default=heads)
        if heads and kv_heads != heads:
            f.problems.append(f"num_key_value_heads {kv_heads!r} must equal num_attention_heads {heads} "
                              "(MLA expands one latent to every head)")
        q_lora = f.get("q_lora_rank", default=0)
        if not isinstance(q_lora, int) or isinstance(q_lora, bool) or q_lora < 0:
            f.problems.append(f"q_lora_rank must be a positive integer or null (no low-rank query), got {q_lora!r}")
            q_lora = 0
        rope_dim = f.get("qk_rope_head_dim", default=64)
        if not isinstance(rope_dim, int) or rope_dim < 0 or rope_dim % 2:
            f.problems.append(f"qk_rope_head_dim must be an even integer >= 0 (rotary pairs), got {rope_dim!r}")
            rope_dim = 0
        n_group = f.positive_int("n_group", default=1)
        topk_group = f.positive_int("topk_group", default=1)
        top_k = c["top_k"]
        if experts and n_group:
            if experts % n_group:
                f.problems.append(f"n_routed_experts {experts} does not split into n_group {n_group} equal groups")
            elif n_group > 1 and experts // n_group < 2:
                f.problems.append(f"n_group {n_group} leaves {experts // n_group} expert per group; the group "
                                  "score sums each group's two best experts, so groups need at least 2")
            if topk_group > n_group:
                f.problems.append(f"topk_group {topk_group} is larger than n_group {n_group}")
            elif not experts % n_group and top_k > topk_group * (experts // n_group):
                f.problems.append(f"num_experts_per_tok {top_k} is more than the {topk_group * (experts // n_group)} "
                                  f"experts of topk_group {topk_group} groups")
        for key, want in (("scoring_func", "sigmoid"), ("topk_method", "noaux_tc"), ("hidden_act", "silu")):
            got = f.get(key, default=want)
            if got != want:
                f.problems.append(f"{key} {got!r} is not supported (only {want!r})")
        if f.get("moe_layer_freq", default=1) != 1:
            f.problems.append(f"moe_layer_freq {f.get('moe_layer_freq')!r} is not supported (only 1: every layer "
                              "after the dense ones is a MoE layer)")
        first_k = f.get("first_k_dense_replace", default=first_k_dense_default)
        if not isinstance(first_k, int) or first_k < 0:
            f.problems.append(f"first_k_dense_replace must be an integer >= 0, got {first_k!r}")
            first_k = 0
        types = f.get("mlp_layer_types", default=None) if layer_types_field else None
        if types is None:
            n_dense = min(first_k, layers)
            types = ["dense"] * n_dense + ["sparse"] * (layers - n_dense)
        elif (not isinstance(types, list) or len(types) != layers
              or any(t not in ("dense", "sparse") for t in types)):
            f.problems.append(f"mlp_layer_types must list 'dense' or 'sparse' for each of the {layers} layers, "
                              f"got {types!r}")
            types = ["dense"] * layers
        rope = dict(f.get("rope_parameters", "rope_scaling", default=None) or {})
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ROPE_TYPES:
            f.problems.append(f"rope type {rope_type!r} is not supported (only {', '.join(ROPE_TYPES)})")
        factor = rope.get("factor", 1.0)
        orig = rope.get("original_max_position_embeddings", 0)
        if rope_type == "yarn":
            if not isinstance(factor, (int, float)) or factor <= 0:
                f.problems.append(f"rope_scaling factor must be a positive number for yarn, got {factor!r}")
                factor = 1.0
            if not isinstance(orig, int) or orig <= 0:
                f.problems.append("rope_scaling original_max_position_embeddings must be a positive integer for "
                                  f"yarn, got {orig!r}")
                orig = 1
        shared = f.get("n_shared_experts", default=0)
        if not isinstance(shared, int) or isinstance(shared, bool) or shared < 0:
            f.problems.append(f"n_shared_experts must be an integer >= 0, got {shared!r}")
            shared = 0
        mtp = f.get("num_nextn_predict_layers", "num_mtp_layers", default=0)
        if not isinstance(mtp, int) or mtp < 0:
            f.problems.append(f"num_nextn_predict_layers must be an integer >= 0, got {mtp!r}")
            mtp = 0
        return dict(
            c,
            intermediate_size=f.positive_int("intermediate_size"),
            num_heads=heads,
            q_lora_rank=q_lora,
            kv_lora_rank=f.positive_int("kv_lora_rank"),
            qk_nope_head_dim=f.positive_int("qk_nope_head_dim"),
            qk_rope_head_dim=rope_dim,
            v_head_dim=f.positive_int("v_head_dim"),
            n_group=n_group,
            topk_group=topk_group,
            norm_topk_prob=bool(f.get("norm_topk_prob", default=True)),
            routed_scaling_factor=f.number("routed_scaling_factor", default=1.0),
            n_shared_experts=shared,
            first_k_dense_replace=first_k,
            mlp_layer_types=tuple(types),
            rope_theta=float(rope.get("rope_theta", f.get("rope_theta", default=10000.0))),
            rope_type=rope_type,
            rope_factor=float(factor),
            original_max_position_embeddings=orig,
            beta_fast=float(rope.get("beta_fast") or 32),
            beta_slow=float(rope.get("beta_slow") or 1),
            mscale=float(rope.get("mscale") or 0),
            mscale_all_dim=float(rope.get("mscale_all_dim") or 0),
            attention_factor=rope.get("attention_factor"),
            rope_truncate=bool(rope.get("truncate", True)),
            attention_bias=bool(f.get("attention_bias", default=False)),
            num_nextn_predict_layers=mtp,
        )

    def rope_hf_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"rope_type": self.rope_type, "rope_theta": self.rope_theta}
        if self.rope_type == "yarn":
            out.update(factor=self.rope_factor, original_max_position_embeddings=self.original_max_position_embeddings,
                       beta_fast=self.beta_fast, beta_slow=self.beta_slow, mscale=self.mscale,
                       mscale_all_dim=self.mscale_all_dim, truncate=self.rope_truncate)
            if self.attention_factor is not None:
                out["attention_factor"] = self.attention_factor
        return out

    def mla_hf_dict(self) -> dict[str, Any]:
        return {
            **self.common_hf_dict(),
            "intermediate_size": self.intermediate_size,
            "moe_intermediate_size": self.moe_intermediate_size,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_heads,
            "q_lora_rank": self.q_lora_rank or None,
            "kv_lora_rank": self.kv_lora_rank,
            "qk_nope_head_dim": self.qk_nope_head_dim,
            "qk_rope_head_dim": self.qk_rope_head_dim,
            "v_head_dim": self.v_head_dim,
            "n_routed_experts": self.num_experts,
            "num_experts_per_tok": self.top_k,
            "n_shared_experts": self.n_shared_experts,
            "n_group": self.n_group,
            "topk_group": self.topk_group,
            "norm_topk_prob": self.norm_topk_prob,
            "routed_scaling_factor": self.routed_scaling_factor,
            "first_k_dense_replace": self.first_k_dense_replace,
            "rope_parameters": self.rope_hf_dict(),
            "attention_bias": self.attention_bias,
            "attention_dropout": 0.0,
            "hidden_act": "silu",
            "num_nextn_predict_layers": self.num_nextn_predict_layers,
        }

    def attention_parameters(self, layer: int) -> int:
        h, hq, r, p = self.hidden_size, self.num_heads, self.kv_lora_rank, self.qk_rope_head_dim
        ql, b = self.q_lora_rank, int(self.attention_bias)
        q = h * ql + b * ql + ql + ql * hq * self.qk_head_dim if ql else h * hq * self.qk_head_dim
        kv = h * (r + p) + b * (r + p) + r + r * hq * (self.qk_nope_head_dim + self.v_head_dim)
        return q + kv + hq * self.v_head_dim * h + b * h

    def attention_activations(self, tokens: int, dtype: torch.dtype) -> list[int]:
        """q_resid and the latent projection, q [T, Hq, nope + rope], the absorbed query [T, Hq, R + P],
        the latent output [T, Hq, R] and after W_UV [T, Hq, v]. Not counted: the CPU reference's
        [Hq, T, context] float32 scores (the CUDA kernel's own workspace is for its author to add)."""
        t, isz, hq, r, p = tokens, dtype.itemsize, self.num_heads, self.kv_lora_rank, self.qk_rope_head_dim
        return [t * (self.q_lora_rank + r + p) * isz, t * hq * self.qk_head_dim * isz, t * hq * (r + p) * isz,
                t * hq * r * isz, t * hq * self.v_head_dim * isz]

    def num_parameters(self) -> int:
        h, mi = self.hidden_size, self.moe_intermediate_size
        total = self.vocab_size * h * (1 if self.tie_word_embeddings else 2) + h
        for i in range(self.num_layers + self.mtp_layers):
            # an MTP layer adds enorm, hnorm, eh_proj [H, 2H] and its head's norm (embedding, head: shared)
            total += 2 * h + self.attention_parameters(i) + (3 * h + 2 * h * h if i >= self.num_layers else 0)
            if self.is_moe_layer(i):
                e = self.num_experts
                total += e * h + e + e * 3 * h * mi + 3 * h * mi * self.n_shared_experts
            else:
                total += 3 * h * self.intermediate_size
        return total
