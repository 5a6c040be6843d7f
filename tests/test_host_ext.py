"""The compiled host expert kernel (experts/hybrid/csrc/host_experts.cpp, built by experts/hybrid/host_ext.py): against
the fp32 oracle (cpu_experts.reference) and the torch `pair` kernel for bf16, fp32 and FP8 rows on
ragged shapes; its result independent of the thread count (bitwise: its own summation order); the
build into a cache outside the source tree; the fallback to the torch kernel when the build fails;
FP8 rows through the torch kernels and through the hybrid backend (to the engine's logits).

Tolerances: the kernel accumulates in fp32 in its own order, torch in BLAS order, so results are held
to the oracle within fp32 or bf16 rounding, never bitwise (the CI CPUs differ: AVX-512 or AVX2)."""

from __future__ import annotations

import warnings

import pytest
import torch

from moetier.experts.hybrid import host_ext
from moetier.experts.backends import ResidentExperts, SlotExperts
from moetier.experts.hybrid.cost_model import PathRates
from moetier.experts.hybrid.host_kernels import GroupedKernel, host_kernel, reference
from moetier.experts.hybrid.backend import HostPath, HybridExperts
from moetier.experts.shape import RowLayout
from moetier.quant import fp8_block as fp8

H, I = 200, 72  # ragged: neither a multiple of 128 nor of any SIMD width


@pytest.fixture(scope="module")
def lib():
    """Built once per session (then cached on disk in the user's cache)."""
    if host_ext.compiler() is None:
        pytest.skip("no C++ compiler found (c++, g++ or clang++; or CXX): the compiled host kernel "
                    "cannot be built here")
    return host_ext.load()  # with a compiler present, a failed build is a test failure


def bf16_rows(e: int, lay: RowLayout, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(e, lay.numel, generator=g) * 0.1).to(torch.bfloat16)


def fp8_rows(src: torch.Tensor, lay: RowLayout) -> torch.Tensor:
    """FP8 rows (uint8) quantized from bf16 rows of the same shape, part by part as the loader fills them."""
    q = RowLayout(lay.hidden, lay.inter, "fp8")
    rows = torch.zeros(src.shape[0], q.numel, dtype=torch.uint8)
    i = lay.inter
    for e in range(src.shape[0]):
        w13, w2 = lay.w13(src[e:e + 1])[0].float(), lay.w2(src[e:e + 1])[0].float()
        for part, w in (("gate", w13[:i]), ("up", w13[i:]), ("down", w2)):
            qw, s = fp8.quantize(w)
            q.part(rows, part, e).copy_(qw)
            q.part(rows, part + "_scale", e).copy_(s)
    return rows


def rows_of(kind: str, e: int = 6, hidden: int = H, inter: int = I, seed: int = 0):
    """(layout, rows) of bf16, fp32 or FP8 rows, or 4-bit ones (nvfp4 and the INT4 names: random experts
    quantized by the format's rule, random_bed.fill_4bit_rows)."""
    from moetier.quant.registry import PACKED4

    if kind in PACKED4:
        from moetier.checkpoint.random_bed import fill_4bit_rows

        lay = RowLayout(hidden, inter, kind)
        rows = torch.zeros(e, lay.numel, dtype=torch.uint8)
        fill_4bit_rows(rows, lay, torch.Generator().manual_seed(seed))
        return lay, rows
    lay = RowLayout(hidden, inter)
    rows = bf16_rows(e, lay, seed)
    if kind == "fp8":
        return RowLayout(hidden, inter, "fp8"), fp8_rows(rows, lay)
    return lay, rows.float() if kind == "fp32" else rows


def step(t: int, k: int, e: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)]).reshape(-1)
    return torch.randn(t, H, generator=g).to(torch.bfloat16), ids, torch.rand(t * k, generator=g)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


