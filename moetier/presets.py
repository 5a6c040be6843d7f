"""Named model shapes: published ones for benchmarks, tiny ones for tests and the default model.

Each preset is the config.json fields of a Hugging Face checkpoint; `moetier make-checkpoint --preset`
writes random weights of that shape.
"""

from __future__ import annotations

from typing import Any

from moetier.config import ModelConfig
from moetier.models.mtp import MTP_FAMILIES
from moetier.models.registry import config_from_dict
from moetier.errors import ConfigError
from moetier.experts.shape import MoeShape

_QWEN3_COMMON: dict[str, Any] = {
    "model_type": "qwen3_moe",
    "architectures": ["Qwen3MoeForCausalLM"],
    "hidden_act": "silu",
    "rms_norm_eps": 1e-6,
    "attention_bias": False,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "use_sliding_window": False,
}

_DEEPSEEK_COMMON: dict[str, Any] = {
    "model_type": "deepseek_v3",
    "architectures": ["DeepseekV3ForCausalLM"],
    "hidden_act": "silu",
    "scoring_func": "sigmoid",
    "topk_method": "noaux_tc",
    "moe_layer_freq": 1,
    "attention_bias": False,
}

_GLM_COMMON: dict[str, Any] = {
    "model_type": "glm_moe_dsa",
    "architectures": ["GlmMoeDsaForCausalLM"],
    "hidden_act": "silu",
    "attention_bias": False,
}

_GLM5_NEXT_COMMON: dict[str, Any] = {
    "model_type": "glm5_next",
    "architectures": ["Glm5NextForConditionalGeneration"],
}

_COMMON = {"qwen3_moe": _QWEN3_COMMON, "deepseek_v3": _DEEPSEEK_COMMON, "glm_moe_dsa": _GLM_COMMON,
           "glm5_next": _GLM5_NEXT_COMMON}

