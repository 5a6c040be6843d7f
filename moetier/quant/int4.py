"""INT4 weights, symmetric, one bf16 scale per group of 128 (or 32) along K, weight-only: the
plain-torch oracle of every INT4 path, as compressed-tensors' `pack-quantized` format stores it
(llm-compressor's W4A16; most community quantizations of DeepSeek-V3, Qwen3 and GLM):

    `x.weight_packed`  int32 [N, ceil(K/8)]: eight values per word, value i of a word in bits 4i..4i+3,
                       each stored as q + 8 (q in -8..7, the unsigned offset of pack_to_int32)
    `x.weight_scale`   bfloat16 [N, ceil(K/group)]
    `x.weight_shape`   int [2]: (N, K) (checked against the model; the codes carry no other use)

    W[n, k] = (code[n, k] - 8) * float32(weight_scale[n, k // group])   (exact in float32, then
                                                                         rounded once to dtype)

Rows (quant/packed4.py) hold the codes as bytes, two per byte, the even element in the low nibble:
an int32 word read as four little-endian bytes is that order already, so to_bytes is a view and a
crop. Asymmetric checkpoints (`weight_zero_point`) are refused in one line (config and loader).
Scales of another dtype (float16) are refused too: rows keep bf16 scales unchanged.
"""

from __future__ import annotations

import sys

import torch

from moetier.quant import packed4
from moetier.quant.format import Format

GROUPS = {"int4": 128, "int4-g32": 32}  # format name -> group size
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
               group: int = 128, name: str = "weight") -> torch.Tensor:
    """(uint8 [..., N, K/2] codes q + 8, bf16 [..., N, ceil(K/group)]) -> [..., N, K] in dtype."""
    k = packed4.check_pair(name, packed, scale, group, SCALE)
    q = packed4.unpack(packed).float() - OFFSET
    return (q * packed4.expand_groups(scale.float(), k, group)).to(dtype)


def quantize(weight: torch.Tensor, group: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [..., N, K] -> (uint8 [..., N, K/2], bf16 [..., N, ceil(K/group)]): compressed-tensors'
    symmetric rule, scale = amax / 7.5 per group (rounded to bf16 first), q = clamp(round(w / scale), -8, 7)."""
    w = weight.float()
    k = w.shape[-1]
    g = packed4.cdiv(k, group)
    gmax = torch.nn.functional.pad(w, (0, g * group - k)).reshape(*w.shape[:-1], g, group).abs().amax(dim=-1)
    scale = torch.where(gmax > 0, gmax / 7.5, torch.ones_like(gmax)).to(SCALE)
    q = (w / packed4.expand_groups(scale.float(), k, group)).round().clamp(-8, 7)
    return packed4.pack(q.to(torch.int16) + OFFSET), scale


def row_offsets(hidden: int, inter: int, group: int) -> tuple[int, int, int, int]:
    """(s13, s2, gs, row bytes) of an INT4 expert row: bf16 group scales, no tensor scales."""
    return packed4.row_offsets(hidden, inter, group, 2, 0)


def _format(name: str) -> Format:
    from moetier.quant import quant_config

    group = GROUPS[name]
    return Format(name=name, weight_code=CODE, scale_suffixes=("_scale",),
                  dequantize=lambda packed, scale, dtype=torch.float32: dequantize(packed, scale, dtype, group),
                  row_bytes=lambda hidden, inter: row_offsets(hidden, inter, group)[3],
                  config_problems=lambda qc: quant_config.problems(qc, name))


FORMATS = tuple(_format(n) for n in GROUPS)
