"""The hybrid expert backend: the host expert kernels against their reference (the cost model: test_cost_model.py),
the backend against resident on the CPU (and on CUDA, marked gpu), and the
engine's batch == alone with it."""

from __future__ import annotations

import pytest
import torch

from moetier.experts.backends import ResidentExperts, SlotExperts
from moetier.experts.hybrid.cost_model import PathRates
from moetier.experts.hybrid.host_kernels import KERNELS, host_kernel, reference
from moetier.experts.hybrid.backend import HostPath, HybridExperts
from moetier.experts.placement import ExpertOptions
from moetier.experts.shape import RowLayout

BF16 = "bfloat16"

# -- host kernels ---------------------------------------------------------------------------------
@pytest.mark.parametrize("name", KERNELS)
def test_host_kernels_match_the_reference(name):
    lay = RowLayout(64, 48)
    g = torch.Generator().manual_seed(1)
    rows = (torch.randn(10, lay.numel, generator=g) * 0.1).to(torch.bfloat16)
    t, k = 5, 3
    ids = torch.stack([torch.randperm(10, generator=g)[:k] for _ in range(t)]).reshape(-1)
    w = torch.rand(t * k, generator=g)
    pairs = torch.tensor([0, 1, 4, 6, 7, 8, 12, 14])
    x = torch.randn(t, 64, generator=g)
    kern = host_kernel(name, lay, threads=2)
    got = kern(x, pairs, ids[pairs], w[pairs], rows, k)
    want = reference(x, pairs, ids[pairs], w[pairs], rows, lay, k)
    assert got.shape == (t, 64) and got[2].abs().max() > 0
    assert torch.equal(got[3], torch.zeros(64))  # token 3's pairs (9, 10, 11) are not asked for
    assert (got - want).abs().max() <= 1e-2 * want.abs().max()


def test_host_kernel_refuses_bad_input():
    lay = RowLayout(16, 8)
    rows = torch.zeros(4, lay.numel)
    k = host_kernel("grouped", lay)
    with pytest.raises(ValueError, match="expert ids must be in 0..3"):
        k(torch.zeros(1, 16), torch.tensor([0]), torch.tensor([4]), torch.ones(1), rows, 1)
    with pytest.raises(ValueError, match="no host expert kernel for torch.int8"):
        k(torch.zeros(1, 16), torch.tensor([0]), torch.tensor([0]), torch.ones(1), rows.to(torch.int8), 1)
    with pytest.raises(ValueError, match="unknown host expert kernel"):
        host_kernel("fast", lay)


# -- the backend on the CPU ------------------------------------------------------------------------
E, K, S, H, I = 16, 4, 6, 64, 32


def setup(dtype=torch.bfloat16, seed=0):
    lay = RowLayout(H, I)
    g = torch.Generator().manual_seed(seed)
    rows = (torch.randn(E, lay.numel, generator=g) * 0.1).to(dtype)
    return lay, rows, g


def steps(g, n=12, t=3):
    for _ in range(n):
        ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(t)])
        yield torch.randn(t, H, generator=g).to(torch.bfloat16), ids, torch.rand(t, K, generator=g)


def hybrid(lay, rows, link, host, kernel="grouped"):
    rates = PathRates(link, {BF16: host, "float32": host})
    return HybridExperts(rows, lay, K, S, decode_tokens=16, host=HostPath(lay, kernel, 2, rates))


def test_all_link_choice_is_bit_exact_against_slots_and_resident():
    lay, rows, g = setup()
    res, slots = ResidentExperts(rows, lay, K, 16), SlotExperts(rows, lay, K, S, 16)
    hyb = hybrid(lay, rows, link=1e6, host=1e-3)
    for x, ids, w in steps(g):
        want = res.forward(x, ids, w)
        assert torch.equal(hyb.forward(x, ids, w), want) and torch.equal(slots.forward(x, ids, w), want)
    assert hyb.stats()["host"] == 0 and hyb.stats() == {**slots.stats(), "host": 0, "host_pairs": 0, "host_us": 0}
    hyb.cache.check()


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("link,host", [(1e-3, 1e6), (50.0, 50.0)], ids=["all-host", "split"])
def test_hybrid_equals_resident_within_bf16(kernel, link, host):
    lay, rows, g = setup()
    res = ResidentExperts(rows, lay, K, 16)
    hyb = hybrid(lay, rows, link, host, kernel)
    # compiled: fp32 between its roundings (as the GPU kernel), where torch rounds every op to bf16; the
    # two differ by up to 2 bf16 steps of an output (1.2% of the largest here; it is nearer the fp32 oracle)
    tol = 2e-2 if kernel == "compiled" else 1e-2
    for x, ids, w in steps(g):
        want = res.forward(x, ids, w)
        got = hyb.forward(x, ids, w)
        assert (got.float() - want.float()).abs().max() <= tol * want.float().abs().max()
        hyb.cache.check()
    st = hyb.stats()
    assert st["host"] > 0 and st["host_pairs"] >= st["host"]
    if link < 1:
        assert st["misses"] == 0 and st["overflow"] == 0  # nothing crossed the link
    else:
        assert st["misses"] > 0  # the other half went over it


