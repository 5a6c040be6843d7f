"""Runs the grouped expert GEMM (moetier/experts/grouped.py) in Triton's interpreter on the CPU.

Run as a script (TRITON_INTERPRET must be set before triton is imported); test_grouped.py does that in a
subprocess. Every case checks the plan against a stable argsort, the output against a float64 oracle,
bit-equality of slot rows vs host rows vs the resident layout, and that a subset of the step's tokens
gets its outputs within rounding of the whole step's.

What the interpreter can promise: its tl.dot is numpy's matmul, i.e. OpenBLAS, whose result for a row
of a [BLOCK_M, K] tile depends on the row's position in the tile under some kernels (Haswell and Zen
do; SkylakeX and Sandybridge do not). So bit-equality holds here only where the launches are literally
the same: slots vs host vs resident make the same chunks, the same pairs at the same tile rows, over
the same bytes (checked below). A token alone or in another batch sits at other tile rows, so "a
token gets the same bits whatever shares its step" cannot be shown here; tests/test_gpu.py holds the
compiled kernel to it bit for bit, and here it is held to the oracle and to the full step's values
within rounding.
"""

from __future__ import annotations

import os
import sys

os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402

from moetier.experts.kernels import grouped_gemm as grouped  # noqa: E402
from moetier.experts.kernels import grouped_gemm_large as grouped_large  # noqa: E402
from moetier.experts.reference import combine, expert_pairs, row_fetch  # noqa: E402
from moetier.experts.shape import RowLayout  # noqa: E402

TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}
# subset vs full step, per element, relative to the largest output. Only the order of the fp32 sums
# in a tl.dot differs: for K <= 72 terms that moves a result by at most about K * 2**-24 of their
# magnitude (4e-6; up to 2.7e-7 seen under OpenBLAS Haswell/Zen). bf16 rounds h and the output to 8
# bits, so a flipped rounding shows as an ulp of the largest value (2**-8); two are allowed.
BATCH_ATOL = {torch.float32: 4e-6, torch.bfloat16: 2**-7}


