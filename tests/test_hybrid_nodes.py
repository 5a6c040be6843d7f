"""The hybrid backend's nodes mode (experts/hybrid/nodes.py, hybrid_plan.py, csrc/host_node.cpp): the
plan's reference against CostModel.split, the plan kernel in Triton's interpreter, the host node
function against the compiled kernel, the mode on the CPU against the eager hybrid path (bits) and
resident (bf16 tolerance), the engine's batch == alone and the bench's nodes rows; on CUDA (marked gpu)
one layer's step captured in a CUDA graph, the engine's tokens, and no host sync in the step."""

from __future__ import annotations

import ctypes

import pytest
import torch

from moetier.experts.hybrid import host_ext
from moetier.experts.backends import ResidentExperts
from moetier.experts.hybrid.cost_model import CostModel, PathRates
from moetier.experts.hybrid.backend import HostPath, HybridExperts
from moetier.experts.hybrid.nodes import HybridNodesExperts, NodeJob
from moetier.experts.hybrid.device_plan import PlanBuffers, plan_rates, plan_reference
from moetier.experts.placement import ExpertOptions
from moetier.experts.shape import RowLayout

needs_ext = pytest.mark.skipif(not host_ext.available()[0], reason="the compiled host kernel does not build here")
E, K, S, H, I = 16, 4, 6, 64, 32


def split_host_set(ids: torch.Tensor, expert_slot: torch.Tensor, model: CostModel) -> set[int]:
    """HybridExperts.choose's host set, by CostModel.split."""
    tokens: dict[int, int] = {}
    for e, s in zip(ids.reshape(-1).tolist(), expert_slot[ids.reshape(-1).clamp(min=0)].tolist()):
        if s < 0 <= e:
            tokens[e] = tokens.get(e, 0) + 1
    return {e for e, h in zip(tokens, model.split(list(tokens.values())).host) if h} if tokens else set()


def test_plan_reference_is_cost_model_split():
    g = torch.Generator().manual_seed(0)
    for n in range(300):
        e, t, k = [(16, 3, 4), (128, 1, 8), (128, 8, 8), (128, 64, 8), (8, 5, 2)][n % 5]
        ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
        ids[torch.rand(t, k, generator=g) < 0.1] = -1
        expert_slot = torch.full((e,), -1, dtype=torch.int32)
        s = int(torch.randint(0, e, (1,), generator=g))
        expert_slot[torch.randperm(e, generator=g)[:s]] = torch.arange(s, dtype=torch.int32)
        r = torch.rand(4, generator=g).tolist()
        host = 0.0 if n % 17 == 0 else 10 ** (3 * r[1] - 1)
        model = CostModel(PathRates(10 ** (3 * r[0] - 1), {"bfloat16": host}, r[2] * 1e-3, r[3] * 1e-4 * (n % 2)),
                          9_437_184, "bfloat16")
        plan, counters = PlanBuffers(e, t * k, "cpu"), torch.zeros(2, dtype=torch.int64)
        plan_reference(ids, expert_slot, plan_rates(model, t), plan, counters)
        want = split_host_set(ids, expert_slot, model)
        flat = ids.reshape(-1)
        host_pairs = [p for p, x in enumerate(flat.tolist()) if x in want]
        assert counters.tolist() == [len(want), len(host_pairs)]
        assert plan.dev_ids.tolist() == [-1 if x in want else x for x in flat.tolist()]
        nh = int(plan.job[0])
        assert nh == len(host_pairs) and plan.pos.tolist() == host_pairs + [t * k] * (t * k - nh)
        assert plan.job[1:1 + nh].tolist() == [p // k for p in host_pairs]
        assert plan.job[1 + t * k:1 + t * k + nh].tolist() == [int(flat[p]) for p in host_pairs]


def test_plan_kernel_in_the_triton_interpreter():
    from tests.interpreter import run_script

    assert "ok" in run_script("hybrid_nodes_interpreter.py")


@needs_ext
def test_nodes_cuda_path_in_the_triton_interpreter():
    """The CUDA forward on the CPU: one-token steps too (their device pairs once read past hidden's row)."""
    from tests.interpreter import run_script

    assert "ok" in run_script("hybrid_nodes_cuda_interpreter.py")


def test_grouped_gemm_refuses_x_that_is_not_dense_rows():
    """The kernels read token t's row at x + t * H: a stride-0 view (expand of one token) is refused."""
    from moetier.experts.kernels.grouped_gemm import GemmScratch, grouped_expert_mlp

    x = torch.randn(1, H).expand(K, H)
    ids = torch.zeros(K, 1, dtype=torch.int64)
    with pytest.raises(ValueError, match="dense"):
        grouped_expert_mlp(x, ids.int(), ids, torch.ones(K, 1), torch.zeros(1, 3 * H * I), None, H, I,
                           GemmScratch.make(K, H, I, torch.device("cpu")), torch.empty(K, H))


def setup(dtype=torch.bfloat16, seed=0):
    lay = RowLayout(H, I)
    g = torch.Generator().manual_seed(seed)
    return lay, (torch.randn(E, lay.numel, generator=g) * 0.1).to(dtype), g


def steps(g, n=12, t=3, dtype=torch.bfloat16):
    for _ in range(n):
        ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(t)])
        ids[0, 1] = -1  # another rank's expert: nobody's work
        yield torch.randn(t, H, generator=g).to(dtype), ids, torch.rand(t, K, generator=g)


