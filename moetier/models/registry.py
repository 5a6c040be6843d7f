"""Model families by the checkpoint's model_type (or architectures), imported only when used.

Adding an architecture: its model file (model class + config class) and one line here.
"""

from __future__ import annotations

import importlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from moetier.errors import ConfigError
from moetier.quant import quant_config

if TYPE_CHECKING:
    from moetier.config import ModelConfig
    from moetier.models.base import CausalLM


@dataclass(frozen=True)
class Architecture:
    model_type: str
    architectures: tuple[str, ...]  # the names Hugging Face writes in config.json "architectures"
    module: str
    model_class: str
    config_class: str


ARCHITECTURES = (
    Architecture("qwen3_moe", ("Qwen3MoeForCausalLM",), "moetier.models.qwen3_moe", "Qwen3MoeForCausalLM",
                 "Qwen3MoeConfig"),
    Architecture("deepseek_v3", ("DeepseekV3ForCausalLM",), "moetier.models.deepseek_v3", "DeepseekV3ForCausalLM",
                 "DeepseekV3Config"),
    Architecture("glm_moe_dsa", ("GlmMoeDsaForCausalLM",), "moetier.models.glm_moe_dsa", "GlmMoeDsaForCausalLM",
                 "GlmMoeDsaConfig"),
    Architecture("glm5_next", ("Glm5NextForConditionalGeneration",), "moetier.models.glm5_next",
                 "Glm5NextForConditionalGeneration", "Glm5NextConfig"),
)


def supported() -> str:
    return ", ".join(f"{a.model_type} ({', '.join(a.architectures)})" for a in ARCHITECTURES)


def lookup(d: dict[str, Any], source: str = "config.json") -> Architecture:
    """The family of a config.json: by model_type, else by its architectures."""
    model_type, archs = d.get("model_type"), d.get("architectures") or []
    for a in ARCHITECTURES:
        if model_type == a.model_type:
            return a
    for a in ARCHITECTURES:
        if isinstance(archs, list) and set(archs) & set(a.architectures):
            return a
    given = ", ".join(map(str, archs)) if isinstance(archs, list) and archs else "none given"
    raise ConfigError(f"{source}: model_type {model_type!r} (architectures: {given}) is not supported. "
                      f"moetier supports: {supported()}.")


def _attr(a: Architecture, name: str) -> Any:
    return getattr(importlib.import_module(a.module), name)


def config_class(a: Architecture) -> type[ModelConfig]:
    return _attr(a, a.config_class)


def model_class(cfg: ModelConfig) -> type[CausalLM]:
    for a in ARCHITECTURES:
        if a.model_type == cfg.model_type:
            return _attr(a, a.model_class)
    raise ConfigError(f"model_type {cfg.model_type!r} is not supported. moetier supports: {supported()}.")


def config_from_dict(d: dict[str, Any], source: str = "config.json") -> ModelConfig:
    """The family's config class, chosen by model_type (or architectures), parses d."""
    return config_class(lookup(d, source)).from_dict(d, source)


def config_from_dir(path: str | Path) -> ModelConfig:
    f = Path(path) / "config.json"
    if not f.is_file():
        raise ConfigError(
            f"{f} not found: --model must be a Hugging Face checkpoint directory holding config.json, "
            "tokenizer.json and *.safetensors"
        )
    try:
        d = json.loads(f.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"{f} is not readable JSON: {e}") from None
    if not isinstance(d, dict):
        raise ConfigError(f"{f} must hold a JSON object")
    hq = Path(path) / "hf_quant_config.json"  # ModelOpt's quantization file beside config.json
    if "quantization_config" not in d and hq.is_file():
        try:
            qc = quant_config.from_hf_quant_config(json.loads(hq.read_text()))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ConfigError(f"{hq} is not readable JSON: {e}") from None
        if qc is None:
            raise ConfigError(f"{hq} has no \"quantization\" object (ModelOpt writes quant_algo, group_size and "
                              "exclude_modules there)")
        d = {**d, "quantization_config": qc}
    return config_from_dict(d, source=str(f))
