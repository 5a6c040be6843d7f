"""Overlapped scheduling on CUDA (engine/overlap.py): decode graphs whose input ids are gathered on the
device from the step in flight, the host twins of their inputs used in turn, the tokens read through
pinned memory after an event. Greedy and seeded tokens equal the synchronous loop's with graphs."""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("preset", ["tiny", "tiny-glm5-next"])
def test_async_scheduling_with_graphs_equals_the_synchronous_loop(tmp_path, preset):
    if preset == "tiny-glm5-next":
        pytest.importorskip("fla", reason="fla-core is not installed (pip install fla-core==0.6.0)")
    from moetier.checkpoint.writer import make_checkpoint
    from moetier.engine import LLM
    from moetier.sampling_params import SamplingParams

    path = make_checkpoint(tmp_path / preset, preset, seed=5, dtype="float32")
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, 512, (n,), generator=g).tolist() for n in (3, 40, 12, 70, 25)]
    # different ends: max_tokens (one at a page boundary of 16-token pages), EOS allowed, seeded sampling
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in (13, 24, 30)]
    params += [SamplingParams(max_tokens=20), SamplingParams(max_tokens=26, temperature=0.8, seed=3, ignore_eos=True)]
    runs = {}
    for overlap in (False, True):
        llm = LLM(path, dtype="float32", device="cuda", max_num_seqs=8, max_num_tokens=128, async_scheduling=overlap)
        outs = llm.generate(prompts, params)
        runs[overlap] = [(o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in outs]
        runs[overlap] += [llm.generate([p], sp)[0].outputs[0].token_ids for p, sp in zip(prompts[:2], params[:2])]
        assert llm.runner.graph_steps > 40
        if overlap:
            assert llm.overlap.launched_ahead > 40
        llm.scheduler.check()
        assert llm.scheduler.cache.num_in_use == 0
        llm.close()
    assert runs[True] == runs[False]
