"""GLM-5 (glm_moe_dsa) in our own code: the DeepSeek-V3 decoder (models/mla_model.py) with
DeepSeek sparse attention: a lightning indexer (layers/dsa_indexer.py) picks index_topk earlier
tokens per token, and attention reads only those. indexer_types says, per layer, whether it runs
its own indexer ("full": its keys live in the KV cache's index_k) or reuses the top-k of the last
full layer before it ("shared"). Rotary is always interleaved, in the attention and the indexer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from moetier.config import Fields
from moetier.layers.dsa_indexer import DsaIndexer
from moetier.models.base import Weight
from moetier.models.mla_config import MlaMoeConfig
from moetier.models.mla_model import MlaMoeForCausalLM

INDEXER_TYPES = ("full", "shared")


def default_indexer_types(f: Fields, layers: int) -> list[str]:
    """transformers' GlmMoeDsaConfig rule when config.json gives no indexer_types: index_topk_pattern
    ("F"/"S" per layer), else "full" every index_topk_freq layers counting from index_skip_topk_offset."""
    pattern = f.get("index_topk_pattern", default=None)
    if pattern is not None:
        return [{"F": "full", "S": "shared"}.get(c, c) for c in pattern] if isinstance(pattern, str) else list(pattern)
    freq = max(f.get("index_topk_freq", default=1), 1)
    offset = f.get("index_skip_topk_offset", default=2)
    return ["full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(layers)]


@dataclass(frozen=True, kw_only=True)
class GlmMoeDsaConfig(MlaMoeConfig):
    index_topk: int
    index_head_dim: int
    index_n_heads: int
    indexer_types: tuple[str, ...] = ()

    architecture: ClassVar[str] = "GlmMoeDsaForCausalLM"

    @property
    def index_layers(self) -> tuple[int, ...]:
        # loaded MTP layers run an indexer of their own (their keys live in the KV cache too)
        mtp = tuple(range(self.num_layers, self.num_layers + self.mtp_layers))
        return tuple(i for i, t in enumerate(self.indexer_types) if t == "full") + mtp

    @classmethod
    def parse(cls, f: Fields) -> dict[str, Any]:
        out = cls.parse_mla(f, first_k_dense_default=3, layer_types_field=True)
        layers = out["num_layers"]
        if not f.get("rope_interleave", default=True):
            f.problems.append("rope_interleave false is not supported for glm_moe_dsa (GLM-5 interleaves its "
                              "rotary pairs); remove the field")
        if not out["q_lora_rank"]:
            f.problems.append("q_lora_rank is required for glm_moe_dsa (the indexer reads the low-rank query)")
        types = f.get("indexer_types", default=None)
        if types is None:
            types = default_indexer_types(f, layers)
        if not isinstance(types, list) or len(types) != layers or any(t not in INDEXER_TYPES for t in types):
            f.problems.append(f"indexer_types must list 'full' or 'shared' for each of the {layers} layers, "
                              f"got {types!r}")
            types = ["full"] * layers
        elif types and types[0] != "full":
            f.problems.append("indexer_types[0] must be 'full': a 'shared' layer reuses the top-k of an earlier "
                              "full layer")
        head_dim = f.positive_int("index_head_dim", default=128)
        if head_dim and head_dim < out["qk_rope_head_dim"]:
            f.problems.append(f"index_head_dim {head_dim} is smaller than qk_rope_head_dim "
                              f"{out['qk_rope_head_dim']} (the indexer ropes its first qk_rope_head_dim dims)")
        return dict(out, rope_interleave=True, index_topk=f.positive_int("index_topk", default=2048),
                    index_head_dim=head_dim, index_n_heads=f.positive_int("index_n_heads", default=32),
                    indexer_types=tuple(types))

    def to_hf_dict(self) -> dict[str, Any]:
        return {**self.mla_hf_dict(), "mlp_layer_types": list(self.mlp_layer_types), "index_topk": self.index_topk,
                "index_head_dim": self.index_head_dim, "index_n_heads": self.index_n_heads,
                "indexer_types": list(self.indexer_types), "head_dim": self.qk_rope_head_dim}

    def decode_selection_activations(self, rows: int, context: int, dtype: torch.dtype) -> list[int]:
        """The CUDA decode selection (layers/dsa_select_triton.key_scores, then dsa_indexer.topk_positions;
        the kernel reads the keys in place): the float32 scores [N, C], topk's values [N, K] float32
        and indices [N, K] int64 (K = min(index_topk, C)), the positions [N, index_topk] int32."""
        if not self.index_layers:
            return []
        picks = min(self.index_topk, context)
        return [rows * context * 4, rows * picks * 4, rows * picks * 8, rows * self.index_topk * 4]

    def attention_parameters(self, layer: int) -> int:
        n = super().attention_parameters(layer)
        if layer >= self.num_layers or self.indexer_types[layer] == "full":  # MTP layers: their own indexer
            h, hi, d = self.hidden_size, self.index_n_heads, self.index_head_dim
            n += self.q_lora_rank * hi * d + h * d + 2 * d + h * hi
        return n


class GlmMoeDsaForCausalLM(MlaMoeForCausalLM):
    cfg: GlmMoeDsaConfig

    @classmethod
    def make_indexer(cls, cfg: GlmMoeDsaConfig, layer: int, dtype: torch.dtype, device: torch.device | str
                     ) -> nn.Module | None:
        if layer < cfg.num_layers and cfg.indexer_types[layer] != "full":  # MTP layers index for themselves
            return None
        return DsaIndexer(layer, cfg.hidden_size, cfg.q_lora_rank, cfg.index_n_heads, cfg.index_head_dim,
                          cfg.qk_rope_head_dim, cfg.index_topk, dtype, device)

    @classmethod
    def index_keys(cls, cfg: GlmMoeDsaConfig) -> tuple[int, tuple[int, ...]]:
        return cfg.index_head_dim, cfg.index_layers

    @classmethod
    def indexer_weights(cls, cfg: GlmMoeDsaConfig, prefix: str, layer: int) -> list[Weight]:
        # MTP layers (layer >= num_layers) run an indexer of their own in the published checkpoints
        if layer < cfg.num_layers and cfg.indexer_types[layer] != "full":
            return []
        h, hi, d = cfg.hidden_size, cfg.index_n_heads, cfg.index_head_dim
        return [Weight(prefix + "wq_b.weight", (hi * d, cfg.q_lora_rank)), Weight(prefix + "wk.weight", (d, h)),
                Weight(prefix + "k_norm.weight", (d,)), Weight(prefix + "k_norm.bias", (d,)),
                Weight(prefix + "weights_proj.weight", (hi, h), float32=True)]

    def indexer_param(self, indexer: nn.Module, rest: str) -> torch.Tensor | None:
        if indexer is None:
            return None
        return {"wq_b.weight": indexer.wq_b, "wk.weight": indexer.wk, "k_norm.weight": indexer.k_norm,
                "k_norm.bias": indexer.k_norm_bias, "weights_proj.weight": indexer.weights_proj}.get(rest)
