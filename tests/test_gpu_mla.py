"""GPU tests of the DeepSeek-V3 family (marked `gpu`, skipped without CUDA): float32 parity with
transformers on the device, the engine's backends and batching on the device, eagerly and from
CUDA graphs (those need the latent attention kernel, layers/latent_attention_triton.py)."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from tests.conftest import hf_mla_checkpoint
from tests.test_parity import rel_err

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
HAS_KERNEL = importlib.util.find_spec("moetier.layers.latent_attention_triton") is not None
PRESETS = ["tiny-dsv3", "tiny-glm5"]


@pytest.mark.parametrize("preset", PRESETS)
def test_float32_on_gpu_matches_transformers(tmp_path, preset):
    from moetier.engine.llm import LLM
    from tests.helpers import Sequence

    path, ref = hf_mla_checkpoint(tmp_path / preset, preset, 11)
    model = LLM(path, dtype="float32", device="cuda", cuda_graphs=False).model
    ids = torch.randint(0, 512, (29,), generator=torch.Generator().manual_seed(11))
    seq = Sequence(model, 64, page_size=16)
    ours = model.logits(seq.forward(ids[:21])).cpu()
    with torch.no_grad():
        want = ref(ids[None, :21]).logits[0]
    assert rel_err(ours, want) <= 1e-4
    for n in range(21, 29):  # decode steps: on CUDA the indexer takes its fixed-shape path
        ours = model.logits(seq.forward(ids[n:n + 1])).cpu()
        with torch.no_grad():
            want = ref(ids[None, : n + 1]).logits[0, -1:]
        assert rel_err(ours, want) <= 1e-4


@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("graphs", [False, pytest.param(True, marks=pytest.mark.skipif(
    not HAS_KERNEL, reason="decode graphs need layers/latent_attention_triton.py"))])
def test_engine_on_gpu_backends_and_batch_equal_alone(tmp_path, preset, graphs):
    from moetier.checkpoint.writer import make_checkpoint
    from moetier.engine import LLM
    from moetier.experts.placement import ExpertOptions
    from tests.test_engine import workload

    path = make_checkpoint(tmp_path / preset, preset, seed=12, dtype="bf16")
    prompts, params = workload(n=16, vocab=512)
    outs = {}
    for name, opts in {"resident": ExpertOptions("resident"), "slots": ExpertOptions("slots", slots=4),
                       "uva": ExpertOptions("uva")}.items():
        llm = LLM(path, device="cuda", experts=opts, max_num_seqs=8, max_num_tokens=64, cuda_graphs=graphs)
        outs[name] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        assert (llm.runner.graph_steps > 10) == graphs
        if name == "slots":
            assert llm.metrics()["expert_stats"]["misses"] > 20  # 4 slots of 16 experts: the cache works hard
            alone = [llm.generate([p], sp)[0].outputs[0].token_ids for p, sp in zip(prompts, params)]
            assert outs[name] == alone
        llm.scheduler.check()
    assert outs["slots"] == outs["resident"] == outs["uva"]


def test_fixed_shape_selection_captures_and_equals_the_reference():
    """The decode selection as the indexer runs it on CUDA (the scoring kernel, then topk), captured."""
    from moetier.layers.attention import make_batch
    from moetier.layers.dsa_indexer import select_topk_reference, topk_positions
    from moetier.layers.dsa_select_triton import key_scores
    from tests.test_gpu import capture

    g = torch.Generator().manual_seed(4)
    index_k = torch.rand(12, 4, 16, generator=g).cuda()
    batch = make_batch([(9, 1, [3, 7, 1]), (13, 1, [5, 11, 4, 9]), (2, 1, [6, 8])], 4, "cuda")
    q, w = torch.rand(3, 3, 16, generator=g).cuda(), torch.rand(3, 3, generator=g).cuda()
    graph, got = capture(lambda: topk_positions(key_scores(q, w, index_k, batch, 0.25), 5))
    graph.replay()
    want = select_topk_reference(q, w, index_k, batch, 5, 0.25)
    assert torch.equal(got.sort(-1).values, want.sort(-1).values)


@pytest.mark.parametrize("narrow", [False, True])
def test_decode_scoring_kernel_at_glm5_sizes_and_in_a_graph(narrow):
    """layers/dsa_select_triton.key_scores at GLM-5's indexer shape (32 heads of 128, pages of 64, top
    2048) over contexts of 5 to 3,000 tokens in a window of 64 pages (a narrow one: a column view of a
    wider table, as a graph bucket): -inf where the torch form masks, the rest within float32
    rounding, and the same keys picked (positive inputs: no exact ties), replayed from a graph."""
    import dataclasses

    from moetier.layers.attention import make_batch
    from moetier.layers.dsa_indexer import key_scores_fixed, topk_positions
    from moetier.layers.dsa_select_triton import key_scores
    from tests.test_gpu import capture

    g = torch.Generator().manual_seed(6)
    pages = torch.randperm(256, generator=g)
    seqs = [(4, 1, pages[:1].tolist()), (700, 1, pages[1:12].tolist()), (2999, 1, pages[12:59].tolist()),
            (2100, 1, pages[59:93].tolist())]
    batch = make_batch(seqs, 64, "cuda")
    width = 64
    table = torch.zeros(len(seqs), width + (5 if narrow else 0), dtype=batch.page_table.dtype, device="cuda")
    table[:, :batch.page_table.shape[1]] = batch.page_table
    batch = dataclasses.replace(batch, page_table=table[:, :width])
    index_k = torch.rand(256, 64, 128, generator=g).bfloat16().cuda()
    q = torch.rand(len(seqs), 32, 128, generator=g).bfloat16().cuda()
    w = torch.rand(len(seqs), 32, generator=g).cuda()
    want = key_scores_fixed(q, w, index_k, batch, 128 ** -0.5)
    graph, got = capture(lambda: key_scores(q, w, index_k, batch, 128 ** -0.5))
    graph.replay()
    inf = float("-inf")
    assert torch.equal(got == inf, want == inf)
    live = want != inf
    assert ((got[live] - want[live]).abs() / want[live].abs()).max().item() <= 1e-5
    # the same keys picked (their order may part where two scores agree to float32 rounding)
    assert torch.equal(topk_positions(got, 2048).sort(-1).values, topk_positions(want, 2048).sort(-1).values)


@pytest.mark.parametrize("e,n_group,topk_group", [(256, 8, 4), (256, 1, 1), (288, 1, 1)])
def test_grouped_router_kernel_on_gpu_and_in_a_graph(e, n_group, topk_group):
    """DeepSeek-V3's router shape (256 experts, 8 groups keep 4, top-8), GLM-5's (one group) and
    GLM-5.3-Flash's (288 experts, one group): the kernel's picks are the reference's, in its order,
    replayed from a graph too."""
    from moetier.layers.router import grouped_route_reference
    from moetier.layers.router_triton import route_grouped
    from tests.test_gpu import capture

    g = torch.Generator().manual_seed(2)
    logits = torch.stack([(torch.randperm(e, generator=g).float() - e / 2) / 32 for _ in range(64)]).cuda()
    bias = (torch.randn(e, generator=g) * 0.05).cuda()
    want_ids, want_w = grouped_route_reference(logits, bias, 8, n_group, topk_group, True, 2.5)
    graph, (ids, w) = capture(lambda: route_grouped(logits, bias, 8, n_group, topk_group, True, 2.5, torch.float32))
    graph.replay()
    assert torch.equal(ids, want_ids)  # in the same order too: largest weight first (layers/router.py)
    torch.testing.assert_close(w, want_w, rtol=1e-6, atol=0)
