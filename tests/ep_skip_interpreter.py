"""Runs the CUDA expert paths on steps where some pairs carry the id -1 (experts/parallel/ep.NOT_MINE: another
rank's expert) in Triton's interpreter on the CPU. Run as a script (TRITON_INTERPRET must be set before
triton is imported); test_ep_skip.py does that in a subprocess. Checks:

  - bookkeeping (both kernels): the cache's state, slot ids and miss list equal those of the torch
    reference stepping only the step's other ids: a -1 pair takes no slot and counts nowhere; slot id
    -1 for it; the scratch restored;
  - the grouped GEMM (decode: one token and several; FP8 rows: the one-token GEMV and the grouped GEMM;
    the large-step path): the plan sorts the -1 pairs last and starts no chunk there, no program writes
    their h / y rows (poisoned with NaN first), slots, uva and resident bit-equal (a -1 pair's slot id
    is moot, so the slots run gives it slot 0), the output against the float64 oracle with the -1 pairs
    skipped, and bit-equal to the old workaround (the -1 pairs on an otherwise unused expert with
    weight 0: the other pairs' chunks and the k-sum order are the same, so the same numpy calls);
  - the backends' CUDA code paths (with CPU tensors standing in, as hybrid_interpreter.py does):
    slots, uva and resident bit-equal step after step, prefill (bypass and refresh) included, and the
    slot cache's counters and state equal to the CPU slots backend's on the same ids.
"""

from __future__ import annotations

import os
import sys

os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402

from moetier.checkpoint.random_bed import fill_4bit_rows  # noqa: E402
from moetier.experts.kernels import grouped_gemm as grouped  # noqa: E402
from moetier.experts.kernels import grouped_gemm_large as grouped_large  # noqa: E402
from moetier.experts.cache import slot_kernels as kernels  # noqa: E402
from moetier.experts.backends import ResidentExperts, SlotExperts, UvaExperts  # noqa: E402
from moetier.experts.kernels.gemm_config import GemmConfig  # noqa: E402
from moetier.experts.reference import combine, expert_pairs, row_fetch  # noqa: E402
from moetier.experts.shape import RowLayout  # noqa: E402
from moetier.experts.cache.slots import STATE, STEPS, SlotCache, policy_for  # noqa: E402
from tests.fp8_interpreter import fp8_rows  # noqa: E402

TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}
E, S = 16, 6  # experts E - 1 is never routed to: the old workaround's target in the bit-equality check
CPU = torch.device("cpu")
LARGE = GemmConfig(large_block_m=16, large_gate_up=(32, 32, 4), large_down=(32, 32, 4))


def routed(t: int, k: int, g: torch.Generator, frac: float = 0.4) -> torch.Tensor:
    """[t, k] distinct experts of 0..E-2 per token (tokens 0 and 1 alike: shared rows), about `frac` of
    the pairs -1, the first always."""
    ids = torch.stack([torch.randperm(E - 1, generator=g)[:k] for _ in range(t)])
    if t > 2:
        ids[1] = ids[0]
    skip = torch.rand(ids.shape, generator=g) < frac
    skip.view(-1)[0] = True
    return torch.where(skip, -1, ids)


