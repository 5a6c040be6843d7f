"""NVFP4 weights (E2M1 values in groups of 16 with an e4m3 scale each, and a float32 scale per
tensor), weight-only: the plain-torch oracle of every NVFP4 path. Two published layouts, one rule:

    ModelOpt            `x.weight` uint8 [N, K/2], `x.weight_scale` float8_e4m3fn [N, K/16],
                        `x.weight_scale_2` float32 scalar (optional `x.input_scale`: never read)
    compressed-tensors  `x.weight_packed` uint8 [N, K/2], `x.weight_scale` float8_e4m3fn [N, K/16],
                        `x.weight_global_scale` float32 [1], the reciprocal: scale_2 = 1 / global
                        (optional `x.input_global_scale`: never read)

    W[n, k] = e2m1(code[n, k]) * (float32(weight_scale[n, k // 16]) * scale_2)   (float32, then
                                                                                   rounded once to dtype)

with codes packed two per byte, the even element in the low nibble (quant/packed4.py). E2M1: bit 3
the sign, bits 2..1 the exponent (bias 1), bit 0 the mantissa: 0, 0.5, 1, 1.5, 2, 3, 4, 6 and their
negatives (code 8 is -0.0). The group scale multiplies the tensor scale first, in float32, then the
code: the Triton helpers (quant/packed4_triton.py) compute the same products, so the kernels'
weights are these bits. compressed-tensors' reciprocal is taken once at load, in float32
(1 / global): its own dequantize divides, which differs from this by at most an fp32 rounding.

Activations are never quantized here (Hopper has no FP4 tensor cores): the kernels multiply these
weights with the model-dtype activations, whatever input scales the checkpoint holds.
"""

from __future__ import annotations

import torch

from moetier.quant import packed4
from moetier.quant.format import Format

GROUP = 16
E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0
E2M1_MAX = 6.0
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # codes 0..7; 8..15 are their negatives
CODE = "U8"  # safetensors' dtype code of the packed weights
N_GLOBAL = 3  # float32 tensor scales in a row: gate's, up's, down's


def decode(codes: torch.Tensor) -> torch.Tensor:
    """E2M1 codes (0..15, any integer dtype) -> float32 values (code 8 -> -0.0)."""
    table = torch.tensor(E2M1 + tuple(-v for v in E2M1), dtype=torch.float32, device=codes.device)
    return table[codes.long()]


def encode(values: torch.Tensor) -> torch.Tensor:
    """float values (already scaled into [-6, 6]) -> the nearest E2M1 code, uint8 0..15 (ties to the
    smaller magnitude; the sign kept, so -0.0 -> 8)."""
    # the midpoints between neighbouring magnitudes: bucketize (right=False) puts a value equal to one
    # in the lower bucket, the smaller magnitude; anything above 5 is 6 (the old argmin over the eight
    # distances, same codes: tests/test_quant4.py, without its [..., 8] temporary)
    mids = torch.tensor([(a + b) / 2 for a, b in zip(E2M1, E2M1[1:])], dtype=torch.float32, device=values.device)
    v = values.float()
    idx = torch.bucketize(v.abs(), mids, right=False)
    return (idx + 8 * torch.signbit(v).long()).to(torch.uint8)


def dequantize(packed: torch.Tensor, scale: torch.Tensor, scale_2: torch.Tensor | float,
               dtype: torch.dtype = torch.float32, name: str = "weight") -> torch.Tensor:
    """(uint8 [..., N, K/2], float8_e4m3fn [..., N, ceil(K/16)], float32 scale_2: a number or a tensor
    broadcasting over [...] (shape [...] or [..., 1, 1])) -> [..., N, K] in dtype (module docstring)."""
    k = packed4.check_pair(name, packed, scale, GROUP, E4M3)
    s2 = torch.as_tensor(scale_2, dtype=torch.float32)
    if s2.dim() and s2.dim() == packed.dim() - 2:
        s2 = s2[..., None, None]
    group = scale.float() * s2  # [..., N, G]: one float32 product per group, as the kernels take it
    return (decode(packed4.unpack(packed)) * packed4.expand_groups(group, k, GROUP)).to(dtype)


def quantize(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """weight [..., N, K] -> (packed uint8 [..., N, K/2], e4m3 [..., N, ceil(K/16)], float32 scale_2 [...]):
    ModelOpt's recipe, scale_2 = amax / (6 * 448) per tensor, each group's scale its amax / 6 / scale_2
    rounded to e4m3 (an all-zero tensor gets scale_2 = 1)."""
    w = weight.float()
    n, k = w.shape[-2:]
    amax = w.abs().amax(dim=(-2, -1))
    s2 = torch.where(amax > 0, amax / (E2M1_MAX * E4M3_MAX), torch.ones_like(amax))
    g = packed4.cdiv(k, GROUP)
    padded = torch.nn.functional.pad(w, (0, g * GROUP - k))
    gmax = padded.reshape(*w.shape[:-1], g, GROUP).abs().amax(dim=-1)
    scale = (gmax / E2M1_MAX / s2[..., None, None]).clamp(max=E4M3_MAX).to(E4M3)
    full = packed4.expand_groups(scale.float() * s2[..., None, None], k, GROUP)
    codes = encode(torch.where(full > 0, w / full, torch.zeros_like(w)))
    return packed4.pack(codes), scale, s2


def row_offsets(hidden: int, inter: int) -> tuple[int, int, int, int]:
    """(s13, s2, gs, row bytes) of an NVFP4 expert row: e4m3 group scales, three float32 tensor scales."""
    return packed4.row_offsets(hidden, inter, GROUP, 1, N_GLOBAL)


def config_problems(qc: object) -> list[str]:
    from moetier.quant.quant_config import problems

    return problems(qc, "nvfp4")


FORMAT = Format(name="nvfp4", weight_code=CODE, scale_suffixes=("_scale", "_scale_2"), dequantize=dequantize,
                row_bytes=lambda hidden, inter: row_offsets(hidden, inter)[3], config_problems=config_problems)
