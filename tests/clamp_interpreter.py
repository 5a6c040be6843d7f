"""The clamped SwiGLU (swiglu_limit) in every Triton expert kernel, in Triton's interpreter on the CPU.
Run as a script (TRITON_INTERPRET must be set before triton is imported); test_swiglu_clamp.py does that
in a subprocess. Every case, with a limit small enough that a large share of the gate / up values lie
beyond it (checked, so the clamp is exercised):

  - the kernel's output within float tolerance of the torch reference (reference.expert_pairs) with the
    same limit, in float64 over the same weights, and clearly away from the unclamped reference (so a
    kernel that ignored the limit would fail);
  - with no limit: within tolerance of the unclamped reference, and bit-equal to a limit so large that it
    clamps nothing (the launch differs only by the clamp's min / max, so the bits must agree);
  - slots vs resident rows bit-equal under the limit (the same chunks over the same bytes).

Kernels: the decode grouped GEMM (several tokens), the large-step grouped GEMM (prefill), the prefill
ring (its passes on the large-step kernels), and on FP8 rows the one-token GEMV and the grouped GEMM.
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402

from moetier.experts.kernels import grouped_gemm as grouped  # noqa: E402
from moetier.experts.kernels.gemm_config import GemmConfig  # noqa: E402
from moetier.experts.kernels.grouped_gemm_large import grouped_expert_mlp_large  # noqa: E402
from moetier.experts.prefill.ring import StagingRing, ring_large  # noqa: E402
from moetier.experts.reference import combine, expert_pairs, row_fetch  # noqa: E402
from moetier.experts.shape import RowLayout  # noqa: E402
from tests.fp8_interpreter import fp8_rows  # noqa: E402

E, K, H, I = 12, 3, 64, 48
LIMIT = 0.3  # the gate_up values here have a std of about 0.8: most lie beyond it
HUGE = 1e30  # clamps nothing
LARGE = GemmConfig(large_block_m=16, large_gate_up=(32, 32, 4), large_down=(32, 32, 4))
TOL = 1e-5  # float32, relative to the norm (DESIGN.md)


def oracle(x, ids, w, rows, layout, limit):
    fetch = row_fetch(rows, layout, torch.float32)
    return combine(expert_pairs(x.double(), ids, lambda key: tuple(p.double() for p in fetch(key)), limit), w.double())


def clamped_share(x, ids, rows, layout) -> float:
    """The share of the step's gate / up values beyond LIMIT (the clamp's work)."""
    fetch = row_fetch(rows, layout, torch.float32)
    v = torch.cat([x[t] @ fetch(int(e))[0].T for t in range(ids.shape[0]) for e in ids[t].tolist()])
    return (v.abs() > LIMIT).float().mean().item()


def rel(a, b) -> float:
    return ((a.double() - b).norm() / b.norm()).item()


def check(name, run, x, ids, w, rows, layout) -> str:
    """run(limit) -> the kernel's [T, H] output over these inputs."""
    share = clamped_share(x, ids, rows, layout)
    assert share > 0.3, (name, "the limit clamps too little to test", share)
    got, plain, huge = run(LIMIT), run(None), run(HUGE)
    want, want_plain = oracle(x, ids, w, rows, layout, LIMIT), oracle(x, ids, w, rows, layout, None)
    err, err_plain, away = rel(got, want), rel(plain, want_plain), rel(got, want_plain)
    assert err <= TOL, (name, "clamped vs reference", err)
    assert err_plain <= TOL, (name, "no limit vs reference", err_plain)
    assert away > 0.1, (name, "the clamped output is not away from the unclamped one", away)
    assert torch.equal(huge, plain), (name, "a limit that clamps nothing changed bits")
    return f"{name}: err={err:.1e} no-limit err={err_plain:.1e} vs unclamped={away:.2f} clamped share={share:.2f}"


def inputs(t, seed, quant=None):
    g = torch.Generator().manual_seed(seed)
    layout = RowLayout(H, I, quant)
    rows = fp8_rows(layout, E, g) if quant else torch.randn(E, layout.numel, generator=g) * 0.1
    x = torch.randn(t, H, generator=g)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(t)])
    w = torch.rand(t, K, generator=g)
    return layout, rows, x, ids, w, g


def decode(t: int, quant=None, seed=0) -> str:
    layout, rows, x, ids, w, g = inputs(t, seed, quant)
    scratch = grouped.GemmScratch.make(64, H, I, torch.device("cpu"))
    cached = torch.randperm(E, generator=g)[: E // 2]
    slot_of = torch.full((E,), -1, dtype=torch.int32)
    slot_of[cached] = torch.arange(E // 2, dtype=torch.int32)
    slots = rows[cached].clone()

    def run(limit, slot_ids=ids.int(), dev=rows):
        out = torch.full((t, H), float("nan"))
        return grouped.grouped_expert_mlp(x, slot_ids, ids, w, dev, rows, H, I, scratch, out, quant=quant,
                                          limit=limit).clone()
    assert torch.equal(run(LIMIT, slot_of[ids], slots), run(LIMIT)), "slots vs resident under the limit"
    kind = "FP8 GEMV" if quant and t == 1 else "grouped"
    return check(f"decode {kind} t={t} {quant or 'fp32'}", run, x, ids, w, rows, layout)


def large(t: int, seed=1) -> str:
    layout, rows, x, ids, w, _ = inputs(t, seed)
    return check(f"large t={t}", lambda limit: grouped_expert_mlp_large(x, ids.int(), ids, w, rows, rows, H, I, E,
                                                                        LARGE, limit=limit),
                 x, ids, w, rows, layout)


def ring(t: int, seed=2) -> str:
    layout, rows, x, ids, w, _ = inputs(t, seed)
    s = 4
    slot_of = torch.full((E,), -1, dtype=torch.int32)
    slot_of[:s] = torch.arange(s, dtype=torch.int32)
    slots = rows[:s].clone()

    def run(limit):
        staging = StagingRing(2, 2, layout.numel, torch.float32, torch.device("cpu"))
        return ring_large(staging, x, slot_of[ids], ids, w, rows, slots, H, I, LARGE, limit=limit)[0]
    return check(f"ring t={t}", run, x, ids, w, rows, layout)


if __name__ == "__main__":
    print(decode(3), flush=True)
    print(decode(1, "fp8"), flush=True)
    print(decode(3, "fp8"), flush=True)
    print(large(20), flush=True)
    print(ring(20), flush=True)
