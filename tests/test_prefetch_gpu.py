"""Next-layer expert prefetch on CUDA (marked gpu, skipped without CUDA): the prefetch step and its fills
on the side stream, captured inside the decode graphs with the step, give the tokens of prefetch off,
graph-replayed and eager; a perfect guess (the replayed trace's) leaves the later layers fewer misses,
and the early router of the embedded model (real weights) names some of them."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

TRACE = Path(__file__).parents[1] / "data" / "traces" / "tiny-stdlib-heldout.mtrace"


def run(prefetch: str, graphs: bool = True):
    from moetier.engine import LLM
    from moetier.experts.placement import ExpertOptions
    from moetier.sampling_params import SamplingParams

    llm = LLM(device="cuda", experts=ExpertOptions("slots", slots=8, prefetch=prefetch), replay_trace=TRACE,
              max_num_seqs=8, cuda_graphs=graphs)
    res = llm.generate(["def parse(line):", "class Node:", "import os\n"],
                       SamplingParams(max_tokens=80, ignore_eos=True))
    stats = [b.experts.stats() for b in llm.model.moe_blocks()]
    for b in llm.model.moe_blocks():
        b.experts.cache.check()
    assert (llm.runner.graph_steps > 10) == graphs
    llm.close()
    return [r.outputs[0].token_ids for r in res], stats


def test_prefetch_in_graphs_keeps_the_tokens_and_takes_misses():
    off, st_off = run("off")
    for mode in ("router", "trace"):
        got, st = run(mode)
        assert got == off, mode
        assert st[0]["prefetch_steps"] == 0 and all(s["prefetch_steps"] > 0 for s in st[1:])
        assert [s["steps"] for s in st] == [s["steps"] for s in st_off]
        later = sum(s["misses"] for s in st[1:])
        if mode == "trace":
            assert later < sum(s["misses"] for s in st_off[1:]) and all(s["prefetch_fills"] > 0 for s in st[1:])
        print(mode, "later layers' misses", later, "against", sum(s["misses"] for s in st_off[1:]))
    eager, _ = run("trace", graphs=False)
    assert eager == off
