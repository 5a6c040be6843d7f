"""glm5_next on CUDA (marked `gpu`, skipped without CUDA; needs fla-core): the tiny preset's model on
the device against the same checkpoint on the CPU (our torch references: KDA, mHC, the kpool
indexer), prefill and decode; then through the engine: decode replayed from CUDA graphs (the state
slots inside them) gives eager's greedy tokens, the expert backends agree bit for bit, a batch
equals each request alone, and the scheduler's pools stay whole."""

from __future__ import annotations

import pytest
import torch

from tests.test_parity import rel_err

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
if torch.cuda.is_available():
    pytest.importorskip("fla", reason="fla-core is not installed (pip install fla-core==0.6.0)")

PRESET = "tiny-glm5-next"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from moetier.checkpoint.writer import make_checkpoint

    return make_checkpoint(tmp_path_factory.mktemp("glm5next-gpu") / "ckpt", PRESET, seed=4, dtype="float32")


def test_model_on_cuda_tracks_the_cpu_references(checkpoint, tmp_path):
    """float32: a prompt in two steps (a carried KDA state), then decode steps (fla's recurrent step,
    the decode conv and fused mHC kernels, the fixed-shape kpool selection, the latent attention
    kernel) against the CPU's reference paths. Both models route from the same trace, and the context
    stays within index_topk + index_kpool - 1 tokens (every token attended), so that no expert or pool
    choice can flip on rounding (the replayer gives the trace's experts the router's weights largest
    first: the CPU's and the CUDA router's picks come in other orders). With fla's dots in IEEE float32
    the model is within float32 rounding of the references; as shipped, fla's chunked kernel takes TF32
    dots (10-bit mantissas) and lands further off, a lost state or a wrong slot still far beyond. Long
    prompts: tests/test_kda_gpu.py."""
    from moetier.engine.llm import LLM
    from moetier.traces.format import read_trace, write_trace
    from moetier.traces.hooks import Replayer
    from moetier.traces.synth import SynthParams, meta_of, synthesize
    from tests.helpers import Sequence, ieee_fp32_dots

    cpu = LLM(checkpoint, dtype="float32", device="cpu").model
    gpu = LLM(checkpoint, dtype="float32", device="cuda", cuda_graphs=False).model
    cfg = cpu.cfg
    p = SynthParams(experts=cfg.num_experts, top_k=cfg.top_k, layers=len(cpu.moe_blocks()), tokens=64, seed=3)
    write_trace(tmp_path / "t.mtrace", synthesize(p), meta_of(p))
    Replayer(cpu, read_trace(tmp_path / "t.mtrace"))
    replayer = Replayer(gpu, read_trace(tmp_path / "t.mtrace"))
    ids = torch.randint(0, 512, (19,), generator=torch.Generator().manual_seed(5))
    steps = ((0, 9), (9, 14), *((n, n + 1) for n in range(14, 19)))
    a = Sequence(cpu, 64, page_size=16)
    want = [cpu.logits(a.forward(ids[lo:hi])) for lo, hi in steps]

    def errors() -> list[float]:
        replayer.cursor.zero_()  # the trace from its start again
        b = Sequence(gpu, 64, page_size=16)
        return [rel_err(gpu.logits(b.forward(ids[lo:hi])).cpu(), w) for (lo, hi), w in zip(steps, want)]

    tf32 = errors()
    with ieee_fp32_dots("fla"):
        ieee = errors()
    assert max(ieee) <= 1e-4 and max(tf32) <= 2e-2, (ieee, tf32)


def workload():
    g = torch.Generator().manual_seed(6)
    from moetier.sampling_params import SamplingParams

    lens = [1, 90, 7, 33, 2, 64, 15, 120, 3, 50, 1, 26]  # one-token prompts run their first step eagerly
    prompts = [torch.randint(0, 512, (n,), generator=g).tolist() for n in lens]
    params = [SamplingParams(max_tokens=int(torch.randint(6, 20, (1,), generator=g)), ignore_eos=True) for _ in lens]
    return prompts, params


@pytest.fixture(scope="module")
def routing(checkpoint, tmp_path_factory):
    """A trace for the tiny preset: eager and graph runs route alike whatever their rounding (slots and
    uva then fill the same experts; the replayer advances by a padded replay's real rows only)."""
    from moetier.presets import preset
    from moetier.traces.format import write_trace
    from moetier.traces.synth import SynthParams, meta_of, synthesize

    cfg = preset(PRESET)
    moe = sum(cfg.is_moe_layer(i) for i in range(cfg.num_layers))
    p = SynthParams(experts=cfg.num_experts, top_k=cfg.top_k, layers=moe, tokens=512, skew=0.5, seed=7)
    path = tmp_path_factory.mktemp("routing") / "t.mtrace"
    write_trace(path, synthesize(p), meta_of(p))
    return path


def test_engine_graphs_equal_eager_and_backends_bit_exact(checkpoint, routing):
    """The same workload eagerly and from decode graphs (state slots in them), on resident, slots and
    uva: the same greedy tokens everywhere; the graphs really ran; the pools stay whole."""
    from moetier.engine.llm import LLM
    from moetier.experts.placement import ExpertOptions

    prompts, params = workload()
    runs = {}
    for name, opts, graphs in (("eager", ExpertOptions("resident"), False),
                               ("resident", ExpertOptions("resident"), True),
                               ("slots", ExpertOptions("slots", slots=4), True),
                               ("uva", ExpertOptions("uva"), True)):
        llm = LLM(checkpoint, dtype="float32", device="cuda", experts=opts, max_num_seqs=8, max_num_tokens=128,
                  cuda_graphs=graphs, replay_trace=routing)
        runs[name] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        assert (llm.runner.graph_steps > 10) == graphs, (name, llm.runner.graph_steps)
        llm.scheduler.check()
        if name == "slots":
            assert llm.metrics()["expert_stats"]["misses"] > 20  # 4 slots of 16 experts: the cache works hard
        llm.close()
    assert runs["resident"] == runs["eager"]
    assert runs["slots"] == runs["resident"] == runs["uva"]


def test_engine_batch_equals_alone_in_graphs(checkpoint):
    """The router's own choices (a trace would route a request alone by other rows): sequences of
    different lengths share KDA steps and graphs of other sizes, each as it runs alone."""
    from moetier.engine.llm import LLM
    from moetier.experts.placement import ExpertOptions

    prompts, params = workload()
    llm = LLM(checkpoint, dtype="float32", device="cuda", experts=ExpertOptions("slots", slots=4), max_num_seqs=8,
              max_num_tokens=128)
    batch = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert llm.runner.graph_steps > 10
    alone = [llm.generate([p], sp)[0].outputs[0].token_ids for p, sp in zip(prompts, params)]
    assert batch == alone
    llm.scheduler.check()
    llm.close()


def test_engine_hybrid_backend_runs_in_graphs(checkpoint):
    """hybrid: some misses computed by the host kernels (their own summation order: not bit-exact
    against resident); it serves the workload from its graphs and keeps its pools whole."""
    from moetier.engine.llm import LLM
    from moetier.experts.placement import ExpertOptions

    prompts, params = workload()
    llm = LLM(checkpoint, dtype="float32", device="cuda", experts=ExpertOptions("hybrid", slots=4), max_num_seqs=8,
              max_num_tokens=128)
    outs = llm.generate(prompts, params)
    assert [len(o.outputs[0].token_ids) for o in outs] == [p.max_tokens for p in params]
    assert llm.runner.graph_steps > 10
    llm.scheduler.check()
    llm.close()
