"""Where each weight (and, for a quantized format, each scale) sits inside one routed expert's row.
One expert is one contiguous row in every tier (host store, slots, device rows), so a fill moves one
row and no scale is ever left behind. experts/shape.MoeShape hands out the layout of its experts;
the format's byte offsets come from its quant/ file (FP8: fp8_block.row_offsets).

Parts, the names the checkpoint loader copies into (RowLayout.part): the weights `gate`, `up`,
`gate_up`, `down` and, for FP8 rows, their block scales `gate_scale`, ..., `down_scale`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moetier.quant import fp8_block as fp8
from moetier.quant.registry import QUANTS, get

WEIGHT_PARTS = ("gate", "up", "gate_up", "down")
SCALE_PARTS = tuple(p + "_scale" for p in WEIGHT_PARTS)  # FP8 rows only: the parts' block scales
PARTS = WEIGHT_PARTS + SCALE_PARTS


@dataclass(frozen=True)
class RowLayout:
    """One expert is one contiguous row, so a fill moves one row and no scale is ever left behind.

    quant None: a row of the model dtype, [gate_up (2I x H) | down (H x I)], numel = 3*I*H elements.

    quant "fp8": a row of bytes (uint8), offsets in bytes, nI = ceil(I/128), nH = ceil(H/128):
        [0, 2IH)                  gate_up  float8_e4m3fn [2I, H]  (gate rows, then up rows)
        [2IH, 3IH)                down     float8_e4m3fn [H, I]
        [3IH, s13)                zero padding up to a multiple of 16 (at most 15 bytes; fp8.ROW_ALIGN)
        [s13, s13 + 8*nI*nH)      gate_up scales float32 [2, nI, nH] (gate's grid, then up's: each
                                  projection keeps its own 128 x 128 grid, ragged edges included)
        [s2, s2 + 4*nH*nI)        down scales float32 [nH, nI]
        [.., numel)               zero padding up to a multiple of 16 (at most 12 bytes)
    The padding exists only so that every row (rows sit back to back in a block) starts 16-byte
    aligned and its scales 4-byte aligned for float32 views; it is counted in row_bytes.
    """

    hidden: int
    inter: int
    quant: str | None = None
    # not where bytes sit but what a row computes: the SwiGLU clamp every path applies (None: none);
    # carried here because every backend and kernel holds the layout
    swiglu_limit: float | None = None

    def __post_init__(self) -> None:
        if self.quant not in QUANTS:
            raise ValueError(f"unknown expert quantization {self.quant!r}; one of {QUANTS}")

    @property
    def w13_numel(self) -> int:  # weights of gate_up (elements; bytes for fp8)
        return 2 * self.inter * self.hidden

    @property
    def w2_numel(self) -> int:
        return self.hidden * self.inter

    @property
    def n_inter(self) -> int:  # 128-blocks along I
        return fp8.cdiv(self.inter, fp8.BLOCK)

    @property
    def n_hidden(self) -> int:  # 128-blocks along H
        return fp8.cdiv(self.hidden, fp8.BLOCK)

    @property
    def s13_offset(self) -> int:
        """Byte offset of the gate_up scales in an fp8 row."""
        return fp8.row_offsets(self.hidden, self.inter)[0]

    @property
    def s2_offset(self) -> int:
        return fp8.row_offsets(self.hidden, self.inter)[1]

    @property
    def numel(self) -> int:
        """Elements of one row in the row dtype (bytes for a quantized format: its Format.row_bytes)."""
        if self.quant is not None:
            return get(self.quant).row_bytes(self.hidden, self.inter)
        return self.w13_numel + self.w2_numel

    def row_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """The dtype of the rows tensors for a model of `dtype` (bytes for every quantized format)."""
        return torch.uint8 if self.quant is not None else dtype

    def row_bytes(self, dtype: torch.dtype) -> int:
        return self.numel * self.row_dtype(dtype).itemsize

    def w13(self, rows: torch.Tensor) -> torch.Tensor:
        # rows [N, numel] -> [N, 2I, H] (a view; float8 for fp8 rows)
        w = rows[:, : self.w13_numel]
        if self.quant == "fp8":
            w = w.view(fp8.FP8)
        return w.view(rows.shape[0], 2 * self.inter, self.hidden)

    def w2(self, rows: torch.Tensor) -> torch.Tensor:
        # rows [N, numel] -> [N, H, I] (a view; float8 for fp8 rows)
        w = rows[:, self.w13_numel: self.w13_numel + self.w2_numel]
        if self.quant == "fp8":
            w = w.view(fp8.FP8)
        return w.view(rows.shape[0], self.hidden, self.inter)

    def s13(self, rows: torch.Tensor) -> torch.Tensor:
        # fp8 rows [N, numel] uint8 -> [N, 2, nI, nH] float32 (a view): gate's scales, then up's
        self._need_fp8("gate_up scales")
        a, b = self.s13_offset, self.s2_offset
        return rows[:, a:b].view(torch.float32).view(rows.shape[0], 2, self.n_inter, self.n_hidden)

    def s2(self, rows: torch.Tensor) -> torch.Tensor:
        # fp8 rows [N, numel] uint8 -> [N, nH, nI] float32 (a view)
        self._need_fp8("down scales")
        a = self.s2_offset
        return rows[:, a:a + 4 * self.n_hidden * self.n_inter].view(torch.float32).view(
            rows.shape[0], self.n_hidden, self.n_inter)

    def weights(self, rows: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """rows [N, numel] -> (w13 [N, 2I, H], w2 [N, H, I]) in `dtype`: views of unquantized rows,
        dequantized copies of fp8 rows (fp8.dequantize, per projection: the CPU path and the oracle)."""
        if self.quant != "fp8":
            return self.w13(rows), self.w2(rows)
        w13, s13, i = self.w13(rows), self.s13(rows), self.inter
        gate = fp8.dequantize(w13[:, :i], s13[:, 0], dtype)
        up = fp8.dequantize(w13[:, i:], s13[:, 1], dtype)
        return torch.cat([gate, up], dim=1), fp8.dequantize(self.w2(rows), self.s2(rows), dtype)

    def part(self, rows: torch.Tensor, part: str, expert: int | None = None) -> torch.Tensor:
        """The view a checkpoint tensor fills: `part` of one expert ([I, H] gate or up, [2I, H]
        gate_up, [H, I] down; for fp8 rows also their scales: [nI, nH] gate_scale or up_scale,
        [2nI, nH] gate_up_scale, [nH, nI] down_scale), or of every expert at once when expert is
        None ([E, ...])."""
        if part not in PARTS:
            raise ValueError(f"unknown expert part {part!r}; one of {PARTS}")
        sel = rows if expert is None else rows[expert:expert + 1]
        i = self.inter
        if part == "down":
            view = self.w2(sel)
        elif part == "down_scale":
            view = self.s2(sel)
        elif part.endswith("_scale"):
            s = self.s13(sel)
            if part == "gate_up_scale":
                # a fused [2I, H] weight's grid is [ceil(2I/128), nH]: the same as gate's then up's
                # only when I is a multiple of 128
                if i % fp8.BLOCK:
                    raise ValueError(f"fused gate_up block scales need an intermediate size that is a multiple "
                                     f"of {fp8.BLOCK} (got {i}); store gate and up per expert instead")
                view = s.view(s.shape[0], 2 * self.n_inter, self.n_hidden)
            else:
                view = s[:, 0] if part == "gate_scale" else s[:, 1]
        else:
            view = self.w13(sel)
            view = view[:, :i] if part == "gate" else view[:, i:] if part == "up" else view
        return view if expert is None else view[0]

    def _need_fp8(self, what: str) -> None:
        if self.quant != "fp8":
            raise ValueError(f"{what}: rows of quantization {self.quant!r} hold no block scales")
