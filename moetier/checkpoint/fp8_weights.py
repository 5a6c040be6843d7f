"""FP8 block-scaled checkpoints against a model's weight list: the scale tensors a checkpoint must
hold, the FP8 problems validation names, and how the loader reads an FP8 tensor. The format's own
rules (the block rule, the tensor names and dtype codes, what is quantized, the config.json it
writes) are quant/fp8_block.py's; this file joins them to the model's Weights and the Checkpoint.

A model's checkpoint_weights() lists weights as if unquantized; for a config.json with
`quantization_config: {"quant_method": "fp8", ...}` the checkpoint also holds, for every weight
stored as float8_e4m3fn, `<name>_scale_inv` float32 [..., ceil(N/128), ceil(K/128)]. What is where:

    routed experts   must be float8 (a bf16 expert in an FP8 checkpoint is an error naming it): the
                     weights and their scales are copied unchanged into the expert's FP8 row
                     (quant/rows.RowLayout parts `gate`, ..., `gate_scale`, ...)
    everything else  float8 weights are dequantized once at load into the model dtype (bf16 for
                     published checkpoints), or with dense_weights "keep" (config.with_dense) copied
                     unchanged, with their scales, into the model's Fp8Weights (layers/fp8_linear.py)
                     where the model holds one; the rest (embeddings, norms, routers, lm_head) load as
                     they are.
"""

from __future__ import annotations

import torch

from moetier.checkpoint.index import Checkpoint
from moetier.config import ModelConfig
from moetier.errors import MoetierError
from moetier.models.base import ExpertTensor, Weight
from moetier.quant import fp8_block as fp8
from moetier.quant.fp8_block import FP8_CODE, scale_name

def with_scales(cfg: ModelConfig, ckpt: Checkpoint, weights: list[Weight]) -> tuple[list[Weight], list[str]]:
    """The model's weights plus the scale tensors this checkpoint must hold, and the FP8 problems
    validation cannot see by name and shape (one line each).

    Routed experts of an FP8 config always expect scales (a missing scale is then a missing tensor,
    named); other weights expect one exactly when the checkpoint stores them as float8."""
    if cfg.quant != "fp8":
        stray = sorted(n for n, t in ckpt.tensors.items() if t.dtype == FP8_CODE)
        return weights, ([f"{len(stray)} tensor(s) are float8 (e.g. {stray[0]}) but config.json has no "
                          "quantization_config; add the FP8 checkpoint's quantization_config "
                          f"({fp8.QUANT_CONFIG}) or use an unquantized checkpoint"] if stray else [])
    out, problems = [], []
    for w in weights:
        out.append(w)
        info = ckpt.tensors.get(w.name)
        if w.expert is not None:
            if info is not None and info.dtype != FP8_CODE:
                problems.append(f"{info.file}: routed expert {w.name} is {info.dtype}; in an FP8 checkpoint "
                                "every routed expert must be float8_e4m3fn with its block scale")
            x = w.expert
            if x.part == "gate_up" and cfg.moe_intermediate_size % fp8.BLOCK:
                problems.append(f"{w.name}: fused gate_up block scales need moe_intermediate_size a multiple "
                                f"of {fp8.BLOCK} (got {cfg.moe_intermediate_size}); store gate_proj and up_proj "
                                "per expert")
            out.append(Weight(scale_name(w.name), fp8.scale_shape(w.shape), w.optional,
                              ExpertTensor(x.layer, x.expert, x.part + "_scale")))
        elif info is not None and info.dtype == FP8_CODE:
            if len(w.shape) < 2:
                problems.append(f"{info.file}: {w.name} is float8 but has {len(w.shape)} dimension(s); "
                                "block scales need 2")
            else:
                out.append(Weight(scale_name(w.name), fp8.scale_shape(w.shape), w.optional))
    return out, problems


def is_dense_scale(w: Weight) -> bool:
    """A scale of a non-expert weight: read together with its weight, never on its own."""
    return w.expert is None and w.name.endswith(fp8.SCALE_SUFFIX)


def read_dense(read, ckpt: Checkpoint, name: str, dtype: torch.dtype) -> torch.Tensor:
    """A non-expert tensor in the model dtype: float8 weights dequantized with their block scale.
    read(name) -> the tensor from whichever shard holds it."""
    t = read(name)
    if ckpt.tensors[name].dtype != FP8_CODE:
        return t
    return fp8.dequantize(t, read(scale_name(name)), dtype)


def require_fp8(ckpt: Checkpoint, name: str) -> None:
    """A weight the model holds in FP8 must be float8 in the checkpoint (with its scale: validated)."""
    if ckpt.tensors[name].dtype != FP8_CODE:
        raise MoetierError(f"{ckpt.tensors[name].file}: {name} is {ckpt.tensors[name].dtype}, not float8, but the "
                           "model holds it in FP8 (dense_weights \"keep\"); load with dense_weights \"dequantize\"")


def read_fp8(read, ckpt: Checkpoint, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """A non-expert float8 tensor and its block scale, unchanged (for an Fp8Weight destination)."""
    require_fp8(ckpt, name)
    return read(name), read(scale_name(name))
