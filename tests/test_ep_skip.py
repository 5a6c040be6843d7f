"""Pairs with topk id -1 (experts/parallel/ep.NOT_MINE: another expert-parallel rank's expert) on every expert
path: no row read, no slot taken, nothing counted, exactly zero in the k-sum.

CPU: the Triton kernels' CUDA paths in Triton's interpreter (ep_skip_interpreter.py), the hybrid
backend's CPU path, and two simulated EP ranks (ShardedExperts, the all-reduce replaced by a sum
here) against one process. CUDA (marked gpu, one GPU, no process group): the backends called directly
with -1 ids, bit-equal across resident / slots / uva and to the old workaround (the other ranks'
pairs on local expert 0 with weight 0), the slot cache's state equal to the CPU reference's.
"""

from __future__ import annotations

import pytest
import torch

from moetier.experts.backends import ResidentExperts, SlotExperts, UvaExperts
from moetier.experts.hybrid.cost_model import PathRates
from moetier.experts.parallel.ep import NOT_MINE, ShardedExperts, local_ids
from moetier.experts.hybrid.backend import HostPath, HybridExperts
from moetier.experts.prefill.cache_policy import rows_consistent
from moetier.experts.shape import RowLayout
from moetier.experts.cache.slots import STATE
from moetier.parallel import Parallel

E, K, S = 32, 8, 12
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


class NoGroup(Parallel):
    """A rank's layout without a process group: the all-reduce is left to the test (it sums the ranks)."""

    def all_reduce(self, x, over):
        return x


def with_skips(t: int, g: torch.Generator, frac: float = 0.4, e: int = E) -> torch.Tensor:
    ids = torch.stack([torch.randperm(e, generator=g)[:K] for _ in range(t)])
    skip = torch.rand(ids.shape, generator=g) < frac
    skip.view(-1)[0] = True
    return torch.where(skip, NOT_MINE, ids)


def close(got: torch.Tensor, want: torch.Tensor, tol: float = 1e-2) -> bool:
    d = (got.double().cpu() - want.double().cpu()).norm()
    return bool(d <= tol * want.double().cpu().norm())


def test_skip_kernels_in_the_interpreter():
    pytest.importorskip("triton")
    from tests.interpreter import run_script

    out = run_script("ep_skip_interpreter.py")
    lines = out.splitlines()
    assert sum(line.startswith("skip bookkeeping") for line in lines) == 2, out
    assert sum(line.startswith(("skip decode", "skip large")) for line in lines) == 16, out
    assert sum(line.startswith("skip backends") for line in lines) == 3, out


def test_hybrid_cpu_path_skips_other_ranks_pairs():
    lay = RowLayout(64, 32)
    g = torch.Generator().manual_seed(0)
    rows = (torch.randn(E, lay.numel, generator=g) * 0.1).to(torch.bfloat16)
    res = ResidentExperts(rows, lay, K, 16)
    rates = {"link": PathRates(1e6, {"bfloat16": 1e-3}), "split": PathRates(50.0, {"bfloat16": 50.0}),
             "host": PathRates(1e-3, {"bfloat16": 1e6})}
    hyb = {n: HybridExperts(rows, lay, K, S, 16, host=HostPath(lay, "grouped", 2, r)) for n, r in rates.items()}
    valid = 0
    for step in range(8):
        t = (1, 3, 5, 2)[step % 4]
        ids = with_skips(t, g)
        valid += int((ids >= 0).sum())
        x, w = torch.randn(t, lay.hidden, generator=g).to(torch.bfloat16), torch.rand(t, K, generator=g)
        want = res.forward(x, ids, w)
        for n, b in hyb.items():
            got = b.forward(x, ids, w)
            assert torch.equal(got, want) if n == "link" else close(got, want), (n, step)
            b.cache.check()
    st = {n: b.stats() for n, b in hyb.items()}
    assert st["link"]["host"] == 0 and st["host"]["misses"] == 0 and st["split"]["host"] > 0, st
    assert st["host"]["host_pairs"] <= valid, st  # no -1 pair went to the host


def sharded_pair(make, rows: torch.Tensor) -> list[ShardedExperts]:
    """Two simulated EP ranks: rank r holds the experts e % 2 == r, at local id e // 2."""
    return [ShardedExperts(make(rows[r::2].contiguous()), NoGroup(rank=r, world=2, ep=2)) for r in range(2)]


@pytest.mark.parametrize("backend", ["resident", "slots"])
def test_two_simulated_ranks_sum_to_one_process_on_cpu(backend):
    lay = RowLayout(64, 32)
    g = torch.Generator().manual_seed(1)
    rows = torch.randn(E, lay.numel, generator=g) * 0.1
    one = ResidentExperts(rows, lay, K, 16)
    make = (lambda r: ResidentExperts(r, lay, K, 16)) if backend == "resident" else (
        lambda r: SlotExperts(r, lay, K, 6, 16))
    ranks = sharded_pair(make, rows)
    for t in (1, 5, 20):
        ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(t)])
        x, w = torch.randn(t, lay.hidden, generator=g), torch.rand(t, K, generator=g)
        got = ranks[0].forward(x, ids, w) + ranks[1].forward(x, ids, w)
        assert close(got, one.forward(x, ids, w), 1e-5)


# -- CUDA -----------------------------------------------------------------------------------------

