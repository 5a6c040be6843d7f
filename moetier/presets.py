"""Named model shapes: published ones for benchmarks, tiny ones for tests and the default model.

Each preset is the config.json fields of a Hugging Face checkpoint; `moetier make-checkpoint --preset`
writes random weights of that shape.
"""

from __future__ import annotations

from typing import Any

from moetier.config import ModelConfig, config_from_dict
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
}


# MoE layer shapes of architectures without a model preset yet (published config.json values).
MOE_SHAPES = {"glm-5": MoeShape(num_experts=256, top_k=8, hidden=6144, inter=2048)}


def moe_shape(name: str) -> MoeShape:
    """The routed-expert shape of a model preset or of MOE_SHAPES."""
    return MOE_SHAPES[name] if name in MOE_SHAPES else preset(name).moe_shape


def names() -> list[str]:
    return sorted([*_PUBLISHED, *_TINY])


def preset_dict(name: str, layers: int | None = None, dtype: str | None = None) -> dict[str, Any]:
    """config.json fields of a preset, optionally cut to `layers` layers and with another dtype."""
    table = {**_PUBLISHED, **_TINY}
    if name not in table:
        raise ConfigError(f"unknown preset {name!r}; choose one of: {', '.join(names())}")
    d = {**_QWEN3_COMMON, **table[name]}
    if layers is not None:
        full = d["num_hidden_layers"]
        if not 1 <= layers <= full:
            raise ConfigError(f"--layers {layers}: preset {name} has {full} layers; keep 1 to {full} of them")
        d["num_hidden_layers"] = layers
        d["mlp_only_layers"] = [i for i in d["mlp_only_layers"] if i < layers]
    if dtype is not None:
        d["torch_dtype"] = dtype
    return d


def preset(name: str, layers: int | None = None, dtype: str | None = None) -> ModelConfig:
    return config_from_dict(preset_dict(name, layers, dtype), source=f"preset {name}")
