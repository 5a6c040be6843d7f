"""Log-probabilities end to end: the engine's (the model's own distribution, in a batch or alone),
through graph replays on CUDA, and the server's OpenAI formats (docs/server.md)."""

from __future__ import annotations

import pytest
import torch

from moetier.engine import LLM
from moetier.experts.placement import ExpertOptions
from moetier.layers.attention import make_batch
from moetier.sampling_params import SamplingParams
from server_helpers import live  # noqa: F401 -- the module's server fixture

MODEL = "tiny-stdlib"
PROMPT = "def fibonacci(n):"
GPU = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.fixture(scope="module")
def client(live):
    return live.client()


def test_logprobs_are_the_models_distribution_in_a_batch_or_alone(tiny_ckpt):
    llm = LLM(tiny_ckpt, device="cpu")
    prompts = [[5, 6, 7], [100, 200], [42] * 30]
    params = [SamplingParams(max_tokens=6, temperature=t, seed=1, ignore_eos=True, logprobs=n)
              for t, n in ((0.0, 5), (0.8, 0), (0.0, None))]
    batch = [o.outputs[0] for o in llm.generate(prompts, params)]
    assert batch[2].logprobs is None and len(batch[1].logprobs) == 6 and batch[1].logprobs[0][1] == []
    for p, sp, got in zip(prompts[:2], params[:2], batch[:2]):
        alone = llm.generate([p], sp)[0].outputs[0]
        assert alone.token_ids == got.token_ids
        assert [lp for lp, _ in alone.logprobs] == pytest.approx([lp for lp, _ in got.logprobs], abs=1e-5)
    greedy = batch[0]
    for tok, (lp, alts) in zip(greedy.token_ids, greedy.logprobs):
        assert alts[0][0] == tok and alts[0][1] == lp  # greedy picks the most likely token
        assert [a for _, a in alts] == sorted((a for _, a in alts), reverse=True) and len(alts) == 5
        assert sum(torch.tensor([a for _, a in alts]).exp()) <= 1 + 1e-5
    # the first token's distribution, from the model's logits directly
    model = llm.runner.model
    kv = model.kv_spec().allocate(4, 16, model.dtype, "cpu")
    hidden = model.forward(torch.tensor(prompts[0]), make_batch([(0, 3, [1])], 16, "cpu"), kv)
    ref = torch.log_softmax(model.logits(hidden[-1:]).float(), -1)[0]
    assert greedy.logprobs[0][0] == pytest.approx(ref.max().item(), abs=1e-5)


@pytest.mark.gpu
@GPU
def test_logprobs_from_graph_replays_equal_eager(tiny_ckpt):
    """Logprobs of graph-replayed decode steps come from the graph's logits buffer: same values as the
    eager step's (fp32 log-softmax of the same logits), for a batch mixing requests with and without."""
    prompts = [[5, 6, 7], [100, 200], [42] * 30, [7] * 9]
    params = [SamplingParams(max_tokens=10, temperature=t, seed=3, ignore_eos=True, logprobs=n)
              for t, n in ((0.0, 5), (0.7, 0), (0.0, None), (1.0, 20))]
    llm = LLM(tiny_ckpt, device="cuda", experts=ExpertOptions("slots", slots=4))
    graphed = [o.outputs[0] for o in llm.generate(prompts, params)]
    assert llm.runner.graph_steps > 5
    eager = LLM(tiny_ckpt, device="cuda", experts=ExpertOptions("slots", slots=4), cuda_graphs=False)
    alone = [eager.generate([p], sp)[0].outputs[0] for p, sp in zip(prompts, params)]
    for g, a in zip(graphed, alone):
        assert g.token_ids == a.token_ids
        if a.logprobs is None:
            assert g.logprobs is None
            continue
        assert [x for x, _ in g.logprobs] == pytest.approx([x for x, _ in a.logprobs], abs=1e-4)
        assert [[i for i, _ in alts] for _, alts in g.logprobs] == [[i for i, _ in alts] for _, alts in a.logprobs]


def test_completion_logprobs_match_the_engine_streaming_or_not(live, client):
    with live.engine._lock:
        direct = live.llm.generate([PROMPT], SamplingParams(max_tokens=8, logprobs=3))[0].outputs[0]
    whole = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0, logprobs=3)
    lp = whole.choices[0].logprobs
    assert lp.token_logprobs == pytest.approx([e[0] for e in direct.logprobs], abs=1e-6)
    assert len(lp.tokens) == len(lp.text_offset) == len(lp.top_logprobs) == 8
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs):  # greedy: the sampled token is the top one
        assert 1 <= len(top) <= 3 and max(top.values()) == pytest.approx(chosen, abs=1e-6)
    streamed = [c.choices[0].logprobs for c in client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0, logprobs=3, stream=True) if c.choices]
    assert [x for c in streamed for x in c.token_logprobs] == pytest.approx(lp.token_logprobs, abs=1e-6)
    assert [x for c in streamed for x in c.tokens] == lp.tokens
    zero = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0, logprobs=0)
    zl = zero.choices[0].logprobs  # logprobs 0: each token's own logprob only, in top_logprobs too (as vLLM)
    assert len(zl.token_logprobs) == 4
    assert [list(t.values()) for t in zl.top_logprobs] == [[x] for x in zl.token_logprobs]
    assert client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4).choices[0].logprobs is None


def test_chat_logprobs_streaming_or_not(client):
    msgs = [{"role": "user", "content": "def f(x):"}]
    r = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=6, temperature=0, logprobs=True,
                                       top_logprobs=2)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens == 6
    for e in content:
        assert len(e.top_logprobs) == 2 and e.top_logprobs[0].logprob == pytest.approx(e.logprob, abs=1e-6)
        assert e.bytes == list(e.token.encode())
    streamed = [e for c in client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=6, temperature=0,
                                                          logprobs=True, stream=True)
                if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [e.logprob for e in streamed] == pytest.approx([e.logprob for e in content], abs=1e-6)
    assert all(e.top_logprobs == [] for e in streamed)
