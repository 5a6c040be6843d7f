"""What the expert tiers know of a model: the shape of one MoE layer's routed experts. Where each
weight and scale sits inside an expert's row is the format's business (quant/rows.RowLayout, handed
out by MoeShape.layout and importable from here). Nothing here knows a model family."""

from __future__ import annotations

from dataclasses import dataclass

from moetier.quant.rows import RowLayout

__all__ = ["MoeShape", "RowLayout"]


@dataclass(frozen=True)
class MoeShape:
    num_experts: int
    top_k: int
    hidden: int
    inter: int  # the intermediate size of one expert
    quant: str | None = None  # None: experts in the model dtype, else a quant/registry format ("fp8")
    swiglu_limit: float | None = None  # the clamped SwiGLU (GLM-5.3-Flash, moetier/activation.py)

    @property
    def layout(self) -> RowLayout:
        return RowLayout(self.hidden, self.inter, self.quant, self.swiglu_limit)