def check_plan(scratch: grouped.GemmScratch, slot_ids: torch.Tensor, ids: torch.Tensor) -> list[tuple[int, ...]]:
    """order == a stable argsort of the row keys; chunk_end marks every BLOCK_M-th pair of each group.
    -> the chunks, each the pair ids at its tile rows in order."""
    p = ids.numel()
    if ids.shape[0] == 1:  # one-token steps skip the plan: a chunk per pair (grouped.GemmScratch.one_order)
        return [(j,) for j in range(p)]
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
    return [tuple(order[c:int(want[c])].tolist()) for c in range(p) if want[c] > 0]


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
    res_chunks = check_plan(scratch, ids.int(), ids)
    none = torch.full_like(ids, -1, dtype=torch.int32)
    out_uva = run(x, none, ids, w, torch.zeros(1, layout.numel, dtype=dtype), rows, layout, scratch).clone()
    uva_chunks = check_plan(scratch, none, ids)
    # NOTE: the three backends group by expert alike (a key per expert), so every chunk holds the same
    # pairs at the same tile rows over the same bytes: the same numpy calls, bit-equal under any BLAS.
    assert sorted(chunks) == sorted(res_chunks) == sorted(uva_chunks), (chunks, res_chunks, uva_chunks)
    assert torch.equal(out_slots, out_res), f"slots vs resident: {(out_slots - out_res).abs().max()}"
    assert torch.equal(out_uva, out_res), f"uva vs resident: {(out_uva - out_res).abs().max()}"

    oracle = combine(expert_pairs(x.double(), ids, row_fetch(rows.double(), layout)), w.double())
    err = ((out_res.double() - oracle).norm() / oracle.norm()).item()
    assert err <= TOL[dtype], (t, k, h, i, dtype, ids_kind, err)

    # a subset of the tokens, in another order: its own plan, the oracle's values, and the full step's
    # within rounding. NOTE: not bit-equal here: its pairs sit at other tile rows (see the docstring).
    if t > 1:
        perm = torch.randperm(t, generator=g)[: max(1, t // 2)]
        sub = run(x[perm], mixed[perm], ids[perm], w[perm], slots, rows, layout, scratch)
        check_plan(scratch, mixed[perm], ids[perm])
        sub_oracle = oracle[perm]
        sub_err = ((sub.double() - sub_oracle).norm() / sub_oracle.norm()).item()
        assert sub_err <= TOL[dtype], (t, k, h, i, dtype, ids_kind, "subset", sub_err)
        torch.testing.assert_close(sub.float(), out_res[perm].float(), rtol=0,
                                   atol=BATCH_ATOL[dtype] * out_res.float().abs().max().item())
    return f"grouped t={t} k={k} h={h} i={i} {str(dtype)[6:]} {ids_kind} chunks={len(chunks)} err={err:.2e}"


def case_large(t: int, k: int, h: int, i: int, dtype: torch.dtype, ids_kind: str, block_m: int, seed: int,
               dense: bool = False) -> str:
    """The large-step path (grouped_expert_mlp_large): its sorted plan, bit-equality of slots, host and
    resident rows (the same chunks again), the oracle, and the decode path's values within rounding.
    dense: the step counts as dense in pairs (GemmConfig.large_blocks), its block_m from those fields."""
    from moetier.experts.kernels.gemm_config import GemmConfig

    g = torch.Generator().manual_seed(seed)
    e = 16
    layout = RowLayout(h, i)
    rows = (torch.randn(e, layout.numel, generator=g) * 0.1).to(dtype)
    x = torch.randn(t, h, generator=g).to(dtype)
    w = torch.rand(t, k, generator=g).to(dtype)
    ids = (torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)]) if ids_kind == "distinct"
           else torch.randint(0, 3, (t, k), generator=g))  # "dup": groups far longer than a chunk
    cfg = GemmConfig(large_block_m=block_m, large_gate_up=(32, 32, 4), large_down=(32, 32, 4))
    if dense:  # the sparse fields at other blocks, so that the selection check below tells them apart
        cfg = GemmConfig(large_block_m=block_m // 2, large_gate_up=(16, 16, 4), large_down=(16, 16, 4),
                         large_dense_pairs=t * k, large_dense_block_m=block_m, large_dense_gate_up=(32, 32, 4),
                         large_dense_down=(32, 32, 4))
    assert cfg.large_blocks(t * k)[0] == block_m and cfg.large_blocks(t * k - 1)[0] == (block_m // 2 if dense else block_m)
    cached = torch.randperm(e, generator=g)[: e // 2]
    slot_of = torch.full((e,), -1, dtype=torch.int32)
    slot_of[cached] = torch.randperm(e // 2, generator=g).int()
    slots = torch.full((e // 2, layout.numel), float("nan")).to(dtype)
    slots[slot_of[cached].long()] = rows[cached]
    mixed = slot_of[ids]

    def large(slot_ids, dev_rows, max_rows):
        return grouped_large.grouped_expert_mlp_large(x, slot_ids, ids, w, dev_rows, rows, h, i, max_rows, cfg)

    # the plan: a stable sort by row key, chunks of block_m within each row's run, their starts listed
    order, chunk_end, starts = grouped_large.plan_large(mixed, ids, block_m, e + e // 2)
    keys = torch.where(mixed.reshape(-1) >= 0, mixed.reshape(-1).long(), -1 - ids.reshape(-1))
    assert torch.equal(order.long(), torch.argsort(keys, stable=True))
    sk, want, pos = keys[order.long()], torch.zeros(t * k, dtype=torch.int32), 0
    while pos < t * k:
        end = pos
        while end < t * k and sk[end] == sk[pos]:
            end += 1
        for c in range(pos, end, block_m):
            want[c] = min(c + block_m, end)
        pos = end
    assert torch.equal(chunk_end, want), (chunk_end, want)
    listed = want.nonzero().flatten().int()
    assert torch.equal(starts[: listed.numel()], listed) and bool((starts[listed.numel():] == -1).all())

    out_slots = large(mixed, slots, e + e // 2)
    out_res = large(ids.int(), rows, e)
    out_uva = large(torch.full_like(ids, -1, dtype=torch.int32), torch.zeros(1, layout.numel, dtype=dtype), e)
    assert torch.equal(out_slots, out_res), f"slots vs resident: {(out_slots - out_res).abs().max()}"
    assert torch.equal(out_uva, out_res), f"uva vs resident: {(out_uva - out_res).abs().max()}"
    oracle = combine(expert_pairs(x.double(), ids, row_fetch(rows.double(), layout)), w.double())
    err = ((out_res.double() - oracle).norm() / oracle.norm()).item()
    assert err <= TOL[dtype], (t, k, h, i, dtype, ids_kind, block_m, err)
    if t * k <= 64 * 8:  # the decode path computes the same function: equal within rounding
        small = run(x, ids.int(), ids, w, rows, rows, layout, grouped.GemmScratch.make(64 * 8, h, i, torch.device("cpu")))
        torch.testing.assert_close(out_res.float(), small.float(), rtol=0,
                                   atol=BATCH_ATOL[dtype] * small.float().abs().max().item())
    return (f"large t={t} k={k} h={h} i={i} {str(dtype)[6:]} {ids_kind} block_m={block_m}{' dense' if dense else ''} "
            f"chunks={listed.numel()} err={err:.2e}")


LARGE_CASES = [  # (t, k, h, i, ids, block_m, dense)
    (40, 4, 72, 40, "distinct", 16, False),
    (96, 2, 64, 32, "dup", 16, False),
    (70, 8, 72, 40, "dup", 64, False),
    (48, 4, 64, 32, "dup", 32, True),
]

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
    for n, (t, k, h, i, kind, bm, dense) in enumerate(LARGE_CASES):
        for dtype in (torch.float32, torch.bfloat16):
            print(case_large(t, k, h, i, dtype, kind, bm, seed=100 + n, dense=dense), flush=True)
    sys.exit(0)
