"""INT4 weights, one bf16 scale per group of 128 (or 32) along K, weight-only: the plain-torch
oracle of every INT4 path, as compressed-tensors' `pack-quantized` format stores it (llm-compressor's
W4A16; most community quantizations of DeepSeek-V3, Qwen3 and GLM):

    `x.weight_packed`      int32 [N, ceil(K/8)]: eight values per word, value i of a word in bits
                           4i..4i+3, each stored as q + 8 (q in -8..7, the unsigned offset of pack_to_int32)
    `x.weight_scale`       bfloat16 [N, ceil(K/group)]
    `x.weight_zero_point`  asymmetric only (`symmetric: false`): int32 [ceil(N/8), ceil(K/group)],
                           each group's zero point z in -8..7 stored as z + 8, eight output rows per
                           word (packed along N, pack_to_int32's packed_dim 0)
    `x.weight_shape`       int [2]: (N, K) (checked against the model; the codes carry no other use)

    W[n, k] = (code[n, k] - zcode[n, k // group]) * float32(weight_scale[n, k // group])
              zcode = 8 for the symmetric formats; exact in float32, then rounded once to dtype

Formats: int4, int4-g32 (symmetric), int4-asym, int4-g32-asym (zero points). One kernel serves all
four: the symmetric ones subtract the constant 8, the asymmetric ones the group's zero code, read
like its scale. Rows (quant/packed4.py) hold the codes as bytes, two per byte, the even element in
the low nibble (an int32 word read as four little-endian bytes is that order already, so to_bytes is
a view and a crop), and an asymmetric row one zero code byte per group after its scales. Scales of
another dtype (float16) are refused: rows keep bf16 scales unchanged.
"""

from __future__ import annotations

import sys

import torch

from moetier.quant import packed4
from moetier.quant.format import Format

GROUPS = {"int4": 128, "int4-g32": 32, "int4-asym": 128, "int4-g32-asym": 32}  # format name -> group size
ASYMMETRIC = ("int4-asym", "int4-g32-asym")  # the formats with zero points
SCALE = torch.bfloat16
OFFSET = 8  # stored code = q + 8
CODE = "I32"  # safetensors' dtype code of weight_packed