def pair(lay, rows, link, host):
    rates = PathRates(link, {"bfloat16": host, "float32": host})
    return (HybridExperts(rows, lay, K, S, 16, host=HostPath(lay, "compiled", 2, rates)),
            HybridNodesExperts(rows, lay, K, S, 16, host=HostPath(lay, "compiled", 2, rates)))


@needs_ext
def test_host_node_function_equals_the_compiled_kernel():
    lay, rows, g = setup()
    lib = host_ext.load()
    assert lib.moetier_host_node_job_size() == ctypes.sizeof(NodeJob)
    p, t = 12, 5
    x = torch.randn(t, H, generator=g).to(torch.bfloat16).float()
    tok, exp = torch.randint(0, t, (p,), generator=g), torch.randint(0, E, (p,), generator=g)
    want = host_ext.pair_outputs(lib, x.to(torch.bfloat16), tok, exp, rows, lay, 2)
    n = 7  # the job's buffers hold p pairs; this step has n
    plan = torch.zeros(1 + 2 * p, dtype=torch.int64)
    plan[0], plan[1:1 + n], plan[1 + p:1 + p + n] = n, tok[:n], exp[:n]
    h, y = torch.zeros(p, I), torch.full((p, H), float("nan"))
    job = NodeJob(rows.data_ptr(), E, rows.shape[1] * 2, 0, H, I, 0, 0, 1, -1.0, x.data_ptr(), t, plan.data_ptr(), p,
                  h.data_ptr(), y.data_ptr(), 2, 0)
    lib.moetier_host_node(ctypes.addressof(job))
    assert job.status == 0 and job.calls == 1 and job.pairs == n
    assert torch.equal(y[:n], want[:n]) and bool(y[n:].isnan().all())  # compacted, nothing past n written
    plan[1 + p] = E  # a bad expert: the node reports, it cannot raise
    lib.moetier_host_node(ctypes.addressof(job))
    assert job.status == 1 and b"expert" in job.err


@needs_ext
@pytest.mark.parametrize("link,host", [(1e6, 1e-3), (1e-3, 1e6), (50.0, 50.0)], ids=["all-link", "all-host", "split"])
def test_nodes_equal_the_eager_hybrid_path_bits(link, host):
    lay, rows, g = setup(seed=2)
    eager, nodes = pair(lay, rows, link, host)
    for x, ids, w in steps(g, t=3):
        assert torch.equal(nodes.forward(x, ids, w), eager.forward(x, ids, w))
    for x, ids, w in steps(g, n=3, t=1):
        assert torch.equal(nodes.forward(x, ids, w), eager.forward(x, ids, w))
    assert nodes.stats() == eager.stats() | {"host_us": nodes.stats()["host_us"]}
    assert (nodes.stats()["host"] > 0) == (host > 1)
    nodes.cache.check()
    nodes.reset()
    assert nodes.stats()["host"] == 0 and nodes.stats()["steps"] == 0


