"""The hybrid layer's device path as CUDA graphs (experts/hybrid_graphs.py): the padding on the CPU; the
padded, static-buffer path itself in Triton's interpreter (tests/hybrid_interpreter.py, test_hybrid.py);
graphed == eager bit for bit on CUDA (gpu-marked)."""

from __future__ import annotations

import pytest
import torch

from moetier.experts.cost_model import PathRates
from moetier.experts.host_path import HostPath
from moetier.experts.hybrid import HybridExperts
from moetier.experts.hybrid_graphs import pad_size, padded_plan, sizes
from moetier.experts.placement import ExpertOptions
from moetier.experts.shape import RowLayout
from tests.helpers import tiny_hybrid_bench

BF16 = "bfloat16"


def test_sizes_cover_every_count_with_the_next_power_of_two():
    assert sizes(1) == [1] and sizes(8) == [1, 2, 4, 8] and sizes(24) == [1, 2, 4, 8, 16, 24]
    for p in (1, 8, 24, 512):
        for n in range(1, p + 1):
            s = pad_size(n, p)
            assert s in sizes(p) and n <= s
            # the bookkeeping's BLOCK_N (next power of two, at least 16) and the one-token plan (n == 1)
            # are the same for the padded count: the padding cannot change which kernel variant runs
            assert max(16, 1 << (s - 1).bit_length()) == max(16, 1 << (n - 1).bit_length())
            assert (s == 1) == (n == 1)
    with pytest.raises(ValueError, match="1..8"):
        pad_size(0, 8)
    with pytest.raises(ValueError, match="1..8"):
        pad_size(9, 8)


def test_padded_plan_puts_device_pairs_then_padding_then_host_pairs():
    assert padded_plan([3, 0, 5], [1, 2], 4, 8) == [3, 0, 5, 8, 1, 2]
    assert padded_plan([7], [], 1, 8) == [7]
    assert padded_plan([0, 1, 2, 3], [4], 4, 8) == [0, 1, 2, 3, 4]


def test_the_option_reaches_the_host_path_and_the_env_sets_its_default(monkeypatch):
    lay = RowLayout(16, 8)
    rates = PathRates(1.0, {BF16: 1.0})
    assert HostPath(lay, "grouped", 1, rates).device_graphs is False  # off by default (host_path.py)
    assert HostPath(lay, "grouped", 1, rates, device_graphs=True).device_graphs is True
    monkeypatch.setenv("MOETIER_HYBRID_DEVICE_GRAPHS", "1")
    assert HostPath(lay, "grouped", 1, rates).device_graphs is True
    assert HostPath(lay, "grouped", 1, rates, device_graphs=False).device_graphs is False
    assert ExpertOptions("hybrid").device_graphs is None
    # on the CPU the device path is the torch reference: no graphs
    rows = torch.zeros(4, lay.numel, dtype=torch.bfloat16)
    assert HybridExperts(rows, lay, 2, 2, 4, host=HostPath(lay, "grouped", 1, rates)).device_graphs is None


def test_bench_cli_checks_the_device_graphs_variants():
    from typer.testing import CliRunner

    from moetier.cli.app import app

    r = CliRunner().invoke(app, ["bench", "decode", "--hybrid-device-graphs", "maybe"])
    assert r.exit_code == 2 and "--hybrid-device-graphs 'maybe'" in r.stderr, r.stderr


def test_bench_decode_rows_per_device_graphs_variant(tmp_path):
    from moetier.bench import decode

    data = tiny_hybrid_bench(tmp_path, 2, batch=1, tokens=2, warmup=1, prompt_len=5,
                             hybrid_device_graphs=[True, False])
    rows = data["rows"]
    assert [r["hybrid"]["device_graphs"] for r in rows] == [False, True]  # off first (a failed capture)
    assert "device graphs off" in decode.table(rows) and "device graphs on" in decode.table(rows)


# -- CUDA ---------------------------------------------------------------------------------------------
def _backends(t_max: int, kernel: str = "compiled"):
    from moetier.experts.store import HostStore

    lay = RowLayout(256, 128)
    store = HostStore([0], 32, lay, torch.bfloat16, pin=True)
    host = store.rows(0)
    host.copy_((torch.randn(32, lay.numel, generator=torch.Generator().manual_seed(3)) * 0.05).to(torch.bfloat16))
    rates = PathRates(50.0, {BF16: 50.0})  # a split: link misses and host experts in one step
    return {dg: HybridExperts(host, lay, 8, 12, t_max, "cuda",
                              host=HostPath(lay, kernel, None, rates, "host-first", dg)) for dg in (True, False)}


