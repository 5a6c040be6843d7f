"""Load a checkpoint directory into its model, for every family: validate first, allocate once,
stream tensor by tensor.

    config.json -> the family's config and model class (models/registry.py)
    shard headers -> validated against the model's checkpoint_weights()
    model built (no expert memory), expert placement built (device rows or the pinned host store)
    each tensor read once and copied into its place, converting dtype on the way:
        routed-expert tensors -> their expert's row (quant/rows.RowLayout.part); FP8 experts and
            their block scales unchanged into FP8 rows
        everything else -> model.param(name); FP8 and 4-bit weights dequantized with their scales
            first (checkpoint/fp8_weights.py, quant4_weights.py), or with dense_weights "keep" copied
            as stored, with their scales, into the model's kept weights (layers/quant_linear.py:
            Fp8Weight, Packed4Weight) where the model holds one
    each MoE block gets its expert backend

No second full copy of the model is ever held.

Under a parallel layout (moetier/parallel.Parallel; docs/parallel.md) each rank loads its share only:
a dense tensor whose Weight.split names a dim gives this rank its contiguous 1/tp part of that dim
(generic: any family declares its splits in checkpoint_weights()), the others whole; routed experts
other ranks own (expert parallelism) are not read at all, fused [E, ...] tensors give their owned rows;
under the "columns" expert split (experts/parallel/columns.py) every expert tensor gives this rank its I/tp
slice (gate / up rows, down columns, and their FP8 scale blocks). A kept dense weight is split as
its dequantized self would be: rows for column-parallel weights, K for row-parallel ones, with the
scales' blocks (FP8: 128 wide; 4-bit: groups along K, codes two per byte).
"""

from __future__ import annotations

import dataclasses
import time
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
from safetensors import safe_open

from moetier.checkpoint.fp8_weights import is_dense_scale, read_dense, read_fp8, require_fp8
from moetier.checkpoint import quant4_weights as quant4
from moetier.checkpoint.index import Checkpoint
from moetier.checkpoint.validate import model_weights, validate
from moetier.config import ModelConfig, with_dense
from moetier.models.registry import config_from_dir
from moetier.errors import MoetierError
from moetier.experts.parallel.columns import column_part
from moetier.experts.placement import ExpertOptions, ExpertPlacement
from moetier.layers.quant_linear import WEIGHTS, destination
from moetier.models.base import CausalLM, Weight
from moetier.models.mtp import with_mtp
from moetier.models.registry import model_class
from moetier.parallel import Parallel
from moetier.quant import fp8_block as fp8
from moetier.quant import quant_config as qconfig
from moetier.quant.registry import GROUPS, PACKED4
from moetier.quant.rows import weight_part

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16}


def resolve_dtype(name: str, cfg: ModelConfig) -> torch.dtype:
    """'auto' takes the checkpoint's dtype (config.json torch_dtype)."""
    key = cfg.torch_dtype if name == "auto" else name
    if key not in DTYPES:
        raise MoetierError(f"unsupported --dtype {name!r}; choose auto, float32, bfloat16 or float16")
    return DTYPES[key]


@dataclass
class LoadReport:
    seconds: float
    checkpoint_bytes: int
    tensors: int
    expert_bytes: dict[str, int] = field(default_factory=dict)  # by tier: device, host
    notes: list[str] = field(default_factory=list)
    dense_bytes: int = 0  # every weight besides the routed experts, as held (FP8 weights: q + scales)


# safetensors dtype codes -> bytes per element (for the progress total, from the headers alone)
ITEMSIZE = {"F64": 8, "I64": 8, "U64": 8, "F32": 4, "I32": 4, "U32": 4, "F16": 2, "BF16": 2, "I16": 2, "U16": 2,
            "F8_E4M3": 1, "F8_E5M2": 1, "I8": 1, "U8": 1, "BOOL": 1}


def tensor_bytes(ckpt: Checkpoint, name: str) -> int:
    info = ckpt.tensors[name]
    n = ITEMSIZE.get(info.dtype, 1)
    for d in info.shape:
        n *= d
    return n


