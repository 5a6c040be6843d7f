"""Tensor parallelism inside each routed expert ("columns", docs/parallel.md): rank r of tp ranks
holds, for every expert, the gate and up rows [r I/tp, (r+1) I/tp) of the intermediate dimension and
the matching columns of down, so its rows are RowLayout(hidden, I/tp) (1/tp of the bytes in its host
store, slots and HBM rows). Every rank routes every token and computes every (token, expert) pair
over its slice: SwiGLU is elementwise along I, so the ranks' partial outputs sum to the whole expert
output, and one all-reduce over the tp group per MoE layer makes it (ColumnExperts).

    SPLITS                         "auto", "replicate", "columns" (ExpertOptions.split, --expert-split)
    split_problems(split, shape, tp, ep, backend) -> [str]   what is wrong, one line each
    resolve(split, shape, tp, ep, backend) -> "replicate" | "columns"
        auto: columns whenever valid (tp > 1, ep == 1, I / tp whole, for FP8 rows a multiple of 128,
        for 4-bit rows of the format's group, not the hybrid backend): it divides every rank's expert bytes by tp for one all-reduce of
        [T, H] per MoE layer, the same collective TP already pays per dense layer
    column_part(t, part, inter, rank, tp, quant)   this rank's slice of a checkpoint expert tensor
    slice_rows(src, full, dst, local, rank, tp)   full rows -> this rank's rows (random weights)

4-bit rows (quant/packed4.py) slice as their weights do: gate and up rows with their group-scale
(and zero-code) rows (groups run along H, whole in every row), down's packed columns (two per byte)
with the group scales and zero codes of those columns, which is why I / tp must hold whole groups;
NVFP4's per-projection tensor scales are every rank's unchanged.
"""

from __future__ import annotations

import torch

from moetier.errors import MoetierError
from moetier.experts.backends import ExpertBackend
from moetier.experts.parallel.ep import ReducedExperts
from moetier.experts.registry import KINDS, either, find
from moetier.experts.shape import MoeShape
from moetier.parallel import Parallel
from moetier.quant import fp8_block as fp8
from moetier.quant.registry import GROUPS, PACKED4
from moetier.quant.rows import GLOBAL_PARTS, RowLayout, weight_part

SPLITS = ("auto", "replicate", "columns")