def bookkeeping(policy: str, steps: int, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    pol = policy_for(policy, S, 4)
    ker, ref = SlotCache(E, S, policy=pol), SlotCache(E, S, policy=pol)
    scratch = kernels.BookkeepingScratch(E, S, 128, CPU)
    for step in range(steps):
        t = [1, 2, 5, 20][step % 4]  # 20 x 4 = 80 pairs take the barrier kernel, the others the register one
        ids = routed(t, 4, g) if step % 9 != 8 else torch.full((t, 4), -1)  # and steps of nothing but -1
        mine = ids >= 0
        got = kernels.bookkeeping(ker, scratch, ids).clone()
        assert bool((got[~mine] == -1).all()), (step, ids, got)
        if mine.any():
            want, miss = ref.step_reference(ids[mine].view(1, -1))  # the same step without the -1 pairs
            assert torch.equal(got[mine], want.view(-1)), (step, got, want)
            n = int(miss.count)
            assert torch.equal(scratch.miss_expert[:n], miss.expert[:n]) and torch.equal(scratch.miss_slot[:n], miss.slot[:n])
        else:  # a step of nothing: the clock and the step counter move, nothing else
            ref.clock += 1
            ref.stats[STEPS] += 1
            n = 0
        assert int(scratch.miss_count) == n, step
        for name in STATE:
            assert torch.equal(getattr(ref, name), getattr(ker, name)), (step, name)
        assert bool((scratch.first == kernels.BIG32).all()) and not scratch.used.any(), step  # scratch restored
        ker.check()
    return ker.read_stats()


def weights(layout: RowLayout, dtype: torch.dtype, g: torch.Generator) -> torch.Tensor:
    if layout.quant == "fp8":
        return fp8_rows(layout, E, g)
    if layout.packed4:  # each projection drawn in bf16 and quantized by the format's rule
        rows = torch.zeros(E, layout.numel, dtype=torch.uint8)
        fill_4bit_rows(rows, layout, g)
        return rows
    return (torch.randn(E, layout.numel, generator=g) * 0.1).to(dtype)


def gemm_case(t: int, k: int, h: int, i: int, dtype: torch.dtype, quant: str | None, large: bool, seed: int) -> str:
    g = torch.Generator().manual_seed(seed)
    layout = RowLayout(h, i, quant)
    rows = weights(layout, dtype, g)
    x = torch.randn(t, h, generator=g).to(dtype)
    w = torch.rand(t, k, generator=g).to(dtype)
    ids = routed(t, k, g)
    mine = ids >= 0
    cached = torch.randperm(E, generator=g)[: E // 2]
    slot_of = torch.full((E,), -1, dtype=torch.int32)
    slot_of[cached] = torch.randperm(E // 2, generator=g).int()
    poison = 0xFF if quant else float("nan")  # NaN in e4m3 and in the scales
    slots = torch.full((E // 2, layout.numel), poison).to(rows.dtype)
    slots[slot_of[cached].long()] = rows[cached]
    mixed = torch.where(mine, slot_of[ids.clamp(min=0)], 0)  # a -1 pair's slot id is moot: slot 0 here
    none = torch.full_like(ids, -1, dtype=torch.int32)
    nan_rows = torch.full((1, layout.numel), poison).to(rows.dtype)

    def run(slot_ids, topk, wt, dev_rows, max_rows, skips=True):
        if large:
            return grouped_large.grouped_expert_mlp_large(x, slot_ids, topk, wt, dev_rows, rows, h, i, max_rows,
                                                          LARGE, quant)
        scratch = grouped.GemmScratch.make(t * k, h, i, CPU)
        scratch.h.fill_(float("nan"))
        scratch.y.fill_(float("nan"))
        out = torch.full((t, h), float("nan"), dtype=dtype)
        grouped.grouped_expert_mlp(x, slot_ids, topk, wt, dev_rows, rows, h, i, scratch, out, GemmConfig(), quant)
        # no program wrote a -1 pair's rows: neither gate_up (h) nor down (y) worked for it
        skipped = (~mine).view(-1).nonzero().flatten()
        assert not skips or bool(scratch.y[skipped].isnan().all()) and bool(scratch.h[skipped].isnan().all())
        if t > 1:
            check_plan(scratch, slot_ids, topk)
        return out

    out_slots = run(mixed, ids, w, slots, E + E // 2)
    out_res = run(ids.int(), ids, w, rows, E)
    out_uva = run(none, ids, w, nan_rows, E)
    assert torch.equal(out_slots, out_res), f"slots vs resident {(out_slots - out_res).abs().max()}"
    assert torch.equal(out_uva, out_res), f"uva vs resident {(out_uva - out_res).abs().max()}"
    # the old workaround (experts/parallel/ep.py before): the -1 pairs on expert E - 1, weight 0. Its pairs make
    # chunks of their own, so the other pairs run the very same matmuls: the same bits.
    old_ids = torch.where(mine, ids, E - 1)
    old = run(old_ids.int(), old_ids, torch.where(mine, w, 0), rows, E, skips=False)
    assert torch.equal(old, out_res), f"old workaround vs skip {(old - out_res).abs().max()}"
    fetch = row_fetch(rows, layout, dtype)
    oracle = combine(expert_pairs(x.double(), ids, lambda key: tuple(p.double() for p in fetch(key))), w.double())
    err = ((out_res.double() - oracle).norm() / oracle.norm()).item()
    assert err <= TOL[dtype], (t, k, quant, large, err)
    if large:
        check_large_plan(mixed, ids, E + E // 2)
    path = ("large" if large else "decode") + (f" {quant}" if quant else "")
    return f"skip {path} t={t} k={k} {str(dtype)[6:]} skipped={int((~mine).sum())} err={err:.2e}"


def keys_of(slot_ids: torch.Tensor, ids: torch.Tensor, skip_key: int) -> torch.Tensor:
    s, e = slot_ids.reshape(-1).long(), ids.reshape(-1).long()
    return torch.where(e < 0, skip_key, torch.where(s >= 0, s, -1 - e))


def want_chunk_end(sorted_keys: torch.Tensor, block_m: int, skip_key: int) -> torch.Tensor:
    p = sorted_keys.numel()
    want, pos = torch.zeros(p, dtype=torch.int32), 0
    while pos < p:
        end = pos
        while end < p and sorted_keys[end] == sorted_keys[pos]:
            end += 1
        if sorted_keys[pos] != skip_key:  # the -1 pairs' run starts no chunk
            for c in range(pos, end, block_m):
                want[c] = min(c + block_m, end)
        pos = end
    return want


def check_plan(scratch, slot_ids, ids) -> None:
    keys = keys_of(slot_ids, ids, grouped.SKIP_KEY)
    order = torch.argsort(keys, stable=True)
    p = keys.numel()
    assert torch.equal(scratch.order[:p].long(), order), (scratch.order[:p], order)
    want = want_chunk_end(keys[order], grouped.BLOCK_M, grouped.SKIP_KEY)
    assert torch.equal(scratch.chunk_end[:p], want), (scratch.chunk_end[:p], want)


def check_large_plan(slot_ids, ids, max_rows) -> None:
    bm = LARGE.large_block_m
    order, chunk_end, starts = grouped_large.plan_large(slot_ids, ids, bm, max_rows)
    keys = keys_of(slot_ids, ids, max_rows)
    assert torch.equal(order.long(), torch.argsort(keys, stable=True))
    want = want_chunk_end(keys[order.long()], bm, max_rows)
    assert torch.equal(chunk_end, want), (chunk_end, want)
    listed = want.nonzero().flatten().int()
    assert torch.equal(starts[: listed.numel()], listed) and bool((starts[listed.numel():] == -1).all())


def as_cuda(b, h: int, i: int, pairs: int):
    """Turn a CPU-built backend onto its CUDA code path, with CPU tensors standing in for device ones."""
    b.cuda, b._out = True, None
    b._work = grouped.GemmScratch.make(pairs, h, i, CPU)
    if isinstance(b, (SlotExperts, UvaExperts)):
        b._host_dev = b.host  # the interpreter reads CPU tensors (a DevicePointer is for the device)
    if isinstance(b, SlotExperts):
        b._scratch = kernels.BookkeepingScratch(E, b.cache.num_slots, max(pairs, b.cache.num_slots), CPU)
        b._copy_programs = 4
    if isinstance(b, UvaExperts):
        b._none = torch.full((pairs,), -1, dtype=torch.int32)
        b._no_rows = torch.zeros(1, b.layout.numel, dtype=b.host.dtype)
    return b


def backends_case(dtype: torch.dtype, quant: str | None, prefill: str, seed: int) -> str:
    g = torch.Generator().manual_seed(seed)
    h, i, k, n = 64, 40, 4, 8  # n: decode tokens; 20-token steps take the large path
    layout = RowLayout(h, i, quant)
    rows = weights(layout, dtype, g)
    cuda = {"resident": as_cuda(ResidentExperts(rows, layout, k, n), h, i, n * k),
            "uva": as_cuda(UvaExperts(rows, layout, k, n), h, i, n * k),
            "slots": as_cuda(SlotExperts(rows, layout, k, S, n, prefill=prefill), h, i, n * k)}
    cpu_slots, cpu_res = SlotExperts(rows, layout, k, S, n, prefill=prefill), ResidentExperts(rows, layout, k, n)
    for step in range(8):
        t = (1, 5, 20, 3)[step % 4]
        ids = routed(t, k, g)
        x = torch.randn(t, h, generator=g).to(dtype)
        w = torch.rand(t, k, generator=g).to(dtype)
        outs = {name: b.forward(x, ids, w).clone() for name, b in cuda.items()}
        assert torch.equal(outs["slots"], outs["resident"]) and torch.equal(outs["uva"], outs["resident"]), step
        want = cpu_res.forward(x, ids, w).double()
        if want.any():
            err = ((outs["resident"].double() - want).norm() / want.norm()).item()
            assert err <= TOL[dtype], (step, err)
        else:  # every pair another rank's: exactly zero
            assert not outs["resident"].any(), step
        cpu_slots.forward(x, ids, w)
        for name in STATE:  # the device bookkeeping (and refresh) did what the reference does with -1 ids
            assert torch.equal(getattr(cuda["slots"].cache, name), getattr(cpu_slots.cache, name)), (step, name)
        cuda["slots"].cache.check()
        held = cuda["slots"].cache.slot_expert
        assert bool((cuda["slots"].slots[held >= 0] == rows[held[held >= 0].long()]).all())
    st = cuda["slots"].stats()
    assert st == cpu_slots.stats() and st["hits"] > 0 and st["misses"] > 0, (st, cpu_slots.stats())
    return f"skip backends {str(dtype)[6:]} {quant or 'plain'} prefill={prefill} {st}"


GEMM_CASES = [  # (t, k, h, i, quant, large)
    (1, 8, 72, 40, None, False),
    (5, 4, 72, 40, None, False),
    (16, 8, 64, 32, None, False),
    (1, 4, 200, 136, "fp8", False),  # the one-token FP8 GEMV
    (5, 2, 64, 40, "fp8", False),
    (1, 4, 200, 136, "nvfp4", False),  # the one-token 4-bit GEMV
    (40, 4, 72, 40, None, True),
    (20, 3, 64, 40, "fp8", True),
]

if __name__ == "__main__":
    for policy in ("lru", "lfru"):
        print("skip bookkeeping", policy, bookkeeping(policy, steps=72, seed=len(policy)), flush=True)
    for n, (t, k, h, i, quant, large) in enumerate(GEMM_CASES):
        for dtype in (torch.float32, torch.bfloat16):
            print(gemm_case(t, k, h, i, dtype, quant, large, seed=n), flush=True)
    print(backends_case(torch.bfloat16, None, "bypass", seed=1), flush=True)
    print(backends_case(torch.float32, None, "refresh", seed=2), flush=True)
    print(backends_case(torch.bfloat16, "fp8", "refresh", seed=3), flush=True)
    sys.exit(0)
