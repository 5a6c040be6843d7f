"""Next-layer expert prefetch (experts/prefetch.py) on the CPU: outputs bit-exact with prefetch off, a
perfect guess (the replayed trace's) takes the later layers' misses off the step, its lookups counted
apart, the cache whole; the links made and refused. The CUDA side (a side stream inside the decode
graph) is tests/test_prefetch_gpu.py's."""

from __future__ import annotations

import gc
import weakref

import numpy as np
import pytest
import torch

from moetier.errors import MoetierError
from moetier.traces.format import write_trace
from moetier.traces.synth import SynthParams, synthesize

PROMPTS = [[17, 3, 9], [5] * 12, [40, 41]]


@pytest.fixture(scope="module")
def trace(tiny_ckpt, tmp_path_factory):
    p = SynthParams(32, 4, 4, tokens=600, skew=1.0, reuse=0.3, layer_corr=0.2, seed=5)
    path = tmp_path_factory.mktemp("prefetch") / "t.mtrace"
    write_trace(path, synthesize(p), {"experts": 32, "top_k": 4, "layers": [0, 1, 2, 3]})
    return path


def run(ckpt, trace, prefetch: str):
    from moetier.engine import LLM
    from moetier.experts.placement import ExpertOptions
    from moetier.sampling_params import SamplingParams

    llm = LLM(ckpt, device="cpu", experts=ExpertOptions("slots", slots=6, prefetch=prefetch), replay_trace=trace)
    params = [SamplingParams(max_tokens=24, temperature=t, seed=2, ignore_eos=True, logprobs=3) for t in (0.0, 1.0, 0.7)]
    outs = [o.outputs[0] for o in llm.generate(PROMPTS, params)]
    stats = [b.experts.stats() for b in llm.model.moe_blocks()]
    for b in llm.model.moe_blocks():
        b.experts.cache.check()
    links = sum(b.prefetch_next is not None for b in llm.model.moe_blocks())
    llm.close()
    return [(o.token_ids, o.logprobs) for o in outs], stats, links


def test_prefetch_keeps_outputs_bit_exact_and_a_perfect_guess_takes_the_misses(tiny_ckpt, trace):
    off, st_off, links_off = run(tiny_ckpt, trace, "off")
    for mode in ("router", "trace"):
        got, st, links = run(tiny_ckpt, trace, mode)
        assert got == off, mode  # tokens and logprobs, to the bit
        assert links == 3 and links_off == 0  # every MoE layer but the last links to the next
        assert st[0]["prefetch_steps"] == 0 and all(s["prefetch_steps"] > 0 for s in st[1:])
        # a prefetch step's lookups never count as the layer's own steps
        assert [s["steps"] for s in st] == [s["steps"] for s in st_off]
        if mode == "trace":  # the step's own experts taken in just before it: no fill left on its path
            assert all(s["misses"] == 0 and s["prefetch_fills"] > 0 for s in st[1:])
            # what exceeds the slots still overflows (more distinct experts than slots in a step)
            assert [s["overflow"] for s in st] == [s["overflow"] for s in st_off]
            assert st[0]["misses"] == st_off[0]["misses"]  # the first MoE layer has no prefetch
            assert sum(s["misses"] for s in st_off[1:]) > 0


def test_prefetch_step_counts_apart():
    from moetier.experts.cache.slots import SlotCache

    cache = SlotCache(16, 4)
    own = torch.zeros(5, dtype=torch.int64)
    cache.step_reference(torch.tensor([[1, 2, 3]]), stats=own)
    assert cache.read_stats() == {"hits": 0, "misses": 0, "overflow": 0, "steps": 0, "pinned": 0}
    assert own.tolist() == [0, 3, 0, 1, 0]
    _, miss = cache.step_reference(torch.tensor([[1, 2, 5]]))
    assert cache.read_stats()["hits"] == 2 and int(miss.count) == 1
    cache.check()


def test_prefetch_links_and_refusals(tiny_ckpt):
    from moetier.engine import LLM
    from moetier.experts.placement import ExpertOptions
    from moetier.experts.prefetch import attach_prefetch
    from moetier.presets import moe_shape

    with pytest.raises(MoetierError, match="prefetch 'trace' predicts from the replayed routing"):
        LLM(tiny_ckpt, device="cpu", experts=ExpertOptions("slots", slots=6, prefetch="trace"))
    llm = LLM(tiny_ckpt, device="cpu", experts=ExpertOptions("slots", slots=6))
    assert attach_prefetch(llm.model, "router") == 3
    # a link names the next block, not its backend: a backend replaced under a link is freed (a bench's
    # rows rebuild every layer's backend over one model; a kept one held its device rows)
    gone = weakref.ref(llm.model.moe_blocks()[1].experts)
    llm.model.moe_blocks()[1].experts = None
    gc.collect()
    assert gone() is None
    # an engine's setup links or unlinks (a bench's next row over the same model starts from its own mode)
    LLM.from_model(llm.model, llm.tokenizer).close()
    assert all(b.prefetch_next is None for b in llm.model.moe_blocks())
    llm = LLM(tiny_ckpt, device="cpu", experts=ExpertOptions("resident"))
    assert attach_prefetch(llm.model, "router") == 0  # resident backends take nothing in
    with pytest.raises(ValueError, match="unknown expert prefetch 'sometimes'"):
        attach_prefetch(llm.model, "sometimes")
    llm.close()
    shape = moe_shape("tiny")
    problems = ExpertOptions("slots", prefetch="sometimes").problems(shape, [0, 1])
    assert any("expert prefetch 'sometimes'" in p for p in problems)


def test_peek_is_the_steps_next_layer_ids():
    from types import SimpleNamespace

    from moetier.traces.format import Trace
    from moetier.traces.hooks import Replayer

    blocks = [SimpleNamespace(layer=i, route_hook=None) for i in range(2)]
    model = SimpleNamespace(cfg=SimpleNamespace(num_experts=8, top_k=2, num_layers=2), device=torch.device("cpu"),
                            moe_blocks=lambda: blocks, real_rows=None)
    ids = np.array([[[1, 2], [3, 4]], [[5, 6], [7, 0]]])  # [N, L, k]
    rep = Replayer(model, Trace({"experts": 8, "top_k": 2, "layers": [0, 1]}, ids, None, np.zeros(2, np.int64),
                                np.zeros(2, bool)))
    with pytest.raises(MoetierError, match="known only after the step's first MoE layer"):
        rep.peek(1, 2)
    w = torch.ones(2, 2)
    blocks[0].route_hook(0, torch.zeros(2, 2, dtype=torch.long), w)
    assert rep.peek(1, 2).tolist() == [[3, 4], [7, 0]] and int(rep.cursor) == 0  # the cursor is the last layer's
    got, _ = blocks[1].route_hook(1, torch.zeros(2, 2, dtype=torch.long), w)
    assert got.tolist() == [[3, 4], [7, 0]] and int(rep.cursor) == 2