def to_bytes(words: torch.Tensor, k: int, name: str = "weight_packed") -> torch.Tensor:
    """compressed-tensors int32 [..., N, ceil(K/8)] -> uint8 [..., N, K/2] (the row's packing)."""
    if words.dtype != torch.int32:
        raise ValueError(f"{name}: pack-quantized weights must be int32, got {words.dtype}")
    if k % 2 or words.shape[-1] != packed4.cdiv(k, 8):
        raise ValueError(f"{name}: int32 codes of shape {list(words.shape)} do not hold {k} values per row "
                         f"(want [..., {packed4.cdiv(k, 8)}] and an even K)")
    assert sys.byteorder == "little"  # the view below reads the words' low byte first
    return words.contiguous().view(torch.uint8)[..., : k // 2]


def to_words(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [..., N, K/2] -> int32 [..., N, ceil(K/8)] (zero-padded), as pack_to_int32 writes them."""
    pad = (-packed.shape[-1]) % 4
    return torch.nn.functional.pad(packed, (0, pad)).contiguous().view(torch.int32)


def dequantize(packed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32,
               group: int = 128, name: str = "weight", zero: torch.Tensor | None = None) -> torch.Tensor:
    """(uint8 [..., N, K/2] codes q + 8, bf16 [..., N, ceil(K/group)], zero codes z + 8 uint8 [..., N,
    ceil(K/group)] or None: symmetric) -> [..., N, K] in dtype."""
    k = packed4.check_pair(name, packed, scale, group, SCALE)
    if zero is None:
        q = packed4.unpack(packed).float() - OFFSET
    else:
        check_zero(name, zero, scale)
        q = packed4.unpack(packed).float() - packed4.expand_groups(zero.float(), k, group)
    return (q * packed4.expand_groups(scale.float(), k, group)).to(dtype)


def check_zero(name: str, zero: torch.Tensor, scale: torch.Tensor) -> None:
    if zero.dtype != torch.uint8 or tuple(zero.shape) != tuple(scale.shape):
        raise ValueError(f"{name}: zero points must be uint8 codes of the scales' shape {list(scale.shape)}, got "
                         f"{str(zero.dtype).removeprefix('torch.')} {list(zero.shape)}")


def _groups(w: torch.Tensor, group: int) -> torch.Tensor:
    # [..., N, K] -> [..., N, G, group], the ragged last group padded with zeros
    g = packed4.cdiv(w.shape[-1], group)
    return torch.nn.functional.pad(w, (0, g * group - w.shape[-1])).reshape(*w.shape[:-1], g, group)


def quantize(weight: torch.Tensor, group: int = 128, asymmetric: bool = False
             ) -> tuple[torch.Tensor, torch.Tensor] | tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """weight [..., N, K] -> (uint8 [..., N, K/2], bf16 [..., N, ceil(K/group)]), with asymmetric the
    zero codes uint8 [..., N, ceil(K/group)] third. compressed-tensors' rules, per group: symmetric
    scale = amax / 7.5 (rounded to bf16 first), q = clamp(round(w / scale), -8, 7); asymmetric over
    [lo, hi] = [min(w, 0), max(w, 0)]: scale = (hi - lo) / 15, z = clamp(-8 - round(lo / scale), -8, 7),
    q = clamp(round(w / scale) + z, -8, 7), so that W = (q - z) * scale."""
    w = weight.float()
    k = w.shape[-1]
    grouped = _groups(w, group)
    if not asymmetric:
        gmax = grouped.abs().amax(dim=-1)
        scale = torch.where(gmax > 0, gmax / 7.5, torch.ones_like(gmax)).to(SCALE)
        q = (w / packed4.expand_groups(scale.float(), k, group)).round().clamp(-8, 7)
        return packed4.pack(q.to(torch.int16) + OFFSET), scale
    lo, hi = grouped.amin(dim=-1).clamp(max=0), grouped.amax(dim=-1).clamp(min=0)
    scale = torch.where(hi > lo, (hi - lo) / 15, torch.ones_like(hi)).to(SCALE)
    z = (-8 - (lo / scale.float()).round()).clamp(-8, 7)
    q = ((w / packed4.expand_groups(scale.float(), k, group)).round() + packed4.expand_groups(z, k, group)).clamp(-8, 7)
    return packed4.pack(q.to(torch.int16) + OFFSET), scale, (z + OFFSET).to(torch.uint8)


def zero_to_bytes(words: torch.Tensor, n: int, name: str = "weight_zero_point") -> torch.Tensor:
    """compressed-tensors' zero points int32 [..., ceil(N/8), G] (eight rows a word) -> uint8 [..., N, G]."""
    if words.dtype != torch.int32:
        raise ValueError(f"{name}: pack-quantized zero points must be int32, got {words.dtype}")
    if words.shape[-2] != packed4.cdiv(n, 8):
        raise ValueError(f"{name}: int32 zero points of shape {list(words.shape)} do not hold {n} rows (want "
                         f"[..., {packed4.cdiv(n, 8)}, groups])")
    u = words.to(torch.int64) & 0xFFFFFFFF
    rows = torch.stack([(u >> (4 * i)) & 0xF for i in range(8)], dim=-2)  # [..., W, 8, G]: row 8w + i
    return rows.flatten(-3, -2)[..., :n, :].to(torch.uint8)


def zero_to_words(zero: torch.Tensor) -> torch.Tensor:
    """uint8 zero codes [..., N, G] -> int32 [..., ceil(N/8), G], as pack_to_int32(packed_dim=0) writes them."""
    pad = (-zero.shape[-2]) % 8
    z = torch.nn.functional.pad(zero.to(torch.int64), (0, 0, 0, pad))
    z = z.reshape(*z.shape[:-2], -1, 8, z.shape[-1])
    word = sum(z[..., i, :] << (4 * i) for i in range(8))
    return torch.where(word >= 2**31, word - 2**32, word).to(torch.int32)


def row_offsets(hidden: int, inter: int, group: int, asymmetric: bool = False) -> tuple[int, int, int, int]:
    """(s13, s2, gs, row bytes) of an INT4 expert row: bf16 group scales, for an asymmetric row a zero
    code byte per group after them (packed4.zero_offsets), no tensor scales."""
    return packed4.row_offsets(hidden, inter, group, 2, 0, zero_bytes=int(asymmetric))


def _format(name: str) -> Format:
    from moetier.quant import quant_config

    group, asym = GROUPS[name], name in ASYMMETRIC
    if asym:  # (codes, scales, zero codes, dtype): the scale_suffixes' order
        def reference(packed, scale, zero, dtype=torch.float32):
            return dequantize(packed, scale, dtype, group, zero=zero)
    else:
        def reference(packed, scale, dtype=torch.float32):
            return dequantize(packed, scale, dtype, group)

    return Format(name=name, weight_code=CODE, scale_suffixes=("_scale", "_zero_point") if asym else ("_scale",),
                  dequantize=reference, row_bytes=lambda hidden, inter: row_offsets(hidden, inter, group, asym)[3],
                  config_problems=lambda qc: quant_config.problems(qc, name))


FORMATS = tuple(_format(n) for n in GROUPS)
