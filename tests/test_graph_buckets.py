"""Context buckets of the decode graphs (engine/graphs.py): the widths a page table is captured at, and
on CUDA, for the two indexer families (GLM-5's DSA, glm5_next's kpool), decode replayed from the
narrower graphs gives eager's greedy tokens, with sequences crossing from one bucket into the next."""

from __future__ import annotations

import pytest
import torch

from moetier.plan.residents import width_buckets


def test_width_buckets_grow_by_four_and_end_at_the_width():
    assert width_buckets(1, 16) == (1,)
    assert width_buckets(256, 16) == (256,)  # 4,096 tokens in 16-token pages: one bucket
    assert width_buckets(257, 16) == (256, 257)
    assert width_buckets(65536, 16) == (256, 1024, 4096, 16384, 65536)
    assert width_buckets(65537, 16) == (256, 1024, 4096, 16384, 65536, 65537)
    assert width_buckets(10, 64, first_tokens=100) == (2, 7, 10)  # rounded up to whole pages
    assert width_buckets(40, 16, first_tokens=16) == (1, 4, 16, 40)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("preset", ["tiny-glm5", "tiny-glm5-next"])
def test_narrow_graphs_equal_eager(tmp_path, monkeypatch, preset):
    if preset == "tiny-glm5-next":
        pytest.importorskip("fla", reason="fla-core is not installed (pip install fla-core==0.6.0)")
    from moetier.checkpoint.writer import make_checkpoint
    from moetier.engine import LLM
    from moetier.engine import graphs as graphs_mod
    from moetier.sampling_params import SamplingParams

    path = make_checkpoint(tmp_path / preset, preset, seed=5, dtype="float32")
    g = torch.Generator().manual_seed(8)
    # with 16-token buckets a step replays the bucket of the batch's longest context: the batch's
    # (16 pages), then each prompt alone: 3 tokens decode at widths 1 and 4, 40 at 4, 100 at 16
    lens = [3, 40, 12, 70, 25, 100]
    prompts = [torch.randint(0, 512, (n,), generator=g).tolist() for n in lens]
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    monkeypatch.setattr(graphs_mod, "BUCKET_TOKENS", 16)
    runs, used = {}, set()
    for graphs in (False, True):
        llm = LLM(path, dtype="float32", device="cuda", max_num_seqs=8, max_num_tokens=128, cuda_graphs=graphs)
        if graphs:
            dg = llm.runner.graphs
            assert len(dg.buckets) > 2 and len(dg.by_width) == len(dg.sizes) * len(dg.buckets), dg.buckets
            width_of = dg.width_of
            def record(seqs, width_of=width_of):
                w = width_of(seqs)
                used.add(w)
                return w
            monkeypatch.setattr(dg, "width_of", record)
        runs[graphs] = [o.outputs[0].token_ids for o in llm.generate(prompts, [params] * len(prompts))]
        runs[graphs] += [llm.generate([p], params)[0].outputs[0].token_ids for p in prompts]
        assert (llm.runner.graph_steps > 10) == graphs
        if graphs:
            assert len(used) >= 3 and min(used) < dg.width, (used, dg.buckets)  # narrow graphs really ran
        llm.scheduler.check()
        llm.close()
    assert runs[True] == runs[False]