def load_weights(model: CausalLM, placement: ExpertPlacement, ckpt: Checkpoint, weights: list[Weight],
                 rows: dict[int, torch.Tensor], progress: Callable[[int, int], None] | None = None) -> int:
    """Copy every weight into its destination, shard by shard. Returns the tensors copied.
    progress(bytes read, bytes in all) after each tensor (checkpoint bytes, before dtype conversion)."""
    cfg = model.cfg
    four = cfg.quant in PACKED4
    by_file: dict[str, list[Weight]] = {}
    for w in weights:
        by_file.setdefault(ckpt.tensors[w.name].file, []).append(w)
    done, read, total = 0, 0, sum(tensor_bytes(ckpt, w.name) for w in weights)
    with ExitStack() as stack:
        handles = {}

        def tensor(name: str) -> torch.Tensor:
            # a dense FP8 weight's scale may sit in another shard: every shard opens once (mmap)
            file = ckpt.tensors[name].file
            if file not in handles:
                handles[file] = stack.enter_context(safe_open(str(ckpt.path / file), framework="pt", device="cpu"))
            return handles[file].get_tensor(name)

        for file in sorted(by_file):
            for w in by_file[file]:
                if is_dense_scale(w):
                    pass  # read with its weight
                elif w.expert is not None:
                    if not copy_expert(placement, rows, w, tensor):
                        done -= 1  # another rank's expert: not read, not counted as copied
                elif four:  # 4-bit dense codes: kept as stored, or dequantized (checkpoint/quant4_weights.py)
                    dest = model.param(quant4.param_name(cfg, w.name))
                    if (kept := destination(dest)) is not None:
                        codes, scale, s2, zero = quant4.read_codes(tensor, ckpt, cfg, w.name)
                        codes, scale, zero = shard_codes(codes, scale, zero, w, placement.par, GROUPS[cfg.quant])
                        kept.copy_(codes, scale, s2, w.name, zero)
                    elif dest is not None:
                        with torch.no_grad():
                            dest.copy_(shard(quant4.read_dense(tensor, ckpt, cfg, w.name, dest.dtype), w,
                                             placement.par))
                elif (kept := destination(dest := model.param(w.name))) is not None:
                    q, scale = read_fp8(tensor, ckpt, w.name)
                    kept.copy_(shard(q, w, placement.par), shard(scale, w, placement.par, fp8.BLOCK), w.name)
                elif dest is not None:
                    with torch.no_grad():
                        dest.copy_(shard(read_dense(tensor, ckpt, w.name, dest.dtype), w, placement.par))
                done += 1
                read += tensor_bytes(ckpt, w.name)
                if progress:
                    progress(read, total)
    return done


