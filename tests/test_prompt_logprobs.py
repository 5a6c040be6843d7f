"""Prompt log-probabilities (engine/prompt_logprobs.py): computed in the prefill's own forward pass,
chunked or not, equal to a log-softmax of the model's logits over the whole prompt; the same in a
batch as alone; the rank and the alternatives those of the reference distribution.

float32 weights, so that comparisons across different batch shapes (whose matrix products may sum in
another order) are tight: 1e-5 in logprob."""

from __future__ import annotations

import pytest
import torch

from moetier.engine import LLM
from moetier.layers.attention import make_batch
from moetier.sampling_params import SamplingParams

TEXT = "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n"


@pytest.fixture(scope="module")
def llm():
    return LLM(None, device="cpu", dtype="float32", max_num_tokens=16)  # the default model; 16: chunked prefill


def reference(llm, ids: list[int]) -> torch.Tensor:
    """log-softmax of the model's logits at every position of one unchunked forward: [len(ids), V]."""
    model = llm.runner.model
    pages = -(-len(ids) // 16)
    kv = model.kv_spec().allocate(pages + 1, 16, model.dtype, "cpu")
    hidden = model.forward(torch.tensor(ids), make_batch([(0, len(ids), list(range(1, pages + 1)))], 16, "cpu"), kv)
    return torch.log_softmax(model.logits(hidden).float(), -1)


def test_prompt_logprobs_equal_the_log_softmax_of_the_models_logits(llm):
    ids = llm.encode(TEXT)
    assert len(ids) > 3 * llm.config.max_num_tokens  # several chunks
    out = llm.generate([ids], SamplingParams(max_tokens=2, prompt_logprobs=3))[0]
    scored = out.prompt_logprobs
    assert len(scored) == len(ids) and scored[0] is None
    ref = reference(llm, ids)
    for j in range(1, len(ids)):
        lp, rank, alts = scored[j]
        want = ref[j - 1]
        assert lp == pytest.approx(want[ids[j]].item(), abs=1e-5)
        assert rank == int((want > want[ids[j]]).sum()) + 1
        top, top_ids = torch.topk(want, 3)
        assert [i for i, _ in alts] == top_ids.tolist()
        assert [v for _, v in alts] == pytest.approx(top.tolist(), abs=1e-5)
    # the output's first token is sampled from the prompt's last position, as without prompt logprobs
    plain = llm.generate([ids], SamplingParams(max_tokens=2))[0]
    assert plain.outputs[0].token_ids == out.outputs[0].token_ids and plain.prompt_logprobs is None


def test_prompt_logprobs_in_a_batch_equal_alone(llm):
    prompts = [llm.encode(TEXT), llm.encode("import os\nimport sys\n"), llm.encode("class A:\n    pass\n" * 3)]
    params = [SamplingParams(max_tokens=3, prompt_logprobs=n) for n in (0, None, 5)]
    batch = llm.generate(prompts, params)
    assert batch[1].prompt_logprobs is None
    for p, sp, got in zip(prompts, params, batch):
        alone = llm.generate([p], sp)[0]
        assert alone.outputs[0].token_ids == got.outputs[0].token_ids
        if sp.prompt_logprobs is None:
            continue
        assert len(got.prompt_logprobs) == len(p)
        for a, b in zip(alone.prompt_logprobs[1:], got.prompt_logprobs[1:]):
            assert a[0] == pytest.approx(b[0], abs=1e-5) and len(a[2]) == len(b[2]) == sp.prompt_logprobs


def test_a_one_token_prompt_has_nothing_to_score(llm):
    out = llm.generate([[5]], SamplingParams(max_tokens=2, prompt_logprobs=2))[0]
    assert out.prompt_logprobs == [None] and len(out.outputs[0].token_ids) == 2


def test_prompt_logprobs_out_of_range_are_refused():
    from moetier.errors import MoetierError

    with pytest.raises(MoetierError, match="prompt_logprobs must be in 0..20"):
        SamplingParams(prompt_logprobs=21).validate()
