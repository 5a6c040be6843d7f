"""Runs the grouped expert GEMM (moetier/experts/grouped.py) in Triton's interpreter on the CPU.

Run as a script (TRITON_INTERPRET must be set before triton is imported); test_grouped.py does that in a
subprocess. Every case checks the plan against a stable argsort, the output against a float64 oracle,
and bit-equality of slot rows vs host rows vs the resident layout, and of a token's output whatever
other tokens share its step.
"""

from __future__ import annotations

import os
import sys

os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402

from moetier.experts import grouped_gemm as grouped  # noqa: E402
from moetier.experts.reference import combine, expert_pairs, row_fetch  # noqa: E402
from moetier.experts.shape import RowLayout  # noqa: E402

TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


def check_plan(scratch: grouped.GemmScratch, slot_ids: torch.Tensor, ids: torch.Tensor) -> int:
    # order == a stable argsort of the row keys; chunk_end marks every BLOCK_M-th pair of each group
    p = ids.numel()
    if ids.shape[0] == 1:  # one-token steps skip the plan: a chunk per pair (grouped.GemmScratch.one_order)
        return p
    keys = torch.where(slot_ids.reshape(-1) >= 0, slot_ids.reshape(-1).long(), -1 - ids.reshape(-1))
    order = torch.argsort(keys, stable=True)
    assert torch.equal(scratch.order[:p].long(), order), (scratch.order[:p], order)
    sk = keys[order]
    want = torch.zeros(p, dtype=torch.int32)
    pos = 0
    while pos < p:
        group_end = pos
        while group_end < p and sk[group_end] == sk[pos]:
            group_end += 1
        for c in range(pos, group_end, grouped.BLOCK_M):
            want[c] = min(c + grouped.BLOCK_M, group_end)
        pos = group_end
    assert torch.equal(scratch.chunk_end[:p], want), (scratch.chunk_end[:p], want)
    return int((want > 0).sum())


def run(x, slot_ids, ids, w, dev_rows, host_rows, layout, scratch) -> torch.Tensor:
    out = torch.full((x.shape[0], layout.hidden), float("nan"), dtype=x.dtype)
    return grouped.grouped_expert_mlp(x, slot_ids, ids, w, dev_rows, host_rows, layout.hidden, layout.inter,
                                      scratch, out)


def case(t: int, k: int, h: int, i: int, dtype: torch.dtype, ids_kind: str, seed: int) -> str:
    g = torch.Generator().manual_seed(seed)
    e = 16
    layout = RowLayout(h, i)
    rows = (torch.randn(e, layout.numel, generator=g) * 0.1).to(dtype)
    x = torch.randn(t, h, generator=g).to(dtype)
    w = torch.rand(t, k, generator=g).to(dtype)
    if ids_kind == "distinct":  # distinct experts per token, shared across tokens
        ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
    elif ids_kind == "dup":  # few experts: duplicates across and within tokens
        ids = torch.randint(0, 3, (t, k), generator=g)
    else:  # "one": every pair on expert 5, a group of t*k pairs
        ids = torch.full((t, k), 5)
    scratch = grouped.GemmScratch.make(64 * 8, h, i, torch.device("cpu"))

    # slots: a random half of the experts cached in shuffled slots, the rest read from the host rows
    cached = torch.randperm(e, generator=g)[: e // 2]
    slot_of = torch.full((e,), -1, dtype=torch.int32)
    slot_of[cached] = torch.randperm(e // 2, generator=g).int()
    slots = torch.full((e // 2, layout.numel), float("nan")).to(dtype)
    slots[slot_of[cached].long()] = rows[cached]
    mixed = slot_of[ids]
    out_slots = run(x, mixed, ids, w, slots, rows, layout, scratch).clone()
    chunks = check_plan(scratch, mixed, ids)
    out_res = run(x, ids.int(), ids, w, rows, rows, layout, scratch).clone()
    check_plan(scratch, ids.int(), ids)
    none = torch.full_like(ids, -1, dtype=torch.int32)
    out_uva = run(x, none, ids, w, torch.zeros(1, layout.numel, dtype=dtype), rows, layout, scratch).clone()
    check_plan(scratch, none, ids)
    assert torch.equal(out_slots, out_res), f"slots vs resident: {(out_slots - out_res).abs().max()}"
    assert torch.equal(out_uva, out_res), f"uva vs resident: {(out_uva - out_res).abs().max()}"

    oracle = combine(expert_pairs(x.double(), ids, row_fetch(rows.double(), layout)), w.double())
    err = ((out_res.double() - oracle).norm() / oracle.norm()).item()
    assert err <= TOL[dtype], (t, k, h, i, dtype, ids_kind, err)

    # a token's output does not depend on the other tokens of its step (chunk-mates, positions)
    if t > 1:
        perm = torch.randperm(t, generator=g)[: max(1, t // 2)]
        sub = run(x[perm], mixed[perm], ids[perm], w[perm], slots, rows, layout, scratch)
        assert torch.equal(sub, out_res[perm]), f"subset differs: {(sub - out_res[perm]).abs().max()}"
    return f"grouped t={t} k={k} h={h} i={i} {str(dtype)[6:]} {ids_kind} chunks={chunks} err={err:.2e}"


CASES = [  # (t, k, h, i, ids)
    (1, 8, 72, 40, "distinct"),
    (2, 2, 72, 40, "distinct"),
    (5, 4, 72, 40, "dup"),
    (16, 8, 64, 32, "distinct"),
    (16, 4, 72, 40, "one"),
    (64, 8, 64, 32, "distinct"),
    (64, 2, 72, 40, "dup"),
    (64, 8, 72, 40, "one"),
]

if __name__ == "__main__":
    for n, (t, k, h, i, kind) in enumerate(CASES):
        for dtype in (torch.float32, torch.bfloat16):
            print(case(t, k, h, i, dtype, kind, seed=n), flush=True)
    sys.exit(0)
