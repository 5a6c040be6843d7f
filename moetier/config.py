"""Model config parsed from a Hugging Face config.json, validated before anything is allocated."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from moetier.errors import ConfigError, problem_list

SUPPORTED_ARCHITECTURES = {"qwen3_moe": "Qwen3MoeForCausalLM"}


@dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int  # dense MLP width (layers in mlp_only_layers or off the sparse step)
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    moe_intermediate_size: int
    num_experts: int
    top_k: int
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 32768
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    hidden_act: str = "silu"
    torch_dtype: str = "bfloat16"  # the checkpoint's dtype as config.json states it
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    extra: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    def is_moe_layer(self, layer: int) -> bool:
        # Same rule as transformers' Qwen3MoeDecoderLayer.
        return (
            layer not in self.mlp_only_layers
            and self.num_experts > 0
            and (layer + 1) % self.decoder_sparse_step == 0
        )

    @property
    def moe_layers(self) -> list[int]:
        return [i for i in range(self.num_layers) if self.is_moe_layer(i)]

    def num_parameters(self) -> int:
        h, d = self.hidden_size, self.head_dim
        attn = h * d * (self.num_heads * 2 + self.num_kv_heads * 2) + 2 * d + 2 * h
        if self.attention_bias:
            attn += d * (self.num_heads + 2 * self.num_kv_heads) + h
        total = self.vocab_size * h * (1 if self.tie_word_embeddings else 2) + h
        for i in range(self.num_layers):
            total += attn
            if self.is_moe_layer(i):
                total += self.num_experts * h + self.num_experts * 3 * h * self.moe_intermediate_size
            else:
                total += 3 * h * self.intermediate_size
        return total

    @classmethod
    def from_dict(cls, d: dict[str, Any], source: str = "config.json") -> ModelConfig:
        problems: list[str] = []
        model_type = d.get("model_type")
        if model_type not in SUPPORTED_ARCHITECTURES:
            archs = ", ".join(d.get("architectures") or []) or "none given"
            raise ConfigError(
                f"{source}: model_type {model_type!r} (architectures: {archs}) is not supported. "
                f"moetier supports: {', '.join(SUPPORTED_ARCHITECTURES)}."
            )

        def get(key: str, *aliases: str, default: Any = KeyError) -> Any:
            for k in (key, *aliases):
                if k in d and d[k] is not None:
                    return d[k]
            if default is KeyError:
                problems.append(f"missing required field {key!r}")
                return None
            return default

        def positive_int(key: str, *aliases: str, default: Any = KeyError) -> int:
            v = get(key, *aliases, default=default)
            if v is None:
                return 0
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                problems.append(f"{key} must be a positive integer, got {v!r}")
                return 0
            return v

        hidden = positive_int("hidden_size")
        heads = positive_int("num_attention_heads")
        kv_heads = positive_int("num_key_value_heads", default=heads or 1)
        head_dim = get("head_dim", default=None)
        if head_dim is None:
            head_dim = hidden // heads if heads and hidden % heads == 0 else 0
            if not head_dim:
                problems.append(
                    f"head_dim is not given and hidden_size {hidden} is not divisible by "
                    f"num_attention_heads {heads}"
                )
        elif not isinstance(head_dim, int) or head_dim <= 0 or head_dim % 2:
            problems.append(f"head_dim must be a positive even integer (rotary halves it), got {head_dim!r}")
        if heads and kv_heads and heads % kv_heads:
            problems.append(
                f"num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads} (GQA groups)"
            )
        experts = positive_int("num_experts", "num_local_experts")
        top_k = positive_int("num_experts_per_tok")
        if experts and top_k and top_k > experts:
            problems.append(f"num_experts_per_tok {top_k} is larger than num_experts {experts}")
        layers = positive_int("num_hidden_layers")
        vocab = positive_int("vocab_size")
        inter = positive_int("intermediate_size")
        moe_inter = positive_int("moe_intermediate_size")
        sparse_step = positive_int("decoder_sparse_step", default=1)
        max_pos = positive_int("max_position_embeddings", default=32768)
        mlp_only = tuple(get("mlp_only_layers", default=[]) or [])
        bad = [i for i in mlp_only if not isinstance(i, int) or not 0 <= i < max(layers, 1)]
        if bad:
            problems.append(f"mlp_only_layers {bad} are outside 0..{layers - 1}")
        act = get("hidden_act", default="silu")
        if act not in ("silu", "swish"):
            problems.append(f"hidden_act {act!r} is not supported (only silu)")
        if get("use_sliding_window", default=False):
            problems.append("use_sliding_window=true is not supported; set it to false")
        rope = get("rope_parameters", "rope_scaling", default=None) or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type != "default":
            problems.append(f"rope type {rope_type!r} is not supported (only the default rotary)")
        rope_theta = rope.get("rope_theta", get("rope_theta", default=10000.0))
        eos = get("eos_token_id", default=[])
        eos_ids = tuple(eos if isinstance(eos, list) else [eos])
        dtype = str(get("torch_dtype", "dtype", default="bfloat16")).replace("torch.", "")
        if problems:
            raise ConfigError(
                problem_list(f"{source} does not describe a valid {model_type} model", problems,
                             "Fix these fields in config.json (compare with the model's published config).")
            )
        return cls(
            model_type=model_type,
            vocab_size=vocab,
            hidden_size=hidden,
            intermediate_size=inter,
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            moe_intermediate_size=moe_inter,
            num_experts=experts,
            top_k=top_k,
            norm_topk_prob=bool(get("norm_topk_prob", default=False)),
            decoder_sparse_step=sparse_step,
            mlp_only_layers=mlp_only,
            rms_norm_eps=float(get("rms_norm_eps", default=1e-6)),
            rope_theta=float(rope_theta),
            max_position_embeddings=max_pos,
            tie_word_embeddings=bool(get("tie_word_embeddings", default=False)),
            attention_bias=bool(get("attention_bias", default=False)),
            hidden_act="silu",
            torch_dtype=dtype,
            bos_token_id=get("bos_token_id", default=None),
            eos_token_ids=eos_ids,
            extra=d,
        )

    @classmethod
    def from_dir(cls, path: str | Path) -> ModelConfig:
        f = Path(path) / "config.json"
        if not f.is_file():
            raise ConfigError(
                f"{f} not found: --model must be a Hugging Face checkpoint directory holding config.json, "
                "tokenizer.json and *.safetensors"
            )
        try:
            d = json.loads(f.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise ConfigError(f"{f} is not readable JSON: {e}") from None
        if not isinstance(d, dict):
            raise ConfigError(f"{f} must hold a JSON object")
        return cls.from_dict(d, source=str(f))

    def to_hf_dict(self) -> dict[str, Any]:
        """config.json as Hugging Face writes it for this architecture."""
        return {
            "architectures": [SUPPORTED_ARCHITECTURES[self.model_type]],
            "model_type": self.model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "moe_intermediate_size": self.moe_intermediate_size,
            "num_experts": self.num_experts,
            "num_experts_per_tok": self.top_k,
            "norm_topk_prob": self.norm_topk_prob,
            "decoder_sparse_step": self.decoder_sparse_step,
            "mlp_only_layers": list(self.mlp_only_layers),
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "attention_bias": self.attention_bias,
            "attention_dropout": 0.0,
            "hidden_act": self.hidden_act,
            "use_sliding_window": False,
            "sliding_window": None,
            "torch_dtype": self.torch_dtype,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": list(self.eos_token_ids) if len(self.eos_token_ids) != 1 else self.eos_token_ids[0],
            "initializer_range": 0.02,
            "use_cache": True,
        }