def split_problems(split: str, shape: MoeShape, tp: int, ep: int, backend: str) -> list[str]:
    """What is wrong with routed-expert split `split` under (tp, ep), one line each (auto: nothing)."""
    if split not in SPLITS:
        return [f"expert split {split!r}: choose one of {', '.join(SPLITS)}"]
    if split != "columns" or tp == 1:  # one process: columns is the whole expert, as replicate
        return []
    out = []
    if ep > 1:
        out.append(f"--expert-split columns splits every expert over the tensor-parallel ranks, but expert "
                   f"parallelism {ep} already splits the experts by owner: with --ep keep --expert-split "
                   "auto or replicate")
    kind = find(backend)
    if kind is not None and not kind.column_split:
        able = either(k.name for k in KINDS.values() if k.column_split)
        out.append(f"--expert-split columns with the {backend} backend is not supported yet; choose {able}, or "
                   "--expert-split replicate")
    i = shape.inter
    if i % tp:
        out.append(f"--expert-split columns: tensor parallelism {tp} does not divide the experts' intermediate size "
                   f"({i}); choose a tensor-parallel size that divides {i}, or --expert-split replicate")
    elif shape.quant in PACKED4 and (i // tp) % (g := GROUPS[shape.quant]):
        out.append(f"--expert-split columns: {shape.quant} expert rows need each rank's intermediate slice in whole "
                   f"groups of {g}, but {i} / {tp} = {i // tp} is not a multiple of {g}; choose a tensor-parallel "
                   "size that leaves a multiple of it, or --expert-split replicate")
    elif shape.quant == "fp8" and (i // tp) % fp8.BLOCK:
        out.append(f"--expert-split columns: FP8 expert rows need each rank's intermediate slice on "
                   f"{fp8.BLOCK}-wide scale blocks, but {i} / {tp} = {i // tp} is not a multiple of {fp8.BLOCK}; "
                   f"choose a tensor-parallel size that leaves a multiple of {fp8.BLOCK}, or --expert-split "
                   "replicate")
    return out


def resolve(split: str, shape: MoeShape, tp: int, ep: int, backend: str) -> str:
    """The split a rank carries out: "columns" or "replicate" (auto: columns whenever valid)."""
    if tp == 1:
        return "replicate"
    if split == "auto":
        return "columns" if not split_problems("columns", shape, tp, ep, backend) else "replicate"
    problems = split_problems(split, shape, tp, ep, backend)
    if problems:
        raise MoetierError("; ".join(problems))
    return split


def local_shape(shape: MoeShape, split: str, tp: int) -> MoeShape:
    """The shape of one rank's expert rows: I / tp under columns, else the whole."""
    if split != "columns" or tp == 1:
        return shape
    return MoeShape(shape.num_experts, shape.top_k, shape.hidden, shape.inter // tp, shape.quant, shape.swiglu_limit)


def _unit(part: str, quant: str | None) -> int:
    """Intermediate columns one entry of `part` covers along the dimension columns slices."""
    per_group, base = part.endswith(("_scale", "_zero_point")), weight_part(part)
    if quant == "fp8":
        return fp8.BLOCK if per_group else 1  # resolve() keeps I / tp on 128-wide scale blocks
    if quant in PACKED4 and base == "down":  # codes: two columns a byte; scales, zero codes: a group each
        return GROUPS[quant] if per_group else 2
    return 1  # gate / up rows (and a 4-bit row's scale rows beside them): one row each


def column_part(t: torch.Tensor, part: str, inter: int, rank: int, tp: int, quant: str | None = None) -> torch.Tensor:
    """Rank `rank`'s slice of a checkpoint expert tensor of `part` ([..., I, H] gate / up, [..., 2I, H]
    gate_up, [..., H, I] down, their FP8 block-scale grids (one entry per 128 x 128 block), or, for
    4-bit rows (quant), their packed codes and group scales; any leading dims, e.g. the E of fused
    tensors). NVFP4's tensor scales (`*_scale_2`) and the whole tensor when tp == 1 pass unchanged."""
    if tp == 1 or part in GLOBAL_PARTS:
        return t
    base = weight_part(part)
    unit = _unit(part, quant)
    whole, k = inter // unit, inter // tp // unit
    a = rank * k
    if base == "down":
        return t[..., a:a + k]
    if base in ("gate", "up"):
        return t[..., a:a + k, :]
    if base == "gate_up":  # gate's slice, then up's
        return torch.cat([t[..., a:a + k, :], t[..., whole + a:whole + a + k, :]], dim=-2)
    raise ValueError(f"unknown expert part {part!r}")


def slice_rows(src: torch.Tensor, full: RowLayout, dst: torch.Tensor, local: RowLayout, rank: int, tp: int) -> None:
    """dst [N, local.numel] <- rank's columns of the whole rows src [N, full.numel] (weights and scales)."""
    parts = ("gate", "up", "down") + (("gate_scale", "up_scale", "down_scale") if full.quant else ())
    parts += ("gate_scale_2", "up_scale_2", "down_scale_2") if full.quant == "nvfp4" else ()
    parts += ("gate_zero_point", "up_zero_point", "down_zero_point") if full.asymmetric else ()
    for p in parts:
        local.part(dst, p).copy_(column_part(full.part(src, p), p, full.inter, rank, tp, full.quant))


class ColumnExperts(ReducedExperts):
    """One rank's columns of every expert (inner: any backend over RowLayout(H, I/tp) rows) plus the
    all-reduce over the tp group that sums the partial SwiGLU outputs. Ids pass unchanged: every rank
    computes every pair."""

    over = "tp"

    def __init__(self, inner: ExpertBackend, par: Parallel):
        super().__init__(inner, par, f"{inner.name}+columns{par.tp}")