# -- the kernel against the oracle ---------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["bf16", "fp32", "fp8"])
def test_compiled_matches_the_reference(lib, kind):
    lay, rows = rows_of(kind)
    t, k = 5, 3
    x, ids, w = step(t, k, rows.shape[0])
    pairs = torch.tensor([0, 1, 2, 4, 6, 7, 8, 12, 13, 14])  # a subset: token 3's pairs are not asked for
    kern = host_kernel("compiled", lay, threads=2)
    got = kern(x, pairs, ids[pairs], w[pairs], rows, k)
    want = reference(x, pairs, ids[pairs], w[pairs], rows, lay, k)
    assert torch.equal(got[3], torch.zeros(H)) and got[0].abs().max() > 0
    # bf16 / FP8 in a bf16 model: the oracle rounds every op's output to bf16, the kernel keeps fp32
    # between the roundings the GPU kernel makes; fp32 rows: both in fp32, only the sum orders differ
    assert rel(got, want) <= (1e-5 if kind == "fp32" else 1e-2)
    grouped = host_kernel("grouped", lay, threads=2)(x, pairs, ids[pairs], w[pairs], rows, k)
    assert rel(got, grouped) <= (1e-5 if kind == "fp32" else 2e-2)


def test_fp8_in_fp32_math_is_the_oracle_to_fp32_rounding(lib):
    """With fp32 hidden states nothing is rounded to bf16: FP8 bytes decode exactly (every e4m3 code but
    the two NaNs, denormals included) and times their block scale as fp8.dequantize does, so only the
    sum order differs from the oracle."""
    lay, rows = rows_of("fp8")
    g = torch.Generator().manual_seed(5)
    w = torch.randint(0, 256, (rows.shape[0], lay.w13_numel + lay.w2_numel), generator=g, dtype=torch.uint8)
    rows[:, :w.shape[1]] = torch.where((w & 0x7F) == 0x7F, w - 1, w)
    lay.s13(rows).copy_(torch.rand(lay.s13(rows).shape, generator=g) * 1e-2)
    lay.s2(rows).copy_(torch.rand(lay.s2(rows).shape, generator=g) * 1e-2)
    x, ids, w = step(4, 2, rows.shape[0])
    pairs = torch.arange(8)
    got = host_kernel("compiled", lay, 2)(x.float(), pairs, ids, w, rows, 2)
    assert rel(got, reference(x.float(), pairs, ids, w, rows, lay, 2)) <= 1e-5


@pytest.mark.parametrize("kind", ["bf16", "fp8"])
def test_thread_count_never_changes_a_bit(lib, kind):
    """Each output element is one thread's dot product in a fixed order: 1, 2 and 3 threads (and how
    the rows and tokens are cut) give the same bits. Duplicate experts, more tokens on one expert than
    a register tile holds (11 > 8), a lone expert."""
    lay, rows = rows_of(kind, e=5)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(11, H, generator=g).to(torch.bfloat16)
    tokens = torch.cat([torch.arange(11), torch.tensor([0, 1, 2, 3, 4, 0])])
    experts = torch.cat([torch.full((11,), 2), torch.tensor([0, 4, 0, 4, 1, 3])])
    outs = [host_ext.pair_outputs(lib, x, tokens, experts, rows, lay, n, block) for n, block in
            ((1, 0), (2, 0), (3, 0), (2, 1024), (3, 600))]  # small blocks: every expert cut in many
    assert all(torch.equal(outs[0], o) for o in outs[1:])
    # a pair's result depends only on its token and its row, not on the other pairs of the call
    alone = host_ext.pair_outputs(lib, x, tokens[-2:-1], experts[-2:-1], rows, lay, 2)
    assert torch.equal(alone[0], outs[0][-2])


def test_compiled_refuses_bad_ids(lib):
    lay, rows = rows_of("bf16", e=3)
    with pytest.raises(ValueError, match="expert 3 of 0..2"):
        host_ext.pair_outputs(lib, torch.zeros(1, H), torch.tensor([0]), torch.tensor([3]), rows, lay, 1)
    with pytest.raises(ValueError, match="token 1 of 0..0"):
        host_ext.pair_outputs(lib, torch.zeros(1, H), torch.tensor([1]), torch.tensor([0]), rows, lay, 1)


def test_rows_it_has_no_code_for_take_the_torch_kernel(lib):
    lay, rows = rows_of("bf16")
    x, ids, w = step(2, 2, rows.shape[0])
    kern = host_kernel("compiled", lay, 1)
    got = kern(x, torch.arange(4), ids, w, rows.half(), 2)  # fp16 rows: grouped computes them
    assert torch.equal(got, GroupedKernel(lay, 1)(x, torch.arange(4), ids, w, rows.half(), 2))


