"""Model configs parsed from a Hugging Face config.json, validated before anything is allocated.

ModelConfig holds what every family shares and what the engine, the loader and the expert tiers
read (sizes, the routed-expert shape, which layers are MoE layers, stop ids). Each family subclasses
it with its own fields and parsing, next to its model (models/<family>.py); the registry
(models/registry.py) picks the class from the checkpoint's model_type or architectures. Every
problem in a config.json is reported in one error, so a user fixes them all in one pass.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, ClassVar

import torch

from moetier.errors import ConfigError, MoetierError, problem_list
from moetier.experts.shape import MoeShape
from moetier.quant import quant_config as qconfig
from moetier.quant.registry import get as quant_format

REQUIRED = object()
DENSE_WEIGHTS = ("dequantize", "keep")  # EngineConfig.dense_weights: what a checkpoint's dense quantized weights become


class Fields:
    """Reads config.json fields, collecting problems instead of raising at the first."""

    def __init__(self, d: dict[str, Any], source: str):
        self.d, self.source = d, source
        self.problems: list[str] = []

    def get(self, key: str, *aliases: str, default: Any = REQUIRED) -> Any:
        for k in (key, *aliases):
            if k in self.d and self.d[k] is not None:
                return self.d[k]
        if default is REQUIRED:
            self.problems.append(f"missing required field {key!r}")
            return None
        return default

    def positive_int(self, key: str, *aliases: str, default: Any = REQUIRED) -> int:
        v = self.get(key, *aliases, default=default)
        if v is None:
            return 0
        if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
            self.problems.append(f"{key} must be a positive integer, got {v!r}")
            return 0
        return v

    def number(self, key: str, *aliases: str, default: Any = REQUIRED) -> float:
        v = self.get(key, *aliases, default=default)
        if v is None:
            return 0.0
        if not isinstance(v, (int, float)) or isinstance(v, bool) or not v > 0:
            self.problems.append(f"{key} must be a positive number, got {v!r}")
            return 0.0
        return float(v)

    def check(self, model_type: str) -> None:
        if self.problems:
            raise ConfigError(problem_list(f"{self.source} does not describe a valid {model_type} model",
                                           self.problems,
                                           "Fix these fields in config.json (compare with the model's published config)."))


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    # the routed experts of every MoE layer
    num_experts: int
    top_k: int
    moe_intermediate_size: int
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 32768
    tie_word_embeddings: bool = False
    torch_dtype: str = "bfloat16"  # the checkpoint's dtype as config.json states it
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    # config.json quantization_config (or hf_quant_config.json): None, "fp8" (block-scaled float8
    # weights, quant/fp8_block.py), "nvfp4" or an INT4 name (weight-only 4-bit, quant/nvfp4.py,
    # quant/int4.py: int4, int4-g32, int4-asym, int4-g32-asym): routed experts stay quantized in their rows, other quantized weights are
    # dequantized at load
    quant: str | None = None
    quant_config: dict[str, Any] | None = field(default=None, compare=False, repr=False)  # as written
    # The format the model holds a quantized checkpoint's dense projections in: None, dequantized to
    # the model dtype at load; else `quant` itself, kept as stored (layers/quant_linear.py). Not in
    # config.json: set from EngineConfig.dense_weights by with_dense.
    dense_quant: str | None = None
    extra: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    architecture: ClassVar[str] = ""  # the `architectures` entry Hugging Face writes for the family

    def is_moe_layer(self, layer: int) -> bool:
        raise NotImplementedError

    @property
    def moe_layers(self) -> list[int]:
        return [i for i in range(self.num_layers) if self.is_moe_layer(i)]

    @property
    def moe_shape(self) -> MoeShape:
        return MoeShape(self.num_experts, self.top_k, self.hidden_size, self.moe_intermediate_size, self.quant)

    @classmethod
    def common(cls, f: Fields) -> dict[str, Any]:
        """The shared fields, read and checked; a family's parse() adds its own."""
        experts = f.positive_int("num_experts", "num_local_experts", "n_routed_experts")
        top_k = f.positive_int("num_experts_per_tok")
        if experts and top_k and top_k > experts:
            f.problems.append(f"num_experts_per_tok {top_k} is larger than num_experts {experts}")
        eos = f.get("eos_token_id", default=[])
        qc = f.get("quantization_config", default=None)
        fmt = qconfig.format_of(qc) if qc is not None else None
        if qc is not None:  # block FP8, NVFP4 (ModelOpt, compressed-tensors), INT4 (compressed-tensors)
            f.problems.extend(quant_format(fmt).config_problems(qc) if fmt else qconfig.unsupported(qc))
        return dict(
            model_type=f.d.get("model_type"),
            vocab_size=f.positive_int("vocab_size"),
            hidden_size=f.positive_int("hidden_size"),
            num_layers=f.positive_int("num_hidden_layers"),
            num_experts=experts,
            top_k=top_k,
            moe_intermediate_size=f.positive_int("moe_intermediate_size"),
            rms_norm_eps=f.number("rms_norm_eps", default=1e-6),
            max_position_embeddings=f.positive_int("max_position_embeddings", default=32768),
            tie_word_embeddings=bool(f.get("tie_word_embeddings", default=False)),
            torch_dtype=str(f.get("torch_dtype", "dtype", default="bfloat16")).replace("torch.", ""),
            bos_token_id=f.get("bos_token_id", default=None),
            eos_token_ids=tuple(eos if isinstance(eos, list) else [eos]),
            quant=fmt,
            quant_config=qc,
            extra=f.d,
        )

    @classmethod
    def parse(cls, f: Fields) -> dict[str, Any]:
        """Constructor arguments from config.json fields (problems collected in f)."""
        raise NotImplementedError

    @classmethod
    def from_dict(cls, d: dict[str, Any], source: str = "config.json") -> ModelConfig:
        f = Fields(d, source)
        kwargs = cls.parse(f)
        f.check(d.get("model_type"))
        return cls(**kwargs)

    def common_hf_dict(self) -> dict[str, Any]:
        return {
            "architectures": [self.architecture],
            "model_type": self.model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_layers,
            "rms_norm_eps": self.rms_norm_eps,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "torch_dtype": self.torch_dtype,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": list(self.eos_token_ids) if len(self.eos_token_ids) != 1 else self.eos_token_ids[0],
            "initializer_range": 0.02,
            "use_cache": True,
            **({"quantization_config": self.quant_config} if self.quant else {}),
        }

    def to_hf_dict(self) -> dict[str, Any]:
        """config.json as Hugging Face writes it for this architecture."""
        raise NotImplementedError

    def num_parameters(self) -> int:
        raise NotImplementedError

    def attention_activations(self, tokens: int, dtype: torch.dtype) -> list[int]:
        """Bytes of each transient the attention of one layer holds at a step of `tokens` tokens
        (plan/residents.step_activations)."""
        raise NotImplementedError

    def decode_selection_activations(self, rows: int, context: int, dtype: torch.dtype) -> list[int]:
        """The transients of an indexed layer's fixed-shape decode selection (graph-safe: it scores every
        row of each sequence's page table, `context` rows, whatever the sequence holds) at a decode step
        of `rows` sequences, one layer deep; [] for a family without an indexer."""
        return []


def with_dense(cfg: ModelConfig, dense_weights: str) -> ModelConfig:
    """cfg with its dense projections held as dense_weights says: "dequantize" (the model dtype, at
    load) or "keep" (the checkpoint's own format: FP8 blocks, 4-bit codes; a quantized checkpoint only)."""
    if dense_weights not in DENSE_WEIGHTS:
        raise MoetierError(f"dense_weights {dense_weights!r}: choose dequantize or keep")
    if dense_weights == "keep" and cfg.quant is None:
        raise MoetierError("dense_weights \"keep\" (--dense-weights keep) keeps a quantized checkpoint's dense "
                           "weights in its own format, but this model is not quantized (no quantization_config); "
                           "use dense_weights \"dequantize\" or a quantized checkpoint (moetier make-checkpoint "
                           "--dtype fp8, nvfp4 or int4)")
    return replace(cfg, dense_quant=cfg.quant if dense_weights == "keep" else None)
