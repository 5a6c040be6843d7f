"""Runs the hybrid backend's CUDA path (experts/hybrid/backend.py: the packed down-copy, the choice, the
compacted device pairs through bookkeeping, fill and the grouped GEMM, the host pairs scattered in,
the Triton combine) in Triton's interpreter on the CPU, with CPU tensors standing in for device ones.

Run as a script (TRITON_INTERPRET must be set before triton is imported); test_hybrid.py does that in
a subprocess. Stand-ins: pinned buffers are plain CPU tensors and the event a no-op (the interpreter
runs every launch at once, so there is nothing to wait for). Checks, over steps of 1, 3 and 5 tokens:
the output against the fp32 oracle (cpu_experts.reference) within bf16 tolerance, the cache's integrity, and the
counters (host experts only when the rates split; link misses never when the host takes everything);
the split case with the phase clock on giving the same bits and counters, and the clock's marks.
With HYBRID_INTERPRETER_FP8=1: FP8 rows, the FP8 grouped GEMM and the compiled host kernel instead.
What it cannot check: streams, pinned-memory copies, CUDA graph capture (tests/test_hybrid.py, gpu).
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402

from moetier.experts.hybrid.host_kernels import reference  # noqa: E402
from moetier.experts.hybrid.cost_model import PathRates  # noqa: E402
from moetier.experts.kernels.grouped_gemm import GemmScratch  # noqa: E402
from moetier.experts.hybrid.backend import HostPath, HybridExperts  # noqa: E402
from moetier.experts.hybrid.phases import PhaseClock  # noqa: E402
from moetier.experts.shape import RowLayout  # noqa: E402
from moetier.experts.cache.slot_kernels import BookkeepingScratch  # noqa: E402

E, K, S, H, I, N = 16, 4, 6, 64, 32, 8  # N: decode tokens


class NoEvent:
    def record(self):
        pass

    def synchronize(self):
        pass

    def query(self):
        return True

    def elapsed_time(self, other):
        return 0.25  # ms


class CpuHostPath(HostPath):
    def buffer(self, name, shape, dtype, pin=False, device=None):
        return super().buffer(name, shape, dtype, False, None)  # no pinned memory without CUDA


def as_cuda(b: HybridExperts) -> HybridExperts:
    """Turn a CPU-built backend onto its CUDA code path, with CPU tensors for device ones."""
    cpu = torch.device("cpu")
    b.cuda = True
    b._host_dev = b.host  # the interpreter reads CPU tensors (a DevicePointer is for the device)
    b._scratch = BookkeepingScratch(E, S, N * K, cpu)
    b._copy_programs = 4
    b._work = GemmScratch.make(N * K, H, I, cpu)
    b._out = None
    b._ev = NoEvent()
    return b


def main() -> None:
    lay = RowLayout(H, I)
    g = torch.Generator().manual_seed(0)
    rows = (torch.randn(E, lay.numel, generator=g) * 0.1).to(torch.bfloat16)
    key, kernel = "bfloat16", "grouped"
    if os.environ.get("HYBRID_INTERPRETER_FP8") == "1":  # FP8 rows, the compiled host kernel (test_host_ext.py)
        from tests.test_host_ext import fp8_rows

        rows, lay, key, kernel = fp8_rows(rows, lay), RowLayout(H, I, "fp8"), "fp8", "auto"
    cases = {"link": PathRates(1e6, {key: 1e-3}), "split": PathRates(50.0, {key: 50.0}),
             "host": PathRates(1e-3, {key: 1e6})}
    hyb = {n: as_cuda(HybridExperts(rows, lay, K, S, N, host=CpuHostPath(lay, kernel, 1, r)))
           for n, r in cases.items()}
    # the split case again with the phase clock on: the same bits and counters
    hyb["split/clocked"] = as_cuda(HybridExperts(rows, lay, K, S, N, host=CpuHostPath(lay, kernel, 1, cases["split"])))
    clocked = hyb["split/clocked"]
    clocked.phases, clocked._ev_dev = PhaseClock(), (NoEvent(), NoEvent())
    torch.cuda.synchronize = lambda *a: None  # the interpreter has nothing to wait for
    hyb["split"]._precompile()  # every compacted size it warms runs through the kernels once
    state = {k: v.clone() for k, v in hyb["split"].cache.state().items()}
    assert all(torch.equal(v, hyb["link"].cache.state()[k]) for k, v in state.items())  # its cache untouched
    for step in range(12):
        t = (1, 3, 5)[step % 3]
        ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(t)])
        x = torch.randn(t, H, generator=g).to(torch.bfloat16)
        w = torch.rand(t, K, generator=g)
        # the oracle in fp32 math (cpu_experts.reference). 2e-2 of the largest output: the interpreter's
        # emulated bf16 dot and the oracle's bf16-rounded pair outputs differ by up to 1.2% here on the
        # plain slots path too (the "link" case), with cancellation in the weighted sum of k outputs
        want = reference(x, torch.arange(t * K), ids.reshape(-1), w.reshape(-1), rows, lay, K)
        outs = {}
        for n, b in hyb.items():
            got = outs[n] = b.forward(x, ids, w).float()
            err = (got - want).abs().max() / want.abs().max()
            assert err <= 2e-2, (n, step, float(err))
            b.cache.check()
        assert torch.equal(outs["split/clocked"], outs["split"]), step
    ph = clocked.phase_means()
    assert ph["layers"] > 0 and ph["host_start"] <= ph["launched"] <= ph["joined"] <= ph["done"], ph
    assert ph["host_begin"] <= ph["host_end"] <= ph["joined"] and ph.get("device_first") == 1.0, ph
    st = {n: b.stats() for n, b in hyb.items()}
    assert st["link"]["host"] == 0 and st["link"]["misses"] > 0, st["link"]
    assert st["split"]["host"] > 0 and st["split"]["misses"] > 0, st["split"]
    same = [n for n in st["split"] if n != "host_us"]  # host_us: wall time
    assert [st["split/clocked"][n] for n in same] == [st["split"][n] for n in same], (st["split/clocked"], st["split"])
    assert st["host"]["misses"] == 0 and st["host"]["overflow"] == 0 and st["host"]["host"] > 0, st["host"]
    print("hybrid CUDA path in the interpreter: ok", {n: (s["host"], s["misses"]) for n, s in st.items()})


if __name__ == "__main__":
    main()