def test_same_choice_same_bits():
    lay, rows, g = setup(seed=3)
    a, b = hybrid(lay, rows, 50.0, 50.0), hybrid(lay, rows, 50.0, 50.0)
    for x, ids, w in steps(g, n=6, t=5):
        assert torch.equal(a.forward(x, ids, w), b.forward(x, ids, w))


def test_prefill_bypasses_and_counts():
    lay, rows, g = setup()
    hyb = hybrid(lay, rows, 50.0, 50.0)
    res = ResidentExperts(rows, lay, K, 16)
    x, ids, w = next(steps(g, n=1, t=20))  # above decode_tokens = 16
    assert torch.equal(hyb.forward(x, ids, w), res.forward(x, ids, w))
    assert hyb.stats()["bypassed"] == 1 and hyb.stats()["host"] == 0


def test_hybrid_is_not_graph_safe_and_options_check_the_kernel():
    from moetier.experts.shape import MoeShape

    assert HybridExperts.graph_safe is False and SlotExperts.graph_safe is True
    problems = ExpertOptions("hybrid", host_kernel="magic", host_threads=0).problems(MoeShape(E, K, H, I), [0])
    assert any("host expert kernel 'magic'" in p for p in problems) and any("host threads" in p for p in problems)


def test_rates_are_measured_when_not_given():
    lay, rows, g = setup()
    path = HostPath(lay, "grouped", 1)
    a = HybridExperts(rows, lay, K, S, 16, host=path)
    b = HybridExperts(rows, lay, K, S, 16, host=path)  # a second layer: measured once per model
    r = a.model.rates
    assert r is b.model.rates and r.link_GBps > 0 and r.host_GBps["bfloat16"] > 0
    assert r.host_overhead_s >= 0 and r.host_token_s >= 0


# -- the engine -------------------------------------------------------------------------------------
def test_engine_batch_equals_alone_with_hybrid(tiny_ckpt):
    from moetier.engine import LLM
    from moetier.sampling_params import SamplingParams

    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 448, (int(torch.randint(1, 30, (1,), generator=g)),), generator=g).tolist()
               for _ in range(8)]
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    solo = LLM(tiny_ckpt, device="cpu")
    want = [solo.generate([p], params)[0].outputs[0].token_ids for p in prompts]
    # rates that split the misses: both paths run in every decode step with misses
    opts = ExpertOptions("hybrid", slots=4, rates=PathRates(50.0, {"float32": 50.0}), host_threads=1)
    llm = LLM(tiny_ckpt, device="cpu", experts=opts)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert got == want
    s = llm.metrics()["expert_stats"]
    assert s["host"] > 0 and s["misses"] > 0