@needs_ext
def test_the_default_mode_is_nodes_on_cuda_only_where_it_ran():
    """hybrid_nodes None: nodes on CUDA with the compiled kernel, one rank and unquantized rows (not on
    the CPU, not with a torch host kernel, not over several ranks, not FP8 rows: never run in a nodes
    graph); hybrid_nodes True / False force a mode."""
    from moetier.experts.placement import ExpertPlacement
    from moetier.experts.registry import nodes_by_default
    from moetier.experts.shape import MoeShape

    assert nodes_by_default("cuda") and nodes_by_default("cuda", "compiled")
    assert not nodes_by_default("cpu") and not nodes_by_default("cuda", "grouped")
    assert not nodes_by_default("cuda", ranks=2) and not nodes_by_default("cuda", quant="fp8")
    lay, rows, _ = setup()
    rates = PathRates(50.0, {"bfloat16": 50.0, "fp8": 50.0})

    def built(quant=None, **opts):
        shape = MoeShape(E, K, H, I, quant)
        placement = ExpertPlacement(shape, torch.bfloat16, [0], ExpertOptions("hybrid", slots=S, rates=rates,
                                                                              **opts), "cpu", 16)
        host = rows if quant is None else torch.zeros(E, shape.layout.row_bytes(torch.bfloat16), dtype=torch.uint8)
        return type(placement.build(0, host))
    assert built() is HybridExperts  # the CPU: the eager path
    assert built(hybrid_nodes=True) is HybridNodesExperts and built(hybrid_nodes=False) is HybridExperts
    assert built("fp8") is HybridExperts


@needs_ext
def test_link_only_sends_nothing_to_the_host_and_restores_the_choice():
    """link_only (the engine times the host path's own cost inside it): both modes serve every miss over
    the link, with the same bits; after it the nodes plan's rates are back and the host takes its share."""
    lay, rows, g = setup(seed=3)
    eager, nodes = pair(lay, rows, 1e-3, 1e6)  # outside link_only: every miss to the host
    table = nodes.rates_table.clone()
    with eager.link_only(), nodes.link_only():
        for x, ids, w in steps(g, n=4, t=3):
            assert torch.equal(nodes.forward(x, ids, w), eager.forward(x, ids, w))
    assert eager.stats()["host"] == nodes.stats()["host"] == 0 and eager.stats()["misses"] > 0
    assert torch.equal(nodes.rates_table, table)
    for x, ids, w in steps(g, n=2, t=3):
        assert torch.equal(nodes.forward(x, ids, w), eager.forward(x, ids, w))
    assert eager.stats()["host"] == nodes.stats()["host"] > 0


@needs_ext
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_nodes_equal_resident_within_tolerance(dtype):
    lay, rows, g = setup(dtype, seed=4)
    res = ResidentExperts(rows, lay, K, 16)
    _, nodes = pair(lay, rows, 50.0, 50.0)
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-5  # compiled: up to 2 bf16 steps (test_hybrid.py)
    for x, ids, w in steps(g, dtype=dtype):
        want, got = res.forward(x, ids, w).float(), nodes.forward(x, ids, w).float()
        assert (got - want).abs().max() <= tol * want.abs().max()
    assert nodes.stats()["host"] > 0 and nodes.stats()["misses"] > 0
    assert HybridNodesExperts.graph_safe and not HybridExperts.graph_safe


def test_nodes_refuse_without_the_compiled_kernel():
    lay, rows, _ = setup()
    with pytest.raises(ValueError, match="needs the compiled host kernel"):
        HybridNodesExperts(rows, lay, K, S, 16, host=HostPath(lay, "grouped", 1, PathRates(1.0, {"bfloat16": 1.0})))


@needs_ext
def test_engine_batch_equals_alone_with_nodes(tiny_ckpt):
    from moetier.engine import LLM
    from moetier.sampling_params import SamplingParams

    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 448, (int(torch.randint(1, 30, (1,), generator=g)),), generator=g).tolist()
               for _ in range(8)]
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    opts = ExpertOptions("hybrid", slots=4, rates=PathRates(50.0, {"float32": 50.0}), host_threads=1,
                         hybrid_nodes=True)
    solo = LLM(tiny_ckpt, device="cpu", experts=opts)
    want = [solo.generate([p], params)[0].outputs[0].token_ids for p in prompts]
    llm = LLM(tiny_ckpt, device="cpu", experts=opts)
    assert all(isinstance(b.experts, HybridNodesExperts) for b in llm.model.moe_blocks())
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert got == want
    s = llm.metrics()["expert_stats"]
    assert s["host"] > 0 and s["misses"] > 0


