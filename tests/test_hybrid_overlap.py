"""Issue 17's overlap work on the hybrid backend, on the CPU: the host call started before the device
path (the compiled kernel's native start / wait, a torch kernel on the worker thread), the default host
threads, the phase clock (experts/hybrid/phases.py) and the bench's hybrid rows with their phases. The
cost model's concurrency: test_cost_model.py."""

from __future__ import annotations

import os

import pytest
import torch

from moetier.experts.hybrid import host_ext
from moetier.experts.hybrid.cost_model import PathRates
from moetier.experts.hybrid.host_path import HostPath, default_host_threads
from moetier.experts.hybrid.backend import HybridExperts
from moetier.experts.hybrid.phases import MARKS, PhaseClock
from moetier.experts.shape import RowLayout
from tests.helpers import tiny_hybrid_bench

E, K, S, H, I = 16, 4, 6, 64, 32
BF16 = "bfloat16"
COMPILED = host_ext.available()[0]


def setup(seed=0):
    lay = RowLayout(H, I)
    g = torch.Generator().manual_seed(seed)
    rows = (torch.randn(E, lay.numel, generator=g) * 0.1).to(torch.bfloat16)
    return lay, rows, g


def steps(g, n=10, t=3):
    for i in range(n):
        tt = (1, t, 2 * t)[i % 3]
        ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(tt)])
        yield torch.randn(tt, H, generator=g).to(torch.bfloat16), ids, torch.rand(tt, K, generator=g)


def backend(lay, rows, kernel="grouped", link=50.0, host=50.0):
    rates = PathRates(link, {BF16: host})
    return HybridExperts(rows, lay, K, S, decode_tokens=16, host=HostPath(lay, kernel, 2, rates))


def test_host_threads_default_leaves_the_launching_thread_a_core():
    cores = len(os.sched_getaffinity(0))
    assert default_host_threads() == max(1, cores - 1)
    lay, _, _ = setup()
    assert HostPath(lay, "grouped", None, PathRates(1.0, {BF16: 1.0})).kernel.threads == default_host_threads()
    assert HostPath(lay, "grouped", 3, PathRates(1.0, {BF16: 1.0})).kernel.threads == 3


@pytest.mark.skipif(not COMPILED, reason="the compiled host kernel does not build here")
def test_native_start_equals_the_plain_call_and_runs_one_at_a_time():
    import time

    lay, rows, g = setup(1)
    lib = host_ext.load()
    x = torch.randn(3, H, generator=g).to(torch.bfloat16)
    tok, exp = torch.tensor([0, 1, 2, 2, 0]), torch.tensor([3, 5, 3, 9, 15])
    want = host_ext.pair_outputs(lib, x, tok, exp, rows, lay, 2)
    before = time.perf_counter()
    job = host_ext.start(lib, x, tok, exp, rows, lay, 2)
    with pytest.raises(ValueError, match="not been waited for"):
        host_ext.start(lib, x, tok, exp, rows, lay, 2)
    assert torch.equal(job.result(), want) and torch.equal(job.result(), want)  # waits once
    begin, end = job.times
    assert before <= begin <= end <= time.perf_counter()  # the perf_counter clock
    with pytest.raises(RuntimeError, match="nothing was started"):
        host_ext.Started(lib, want, ()).result()
    with pytest.raises(ValueError, match="pair 0"):  # checked on the caller, before the hand-over
        host_ext.start(lib, x, torch.tensor([7]), torch.tensor([0]), rows, lay, 2)
    empty = host_ext.start(lib, x, tok[:0], exp[:0], rows, lay, 2).result()
    assert empty.shape == (0, H)
    out = torch.full((5, H), float("nan"))  # the pinned upload buffer on CUDA: written in place
    assert host_ext.start(lib, x, tok, exp, rows, lay, 2, out=out).result() is out and torch.equal(out, want)
    with pytest.raises(ValueError, match="out must be"):
        host_ext.start(lib, x, tok, exp, rows, lay, 2, out=torch.empty(4, H))


def test_phase_clock_is_off_by_default_and_orders_its_marks():
    lay, rows, g = setup(2)
    b = backend(lay, rows)
    keys = set(b.stats())
    assert b.phases is None and b.phase_means() is None
    b.profile(True)
    for x, ids, w in steps(g, n=8):
        b.forward(x, ids, w)
    p = b.phase_means()
    assert set(b.stats()) == keys  # stats() unchanged: the phases are their own read
    assert p["layers"] > 0 and p["layers"] + p["slots_layers"] == 8
    assert set(MARKS) <= set(p)
    assert 0 <= p["sync"] <= p["choose"] <= p["host_args"] <= p["host_start"] <= p["launched"]
    assert p["launched"] <= p["joined"] <= p["done"]
    assert p["host_begin"] <= p["host_end"] <= p["joined"]
    b.reset()
    assert b.phase_means()["layers"] == 0  # reset starts a fresh clock, still on
    b.profile(False)
    assert b.phases is None


