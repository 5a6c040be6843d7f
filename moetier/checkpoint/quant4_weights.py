"""4-bit checkpoints (NVFP4 from ModelOpt or compressed-tensors, INT4 from compressed-tensors) against
a model's weight list: which tensors stand for each weight, what validation checks beyond names and
shapes, and how the loader reads them. The formats' rules are quant/nvfp4.py's and quant/int4.py's;
the config's, quant/quant_config.py's. Names: a weight `W` (a module's `x.weight`, or a fused
`experts.gate_up_proj`) is stored as its companions `W + suffix`:

    layout              codes               group scales      tensor scale                  never read
    modelopt (nvfp4)    W  uint8 [N, K/2]   W_scale e4m3      W_scale_2 float32 []          x.input_scale
    compressed-tensors  W_packed uint8      W_scale e4m3      W_global_scale float32 [1]    x.input_global_scale
      (nvfp4)                                                 (reciprocal: 1 / global)
    compressed-tensors  W_packed int32      W_scale bf16      -                             W_shape
      (int4)            [N, ceil(K/8)]      [N, ceil(K/g)]
      asymmetric int4:  W_zero_point int32 [ceil(N/8), ceil(K/g)]: a zero code per group, eight rows a word

Fused expert tensors take per-expert tensor scales: [E] (down), [E, 2] (gate_up: gate's, up's).

    routed experts   must be quantized (a float expert is an error naming it): codes and scales are
                     copied into the expert's 4-bit row (quant/rows.RowLayout parts `gate`, ...,
                     `gate_scale`, ..., `gate_scale_2`, ...), int32 words as bytes, reciprocals taken
    everything else  quantized where the checkpoint holds codes for it (exclude_modules / ignore leave
                     the rest in bf16), dequantized once at load into the model dtype (read_dense), or
                     with dense_weights "keep" copied as stored into the model's Packed4Weights
                     (read_codes: the rows' conventions, layers/packed4_linear.py)
    activation scales (input_scale, input_global_scale; k_scale, v_scale) are accepted and never read:
                     every 4-bit path here is weight-only (W4A16); the load report says so once
"""

from __future__ import annotations

import dataclasses
from contextlib import contextmanager

import torch

from moetier.checkpoint.index import Checkpoint
from moetier.config import ModelConfig
from moetier.errors import CheckpointError, MoetierError
from moetier.models.base import ExpertTensor, Weight
from moetier.quant import int4, nvfp4, packed4
from moetier.quant import quant_config as qconfig
from moetier.quant.registry import GROUPS

# (codes, group scales, tensor scale or None) suffixes of a weight's companions, per layout
SUFFIXES = {"modelopt": ("", "_scale", "_scale_2"), "compressed-tensors": ("_packed", "_scale", "_global_scale")}
ACTIVATION_SCALES = ("input_scale", "input_global_scale", "k_scale", "v_scale")
CODES = {"nvfp4": "U8", **{name: "I32" for name in int4.GROUPS}}
SCALES = {"nvfp4": "F8_E4M3", **{name: "BF16" for name in int4.GROUPS}}
FLOATS = ("F32", "BF16", "F16")
SCALAR = {(), (1,)}  # the shapes a linear's one float32 tensor scale is stored in


def companions(cfg: ModelConfig, w: Weight) -> tuple[str, str, str | None]:
    """(codes, scales, tensor scale or None) checkpoint names of weight w in cfg's checkpoint layout."""
    codes, scale, glob = SUFFIXES[qconfig.layout(cfg.quant_config)]
    return w.name + codes, w.name + scale, (w.name + glob if cfg.quant == "nvfp4" else None)