@needs_ext
def test_bench_decode_nodes_rows_on_cpu(tmp_path, monkeypatch):
    import json

    from moetier.bench import decode
    from moetier.checkpoint.random_bed import random_bed
    from moetier.presets import preset
    from moetier.traces.format import write_trace
    from moetier.traces.synth import SynthParams, meta_of, synthesize

    cfg = preset("tiny")
    trace = tmp_path / "uniform.mtrace"
    p = SynthParams(experts=cfg.num_experts, top_k=cfg.top_k, layers=cfg.num_layers, tokens=256, skew=0.0, seed=1)
    write_trace(trace, synthesize(p), meta_of(p))
    profile = tmp_path / "cpu.json"  # a winner as fast as the link: the misses split (test_hybrid.py)
    profile.write_text(json.dumps({"shape": {"dtype": "fp32"}, "winner": {"kernel": "grouped", "threads": 1,
                                   "GBps": 10.0, "overhead_s": 0.0}, "results": []}))
    bed = random_bed(cfg, seed=1, device="cpu", dtype=torch.float32)
    # the nodes mode on the CPU, as nodes_by_default picks it on CUDA (the bench's rows use the default)
    use = decode.use_backend
    monkeypatch.setattr(decode, "use_backend", lambda *a, **kw: use(*a, **{**kw, "host_kernel": "compiled",
                                                                           "hybrid_nodes": True}))
    args = {"tokens": 4, "warmup": 2, "prompt_len": 5, "hf_tokens": 2, "policy": "lfru", "decode_tokens": 16,
            "seed": 0, "host_profile": str(profile), "hybrid_graphs": ["auto", "eager"]}
    data = decode.run(cfg, str(trace), [0.5], [1, 4], ["hybrid"], args, bed=bed,
                      bw={"hbm_GBps": 100.0, "link_GBps": 10.0})
    rows = data["rows"]
    assert not data["errors"], data["errors"]
    # the CPU captures no graphs: the auto rows are eager too, and say which mode the default made
    assert [(r["graphs"], r["batch"]) for r in rows] == [("eager", 1), ("eager", 4), ("nodes-auto", 1),
                                                         ("nodes-auto", 4)]
    for r in rows:
        assert r["timed_tokens"] == r["batch"] * args["tokens"]
        assert r["hybrid"]["host_experts_per_layer_step"] > 0
    assert rows[2]["hybrid"]["host_kernel"] == "compiled"


# -- CUDA ---------------------------------------------------------------------------------------------
def _gpu_layers(n: int, link: float = 50.0, host: float = 50.0):
    """n fresh backends over the same pinned rows: eager hybrid first, then nodes ones (own HostPaths)."""
    from moetier.experts.cache.store import HostStore

    lay = RowLayout(256, 128)
    store = HostStore([0], 32, lay, torch.bfloat16, pin=True)
    rows = store.rows(0)
    rows.copy_((torch.randn(32, lay.numel, generator=torch.Generator().manual_seed(5)) * 0.05).to(torch.bfloat16))
    rates = PathRates(link, {"bfloat16": host})
    out = [HybridExperts(rows, lay, 8, 12, 32, "cuda", host=HostPath(lay, "compiled", None, rates))]
    out += [HybridNodesExperts(rows, lay, 8, 12, 32, "cuda", host=HostPath(lay, "compiled", None, rates))
            for _ in range(n)]
    return store, out


def _step(g, t):
    ids = torch.stack([torch.randperm(32, generator=g)[:8] for _ in range(t)])
    ids[0, 2] = -1  # another rank's expert
    return (torch.randn(t, 256, generator=g).to(torch.bfloat16).cuda(), ids.cuda(),
            torch.rand(t, 8, generator=g).to(torch.bfloat16).cuda())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("t", [1, 8, 32])