def test_phase_clock_merges_and_averages():
    a, b = PhaseClock(), PhaseClock()
    a.add(1.0, {m: 1.0 + (i + 1) * 1e-6 for i, m in enumerate(MARKS)})
    b.add(2.0, {m: 2.0 + (i + 1) * 3e-6 for i, m in enumerate(MARKS)})
    b.add_slots(5.0, {"sync": 5.0 + 1e-5, "choose": 5.0 + 2e-5, "done": 5.0 + 4e-5})
    b.device(gpu_s=3e-4, finished_first=True)
    a.device(finished_first=False)
    a.merge(b)
    m = a.means_us()
    assert m["layers"] == 2 and m["sync"] == pytest.approx(2.0) and m["done"] == pytest.approx(2.0 * len(MARKS))
    assert m["slots_layers"] == 1 and m["slots"]["done"] == pytest.approx(40.0)
    assert m["device_gpu"] == pytest.approx(300.0) and m["device_first"] == 0.5


def test_bench_decode_hybrid_rows_with_phases(tmp_path):
    from moetier.bench import decode
    from moetier.presets import preset

    cfg = preset("tiny")
    data = tiny_hybrid_bench(tmp_path, 64, batch=2, tokens=3, warmup=2, prompt_len=5)
    rows = data["rows"]
    assert len(rows) == 1 and rows[0]["graphs"] == "pieces-auto"  # the default (the CPU runs it eagerly)
    # threads: the profile's winner, at most the cores less one
    assert rows[0]["hybrid"]["host_threads"] == min(64, default_host_threads())
    ph = rows[0]["hybrid"]["phases_us"]
    assert ph["layers"] + ph["slots_layers"] > 0  # the timed window's calls only
    assert ph["layers"] + ph["slots_layers"] <= cfg.num_layers * rows[0]["timed_steps"]
    assert f"host threads {rows[0]['hybrid']['host_threads']}:" in decode.table(rows)
    assert set(data["greedy_tokens_equal_to_resident"]) == set()  # no resident rows in this run


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("t", [1, 8, 32])
def test_gpu_host_kernels_give_the_same_choices_with_the_phase_clock(t):
    """The compiled kernel (native thread) and grouped (worker thread) at the same rates: the same
    choices and counts, outputs within bf16 tolerance (their roundings differ); the phase clock's marks."""
    from moetier.experts.cache.store import HostStore

    lay = RowLayout(256, 128)
    store = HostStore([0], 32, lay, torch.bfloat16, pin=True)
    host = store.rows(0)
    host.copy_((torch.randn(32, lay.numel) * 0.05).to(torch.bfloat16))
    hyb = {kern: HybridExperts(host, lay, 8, 12, 32, "cuda", host=HostPath(lay, kern, None,
                                                                           PathRates(50.0, {BF16: 50.0})))
           for kern in ("compiled", "grouped")}
    hyb["compiled"].profile(True)
    g = torch.Generator().manual_seed(t)
    for _ in range(6):
        ids = torch.stack([torch.randperm(32, generator=g)[:8] for _ in range(t)]).cuda()
        x = torch.randn(t, 256, generator=g).to(torch.bfloat16).cuda()
        w = torch.rand(t, 8, generator=g).cuda()
        outs = {kern: b.forward(x, ids, w).float() for kern, b in hyb.items()}
        assert torch.allclose(outs["compiled"], outs["grouped"], rtol=0, atol=2e-2 * outs["grouped"].abs().max())
    st = {kern: {k: v for k, v in b.stats().items() if k != "host_us"} for kern, b in hyb.items()}
    assert st["compiled"] == st["grouped"] and st["compiled"]["host"] > 0 and st["compiled"]["misses"] > 0
    for b in hyb.values():
        b.cache.check()
    p = hyb["compiled"].phase_means()
    assert p["layers"] > 0 and p["host_begin"] <= p["host_end"] <= p["joined"] <= p["done"]
    assert p.get("device_gpu", 0) > 0 and 0 <= p.get("device_first", 0) <= 1