def _same(a: HybridExperts, b: HybridExperts) -> None:
    sa, sb = a.stats(), b.stats()
    sa.pop("host_us"), sb.pop("host_us")
    assert sa == sb
    for k, v in a.cache.state().items():
        assert torch.equal(v, b.cache.state()[k]), k
    held = a.cache.slot_expert >= 0  # slots never filled hold whatever torch.empty gave
    assert torch.equal(a.slots[held], b.slots[held])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("wdt", [torch.bfloat16, torch.float32])  # bf16: captured at build; fp32: eager path
@pytest.mark.parametrize("t", [1, 8])
def test_gpu_graphed_device_path_is_bit_exact_against_eager(t, wdt):
    hyb = _backends(32)
    on, off = hyb[True], hyb[False]
    assert off.device_graphs is None and on.device_graphs is not None
    built = {n for n, x, w in on.device_graphs.graphs if x == w == torch.bfloat16}
    assert built == set(sizes(32 * 8))  # captured at build
    assert int(on.cache.clock) == 0 and int(on.cache.stats.sum()) == 0  # the capture's warm-up put them back
    _same(on, off)
    g = torch.Generator().manual_seed(t)
    replayed = 0
    for step in range(12):
        tt = t if step % 4 else max(1, t // 2)  # two batch sizes: the statics' rows beyond T are stale
        ids = torch.stack([torch.randperm(32, generator=g)[:8] for _ in range(tt)]).cuda()
        if step == 5:
            ids[0, 1] = -1  # another rank's expert (experts/ep.NOT_MINE): nobody's work
        x = torch.randn(tt, 256, generator=g).to(torch.bfloat16).cuda()
        w = torch.rand(tt, 8, generator=g).to(wdt).cuda()
        before = on.device_graphs.replays
        got, want = on.forward(x, ids, w).clone(), off.forward(x, ids, w).clone()
        assert torch.equal(got, want), step
        _same(on, off)  # the slot map and stamps moved alike: the next replay reads them on the device
        replayed += on.device_graphs.replays > before
        on.cache.check()
    st = on.stats()
    assert st["host"] > 0 and st["misses"] > 0 and st["hits"] > 0  # all three kinds of pair
    if wdt == torch.bfloat16:
        assert replayed > 3  # replays after the cache state changed
    else:
        assert replayed == 0 and not on.device_graphs.ready(torch.bfloat16, wdt)  # not captured: eager, same bits


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_replay_after_the_cache_changed_outside_forward_matches_eager():
    """Reset and a refresh between steps change the slot map in place: the graphs read it on the device."""
    hyb = _backends(8)
    g = torch.Generator().manual_seed(7)

    def step(t):
        ids = torch.stack([torch.randperm(32, generator=g)[:8] for _ in range(t)]).cuda()
        x = torch.randn(t, 256, generator=g).to(torch.bfloat16).cuda()
        w = torch.rand(t, 8, generator=g).to(torch.bfloat16).cuda()
        assert torch.equal(hyb[True].forward(x, ids, w), hyb[False].forward(x, ids, w).clone())
        _same(hyb[True], hyb[False])
    for t in (8, 1, 8):
        step(t)
    for b in hyb.values():
        b.reset()
        miss = b.cache.warm(list(range(20, 32)))  # a different map, written in place (bench/decode.warm_all)
        n = int(miss.count)
        b.slots[miss.slot[:n].long()] = b.host[miss.expert[:n].long().cpu()].to(b.slots.device)
    for t in (1, 8, 8, 2):
        step(t)
    assert hyb[True].device_graphs.replays > 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_engine_device_graphs_on_and_off_give_the_same_tokens(tiny_ckpt):
    from moetier.engine import LLM
    from moetier.sampling_params import SamplingParams

    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 448, (int(torch.randint(1, 30, (1,), generator=g)),), generator=g).tolist()
               for _ in range(4)]
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    outs = {}
    for dg in (True, False):
        opts = ExpertOptions("hybrid", slots=4, rates=PathRates(50.0, {"float32": 50.0}), device_graphs=dg,
                             hybrid_nodes=False)  # the pieces' device path (the CUDA default is nodes)
        llm = LLM(tiny_ckpt, device="cuda", experts=opts, graph_switch=False)
        outs[dg] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        assert llm.metrics()["expert_stats"]["host"] > 0
        replays = sum(getattr(b.experts.device_graphs, "replays", 0) for b in llm.model.moe_blocks())
        assert (replays > 0) == dg
    assert outs[True] == outs[False]