# -- bench decode rows -------------------------------------------------------------------------------
def test_bench_decode_hybrid_rows_on_cpu(tmp_path):
    import json

    from moetier.bench import decode
    from moetier.checkpoint.random_bed import random_bed
    from moetier.presets import preset
    from moetier.traces.format import write_trace
    from moetier.traces.synth import SynthParams, meta_of, synthesize

    cfg = preset("tiny")
    trace = tmp_path / "uniform.mtrace"  # skew 0: uniform routing, as the H200 rows use
    p = SynthParams(experts=cfg.num_experts, top_k=cfg.top_k, layers=cfg.num_layers, tokens=256, skew=0.0, seed=1)
    write_trace(trace, synthesize(p), meta_of(p))
    # a bench_cpu_experts.py record whose winner streams as fast as the link: the misses split
    profile = tmp_path / "cpu.json"
    profile.write_text(json.dumps({"shape": {"dtype": "fp32"}, "winner": {"kernel": "grouped", "threads": 1,
                                   "GBps": 10.0, "overhead_s": 0.0}, "results": []}))
    bed = random_bed(cfg, seed=1, device="cpu", dtype=torch.float32)
    args = {"tokens": 4, "warmup": 2, "prompt_len": 5, "hf_tokens": 2, "policy": "lfru", "decode_tokens": 16,
            "seed": 0, "host_profile": str(profile)}
    data = decode.run(cfg, str(trace), [0.5], [1, 4], ["hybrid"], args, bed=bed, bw={"hbm_GBps": 100.0,
                                                                                    "link_GBps": 10.0})
    rows = data["rows"]
    assert [(r["backend"], r["budget"], r["batch"]) for r in rows] == [("hybrid", 0.5, 1), ("hybrid", 0.5, 4)]
    for r in rows:
        assert r["timed_tokens"] == r["batch"] * args["tokens"] and r["graph_steps"] == 0
        assert r["hybrid"]["host_experts_per_layer_step"] > 0 and r["hybrid"]["rates"]["host_GBps"] == {"float32": 10.0}
    assert "host" in decode.table(rows)


def test_cuda_path_in_the_triton_interpreter():
    from tests.interpreter import run_script

    assert "ok" in run_script("hybrid_interpreter.py")


# -- piecewise capture, its bookkeeping on the CPU (fake graphs: the split, the parts, the replay order) --
def test_piecewise_split_bookkeeping_with_fake_graphs(tiny_ckpt, monkeypatch):
    import contextlib

    from helpers import Sequence

    from moetier.checkpoint.loader import load_model
    from moetier.engine import piecewise

    log = []

    class FakeGraph:
        def capture_begin(self, pool=None):
            log.append(("begin", id(self)))

        def capture_end(self):
            log.append(("end", id(self)))

        def replay(self):
            log.append(("replay", id(self)))

    class FakeStream:
        def wait_stream(self, other):
            pass
    monkeypatch.setattr(torch.cuda, "CUDAGraph", FakeGraph)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(torch.cuda, "Stream", FakeStream)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a: FakeStream())
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    opts = ExpertOptions("hybrid", slots=4, rates=PathRates(1e6, {"float32": 1e-3}))  # all link: exact
    _, model, _ = load_model(tiny_ckpt, experts=opts)
    blocks = model.moe_blocks()
    assert piecewise.needs_pieces(model) and len(blocks) > 1
    seq = Sequence(model, 64)
    pieces, _ = piecewise.capture_pieces(model, lambda: seq.forward(torch.tensor([5, 17, 300])), pool=None)
    assert len(pieces.graphs) == len(blocks) + 1 and len(pieces.eager) == len(blocks)
    assert [e for e, _ in log] == ["begin", "end"] * (len(blocks) + 1)
    assert all(b.eager_split is None for b in blocks)  # unset after the capture
    assert sum(b.experts.stats()["steps"] for b in blocks) == 0  # no backend ran while capturing
    log.clear()
    # the fake capture ran the rest of the model on `out` buffers never written: give every part the
    # input a graph would have written (fresh, finite), and poison its output
    g = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        for part in pieces.eager:
            t, k = part.ids.shape
            part.hidden.copy_(torch.randn(part.hidden.shape, generator=g))
            part.ids.copy_(torch.stack([torch.randperm(32, generator=g)[:k] for _ in range(t)]))
            part.weights.copy_(torch.rand(t, k, generator=g))
            part.out.fill_(float("nan"))
    pieces.replay()
    assert [e for e, _ in log] == ["replay"] * (len(blocks) + 1)
    for part, b in zip(pieces.eager, blocks):
        rows = b.experts.host
        want = ResidentExperts(rows, b.experts.layout, b.experts.top_k, 64).forward(part.hidden, part.ids,
                                                                                    part.weights)
        assert torch.equal(part.out, want)
        assert b.experts.stats()["steps"] == 1


