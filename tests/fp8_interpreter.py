"""Runs the grouped expert GEMM on FP8 rows (grouped_gemm.py with FP8 set) in Triton's interpreter on
the CPU. Run as a script (TRITON_INTERPRET must be set before triton is imported); test_fp8.py does
that in a subprocess. Every case checks, for the decode and the large-step path:

  - slots, uva and resident bit-equal (the same chunks over the same row bytes: see
    grouped_interpreter.py for why only that is promised under the interpreter's BLAS);
  - the output against a float64 oracle over the dequantized weights (fp8.dequantize into the
    compute dtype, widened): fp32 1e-5, bf16 1e-2 relative;
  - the output against the CPU backend (the torch path every CPU backend runs: the row dequantized
    into the hidden dtype, then F.linear) within the same bf16 / fp32 bounds.
Shapes are ragged on purpose: hidden 200 = 128 + 72 and inter 136 = 128 + 8, so K tiles cross from
one scale column to the next and N blocks from one scale row to the next.
"""

from __future__ import annotations

import os
import sys

os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402

from moetier.experts.kernels import grouped_gemm as grouped  # noqa: E402
from moetier.experts.kernels import grouped_gemm_large as grouped_large  # noqa: E402
from moetier.experts.backends import ResidentExperts  # noqa: E402
from moetier.experts.kernels.gemm_config import GemmConfig  # noqa: E402
from moetier.experts.reference import combine, expert_pairs, row_fetch  # noqa: E402
from moetier.experts.shape import RowLayout  # noqa: E402
from moetier.quant import fp8_block as fp8  # noqa: E402

TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}
LARGE = GemmConfig(large_block_m=16, large_gate_up=(32, 32, 4), large_down=(32, 32, 4))
# K tiles of 256: one tile spans two scale columns (hidden 200 = 128 + 72; inter 136 = 128 + 8)
WIDE = GemmConfig(gate_up=(16, 256, 4), down=(16, 256, 4), large_block_m=16, large_gate_up=(16, 256, 4),
                  large_down=(16, 256, 4))


def fp8_rows(layout: RowLayout, e: int, g: torch.Generator) -> torch.Tensor:
    rows = torch.zeros(e, layout.numel, dtype=torch.uint8)
    h, i = layout.hidden, layout.inter
    for part, shape in (("gate", (i, h)), ("up", (i, h)), ("down", (h, i))):
        w = torch.randn(e, *shape, generator=g) * 0.1
        w[:, :, :min(64, shape[1])] *= 8.0  # blocks of different magnitude: every scale matters
        q, s = fp8.quantize(w)
        layout.part(rows, part).copy_(q)
        layout.part(rows, part + "_scale").copy_(s)
    return rows


def check(name, out_slots, out_res, out_uva, x, ids, w, rows, layout, dtype, limit=None) -> float:
    # limit: the rows' SwiGLU clamp (layout.swiglu_limit; tests/quant4_interpreter.py clamps some cases)
    assert torch.equal(out_slots, out_res), f"{name}: slots vs resident {(out_slots - out_res).abs().max()}"
    assert torch.equal(out_uva, out_res), f"{name}: uva vs resident {(out_uva - out_res).abs().max()}"
    # the oracle's weights are the reference model's: dequantized into the compute dtype (the kernel
    # rounds fp32(q) * scale to it once, as fp8.dequantize does), then every product in float64
    fetch = row_fetch(rows, layout, dtype)
    oracle = combine(expert_pairs(x.double(), ids, lambda key: tuple(p.double() for p in fetch(key)), limit),
                     w.double())
    err = ((out_res.double() - oracle).norm() / oracle.norm()).item()
    assert err <= TOL[dtype], (name, err)
    torch_path = ResidentExperts(rows, layout, ids.shape[1]).forward(x, ids, w)  # the CPU backend
    err_torch = ((out_res.double() - torch_path.double()).norm() / torch_path.double().norm()).item()
    assert err_torch <= TOL[dtype], (name, "vs torch", err_torch)
    return err