# -- FP8 rows through the torch kernel (the fallback) ---------------------------------------------------
def test_torch_kernel_takes_fp8_rows():
    lay, rows = rows_of("fp8")
    x, ids, w = step(3, 2, rows.shape[0])
    pairs = torch.tensor([0, 1, 3, 5])
    kern = host_kernel("grouped", lay, 2)
    got = kern(x, pairs, ids[pairs], w[pairs], rows, 2)
    assert rel(got, reference(x, pairs, ids[pairs], w[pairs], rows, lay, 2)) <= 1e-2
    with pytest.raises(ValueError, match="FP8 rows are bytes"):
        kern(x, pairs, ids[pairs], w[pairs], rows.float(), 2)


# -- the build: where it goes, and what happens when it cannot --------------------------------------------
def test_build_goes_to_the_cache_dir_never_the_source_tree(lib, tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    path = host_ext.build(host_ext.compiler(), host_ext.cache_dir())
    assert path.parent == tmp_path / "moetier" / "host_ext" and path.suffix == ".so"
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temporary file left behind
    assert host_ext.build(host_ext.compiler(), host_ext.cache_dir()) == path  # cached: no second build
    assert not list(host_ext.SOURCE.parent.glob("*.so"))


def test_a_failed_build_falls_back_to_grouped_with_one_line(tmp_path, monkeypatch):
    fake = tmp_path / "fake-c++"
    fake.write_text("#!/bin/sh\nif [ \"$1\" = --version ]; then echo fake 1.0; exit 0; fi\n"
                    "echo 'host_experts.cpp:1: error: forced by the test' >&2\nexit 1\n")
    fake.chmod(0o755)
    monkeypatch.setenv("CXX", str(fake))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    ok, reason = host_ext.available()
    assert not ok and "error: forced by the test" in reason and "\n" not in reason
    lay, rows = rows_of("bf16")
    with pytest.raises(host_ext.HostExtUnavailable, match="forced by the test"):
        host_kernel("compiled", lay, 1)
    with pytest.warns(UserWarning, match="'grouped' instead of 'compiled'.*forced by the test"):
        kern = host_kernel("auto", lay, 1)
    assert isinstance(kern, GroupedKernel) and "forced" in kern.fallback_reason
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        path = HostPath(lay, "compiled", 1, PathRates(1e-3, {"bfloat16": 1e6}))  # serve time: never a crash
    assert path.kernel.name == "grouped"
    hyb = HybridExperts(rows, lay, 2, 3, 8, host=path)
    x, ids, w = step(3, 2, rows.shape[0])
    assert hyb.forward(x, ids.view(3, 2), w.view(3, 2)).isfinite().all() and hyb.stats()["host"] > 0
    monkeypatch.setenv("CXX", str(tmp_path / "missing"))
    assert "cannot be run" in host_ext.available()[1]


# -- the hybrid backend with quantized rows (FP8; NVFP4 and INT4, tests/test_quant4_host.py) ----------------
@pytest.mark.parametrize("kind", ["fp8", "nvfp4", "int4"])
@pytest.mark.parametrize("kernel", ["auto", "grouped"])
@pytest.mark.parametrize("link,host", [(1e-3, 1e6), (50.0, 50.0)], ids=["all-host", "split"])
def test_hybrid_with_quantized_rows_equals_slots_and_resident(kind, kernel, link, host):
    e, k, s = 12, 3, 4
    lay, rows = rows_of(kind, e=e)
    res, slots = ResidentExperts(rows, lay, k, 16), SlotExperts(rows, lay, k, s, 16)
    rates = PathRates(link, {kind: host})
    hyb = HybridExperts(rows, lay, k, s, 16, host=HostPath(lay, kernel, 2, rates))
    assert hyb.hostpath.kernel.name == ("grouped" if kernel == "grouped" or host_ext.compiler() is None else "compiled")
    g = torch.Generator().manual_seed(7)
    for _ in range(8):
        ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(3)])
        x, w = torch.randn(3, H, generator=g).to(torch.bfloat16), torch.rand(3, k, generator=g)
        want = res.forward(x, ids, w)
        assert torch.equal(slots.forward(x, ids, w), want)
        assert rel(hyb.forward(x, ids, w), want) <= 2e-2  # bf16 outputs: 2 steps of the largest
        hyb.cache.check()
    st = hyb.stats()
    assert st["host"] > 0 and (st["misses"] == 0 if link < 1 else st["misses"] > 0)