# -- CUDA ---------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("rows", ["bf16", "fp8"])
@pytest.mark.parametrize("kernel", ["grouped", "compiled"])
@pytest.mark.parametrize("t", [1, 8, 32])
def test_gpu_hybrid_against_resident(t, kernel, rows):
    from moetier.experts.cache.store import HostStore
    from tests.test_host_ext import fp8_rows

    lay = RowLayout(256, 128)
    src = (torch.randn(32, lay.numel) * 0.05).to(torch.bfloat16)
    if rows == "fp8":  # the same weights quantized: FP8 rows in the exact-pinned store
        src, lay = fp8_rows(src, lay), RowLayout(256, 128, "fp8")
    store = HostStore([0], 32, lay, torch.bfloat16, pin=True)
    host = store.rows(0)
    host.copy_(src)
    res = ResidentExperts(host.cuda(), lay, 8, 32)
    runs = {"link": (1e6, 1e-3), "split": (50.0, 50.0), "host": (1e-3, 1e6)}
    hyb = {n: HybridExperts(host, lay, 8, 12, 32, "cuda", host=HostPath(lay, kernel, None,
                                                                          PathRates(a, {BF16: b, "fp8": b})))
           for n, (a, b) in runs.items()}
    g = torch.Generator().manual_seed(t)
    for _ in range(6):
        ids = torch.stack([torch.randperm(32, generator=g)[:8] for _ in range(t)]).cuda()
        x = torch.randn(t, 256, generator=g).to(torch.bfloat16).cuda()
        w = torch.rand(t, 8, generator=g).cuda()
        want = res.forward(x, ids, w).clone()
        for n, b in hyb.items():
            got = b.forward(x, ids, w)
            if n == "link":
                assert torch.equal(got, want)
            else:
                # grouped's host pairs round their outputs to bf16 where the device kernel keeps fp32 (the
                # compiled kernel's FP8 weights and SwiGLU round as the device's do): 1e-2 of the
                # norm, and 2e-2 of the largest value elementwise (cancellation in the k-sum)
                d = got.float() - want.float()
                assert d.norm() <= 1e-2 * want.float().norm(), n
                assert d.abs().max() <= 2e-2 * want.float().abs().max(), n
    assert hyb["host"].stats()["misses"] == 0 and hyb["split"].stats()["host"] > 0
    for b in hyb.values():
        b.cache.check()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_engine_hybrid_piecewise_and_eager(tiny_ckpt):
    """Piecewise graphs (split at the hybrid MoE layers) and eager decode give resident's tokens when
    every miss goes over the link; with a split they run and replay graphs. (On CUDA a host pair's bits
    differ from the device kernel's, so batch == alone holds only where the choices agree: not tested.)"""
    from moetier.engine import LLM
    from moetier.sampling_params import SamplingParams

    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 448, (int(torch.randint(1, 30, (1,), generator=g)),), generator=g).tolist()
               for _ in range(6)]
    params = SamplingParams(max_tokens=12, ignore_eos=True)

    def run(opts, hold=False, **engine):
        llm = LLM(tiny_ckpt, device="cuda", experts=opts, **engine)
        if hold:  # the pieces on every step, never the whole slots-step graph
            llm.runner.graphs.switch = None
        outs = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        return llm, outs
    _, want = run(ExpertOptions("resident"))
    # hybrid_nodes=False: the pieces (the CUDA default is the nodes mode: tests/test_hybrid_nodes.py)
    link = ExpertOptions("hybrid", slots=4, rates=PathRates(1e6, {"float32": 1e-3}), hybrid_nodes=False)
    for hold, engine in ((True, {}), (False, {}), (False, dict(cuda_graphs=False))):
        llm, got = run(link, hold, **engine)
        assert got == want, (hold, engine)
        graphs = llm.runner.graphs
        assert (graphs is not None and llm.runner.graph_steps > 0) == engine.get("cuda_graphs", True)
        if graphs is not None and not hold:
            assert sum(graphs.switch.counts.values()) == llm.runner.graph_steps
            assert all(s >= 0 for s in graphs.overhead_s.values())
    split = ExpertOptions("hybrid", slots=4, rates=PathRates(50.0, {"float32": 50.0}), hybrid_nodes=False)
    llm, batch = run(split, hold=True)  # the pieces on every step (the switch starts whole)
    assert llm.runner.graph_steps > 0 and llm.metrics()["expert_stats"]["host"] > 0
    assert [len(t) for t in batch] == [12] * len(prompts)