def inputs(layout: RowLayout, rows: torch.Tensor, t: int, k: int, h: int, dtype: torch.dtype, g: torch.Generator):
    """-> (x [t, h], w [t, k], ids [t, k], slots, slot ids of a mixed placement, all-host slot ids, a
    poisoned dummy slot): half the experts cached in shuffled slots; slots not holding one, and the
    dummy, are 0xFF bytes (NaN in e4m3 and in float32 scales)."""
    e = rows.shape[0]
    x = torch.randn(t, h, generator=g).to(dtype)
    w = torch.rand(t, k, generator=g).to(dtype)
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
    if t > 2:
        ids[1] = ids[0]  # a shared row: a chunk of several pairs
    cached = torch.randperm(e, generator=g)[: e // 2]
    slot_of = torch.full((e,), -1, dtype=torch.int32)
    slot_of[cached] = torch.randperm(e // 2, generator=g).int()
    slots = torch.full((e // 2, layout.numel), 0xFF, dtype=torch.uint8)
    slots[slot_of[cached].long()] = rows[cached]
    dummy = torch.full((1, layout.numel), 0xFF, dtype=torch.uint8)
    return x, w, ids, slots, slot_of[ids], torch.full_like(ids, -1, dtype=torch.int32), dummy


def case(t: int, k: int, h: int, i: int, dtype: torch.dtype, seed: int, large: bool, wide: bool = False) -> str:
    g = torch.Generator().manual_seed(seed)
    e = 8
    layout = RowLayout(h, i, "fp8")
    rows = fp8_rows(layout, e, g)
    x, w, ids, slots, mixed, none, dummy = inputs(layout, rows, t, k, h, dtype, g)

    def run(slot_ids, dev_rows, max_rows):
        if large:
            return grouped_large.grouped_expert_mlp_large(x, slot_ids, ids, w, dev_rows, rows, h, i, max_rows,
                                                    WIDE if wide else LARGE, "fp8")
        scratch = grouped.GemmScratch.make(64, h, i, torch.device("cpu"))
        out = torch.full((t, h), float("nan"), dtype=dtype)
        return grouped.grouped_expert_mlp(x, slot_ids, ids, w, dev_rows, rows, h, i, scratch, out,
                                          WIDE if wide else GemmConfig(), "fp8").clone()

    out_slots = run(mixed, slots, e + e // 2)
    out_res = run(ids.int(), rows, e)
    out_uva = run(none, dummy, e)
    path = ("large" if large else "decode") + (" wide-k" if wide else "")
    err = check(path, out_slots, out_res, out_uva, x, ids, w, rows, layout, dtype)
    return f"fp8 {path} t={t} k={k} h={h} i={i} {str(dtype)[6:]} err={err:.2e}"


def copies_fp8_rows() -> str:
    """The fill kernel moves FP8 rows (as 2-byte words) byte for byte, scales included."""
    from moetier.experts.cache.slot_kernels import BookkeepingScratch, copy_rows

    layout = RowLayout(200, 72, "fp8")
    rows = fp8_rows(layout, 6, torch.Generator().manual_seed(9))
    slots = torch.zeros(4, layout.numel, dtype=torch.uint8)
    sc = BookkeepingScratch(6, 4, 8, torch.device("cpu"))
    sc.miss_expert[:3] = torch.tensor([5, 0, 3], dtype=torch.int32)
    sc.miss_slot[:3] = torch.tensor([2, 0, 3], dtype=torch.int32)
    sc.miss_count.fill_(3)
    copy_rows(rows, slots, sc, programs=3, block=4096)
    assert torch.equal(slots[[2, 0, 3]], rows[[5, 0, 3]]) and not slots[1].any()
    return "fp8 rows copied"


def refuses_unaligned_k() -> str:
    try:
        grouped.fp8_args(64, 64, "fp8", (96, 128))
    except ValueError as e:
        assert "BLOCK_K dividing or a multiple of 128" in str(e)
        return "fp8 refuses BLOCK_K 96"
    raise AssertionError("BLOCK_K 96 was accepted for FP8 rows")


CASES = [  # (t, k, h, i)
    (1, 4, 200, 136),
    (1, 3, 64, 40),  # one token (fp8_gemv.py), K shorter than a tile
    (5, 2, 200, 136),
    (3, 3, 64, 40),
]

if __name__ == "__main__":
    for n, (t, k, h, i) in enumerate(CASES):
        for dtype in (torch.float32, torch.bfloat16):
            print(case(t, k, h, i, dtype, seed=n, large=False), flush=True)
            print(case(t, k, h, i, dtype, seed=50 + n, large=True), flush=True)
    for large in (False, True):
        for dtype in (torch.float32, torch.bfloat16):
            print(case(5, 2, 200, 136, dtype, seed=90, large=large, wide=True), flush=True)
    print(copies_fp8_rows(), flush=True)
    print(refuses_unaligned_k(), flush=True)
    sys.exit(0)