def test_cuda_path_with_fp8_rows_in_the_triton_interpreter(lib, monkeypatch):
    """hybrid's CUDA path (bookkeeping, fills, the FP8 grouped GEMM, the compiled host kernel, the
    Triton combine) in Triton's interpreter with FP8 rows, against the oracle."""
    from tests.interpreter import run_script

    monkeypatch.setenv("HYBRID_INTERPRETER_FP8", "1")
    assert "ok" in run_script("hybrid_interpreter.py")


def test_fp8_hybrid_is_no_longer_refused_and_rates_key_fp8():
    from moetier.experts.placement import ExpertOptions
    from moetier.experts.shape import MoeShape

    assert ExpertOptions("hybrid").problems(MoeShape(8, 2, H, I, "fp8"), [0]) == []
    lay, rows = rows_of("fp8", e=4)
    hyb = HybridExperts(rows, lay, 2, 2, 8, host=HostPath(lay, "grouped", 1))  # rates measured
    assert set(hyb.model.rates.host_GBps) == {"fp8"} and hyb.model.rates.host_GBps["fp8"] > 0


def test_engine_fp8_checkpoint_hybrid_matches_resident(tmp_path):
    """An FP8 checkpoint end to end in bf16: hybrid (misses split between the host kernel and the slots)
    against resident, logits within bf16 tolerance."""
    from helpers import Sequence

    from moetier.checkpoint.loader import load_model
    from moetier.checkpoint.writer import make_checkpoint
    from moetier.experts.placement import ExpertOptions

    path = make_checkpoint(tmp_path / "fp8", "tiny", seed=3, dtype="fp8")
    prompt = torch.randint(0, 400, (7,), generator=torch.Generator().manual_seed(0))

    def logits(opts):
        _, model, _ = load_model(path, dtype="bfloat16", experts=opts)
        seq = Sequence(model, 64)
        out = [model.logits(seq.forward(prompt))]
        for tok in (5, 17, 99, 3):  # fixed tokens: the same decode steps for both
            out.append(model.logits(seq.forward(torch.tensor([tok]))))
        return torch.cat(out).float(), model

    want, _ = logits(ExpertOptions("resident"))
    got, model = logits(ExpertOptions("hybrid", slots=2, rates=PathRates(50.0, {"fp8": 50.0}), host_threads=1))
    assert sum(b.experts.stats()["host"] for b in model.moe_blocks()) > 0
    assert rel(got, want) <= 3e-2  # bf16 logits after 4 layers of differently rounded experts (1.5% seen)


# -- the benchmark script's JSON feeds the cost model, one rate per row dtype -------------------------------
def test_bench_script_small_run_gives_rates_per_dtype(lib, tmp_path):
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    from moetier.experts.hybrid.cost_model import rates_from_bench

    root = Path(__file__).resolve().parents[1]
    out = tmp_path / "cpu.json"
    env = {**os.environ, "PYTHONPATH": str(root)}
    r = subprocess.run([sys.executable, str(root / "scripts" / "bench_cpu_experts.py"), "--small", "--threads", "1",
                        "--reps", "1", "--kernels", "compiled,grouped", "--dtypes", "bf16,fp8,nvfp4,int4",
                        "--out", str(out)],
                       capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "dtype  kernel" in r.stdout  # the last table
    data = json.loads(out.read_text())
    dtypes = ("bf16", "fp8", "nvfp4", "int4")
    assert data["compiled"]["available"] and set(data["winners"]) == set(dtypes)
    assert {(x["dtype"], x["kernel"]) for x in data["results"]} == {(d, k) for d in dtypes
                                                                    for k in ("compiled", "grouped")}
    assert data["shape"]["row_bytes"]["nvfp4"] == RowLayout(256, 96, "nvfp4").numel  # --small's shape
    rates = rates_from_bench(data, link_GBps=50.0)
    assert set(rates.host_GBps) == {"bfloat16", "fp8", "nvfp4", "int4"} and min(rates.host_GBps.values()) > 0
