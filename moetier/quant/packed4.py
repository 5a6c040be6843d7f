"""What the 4-bit formats (NVFP4: quant/nvfp4.py, INT4: quant/int4.py) share: two 4-bit codes per
byte and one expert row holding the packed weights with their group scales.

Packing: a weight [..., N, K] (K even) is stored as uint8 [..., N, K / 2], element 2j in the LOW
nibble of byte j and element 2j + 1 in the high nibble (ModelOpt's and compressed-tensors' NVFP4
order; compressed-tensors' int32 words of eight INT4 values read as four little-endian bytes are the
same order, quant/int4.py). Groups: `group` consecutive elements along K share a scale; the last
group of a K that is not a multiple of `group` is ragged (smaller, its own scale): scales
[..., N, ceil(K / group)].

Row of one routed expert (byte offsets; gate_up is [2I, H], gate rows then up rows; down [H, I]):

    [0, IH)                   gate_up codes  uint8 [2I, H/2]
    [IH, 3IH/2)               down codes     uint8 [H, I/2]
    [s13, s2)                 gate_up scales [2I, ceil(H/g)] (scale_bytes each)
    [s2, z13)                 down scales    [H, ceil(I/g)]
    [z13, z2)                 asymmetric INT4 only: gate_up zero codes uint8 [2I, ceil(H/g)]
    [z2, ..)                  and down's [H, ceil(I/g)] (zero_offsets; absent elsewhere: z13 = z2 = gs)
    [gs, gs + 4 * n_global)   float32 per-projection scales (NVFP4: gate, up, down; INT4: none)
    padding                   zeros so that s13 is a multiple of 16, gs of 4 and the row end of 128

Rows end on ROW_END = 128 bytes so that every row of a store or slot block starts on a 128-byte line:
the fill kernel that copies rows into slots reads whole lines, and at 16-byte row ends it ran at
half the rate (docs/quant4.md, "Row alignment").
"""

from __future__ import annotations

import torch

ROW_ALIGN = 16  # where the scales start
ROW_END = 128  # where a row ends (the next one starts)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _align(n: int, to: int) -> int:
    return cdiv(n, to) * to


def row_offsets(hidden: int, inter: int, group: int, scale_bytes: int, n_global: int, zero_bytes: int = 0
                ) -> tuple[int, int, int, int]:
    """(s13, s2, gs, row bytes) of a 4-bit expert row (module docstring); zero_bytes: per group of an
    asymmetric row's zero codes (1), else 0."""
    if hidden % 2 or inter % 2:
        raise ValueError(f"4-bit rows pack two values per byte: hidden ({hidden}) and intermediate ({inter}) "
                         "sizes must be even")
    s13 = _align(3 * inter * hidden // 2, ROW_ALIGN)
    s2 = s13 + scale_bytes * 2 * inter * cdiv(hidden, group)
    z13 = s2 + scale_bytes * hidden * cdiv(inter, group)
    gs = _align(z13 + zero_bytes * (2 * inter * cdiv(hidden, group) + hidden * cdiv(inter, group)), 4)
    return s13, s2, gs, _align(gs + 4 * n_global, ROW_END)


def zero_offsets(hidden: int, inter: int, group: int, scale_bytes: int) -> tuple[int, int]:
    """(z13, z2): where an asymmetric row's gate_up and down zero codes start (right after the scales)."""
    z13 = row_offsets(hidden, inter, group, scale_bytes, 0)[1] + scale_bytes * hidden * cdiv(inter, group)
    return z13, z13 + 2 * inter * cdiv(hidden, group)


def pack(codes: torch.Tensor) -> torch.Tensor:
    """codes [..., K] (values 0..15, any integer dtype, K even) -> uint8 [..., K/2], even element low."""
    if codes.shape[-1] % 2:
        raise ValueError(f"4-bit packing needs an even last dimension, got shape {list(codes.shape)}")
    c = codes.to(torch.uint8) & 0xF
    return c[..., 0::2] | (c[..., 1::2] << 4)


def unpack(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [..., K/2] -> codes uint8 [..., K] (0..15): the low nibble is the even element."""
    if packed.dtype != torch.uint8:
        raise ValueError(f"4-bit codes are stored as uint8, got {packed.dtype}")
    return torch.stack([packed & 0xF, packed >> 4], dim=-1).flatten(-2)


def expand_groups(scale: torch.Tensor, k: int, group: int) -> torch.Tensor:
    """[..., N, ceil(K/group)] -> [..., N, K]: each scale repeated over its (possibly ragged) group."""
    return scale.repeat_interleave(group, dim=-1)[..., :k]


def check_pair(name: str, packed: torch.Tensor, scale: torch.Tensor, group: int, scale_dtype: torch.dtype) -> int:
    """K of a packed weight and its group scales, or one ValueError line naming `name` and the problem."""
    if packed.dtype != torch.uint8:
        raise ValueError(f"{name}: 4-bit codes must be uint8, got {packed.dtype}")
    if scale.dtype != scale_dtype:
        raise ValueError(f"{name}: scales must be {str(scale_dtype).removeprefix('torch.')}, got "
                         f"{str(scale.dtype).removeprefix('torch.')}")
    k = 2 * packed.shape[-1]
    want = (*packed.shape[:-1], cdiv(k, group))
    if tuple(scale.shape) != want:
        raise ValueError(f"{name}: scales of shape {list(scale.shape)} do not fit packed codes of shape "
                         f"{list(packed.shape)} ({k} values per row in groups of {group}: want {list(want)})")
    return k
