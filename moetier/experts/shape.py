"""What the expert tiers know of a model: the shape of one MoE layer's routed experts, and where
each weight sits inside an expert's row. Nothing here knows a model family."""

from __future__ import annotations

from dataclasses import dataclass

import torch

PARTS = ("gate", "up", "gate_up", "down")


@dataclass(frozen=True)
class MoeShape:
    num_experts: int
    top_k: int
    hidden: int
    inter: int  # the intermediate size of one expert

    @property
    def layout(self) -> RowLayout:
        return RowLayout(self.hidden, self.inter)


@dataclass(frozen=True)
class RowLayout:
    """One expert is one row [gate_up (2I x H) | down (H x I)]; quantized formats will append their
    scales to the same row, so a fill moves one contiguous row."""

    hidden: int
    inter: int

    @property
    def w13_numel(self) -> int:
        return 2 * self.inter * self.hidden

    @property
    def numel(self) -> int:
        return 3 * self.inter * self.hidden

    def w13(self, rows: torch.Tensor) -> torch.Tensor:
        # rows [N, numel] -> [N, 2I, H] (a view)
        return rows[:, : self.w13_numel].view(rows.shape[0], 2 * self.inter, self.hidden)

    def w2(self, rows: torch.Tensor) -> torch.Tensor:
        # rows [N, numel] -> [N, H, I] (a view)
        return rows[:, self.w13_numel:].view(rows.shape[0], self.hidden, self.inter)

    def part(self, rows: torch.Tensor, part: str, expert: int | None = None) -> torch.Tensor:
        """The view a checkpoint tensor fills: `part` of one expert ([I, H] gate or up, [2I, H]
        gate_up, [H, I] down), or of every expert at once when expert is None ([E, ...])."""
        if part not in PARTS:
            raise ValueError(f"unknown expert part {part!r}; one of {PARTS}")
        sel = rows if expert is None else rows[expert:expert + 1]
        if part == "down":
            view = self.w2(sel)
        else:
            view = self.w13(sel)
            i = self.inter
            view = view[:, :i] if part == "gate" else view[:, i:] if part == "up" else view
        return view if expert is None else view[0]