def shapes(quant: str, shape: tuple[int, ...], ct_layout: bool, gate_up: bool = False) -> tuple[tuple, tuple, tuple]:
    """(codes, scales, tensor scale) shapes of a weight [..., N, K] in this format (gate_up: a fused
    [E, 2I, H] tensor, whose tensor scales are gate's and up's, [E, 2])."""
    *lead, n, k = shape
    codes = (*lead, n, packed4.cdiv(k, 8)) if quant != "nvfp4" else (*lead, n, k // 2)
    glob = (*lead, 2) if gate_up and lead else tuple(lead) if lead else ((1,) if ct_layout else ())
    return codes, (*lead, n, packed4.cdiv(k, GROUPS[quant])), glob


def zero_shape(quant: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The int32 zero points of an asymmetric INT4 weight [..., N, K]: [..., ceil(N/8), ceil(K/g)]."""
    *lead, n, k = shape
    return (*lead, packed4.cdiv(n, 8), packed4.cdiv(k, GROUPS[quant]))


def with_tensors(cfg: ModelConfig, ckpt: Checkpoint, weights: list[Weight]) -> tuple[list[Weight], list[str], set[str]]:
    """The checkpoint tensors standing for the model's weights, the problems validation cannot see by
    name and shape (one line each, naming the tensor), and the names whose non-float dtypes are
    checked here. Dense companions come back skipped (the loader reads them with their weight)."""
    ct = qconfig.layout(cfg.quant_config) == "compressed-tensors"
    out, problems, vouched = [], [], set()
    for w in weights:
        cname, sname, gname = companions(cfg, w)
        info = ckpt.tensors.get(cname)
        quantized = info is not None and info.dtype == CODES[cfg.quant]
        if w.expert is None and not quantized:
            out.append(w)
            if cname != w.name and cname in ckpt.tensors:
                problems.append(f"{ckpt.tensors[cname].file}: {cname} has dtype {ckpt.tensors[cname].dtype}; "
                                f"{cfg.quant} codes are {CODES[cfg.quant]}")
            continue
        if w.expert is not None and not quantized:
            stored = ckpt.tensors.get(w.name) or info
            if stored is not None:
                problems.append(f"{stored.file}: routed expert {w.name} is {stored.dtype}; in a {cfg.quant} checkpoint "
                                f"every routed expert must be {CODES[cfg.quant]} codes ({cname}) with their scales")
                continue
        module = w.name.removesuffix(".weight")
        if w.expert is None and qconfig.excluded(cfg.quant_config, module):
            problems.append(f"{info.file}: {cname} is quantized but quantization_config excludes {module}; fix "
                            "exclude_modules / ignore or store the module unquantized")
        x = w.expert
        cshape, sshape, gshape = shapes(cfg.quant, w.shape, ct, x is not None and x.part == "gate_up")
        dense = x is None
        out.append(dataclasses.replace(w, name=cname, shape=cshape))
        parts = [(sname, sshape, SCALES[cfg.quant], "_scale")]
        if gname is not None:
            parts.append((gname, gshape, "F32", "_scale_2"))
        if cfg.quant in int4.ASYMMETRIC:
            parts.append((w.name + "_zero_point", zero_shape(cfg.quant, w.shape), "I32", "_zero_point"))
        for name, shape, dtype, part in parts:
            got = ckpt.tensors.get(name)
            if part == "_scale_2" and got is not None and {tuple(got.shape), tuple(shape)} <= SCALAR:
                shape = tuple(got.shape)  # a per-linear tensor scale stored as [] or [1]: exporters write either
            out.append(Weight(name, shape, skipped=dense,
                              expert=None if dense else ExpertTensor(x.layer, x.expert, x.part + part)))
            what = {"_scale": "group scales", "_scale_2": "tensor scales", "_zero_point": "zero points"}[part]
            if got is None and dense:
                problems.append(f"{info.file}: {cname} holds {cfg.quant} codes but its {what[:-1]} {name} is missing")
            elif got is not None and got.dtype != dtype:
                problems.append(f"{got.file}: {name} has dtype {got.dtype}; {cfg.quant} wants {dtype} here "
                                f"({what} of {cname})")
            elif got is not None and dense and tuple(got.shape) != tuple(shape):
                problems.append(f"{got.file}: {name} has shape {list(got.shape)}, {cname} needs {list(shape)}")
        if cfg.quant != "nvfp4":
            out.append(Weight(w.name + "_shape", (len(w.shape),), optional=True, skipped=True))
            if cfg.quant not in int4.ASYMMETRIC and w.name + "_zero_point" in ckpt.tensors:
                problems.append(f"{w.name}_zero_point: a zero point in a checkpoint whose quantization_config says "
                                "symmetric; set weights.symmetric false in config.json, or drop the zero points")
        vouched.update(n for n, *_ in parts)
        vouched.update((cname, w.name + "_shape"))
    for name, t in ckpt.tensors.items():  # W4A4 calibration and KV scales: accepted, never read
        if name.rsplit(".", 1)[-1].endswith(ACTIVATION_SCALES) and t.dtype in FLOATS:
            out.append(Weight(name, tuple(t.shape), optional=True, skipped=True))
    return out, problems, vouched


def param_name(cfg: ModelConfig, name: str) -> str:
    """The model weight a checkpoint tensor of the loader's list fills (codes carry their suffix)."""
    codes = SUFFIXES[qconfig.layout(cfg.quant_config)][0]
    return name.removesuffix(codes) if codes and name.endswith(codes) else name


def read_dense(read, ckpt: Checkpoint, cfg: ModelConfig, name: str, dtype: torch.dtype) -> torch.Tensor:
    """A non-expert tensor of the loader's list in the model dtype: 4-bit codes dequantized with their
    scales (the format's torch reference). read(name) -> the tensor from whichever shard holds it."""
    if ckpt.tensors[name].dtype != CODES[cfg.quant]:
        return read(name)
    codes, scale, s2, zero = read_codes(read, ckpt, cfg, name)
    with _named(ckpt, name):
        if s2 is not None:
            return nvfp4.dequantize(codes, scale, s2, dtype, name)
        return int4.dequantize(codes, scale, dtype, int4.GROUPS[cfg.quant], name, zero)


def read_codes(read, ckpt: Checkpoint, cfg: ModelConfig, name: str
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """A non-expert weight's codes (uint8 [N, K/2]: INT4's int32 words as bytes, K from `W_shape`),
    group scales as stored, NVFP4's float32 tensor scale (compressed-tensors' global scale inverted,
    as the expert rows take it) or None, and asymmetric INT4's zero codes (uint8 [N, G], unpacked from
    their int32 words of eight rows) or None: what a Packed4Weight holds and read_dense dequantizes."""
    w = Weight(param_name(cfg, name), ())
    _, sname, gname = companions(cfg, w)
    t = read(name)
    with _named(ckpt, name):
        if cfg.quant == "nvfp4":
            return t, read(sname), scale_2(read(gname), gname), None
        shape = w.name + "_shape"  # K exactly; without it the codes fill their words
        k = int(read(shape)[-1]) if shape in ckpt.tensors else 8 * t.shape[-1]
        zero = None
        if cfg.quant in int4.ASYMMETRIC:
            zname = w.name + "_zero_point"
            zero = int4.zero_to_bytes(read(zname), t.shape[-2], zname)
        return int4.to_bytes(t, k, name), read(sname), None, zero


def require_codes(ckpt: Checkpoint, cfg: ModelConfig, name: str) -> None:
    """A weight the model keeps 4-bit must be stored as codes (its scales are validated)."""
    info = ckpt.tensors[name]
    if info.dtype != CODES[cfg.quant]:
        raise MoetierError(f"{info.file}: {name} is {info.dtype}, not {cfg.quant} codes, but the model keeps it "
                           f"{cfg.quant} (dense_weights \"keep\"); list its module in quantization_config's "
                           "exclude_modules / ignore, or load with dense_weights \"dequantize\"")


@contextmanager
def _named(ckpt: Checkpoint, name: str):
    # a format's ValueError (a misfit of codes and scales) as one line naming the shard
    try:
        yield
    except ValueError as e:
        raise CheckpointError(f"{ckpt.tensors[name].file}: {e}") from None


def scale_2(t: torch.Tensor, name: str) -> torch.Tensor:
    """NVFP4's float32 tensor scale as the rows hold it: compressed-tensors' global scale inverted."""
    return (1.0 / t.float()) if name.endswith("_global_scale") else t.float()


def to_row(name: str, t: torch.Tensor, dest: torch.Tensor, nk: tuple[int, int] | None = None) -> torch.Tensor:
    """A routed-expert checkpoint tensor as its row part `dest` holds it: int32 codes and zero points
    as bytes, global scales inverted, scalar scales reshaped. nk: the weight's whole (N, K) (default:
    dest's; a rank's columns of it are cut after)."""
    if t.dtype == torch.int32 and name.endswith("_zero_point"):
        return int4.zero_to_bytes(t, dest.shape[-2] if nk is None else nk[0], name)
    if t.dtype == torch.int32:
        return int4.to_bytes(t, 2 * dest.shape[-1] if nk is None else nk[1], name)
    if name.endswith(("_scale_2", "_global_scale")):
        return scale_2(t, name).reshape(dest.shape)
    return t