def test_gpu_nodes_step_captured_equals_eager_nodes_and_eager_hybrid(t):
    store, (hyb, eager, graphed) = _gpu_layers(2)
    g = torch.Generator().manual_seed(t)
    xs, ids_s, ws = _step(g, t)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up: compile, make the job
        graphed.forward(xs, ids_s, ws)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graphed.reset()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):  # fails on any host sync inside the step
        out_s = graphed.forward(xs, ids_s, ws)
    host_steps = 0
    for _ in range(10):
        x, ids, w = _step(g, t)
        xs.copy_(x), ids_s.copy_(ids), ws.copy_(w)
        graph.replay()
        before = hyb.host_experts
        want = hyb.forward(x, ids, w).clone()
        got = eager.forward(x, ids, w).clone()
        assert torch.equal(out_s, got)
        if hyb.host_experts > before:  # a host set: the same choice, the same bits as the piecewise path's
            host_steps += 1
            assert torch.equal(got, want)
        else:  # all over the link: y + combine against the slots step's GEMM
            assert (got.float() - want.float()).abs().max() <= 1e-2 * want.float().abs().max()
    assert host_steps > 0
    assert graphed.stats() == eager.stats() | {"host_us": graphed.stats()["host_us"]}
    assert graphed.stats()["host"] == hyb.stats()["host"] and graphed.stats()["misses"] == hyb.stats()["misses"]
    graphed.cache.check()
    del graph, store


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_nodes_step_has_no_host_sync():
    store, (_, nodes) = _gpu_layers(1)
    g = torch.Generator().manual_seed(3)
    nodes.forward(*_step(g, 8))  # warm-up: compiles, makes the job
    torch.cuda.synchronize()
    steps = [_step(g, t) for t in (1, 8, 8, 32)]
    torch.cuda.set_sync_debug_mode("error")
    try:
        for x, ids, w in steps:
            nodes.forward(x, ids, w)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert nodes.stats()["host"] > 0
    del store


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_engine_nodes_one_graph_batch_equals_alone(tiny_ckpt):
    """Held to its host path's graph (switch None) the engine replays the whole step as one graph (no
    pieces) on every step; all over the link
    it gives resident's tokens; with a split, batched equals alone (tiny_ckpt's fp32 rows: host and device
    pairs differ in rounding only, so a greedy choice could in principle flip: then this fails and says
    so). With the switch (the default) it also captures the slots-step graph per size and replays one of
    the two every step."""
    from moetier.engine import LLM
    from moetier.sampling_params import SamplingParams

    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 448, (int(torch.randint(1, 30, (1,), generator=g)),), generator=g).tolist()
               for _ in range(6)]
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in LLM(tiny_ckpt, device="cuda").generate(prompts, params)]
    for rates in (PathRates(1e6, {"float32": 1e-3}), PathRates(50.0, {"float32": 50.0})):
        opts = ExpertOptions("hybrid", slots=4, rates=rates, hybrid_nodes=True)
        llm = LLM(tiny_ckpt, device="cuda", experts=opts)
        graphs = llm.runner.graphs
        assert graphs is not None and not graphs.piecewise and graphs.switch is not None
        graphs.switch = None  # the nodes graph on every step
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        assert llm.runner.graph_steps > 0
        if rates.link_GBps > 1e3:
            assert got == want and llm.metrics()["expert_stats"]["host"] == 0
        else:
            alone = [llm.generate([p], params)[0].outputs[0].token_ids for p in prompts]
            assert got == alone and llm.metrics()["expert_stats"]["host"] > 0
        llm.close()
    # the default: nodes (on CUDA with the compiled kernel) and the switch between its graph and the
    # slots step's; both variants' tokens are resident's when every miss goes over the link
    llm = LLM(tiny_ckpt, device="cuda", experts=ExpertOptions("hybrid", slots=4, rates=PathRates(1e6, {"float32": 1e-3})))
    graphs = llm.runner.graphs
    assert isinstance(llm.model.moe_blocks()[0].experts, HybridNodesExperts) and graphs.switch is not None
    assert set(graphs.whole) == set(graphs.graphs) and all(s >= 0 for s in graphs.overhead_s.values())
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == want
    assert sum(graphs.switch.counts.values()) == llm.runner.graph_steps > 0
    llm.close()