def gpu_rows(quant: str | None):
    from moetier.experts.cache.store import HostStore
    from tests.test_host_ext import fp8_rows

    lay = RowLayout(256, 128)
    src = (torch.randn(E, lay.numel, generator=torch.Generator().manual_seed(5)) * 0.05).to(torch.bfloat16)
    if quant == "fp8":
        src, lay = fp8_rows(src, lay), RowLayout(256, 128, "fp8")
    store = HostStore([0], E, lay, torch.bfloat16, pin=True)
    host = store.rows(0)
    host.copy_(src)
    return lay, host, store


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("prefill", ["bypass", "refresh"])
@pytest.mark.parametrize("quant", [None, "fp8"])
def test_gpu_backends_skip_other_ranks_pairs(quant, prefill):
    lay, host, _store = gpu_rows(quant)
    n = 16  # decode tokens: 40-token steps take the large path
    res = ResidentExperts(host.cuda(), lay, K, n)
    cuda = {"resident": res, "uva": UvaExperts(host, lay, K, n, "cuda"),
            "slots": SlotExperts(host, lay, K, S, n, "cuda", prefill=prefill)}
    ref_slots, cpu_res = SlotExperts(host, lay, K, S, n, prefill=prefill), ResidentExperts(host, lay, K, n)
    g = torch.Generator().manual_seed(7)
    for step in range(12):
        t = (1, 5, 16, 40)[step % 4]
        ids = with_skips(t, g)
        x = torch.randn(t, lay.hidden, generator=g).to(torch.bfloat16)
        w = torch.rand(t, K, generator=g)
        idc, xc, wc = ids.cuda(), x.cuda(), w.cuda()
        outs = {name: b.forward(xc, idc, wc).clone() for name, b in cuda.items()}
        assert torch.equal(outs["slots"], outs["resident"]) and torch.equal(outs["uva"], outs["resident"]), step
        # the old workaround (experts/parallel/ep.py before): the -1 pairs on local expert 0 with weight 0. A
        # pair's result depends only on its token and row, and a 0-weight term leaves the k-sum's bits.
        mine = idc >= 0
        old = res.forward(xc, torch.where(mine, idc, 0), torch.where(mine, wc, 0)).clone()
        assert torch.equal(old, outs["resident"]), (step, (old - outs["resident"]).abs().max())
        assert close(outs["resident"], cpu_res.forward(x, ids, w)), step
        ref_slots.forward(x, ids, w)
        for name in STATE:  # the fused bookkeeping (and the refresh) did what the reference does
            assert torch.equal(getattr(cuda["slots"].cache, name).cpu(), getattr(ref_slots.cache, name)), (step, name)
        cuda["slots"].cache.check()
        assert rows_consistent(cuda["slots"].cache, cuda["slots"].slots, host)
    st = cuda["slots"].stats()
    assert st == ref_slots.stats() and st["hits"] > 0 and st["misses"] > 0, (st, ref_slots.stats())


@pytest.mark.gpu
@needs_cuda
def test_gpu_hybrid_and_sharded_skip():
    lay, host, _store = gpu_rows(None)
    res = ResidentExperts(host.cuda(), lay, K, 32)
    rates = {"link": (1e6, 1e-3), "split": (50.0, 50.0), "host": (1e-3, 1e6)}
    hyb = {n: HybridExperts(host, lay, K, S, 32, "cuda", host=HostPath(lay, "grouped", None,
                                                                        PathRates(a, {"bfloat16": b})))
           for n, (a, b) in rates.items()}
    g = torch.Generator().manual_seed(3)
    for step in range(6):
        t = (1, 8, 5)[step % 3]
        ids = with_skips(t, g).cuda()
        x = torch.randn(t, lay.hidden, generator=g).to(torch.bfloat16).cuda()
        w = torch.rand(t, K, generator=g).cuda()
        want = res.forward(x, ids, w).clone()
        for n, b in hyb.items():
            got = b.forward(x, ids, w)
            assert torch.equal(got, want) if n == "link" else close(got, want), (n, step)
            b.cache.check()
    assert hyb["split"].stats()["host"] > 0 and hyb["host"].stats()["misses"] == 0

    # two simulated EP ranks on one GPU: each rank's output bit-equal to the old workaround's, the sum
    # within bf16 rounding of one process (the ranks' partial sums round apart)
    one = ResidentExperts(host.cuda(), lay, K, 32)
    # pinned shares: a slot backend's kernel reads its host rows across the link
    ranks = sharded_pair(lambda r: SlotExperts(r.pin_memory(), lay, K, 6, 32, "cuda"), host)
    olds = [ResidentExperts(host[r::2].contiguous().cuda(), lay, K, 32) for r in range(2)]
    for t in (1, 5, 40):
        ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(t)]).cuda()
        x = torch.randn(t, lay.hidden, generator=g).to(torch.bfloat16).cuda()
        w = torch.rand(t, K, generator=g).cuda()
        parts = []
        for r, rank in enumerate(ranks):
            got = rank.forward(x, ids, w).clone()
            loc = local_ids(ids, r, 2)
            old = olds[r].forward(x, torch.where(loc >= 0, loc, 0), torch.where(loc >= 0, w, 0))
            assert torch.equal(got, old), (t, r)
            parts.append(got.float())
        assert close(parts[0] + parts[1], one.forward(x, ids, w)), t
