"""The split of a MoE layer's experts into pinned (on the GPU for good, no host copy) and cached (in the
host store, served by the slot cache and, with hybrid, by the host cores).

Where each kind lives (one layer, E local experts, P pinned, S slots, rows of R elements):

    device block [S + P, R]   slots 0..S-1, then pinned[j] at row S + j (pinned ascending)
    host block   [E, R]       a virtual block: only the cached experts' rows are backed by memory

The device-side expert -> row map (slots.SlotCache.expert_slot) marks every pinned expert as present
at its row after the slots, permanently, so the bookkeeping kernel finds it a hit, the GEMMs read it
as they read a slot, and a miss is always a cached expert. Why this design rather than translating ids
around the cache: the router's ids reach every path unchanged (decode, the large-step GEMM, the ring,
the refresh policy, hybrid's host share, expert parallelism's local ids), host row e is still expert
e, and one map answers "where is it" for all of them.

The host block is one anonymous mapping of E rows whose pinned rows are never written: untouched
anonymous pages cost no memory (Linux maps them on first write), so the host holds exactly the cached
rows, page rounding aside. Only the backed ranges are pinned (cudaHostRegister), so nothing may read a
pinned expert's host row on the GPU: the map above never sends it there.

Pinned sets come from a file (write_pinned_file / read_pinned_file: {"pinned": {"layer": [ids]}}),
from a routing trace (traces/split_plan.py), or default to experts 0..P-1 (plan/split.py says why).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from moetier.errors import MoetierError


def check_pinned(pinned: tuple[int, ...], num_experts: int, num_slots: int) -> list[str]:
    """What is wrong with one layer's pinned set for E experts and S slots, one line each."""
    out = []
    if len(set(pinned)) != len(pinned):
        out.append(f"pinned experts {list(pinned)} repeat an id")
    bad = [e for e in pinned if not 0 <= e < num_experts]
    if bad:
        out.append(f"pinned experts {bad} are outside 0..{num_experts - 1}")
    if len(set(pinned)) >= num_experts:
        out.append(f"all {num_experts} experts pinned: that is the resident backend")
    elif num_slots > num_experts - len(set(pinned)):
        out.append(f"{num_slots} slots for the {num_experts - len(set(pinned))} cached experts: give at most that")
    return out


def cached_ids(num_experts: int, pinned: tuple[int, ...]) -> list[int]:
    """The experts the host store holds, ascending."""
    held = set(pinned)
    return [e for e in range(num_experts) if e not in held]


def runs(ids: list[int]) -> list[tuple[int, int]]:
    """Ascending ids -> maximal [start, end) runs of consecutive ids."""
    out: list[tuple[int, int]] = []
    for e in ids:
        if out and out[-1][1] == e:
            out[-1] = (out[-1][0], e + 1)
        else:
            out.append((e, e + 1))
    return out


def backed_ranges(num_experts: int, pinned: tuple[int, ...], row_bytes: int, page: int) -> list[tuple[int, int]]:
    """Byte ranges [start, end) of a host block to back and pin: every cached row, rounded out to whole
    pages, ranges that touch merged (a page is registered once). Covers every cached byte; a pinned row
    is backed only where it shares a page with a cached one. The block's first page is always backed:
    kernels take the block's base address, and CUDA (Triton's launcher checks every pointer argument)
    accepts only an address inside registered memory, even one no thread reads."""
    out: list[tuple[int, int]] = [(0, page)]
    for a, b in runs(cached_ids(num_experts, pinned)):
        lo, hi = a * row_bytes // page * page, -(-b * row_bytes // page) * page
        if out and lo <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], hi))
        else:
            out.append((lo, hi))
    return out


def cached_run(rows: torch.Tensor, pinned: tuple[int, ...]) -> torch.Tensor:
    """The longest run of consecutive cached rows of a host block [E, R], as a view (rows whole when
    nothing is pinned): what may be read in bulk, e.g. to time the link."""
    if not pinned:
        return rows
    got = max(runs(cached_ids(rows.shape[0], pinned)), key=lambda r: r[1] - r[0])
    return rows[got[0]:got[1]]


def pinned_split(num_experts: int, pinned: tuple[int, ...], device: torch.device | str = "cpu"
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Device index tensors of one layer: (pinned ids [P], cached ids [E - P]), long, ascending."""
    p = sorted(pinned)
    return (torch.tensor(p, dtype=torch.long, device=device),
            torch.tensor(cached_ids(num_experts, tuple(p)), dtype=torch.long, device=device))


def local_pinned(pinned: tuple[int, ...], ep_rank: int, ep: int) -> tuple[int, ...]:
    """Global pinned ids -> this expert-parallel rank's local ids (experts/parallel/ep.py: e % ep owns)."""
    return tuple(sorted(e // ep for e in pinned if e % ep == ep_rank))


def write_pinned_file(path: str | Path, pinned: dict[int, tuple[int, ...]], meta: dict | None = None,
                      slots: dict[int, int] | None = None) -> None:
    """slots: the plan's slots per layer beside them (then the file is a slots file too:
    placement.read_slots_file reads it)."""
    data = {"pinned": {str(layer): sorted(int(e) for e in ids) for layer, ids in sorted(pinned.items())}}
    if slots:
        data["slots"] = {str(layer): int(s) for layer, s in sorted(slots.items())}
    if meta:
        data["meta"] = meta
    Path(path).write_text(json.dumps(data, indent=1) + "\n")


def read_pinned_file(path: str | Path) -> dict[int, tuple[int, ...]]:
    """Pinned experts per MoE layer (global ids) from a pinned file: {"pinned": {"layer": [ids]}}."""
    try:
        data = json.loads(Path(path).read_text())
        got = {int(layer): tuple(sorted(int(e) for e in ids)) for layer, ids in data["pinned"].items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise MoetierError(f"--pinned-experts-file {path}: not a pinned file ({e}); make one with "
                           "`moetier plan --trace ... --pinned-out FILE`") from None
    return got
