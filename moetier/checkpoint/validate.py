"""A checkpoint against the tensors its model expects (models/base.Weight), from the shard headers
only, before anything is allocated: missing, unexpected, misshapen and non-float tensors, all in one
error. When many tensors are wrong for one reason (a wrong size or layer count in config.json), the
error leads with that reason and caps each list with a count.
"""

from __future__ import annotations

import dataclasses
import re
from collections import Counter

from moetier.checkpoint.fp8_weights import with_scales
from moetier.checkpoint.quant4_weights import with_tensors
from moetier.checkpoint.index import Checkpoint
from moetier.config import ModelConfig
from moetier.errors import CheckpointError, problem_list
from moetier.models.base import Weight
from moetier.quant.fp8_block import FP8_CODE
from moetier.quant.registry import PACKED4

FLOAT_DTYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16", "F64": "float64"}
# Tensors some exporters add that carry nothing we need.
IGNORED = re.compile(r".*rotary_emb\.inv_freq$")
SHOWN = 10  # entries of each list before "... and N more"
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def _capped(lines: list[str], what: str) -> list[str]:
    return lines[:SHOWN] + ([f"... and {len(lines) - SHOWN} more {what}"] if len(lines) > SHOWN else [])


def _fields_equal_to(cfg: ModelConfig, value: int) -> list[str]:
    return [f.name for f in dataclasses.fields(cfg)
            if type(getattr(cfg, f.name)) is int and getattr(cfg, f.name) == value]


def root_causes(cfg: ModelConfig, ckpt: Checkpoint, misshapen: list[tuple[str, tuple, tuple]],
                unexpected: list[str], missing: list[str]) -> list[str]:
    """The config.json values that explain most of the problems, most common first."""
    out = []
    layers = [int(m.group(1)) for name in ckpt.tensors if (m := _LAYER.search(name))]
    if layers and max(layers) + 1 != cfg.num_layers and (unexpected or missing):
        out.append(f"config.json says num_hidden_layers {cfg.num_layers}, the checkpoint holds layers "
                   f"0..{max(layers)} ({max(layers) + 1} layers)")
    pairs: Counter = Counter()
    example: dict[tuple[int, int], str] = {}
    for name, want, got in misshapen:
        if len(want) == len(got):
            for w, g in zip(want, got):
                if w != g:
                    pairs[w, g] += 1
                    example.setdefault((w, g), f"{name} {list(got)}, expected {list(want)}")
    for (w, g), n in pairs.most_common(3):
        if n < 2:  # one misshapen tensor is its own explanation
            break
        fields = _fields_equal_to(cfg, w)
        what = f"config.json gives {' / '.join(fields)} = {w}" if fields else f"config.json implies a size {w}"
        out.append(f"{what} where {n} tensor(s) have {g} (e.g. {example[w, g]})")
    return out


def model_weights(cfg: ModelConfig, ckpt: Checkpoint) -> list[Weight]:
    """The model's checkpoint_weights() for this checkpoint's names (compressed-tensors' `W_packed`
    codes count as `W` where the model asks which layout is present: fused or per-expert)."""
    from moetier.models.registry import model_class

    names = set(ckpt.tensors)
    if cfg.quant in PACKED4:
        names |= {n.removesuffix("_packed") for n in names}
    return model_class(cfg).checkpoint_weights(cfg, names)


def validate(cfg: ModelConfig, ckpt: Checkpoint, weights: list[Weight]) -> list[Weight]:
    """Check every tensor against the model's list; returns the expected weights that are present
    (for FP8 checkpoints with their `*_scale_inv` block scales, checkpoint/fp8_weights.py; for 4-bit
    ones their codes and scales, checkpoint/quant4_weights.py)."""
    if cfg.quant in PACKED4:
        weights, fp8_problems, vouched = with_tensors(cfg, ckpt, weights)
    else:
        (weights, fp8_problems), vouched = with_scales(cfg, ckpt, weights), set()
    want = {w.name: w for w in weights}
    present = set(ckpt.tensors)
    missing = sorted(n for n, w in want.items() if n not in present and not w.optional)
    unexpected = sorted(n for n in present if n not in want and not IGNORED.match(n))
    misshapen, dtypes = [], []
    for name in sorted(present & want.keys()):
        info = ckpt.tensors[name]
        if info.shape != want[name].shape and not want[name].skipped:
            misshapen.append((name, want[name].shape, info.shape))
        if info.dtype not in FLOAT_DTYPES and not (info.dtype == FP8_CODE and cfg.quant == "fp8") and name not in vouched:
            dtypes.append(f"{info.file}: {name} has dtype {info.dtype}; only float32, bfloat16 and float16 "
                          "weights are supported, and float8_e4m3fn in FP8 checkpoints")
    # float8 tensors without quantization_config: that one cause explains every scale and dtype line
    lead = fp8_problems if cfg.quant is None else []
    dtypes += [p for p in fp8_problems if p not in lead]
    if missing or unexpected or misshapen or dtypes:
        causes = lead + root_causes(cfg, ckpt, misshapen, unexpected, missing)
        problems = _capped([f"missing tensor {n} (shape {list(want[n].shape)})"
                            + (" (the block scale of a float8 weight)" if n.endswith("_scale_inv") else "")
                            for n in missing], "missing tensors")
        problems += _capped([f"{ckpt.tensors[n].file}: unexpected tensor {n} (shape {list(ckpt.tensors[n].shape)})"
                             for n in unexpected], "unexpected tensors")
        problems += _capped([f"{ckpt.tensors[n].file}: {n} has shape {list(got)}, the config implies {list(w)}"
                             for n, w, got in misshapen], "misshapen tensors")
        problems += _capped(dtypes, "tensors of unsupported dtypes or formats")
        hint = ("Check that config.json belongs to these weights (layers, experts, sizes)"
                + (", and that the checkpoint is complete." if missing else "."))
        count = len(missing) + len(unexpected) + len(misshapen) + len(dtypes)
        raise CheckpointError(problem_list(f"checkpoint {ckpt.path} does not match its config.json", problems, hint,
                                           count, causes))
    return [w for w in weights if w.name in present and not w.skipped]
