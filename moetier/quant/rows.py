"""Where each weight (and, for a quantized format, each scale) sits inside one routed expert's row.
One expert is one contiguous row in every tier (host store, slots, device rows), so a fill moves one
row and no scale is ever left behind. experts/shape.MoeShape hands out the layout of its experts;
the format's byte offsets come from its quant/ file (FP8: fp8_block.row_offsets; NVFP4 and INT4:
quant/packed4.row_offsets, whose docstring has the 4-bit row's picture).

Parts, the names the checkpoint loader copies into (RowLayout.part): the weights `gate`, `up`,
`gate_up`, `down` (for 4-bit rows their packed codes), for quantized rows their scales
`gate_scale`, ..., `down_scale` (FP8: block grids; 4-bit: group scales, one row per weight row) and,
for NVFP4 rows, the float32 tensor scales `gate_scale_2`, `up_scale_2`, `gate_up_scale_2` (both),
`down_scale_2`; for asymmetric INT4 rows the zero codes `gate_zero_point`, ..., `down_zero_point`
(uint8, one per group, beside the group scales' shape).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moetier.quant import fp8_block as fp8
from moetier.quant import int4, nvfp4, packed4
from moetier.quant.registry import GROUP_SCALES, GROUPS, PACKED4, QUANTS, get

WEIGHT_PARTS = ("gate", "up", "gate_up", "down")
SCALE_PARTS = tuple(p + "_scale" for p in WEIGHT_PARTS)  # quantized rows: the parts' scales
GLOBAL_PARTS = tuple(p + "_scale_2" for p in WEIGHT_PARTS)  # NVFP4 rows: the parts' float32 tensor scales
ZERO_PARTS = tuple(p + "_zero_point" for p in WEIGHT_PARTS)  # asymmetric INT4 rows: the parts' zero codes
PARTS = WEIGHT_PARTS + SCALE_PARTS + GLOBAL_PARTS + ZERO_PARTS


def weight_part(part: str) -> str:
    """The weight a part belongs to: "gate_up_scale_2" -> "gate_up", "down_zero_point" -> "down"."""
    for suffix in ("_scale_2", "_scale", "_zero_point"):
        if part.endswith(suffix):
            return part[: -len(suffix)]
    return part


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

    quant "nvfp4" or an INT4 name: a row of bytes, codes packed two per byte, group scales in the
    same row (quant/packed4.py draws it): NVFP4 0.5625 bytes per weight plus three float32 tensor
    scales, INT4 0.5 + 2/128 (or 2/32) bytes per weight, asymmetric INT4 one zero code byte per
    group more, plus at most 31 bytes of padding.
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
    def packed4(self) -> bool:  # a 4-bit row (two codes per byte)
        return self.quant in PACKED4

    @property
    def w13_numel(self) -> int:  # weights of gate_up (elements; bytes for quantized rows)
        return 2 * self.inter * self.hidden // (2 if self.packed4 else 1)

    @property
    def w2_numel(self) -> int:
        return self.hidden * self.inter // (2 if self.packed4 else 1)

    @property
    def group(self) -> int:
        """Elements per scale along K of a 4-bit row (16 for NVFP4, 128 or 32 for INT4)."""
        return GROUPS[self.quant]

    @property
    def asymmetric(self) -> bool:  # an INT4 row with zero codes (quant/int4.ASYMMETRIC)
        return self.quant in int4.ASYMMETRIC

    @property
    def scale_dtype(self) -> torch.dtype:  # of a quantized row's scales
        return torch.float32 if self.quant == "fp8" else GROUP_SCALES[self.quant]

    def offsets4(self) -> tuple[int, int, int, int]:
        """(s13, s2, gs, row bytes) of a 4-bit row (quant/packed4.row_offsets)."""
        if self.quant == "nvfp4":
            return nvfp4.row_offsets(self.hidden, self.inter)
        return int4.row_offsets(self.hidden, self.inter, self.group, self.asymmetric)

    def zero_offsets(self) -> tuple[int, int]:
        """(z13, z2) of an asymmetric INT4 row's zero codes (quant/packed4.zero_offsets)."""
        return packed4.zero_offsets(self.hidden, self.inter, self.group, self.scale_dtype.itemsize)

    @property
    def n_inter(self) -> int:  # 128-blocks along I
        return fp8.cdiv(self.inter, fp8.BLOCK)

    @property
    def n_hidden(self) -> int:  # 128-blocks along H
        return fp8.cdiv(self.hidden, fp8.BLOCK)

    @property
    def s13_offset(self) -> int:
        """Byte offset of the gate_up scales in a quantized row."""
        return self.offsets4()[0] if self.packed4 else fp8.row_offsets(self.hidden, self.inter)[0]

    @property
    def s2_offset(self) -> int:
        return self.offsets4()[1] if self.packed4 else fp8.row_offsets(self.hidden, self.inter)[1]

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
        # rows [N, numel] -> [N, 2I, H] (a view; float8 for fp8 rows; uint8 [N, 2I, H/2] codes for 4-bit)
        w = rows[:, : self.w13_numel]
        if self.quant == "fp8":
            w = w.view(fp8.FP8)
        return w.view(rows.shape[0], 2 * self.inter, self.hidden // (2 if self.packed4 else 1))

    def w2(self, rows: torch.Tensor) -> torch.Tensor:
        # rows [N, numel] -> [N, H, I] (a view; float8 for fp8 rows; uint8 [N, H, I/2] codes for 4-bit)
        w = rows[:, self.w13_numel: self.w13_numel + self.w2_numel]
        if self.quant == "fp8":
            w = w.view(fp8.FP8)
        return w.view(rows.shape[0], self.hidden, self.inter // (2 if self.packed4 else 1))

    def s13(self, rows: torch.Tensor) -> torch.Tensor:
        # fp8 rows [N, numel] uint8 -> [N, 2, nI, nH] float32 (a view): gate's scales, then up's;
        # 4-bit rows -> [N, 2I, ceil(H/g)] in scale_dtype (gate's rows, then up's)
        a, b = self.s13_offset, self.s2_offset
        if self.packed4:
            return rows[:, a:b].view(self.scale_dtype).view(rows.shape[0], 2 * self.inter, -1)
        self._need_fp8("gate_up scales")
        return rows[:, a:b].view(torch.float32).view(rows.shape[0], 2, self.n_inter, self.n_hidden)

    def s2(self, rows: torch.Tensor) -> torch.Tensor:
        # fp8 rows [N, numel] uint8 -> [N, nH, nI] float32 (a view); 4-bit rows -> [N, H, ceil(I/g)]
        a = self.s2_offset
        if self.packed4:
            g = -(-self.inter // self.group)
            return rows[:, a:a + self.scale_dtype.itemsize * self.hidden * g].view(self.scale_dtype).view(
                rows.shape[0], self.hidden, g)
        self._need_fp8("down scales")
        return rows[:, a:a + 4 * self.n_hidden * self.n_inter].view(torch.float32).view(
            rows.shape[0], self.n_hidden, self.n_inter)

    def zeros13(self, rows: torch.Tensor) -> torch.Tensor:
        # asymmetric INT4 rows [N, numel] -> [N, 2I, ceil(H/g)] uint8 zero codes (a view; gate's, then up's)
        z13, z2 = self._zeros()
        return rows[:, z13:z2].view(rows.shape[0], 2 * self.inter, -1)

    def zeros2(self, rows: torch.Tensor) -> torch.Tensor:
        # asymmetric INT4 rows [N, numel] -> [N, H, ceil(I/g)] uint8 zero codes (a view)
        _, z2 = self._zeros()
        g = -(-self.inter // self.group)
        return rows[:, z2:z2 + self.hidden * g].view(rows.shape[0], self.hidden, g)

    def _zeros(self) -> tuple[int, int]:
        if not self.asymmetric:
            raise ValueError(f"zero points: rows of quantization {self.quant!r} hold none (asymmetric INT4 only)")
        return self.zero_offsets()

    def globals(self, rows: torch.Tensor) -> torch.Tensor:
        # nvfp4 rows [N, numel] uint8 -> [N, 3] float32 (a view): gate's, up's and down's scale_2
        if self.quant != "nvfp4":
            raise ValueError(f"tensor scales: rows of quantization {self.quant!r} hold none (NVFP4 rows only)")
        gs = self.offsets4()[2]
        return rows[:, gs:gs + 4 * nvfp4.N_GLOBAL].view(torch.float32)

    def weights(self, rows: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """rows [N, numel] -> (w13 [N, 2I, H], w2 [N, H, I]) in `dtype`: views of unquantized rows,
        dequantized copies of quantized rows (the format's torch reference, per projection: the CPU
        path and the oracle)."""
        if self.packed4:
            return self._weights4(rows, dtype)
        if self.quant != "fp8":
            return self.w13(rows), self.w2(rows)
        w13, s13, i = self.w13(rows), self.s13(rows), self.inter
        gate = fp8.dequantize(w13[:, :i], s13[:, 0], dtype)
        up = fp8.dequantize(w13[:, i:], s13[:, 1], dtype)
        return torch.cat([gate, up], dim=1), fp8.dequantize(self.w2(rows), self.s2(rows), dtype)

    def _weights4(self, rows: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        w13, s13, w2, s2, i = self.w13(rows), self.s13(rows), self.w2(rows), self.s2(rows), self.inter
        if self.quant != "nvfp4":
            z13, z2 = (self.zeros13(rows), self.zeros2(rows)) if self.asymmetric else (None, None)
            return (int4.dequantize(w13, s13, dtype, self.group, zero=z13),
                    int4.dequantize(w2, s2, dtype, self.group, zero=z2))
        g = self.globals(rows)
        gate = nvfp4.dequantize(w13[:, :i], s13[:, :i], g[:, 0], dtype)
        up = nvfp4.dequantize(w13[:, i:], s13[:, i:], g[:, 1], dtype)
        return torch.cat([gate, up], dim=1), nvfp4.dequantize(w2, s2, g[:, 2], dtype)

    def _part4(self, sel: torch.Tensor, part: str) -> torch.Tensor:
        # the [E, ...] view of a 4-bit row's part (see part)
        i = self.inter
        if part in GLOBAL_PARTS:
            g = self.globals(sel)
            return {"gate": g[:, 0], "up": g[:, 1], "gate_up": g[:, 0:2], "down": g[:, 2]}[part[:-8]]
        if part in ZERO_PARTS:
            base = part.removesuffix("_zero_point")
            z = self.zeros2(sel) if base == "down" else self.zeros13(sel)
            return z if base in ("down", "gate_up") else z[:, :i] if base == "gate" else z[:, i:]
        scale = part.endswith("_scale")
        base = part.removesuffix("_scale")
        if base == "down":
            return self.s2(sel) if scale else self.w2(sel)
        v = self.s13(sel) if scale else self.w13(sel)
        return v[:, :i] if base == "gate" else v[:, i:] if base == "up" else v

    def part(self, rows: torch.Tensor, part: str, expert: int | None = None) -> torch.Tensor:
        """The view a checkpoint tensor fills: `part` of one expert ([I, H] gate or up, [2I, H]
        gate_up, [H, I] down; for fp8 rows also their scales: [nI, nH] gate_scale or up_scale,
        [2nI, nH] gate_up_scale, [nH, nI] down_scale; for 4-bit rows the packed codes [I, H/2], ...,
        their group scales [I, ceil(H/g)], ... and NVFP4's tensor scales: [] gate_scale_2, [2]
        gate_up_scale_2), or of every expert at once when expert is None ([E, ...])."""
        if part not in PARTS:
            raise ValueError(f"unknown expert part {part!r}; one of {PARTS}")
        sel = rows if expert is None else rows[expert:expert + 1]
        if self.packed4:
            view = self._part4(sel, part)
            return view if expert is None else view[0]
        if part in GLOBAL_PARTS or part in ZERO_PARTS:
            raise ValueError(f"expert part {part!r}: rows of quantization {self.quant!r} hold no such part")
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