# Shapes from the published config.json files of Qwen/Qwen3-30B-A3B and Qwen/Qwen3-235B-A22B.
_PUBLISHED = {
    "qwen3-30b-a3b": {
        "vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 6144, "num_hidden_layers": 48,
        "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
        "moe_intermediate_size": 768, "num_experts": 128, "num_experts_per_tok": 8,
        "norm_topk_prob": True, "rope_theta": 1000000.0, "max_position_embeddings": 40960,
        "tie_word_embeddings": False, "bos_token_id": 151643, "eos_token_id": 151645,
        "torch_dtype": "bfloat16",
    },
    "qwen3-235b-a22b": {
        "vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 94,
        "num_attention_heads": 64, "num_key_value_heads": 4, "head_dim": 128,
        "moe_intermediate_size": 1536, "num_experts": 128, "num_experts_per_tok": 8,
        "norm_topk_prob": True, "rope_theta": 1000000.0, "max_position_embeddings": 40960,
        "tie_word_embeddings": False, "bos_token_id": 151643, "eos_token_id": 151645,
        "torch_dtype": "bfloat16",
    },
    # deepseek-ai/DeepSeek-V3's config.json (V3-0324 and R1 share it); num_nextn_predict_layers 1: the
    # MTP layer 61, skipped on load.
    "deepseek-v3": {
        "model_type": "deepseek_v3",
        "vocab_size": 129280, "hidden_size": 7168, "intermediate_size": 18432, "num_hidden_layers": 61,
        "num_attention_heads": 128, "num_key_value_heads": 128, "q_lora_rank": 1536, "kv_lora_rank": 512,
        "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
        "moe_intermediate_size": 2048, "n_routed_experts": 256, "num_experts_per_tok": 8, "n_shared_experts": 1,
        "n_group": 8, "topk_group": 4, "norm_topk_prob": True, "routed_scaling_factor": 2.5,
        "first_k_dense_replace": 3, "rms_norm_eps": 1e-6, "max_position_embeddings": 163840,
        "rope_theta": 10000, "rope_scaling": {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096,
                                              "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
        "num_nextn_predict_layers": 1, "tie_word_embeddings": False, "bos_token_id": 0, "eos_token_id": 1,
        "torch_dtype": "bfloat16",
    },
    # zai-org/GLM-5: transformers' GlmMoeDsaConfig defaults, which describe it (docs/models.md says
    # where to check the card): 78 layers, 256 experts top-8, DSA top-2048 on every layer.
    "glm-5": {
        "model_type": "glm_moe_dsa",
        "vocab_size": 154880, "hidden_size": 6144, "intermediate_size": 12288, "num_hidden_layers": 78,
        "num_attention_heads": 64, "num_key_value_heads": 64, "q_lora_rank": 2048, "kv_lora_rank": 512,
        "qk_nope_head_dim": 192, "qk_rope_head_dim": 64, "v_head_dim": 256,
        "moe_intermediate_size": 2048, "n_routed_experts": 256, "num_experts_per_tok": 8, "n_shared_experts": 1,
        "n_group": 1, "topk_group": 1, "norm_topk_prob": True, "routed_scaling_factor": 2.5,
        "first_k_dense_replace": 3, "rms_norm_eps": 1e-5, "max_position_embeddings": 202752,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        "index_topk": 2048, "index_head_dim": 128, "index_n_heads": 32,
        "num_nextn_predict_layers": 1, "tie_word_embeddings": False, "bos_token_id": 0, "eos_token_id": 1,
        "torch_dtype": "bfloat16",
    },
    # zai-org/GLM-5.3-Flash: transformers' Glm5NextTextConfig defaults (the language model of the
    # multimodal checkpoint; its vision tower is skipped): 45 layers, three KDA layers then one MLA
    # layer (NoPE, kpool-16 DSA indexer), 288 experts top-8, mHC with 4 streams, SwiGLU clamped at 10.
    "glm-5.3-flash": {
        "model_type": "glm5_next", "tie_word_embeddings": False, "torch_dtype": "bfloat16",
        "text_config": {
            "vocab_size": 154880, "hidden_size": 4096, "intermediate_size": 12288, "moe_intermediate_size": 2048,
            "num_hidden_layers": 45, "num_attention_heads": 64, "num_key_value_heads": 64,
            "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 256, "qk_rope_head_dim": 0,
            "v_head_dim": 256, "n_routed_experts": 288, "num_experts_per_tok": 8, "n_shared_experts": 1,
            "n_group": 1, "topk_group": 1, "norm_topk_prob": True, "routed_scaling_factor": 2.5,
            "rms_norm_eps": 1e-5, "max_position_embeddings": 1048576, "pad_token_id": 154820,
            "mlp_layer_types": ["dense"] * 3 + ["sparse"] * 42,
            "layer_types": ["indexed_attention" if i % 4 == 3 else "linear_attention" for i in range(45)],
            "indexer_types": ["full"] * 45,
            "index_topk": 2048, "index_head_dim": 128, "index_n_heads": 32, "index_kpool": 16,
            "swiglu_limit": 10.0, "linear_num_heads": 64, "linear_head_dim": 128, "linear_conv_kernel_dim": 4,
            "linear_lower_bound": -5.0, "hc_mult": 4, "hc_eps": 1e-6, "hc_sinkhorn_iters": 20,
        },
    },
}

# Tiny shapes that differ in the ways the parity tests care about: head counts, GQA ratio, expert
# count, top-k, odd sizes, tied embeddings, dense layers between MoE layers. The vocabulary is at
# least the size of the generated tokenizer (moetier.tokenizer.write_tokenizer).
_TINY = {
    # The shape of the random-weight test model (the embedded default model, tiny-stdlib, has the
    # same expert shape but a trained 448-token vocabulary and tied embeddings).
    "tiny": {
        "vocab_size": 512, "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 4,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
        "moe_intermediate_size": 64, "num_experts": 32, "num_experts_per_tok": 4,
        "norm_topk_prob": True, "rope_theta": 10000.0, "max_position_embeddings": 4096,
        "tie_word_embeddings": False, "torch_dtype": "float32",
    },
    "tiny-gqa": {
        "vocab_size": 520, "hidden_size": 96, "intermediate_size": 160, "num_hidden_layers": 3,
        "num_attention_heads": 6, "num_key_value_heads": 1, "head_dim": 16,
        "moe_intermediate_size": 48, "num_experts": 8, "num_experts_per_tok": 2,
        "norm_topk_prob": False, "rope_theta": 1000000.0, "max_position_embeddings": 2048,
        "tie_word_embeddings": True, "torch_dtype": "float32",
    },
    "tiny-odd": {
        "vocab_size": 601, "hidden_size": 72, "intermediate_size": 100, "num_hidden_layers": 6,
        "num_attention_heads": 3, "num_key_value_heads": 3, "head_dim": 24,
        "moe_intermediate_size": 36, "num_experts": 12, "num_experts_per_tok": 3,
        "norm_topk_prob": True, "rope_theta": 10000.0, "max_position_embeddings": 2048,
        "tie_word_embeddings": False, "decoder_sparse_step": 2, "mlp_only_layers": [5],
        "torch_dtype": "float32",
    },
    # MLA with the low-rank query, YaRN (cos/sin scaled: mscale != mscale_all_dim), groups 4 pick 2,
    # one shared expert, one leading dense layer.
    "tiny-dsv3": {
        "model_type": "deepseek_v3",
        "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 3,
        "num_attention_heads": 4, "num_key_value_heads": 4, "q_lora_rank": 48, "kv_lora_rank": 32,
        "qk_nope_head_dim": 24, "qk_rope_head_dim": 16, "v_head_dim": 20,
        "moe_intermediate_size": 32, "n_routed_experts": 16, "num_experts_per_tok": 4, "n_shared_experts": 1,
        "n_group": 4, "topk_group": 2, "norm_topk_prob": True, "routed_scaling_factor": 2.5,
        "first_k_dense_replace": 1, "rms_norm_eps": 1e-6, "max_position_embeddings": 1024,
        "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256,
                         "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 0.8},
        "rope_theta": 10000.0, "tie_word_embeddings": False, "torch_dtype": "float32",
    },
    # No low-rank query (q_proj), rotate-half rotary, plain rope, one group, two shared experts,
    # no renormalisation, two dense layers, tied embeddings.
    "tiny-dsv3-plain": {
        "model_type": "deepseek_v3",
        "vocab_size": 520, "hidden_size": 48, "intermediate_size": 96, "num_hidden_layers": 4,
        "num_attention_heads": 3, "num_key_value_heads": 3, "q_lora_rank": None, "kv_lora_rank": 24,
        "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16, "rope_interleave": False,
        "moe_intermediate_size": 24, "n_routed_experts": 8, "num_experts_per_tok": 2, "n_shared_experts": 2,
        "n_group": 1, "topk_group": 1, "norm_topk_prob": False, "routed_scaling_factor": 1.5,
        "first_k_dense_replace": 2, "rms_norm_eps": 1e-6, "max_position_embeddings": 1024,
        "rope_theta": 10000.0, "tie_word_embeddings": True, "torch_dtype": "float32",
    },
    # DSA: index_topk 8, below the test contexts; full, shared, full, shared indexer layers; groups 4
    # pick 2, a shared expert, one leading dense layer.
    "tiny-glm5": {
        "model_type": "glm_moe_dsa",
        "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
        "num_attention_heads": 4, "num_key_value_heads": 4, "q_lora_rank": 48, "kv_lora_rank": 32,
        "qk_nope_head_dim": 24, "qk_rope_head_dim": 16, "v_head_dim": 32,
        "moe_intermediate_size": 32, "n_routed_experts": 16, "num_experts_per_tok": 4, "n_shared_experts": 1,
        "n_group": 4, "topk_group": 2, "norm_topk_prob": True, "routed_scaling_factor": 2.5,
        "first_k_dense_replace": 1, "rms_norm_eps": 1e-5, "max_position_embeddings": 1024,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        "index_topk": 8, "index_head_dim": 32, "index_n_heads": 8,
        "indexer_types": ["full", "shared", "full", "shared"],
        "tie_word_embeddings": False, "torch_dtype": "float32",
    },
    # GLM-5.3-Flash: KDA layers (heads 4 x 16, conv 4) around one indexed MLA layer (NoPE, index_topk
    # 16 in pools of 4: 4 pools plus the tail, below the test prompts), hc_mult 4, a dense first layer,
    # 16 experts top-4 with a shared one, swiglu_limit 0.15 (the random weights' gate and up values
    # reach past it). A tiny vision tower, which the engine skips.
    "tiny-glm5-next": {
        "model_type": "glm5_next", "tie_word_embeddings": False, "torch_dtype": "float32",
        "text_config": {
            "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "moe_intermediate_size": 32,
            "num_hidden_layers": 5, "num_attention_heads": 4, "num_key_value_heads": 4,
            "q_lora_rank": 48, "kv_lora_rank": 32, "qk_nope_head_dim": 24, "qk_rope_head_dim": 0, "v_head_dim": 32,
            "n_routed_experts": 16, "num_experts_per_tok": 4, "n_shared_experts": 1, "n_group": 1, "topk_group": 1,
            "norm_topk_prob": True, "routed_scaling_factor": 2.5, "rms_norm_eps": 1e-5,
            "max_position_embeddings": 1024, "pad_token_id": 0,
            "mlp_layer_types": ["dense", "sparse", "sparse", "sparse", "sparse"],
            "layer_types": ["linear_attention"] * 3 + ["indexed_attention", "linear_attention"],
            "indexer_types": ["full"] * 5,
            "index_topk": 16, "index_head_dim": 32, "index_n_heads": 4, "index_kpool": 4,
            "swiglu_limit": 0.15, "linear_num_heads": 4, "linear_head_dim": 16, "linear_conv_kernel_dim": 4,
            "linear_lower_bound": -5.0, "hc_mult": 4, "hc_eps": 1e-6, "hc_sinkhorn_iters": 20,
        },
        "vision_config": {"depth": 1, "hidden_size": 32, "num_heads": 2, "out_hidden_size": 64,
                          "intermediate_size": 64, "projection_intermediate_size": 64},
    },
}


# MoE layer shapes of architectures without a model preset yet (published config.json values).
MOE_SHAPES: dict[str, MoeShape] = {}


def moe_shape(name: str) -> MoeShape:
    """The routed-expert shape of a model preset or of MOE_SHAPES."""
    return MOE_SHAPES[name] if name in MOE_SHAPES else preset(name).moe_shape


def names() -> list[str]:
    return sorted([*_PUBLISHED, *_TINY])


def preset_dict(name: str, layers: int | None = None, dtype: str | None = None, mtp_layers: int | None = None
                ) -> dict[str, Any]:
    """config.json fields of a preset, optionally cut to `layers` layers, with another dtype, and with
    `mtp_layers` MTP layers (num_nextn_predict_layers: the DeepSeek-V3 family's, and qwen3_moe's in the
    same shape, models/mtp.py)."""
    table = {**_PUBLISHED, **_TINY}
    if name not in table:
        raise ConfigError(f"unknown preset {name!r}; choose one of: {', '.join(names())}")
    d = {**_COMMON[table[name].get("model_type", "qwen3_moe")], **table[name]}
    if mtp_layers is not None:
        if d["model_type"] not in MTP_FAMILIES or mtp_layers < 0:
            raise ConfigError(f"preset {name}: MTP layers ({mtp_layers}) are for {', '.join(MTP_FAMILIES)} "
                              "presets, 0 or more")
        d["num_nextn_predict_layers"] = mtp_layers
    if "text_config" in d:  # a multimodal config: the language model's fields sit in text_config
        d["text_config"] = text = dict(d["text_config"])
        if layers is not None:
            full = text["num_hidden_layers"]
            if not 1 <= layers <= full:
                raise ConfigError(f"--layers {layers}: preset {name} has {full} layers; keep 1 to {full} of them")
            text["num_hidden_layers"] = layers
            for key in ("mlp_layer_types", "layer_types", "indexer_types"):
                if key in text:
                    text[key] = text[key][:layers]
        if dtype is not None:
            d["torch_dtype"] = dtype
        return d
    if layers is not None:
        full = d["num_hidden_layers"]
        if not 1 <= layers <= full:
            raise ConfigError(f"--layers {layers}: preset {name} has {full} layers; keep 1 to {full} of them")
        d["num_hidden_layers"] = layers
        if "mlp_only_layers" in d:
            d["mlp_only_layers"] = [i for i in d["mlp_only_layers"] if i < layers]
        for key in ("mlp_layer_types", "indexer_types"):  # per-layer lists keep their first `layers`
            if key in d:
                d[key] = d[key][:layers]
    if dtype is not None:
        d["torch_dtype"] = dtype
    return d


def preset(name: str, layers: int | None = None, dtype: str | None = None, mtp_layers: int | None = None
           ) -> ModelConfig:
    return config_from_dict(preset_dict(name, layers, dtype, mtp_layers), source=f"preset {name}")
