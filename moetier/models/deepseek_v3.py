"""DeepSeek-V3 (and V3-0324, R1: the same architecture) in our own code: multi-head latent attention
with YaRN rotary, grouped sigmoid routing with a correction bias, one shared expert, three leading
dense layers, one MTP layer in the published checkpoints. The decoder is models/mla_model.py; this
file holds what only this family reads from config.json.

rope_interleave (default true, as in transformers): the checkpoints store q_pe / k_pe rows in
DeepSeek's interleaved pair order; false: rotate-half order.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from moetier.config import Fields
from moetier.models.mla_config import MlaMoeConfig
from moetier.models.mla_model import MlaMoeForCausalLM


@dataclass(frozen=True, kw_only=True)
class DeepseekV3Config(MlaMoeConfig):
    architecture: ClassVar[str] = "DeepseekV3ForCausalLM"

    @classmethod
    def parse(cls, f: Fields) -> dict[str, Any]:
        # transformers' DeepseekV3Config defaults: first_k_dense_replace 3, rope_interleave true
        out = cls.parse_mla(f, first_k_dense_default=3, layer_types_field=False)
        out["rope_interleave"] = bool(f.get("rope_interleave", default=True))
        return out

    def to_hf_dict(self) -> dict[str, Any]:
        return {**self.mla_hf_dict(), "rope_interleave": self.rope_interleave}


class DeepseekV3ForCausalLM(MlaMoeForCausalLM):
    cfg: DeepseekV3Config
