"""make-checkpoint --dtype nvfp4 | int4 | int4-g32 (| -asym): the random bf16 tensors of writer.py quantized
and laid out as the published tools write them (checkpoint/quant4_weights.py has the names):

    nvfp4, --format modelopt (the default)   ModelOpt: `x.weight` uint8 codes, `x.weight_scale` e4m3,
                                             `x.weight_scale_2` float32 [], `quant_method: modelopt`,
                                             `exclude_modules`
    nvfp4, --format compressed-tensors       `x.weight_packed`, `x.weight_scale`, `x.weight_global_scale`
                                             float32 [1] (1 / scale_2), `nvfp4-pack-quantized`, `ignore`
    int4, int4-g32 (compressed-tensors)      `x.weight_packed` int32, `x.weight_scale` bf16,
                                             `x.weight_shape`, `pack-quantized` in groups of 128 or 32
    int4-asym, int4-g32-asym                 the same with `x.weight_zero_point` int32 [ceil(N/8), G]
                                             and `symmetric: false`

What is quantized: the projections fp8_block.quantizable names (not embeddings, norms, routers or
lm_head) whose K is even; the rest stay bf16 and are listed in exclude_modules / ignore by name.
Fused expert tensors [E, N, K] get per-expert tensor scales ([E], or [E, 2] for gate_up's halves).
"""

from __future__ import annotations

import torch

from moetier.errors import MoetierError
from moetier.quant import int4, nvfp4, packed4
from moetier.quant.fp8_block import quantizable

FORMATS = ("modelopt", "compressed-tensors")
Entry = tuple[str, torch.dtype, tuple[int, ...]]


def check(dtype: str, fmt: str | None) -> str:
    """The checkpoint layout of --dtype / --format, or one line naming the valid choices."""
    if fmt is not None and fmt not in FORMATS:
        raise MoetierError(f"--format {fmt!r}: choose modelopt or compressed-tensors")
    if dtype == "nvfp4":
        return fmt or "modelopt"
    if fmt == "modelopt":
        raise MoetierError(f"--dtype {dtype} --format modelopt: ModelOpt writes NVFP4 only; INT4 is "
                           "compressed-tensors' pack-quantized (drop --format)")
    return "compressed-tensors"


def quantized(name: str, shape: tuple[int, ...]) -> bool:
    return quantizable(name, shape) and shape[-1] % 2 == 0


def _suffixes(layout: str) -> tuple[str, str, str]:
    return ("", "_scale", "_scale_2") if layout == "modelopt" else ("_packed", "_scale", "_global_scale")


def _fused_gate_up(name: str) -> bool:
    return name.endswith("experts.gate_up_proj")


def entries(name: str, shape: tuple[int, ...], dtype: torch.dtype, quant: str, layout: str) -> list[Entry]:
    """The tensors one planned weight becomes: itself (bf16), or its codes and scales."""
    if not quantized(name, shape):
        return [(name, dtype, shape)]
    c, s, g = _suffixes(layout)
    *lead, n, k = shape
    if quant == "nvfp4":
        glob = (*lead, 2) if _fused_gate_up(name) else tuple(lead) if lead else ((1,) if g == "_global_scale" else ())
        return [(name + c, torch.uint8, (*lead, n, k // 2)), (name + s, nvfp4.E4M3, (*lead, n, packed4.cdiv(k, 16))),
                (name + g, torch.float32, glob)]
    group = int4.GROUPS[quant]
    zero = [(name + "_zero_point", torch.int32, (*lead, packed4.cdiv(n, 8), packed4.cdiv(k, group)))]
    return [(name + c, torch.int32, (*lead, n, packed4.cdiv(k, 8))),
            (name + s, int4.SCALE, (*lead, n, packed4.cdiv(k, group))),
            *(zero if quant in int4.ASYMMETRIC else []), (name + "_shape", torch.int32, (len(shape),))]


def tensors(name: str, t: torch.Tensor, quant: str, layout: str) -> list[tuple[str, torch.Tensor]]:
    """The entries' tensors for weight t (entries' order); fused gate_up halves quantized apart."""
    c, s, g = _suffixes(layout)
    if quant != "nvfp4":
        asym = quant in int4.ASYMMETRIC
        q, scale, *zero = int4.quantize(t, int4.GROUPS[quant], asymmetric=asym)
        return [(name + c, int4.to_words(q)), (name + s, scale),
                *([(name + "_zero_point", int4.zero_to_words(zero[0]))] if asym else []),
                (name + "_shape", torch.tensor(t.shape, dtype=torch.int32))]
    if _fused_gate_up(name):  # gate's and up's own tensor scales, as two modules would have them
        i = t.shape[-2] // 2
        halves = [nvfp4.quantize(t[..., :i, :]), nvfp4.quantize(t[..., i:, :])]
        q = torch.cat([h[0] for h in halves], dim=-2)
        scale = torch.cat([h[1] for h in halves], dim=-2)
        s2 = torch.stack([h[2] for h in halves], dim=-1)
    else:
        q, scale, s2 = nvfp4.quantize(t)
    glob = (1.0 / s2) if layout == "compressed-tensors" else s2
    if layout == "compressed-tensors" and not t.dim() > 2:
        glob = glob.reshape(1)
    if layout == "compressed-tensors":  # the loader inverts again: keep scale_2 = 1 / global exact in our rows
        glob = glob.float()
    return [(name + c, q), (name + s, scale), (name + g, glob)]


def config(d: dict, names: list[str], shapes: dict[str, tuple[int, ...]], quant: str, layout: str) -> dict:
    """config.json fields of this 4-bit checkpoint (names: the planned weights, unquantized)."""
    plain = sorted(n.removesuffix(".weight") for n in names
                   if len(shapes[n]) >= 2 and not quantized(n, shapes[n]) and "embed_tokens" not in n)
    if layout == "modelopt":
        qc = {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": nvfp4.GROUP, "kv_cache_quant_algo": None,
              "exclude_modules": plain}
    else:
        weights = ({"num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": nvfp4.GROUP,
                    "symmetric": True, "dynamic": False} if quant == "nvfp4" else
                   {"num_bits": 4, "type": "int", "strategy": "group", "group_size": int4.GROUPS[quant],
                    "symmetric": quant not in int4.ASYMMETRIC, "dynamic": False})
        fmt = "nvfp4-pack-quantized" if quant == "nvfp4" else "pack-quantized"
        qc = {"quant_method": "compressed-tensors", "format": fmt, "quantization_status": "compressed",
              "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": None,
                                            "output_activations": None, "format": fmt}},
              "ignore": plain}
    return {**d, "torch_dtype": "bfloat16", "quantization_config": qc}