def shard(t: torch.Tensor, w: Weight, par: Parallel, block: int = 1) -> torch.Tensor:
    """This rank's part of a dense checkpoint tensor: part tp_rank of w.split, or all of it.
    block: t holds one entry per `block` of w's elements along the split dim (an FP8 block-scale grid,
    4-bit codes: 2, 4-bit group scales: the group)."""
    if w.split is None or par.tp == 1:
        return t
    n = w.shape[w.split] if block > 1 else t.shape[w.split]
    if n % par.tp:
        raise MoetierError(f"{w.name}: dim {w.split} ({n}) does not split into {par.tp} equal tensor-parallel "
                           "parts; choose a tensor-parallel size that divides it")
    part = n // par.tp
    if part % block:  # the models hold such weights dequantized or refuse them (layers/quant_linear): a bug if here
        raise MoetierError(f"{w.name}: a tensor-parallel part of {part} along dim {w.split} cuts its "
                           f"{block}-wide scale blocks; load with dense_weights \"dequantize\"")
    return t.narrow(w.split, par.tp_rank * part // block, part // block)


def shard_codes(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, w: Weight, par: Parallel,
                group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """This rank's part of a kept 4-bit weight: codes uint8 [N, K/2], group scales [N, ceil(K/group)]
    and zero codes (their shape, or None) cut by rows (split 0) or along K in whole groups (split 1)."""
    full = dataclasses.replace(w, shape=(codes.shape[0], 2 * codes.shape[1]))  # w.shape is the stored codes'
    along_k = w.split == 1
    per_group = group if along_k else 1
    return (shard(codes, full, par, 2 if along_k else 1), shard(scale, full, par, per_group),
            None if zero is None else shard(zero, full, par, per_group))


def copy_expert(placement: ExpertPlacement, rows: dict[int, torch.Tensor], w: Weight, tensor) -> bool:
    """Copy a routed-expert tensor into this rank's rows; False when another rank owns the expert."""
    x, lay, par = w.expert, placement.layout, placement.par
    tp = par.tp if placement.split == "columns" else 1  # columns: this rank's I/tp of every expert
    full = placement.full_shape
    i, h = full.inter, full.hidden  # the weight's whole (N, K), for 4-bit words cut after unpacking
    nk = {"gate": (i, h), "up": (i, h), "gate_up": (2 * i, h), "down": (h, i)}[weight_part(x.part)]

    def mine(t: torch.Tensor) -> torch.Tensor:
        return column_part(t, x.part, full.inter, par.tp_rank, tp, full.quant)

    with torch.no_grad():
        if x.expert is None:  # fused [E, ...]: the rows of the experts this rank owns, in local order
            whole = tensor(w.name)
            src = whole if par.ep == 1 else whole[par.ep_rank::par.ep]
            if x.layer not in placement.pinned:
                dest = lay.part(rows[x.layer], x.part, None)
                dest.copy_(mine(quant4.to_row(w.name, src, dest, nk)))
                return True
            for local in range(src.shape[0]):  # pinned experts to the device, only cached ones to the host
                block, i = placement.home(x.layer, local, rows[x.layer])
                dest = lay.part(block, x.part, i)
                dest.copy_(mine(quant4.to_row(w.name, src[local], dest, nk)))
            return True
        local = placement.local_id(x.expert)
        if local is None:
            return False
        block, i = placement.home(x.layer, local, rows[x.layer])  # the device block for a pinned expert (split.py)
        dest = lay.part(block, x.part, i)
        dest.copy_(mine(quant4.to_row(w.name, tensor(w.name), dest, nk)))
        return True


def build_model(cfg: ModelConfig, dtype: torch.dtype, device: torch.device | str, experts: ExpertOptions,
                decode_tokens: int, par: Parallel = Parallel()
                ) -> tuple[CausalLM, ExpertPlacement, dict[int, torch.Tensor]]:
    """The model without its routed experts, their placement, and each MoE layer's rows to fill."""
    model, placement = _model_and_placement(cfg, dtype, device, experts, decode_tokens, par)
    return model, placement, {layer: placement.rows(layer) for layer in cfg.moe_layers}


def _model_and_placement(cfg: ModelConfig, dtype: torch.dtype, device: torch.device | str, experts: ExpertOptions,
                         decode_tokens: int, par: Parallel) -> tuple[CausalLM, ExpertPlacement]:
    placement = ExpertPlacement(cfg.moe_shape, dtype, cfg.moe_layers, experts, device, decode_tokens, par)
    cls = model_class(cfg)
    if par.tp > 1 and not cls.tensor_parallel:
        raise MoetierError(f"tensor parallelism is not implemented for {cls.__name__} yet (Qwen3-MoE, DeepSeek-V3 "
                           "and GLM-5 have it); use expert parallelism (--ep) alone, or one process")
    return (cls(cfg, dtype, device, par) if par.tp > 1 else cls(cfg, dtype, device)), placement


def attach_experts(model: CausalLM, placement: ExpertPlacement, rows: dict[int, torch.Tensor]) -> None:
    """After loading: each MoE block gets its backend over its filled rows."""
    for block in model.moe_blocks():
        block.experts = placement.build(block.layer, rows[block.layer])


def check_parallel(cfg: ModelConfig, experts: ExpertOptions, decode_tokens: int, par: Parallel) -> None:
    """Refuse a layout this model cannot split, before any process is spawned or byte is read: the
    model is built on the meta device (no memory) with rank 0's layout, so the same checks run as at
    load (attention heads, GQA kv heads and dense / shared-expert columns divisible by tp, experts by
    ep, backend and slots, the routed-expert split: I / tp for "columns")."""
    _model_and_placement(cfg, torch.float32, "meta", experts, decode_tokens, par)  # no rows: no memory


def load_model(path: str | Path, dtype: str = "auto", device: str = "cpu", experts: ExpertOptions | None = None,
               decode_tokens: int = 64, progress: Callable[[int, int], None] | None = None,
               parallel: Parallel = Parallel(), dense_weights: str = "dequantize", mtp: bool = False
               ) -> tuple[ModelConfig, CausalLM, LoadReport]:
    """parallel: this rank's layout (the default: one process holds everything). dense_weights: what a
    quantized checkpoint's dense weights become, "dequantize" or "keep" (EngineConfig.dense_weights).
    mtp: also load the checkpoint's MTP layers (speculative method "mtp"; models/mtp.py)."""
    t0 = time.perf_counter()
    cfg = with_mtp(with_dense(config_from_dir(path), dense_weights), mtp)
    torch_dtype = resolve_dtype(dtype, cfg)
    ckpt = Checkpoint(path)
    weights = validate(cfg, ckpt, model_weights(cfg, ckpt))  # before allocating
    model, placement, rows = build_model(cfg, torch_dtype, device, experts or ExpertOptions(), decode_tokens,
                                         parallel)
    check_kept(model, ckpt, weights)  # before a byte is read
    n = load_weights(model, placement, ckpt, weights, rows, progress)
    attach_experts(model, placement, rows)
    nbytes = {"device": 0, "host": 0}
    for block in model.moe_blocks():
        for tier, b in block.experts.nbytes().items():
            nbytes[tier] += b
    notes = []
    dense = sum(p.numel() * p.element_size() for p in model.parameters())
    held = sum(isinstance(m, WEIGHTS) for m in model.modules())
    kept = f"{held} dense projections kept in {cfg.quant} (layers/quant_linear.py), the " if held else ""
    if cfg.quant == "fp8":
        lay = placement.layout
        notes.append(f"routed experts stay FP8: {lay.row_bytes(torch_dtype)} bytes per expert row (weights and "
                     f"block scales; {lay.w13_numel + lay.w2_numel} weight bytes); {kept}other float8 weights "
                     f"dequantized to {str(torch_dtype).removeprefix('torch.')} at load")
    if cfg.quant in PACKED4:
        lay = placement.layout
        held = "codes, scales and zero points" if lay.asymmetric else "codes and scales"
        notes.append(f"routed experts stay {cfg.quant}: {lay.row_bytes(torch_dtype)} bytes per expert row ({held}; "
                     f"{lay.row_bytes(torch_dtype) / (3 * lay.hidden * lay.inter):.4f} B per weight), "
                     "computed weight-only (W4A16: dequantized in registers, activations in "
                     f"{str(torch_dtype).removeprefix('torch.')}); {kept}other 4-bit weights dequantized at load")
        if qconfig.activation_scales(cfg.quant_config) or any(
                n.rsplit(".", 1)[-1].endswith(quant4.ACTIVATION_SCALES) for n in ckpt.tensors):
            notes.append("the checkpoint carries activation scales (W4A4 calibration): they are never read; "
                         "every 4-bit path here is weight-only (W4A16)")
    return cfg, model, LoadReport(time.perf_counter() - t0, ckpt.nbytes(), n, nbytes, notes, dense)


def check_kept(model: CausalLM, ckpt: Checkpoint, weights: list[Weight]) -> None:
    """Every weight the model keeps in the checkpoint's format (dense_weights "keep") must be stored
    quantized (float8, 4-bit codes; published checkpoints store their quantized projections so, and
    the model holds the modules quantization_config excludes in the model dtype); one clear error
    otherwise, before loading."""
    cfg = model.cfg
    four = cfg.quant in PACKED4
    for w in weights if cfg.dense_quant else ():
        if w.expert is not None or is_dense_scale(w):
            continue
        if destination(model.param(quant4.param_name(cfg, w.name) if four else w.name)) is None:
            continue
        if four:
            quant4.require_codes(ckpt, cfg, w.name)
        else:
            require_fp8(ckpt, w.name)
