from __future__ import annotations

import pytest
import torch

from moetier.errors import MoetierError
from moetier.engine.generate import Generator
from moetier.engine.llm import LLM
from moetier.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def gen(tiny_ckpt):
    return Generator(LLM(tiny_ckpt, device="cpu"))


def greedy(gen, n, **kw):
    return gen.generate(gen.prompt_ids("The quick brown fox"), SamplingParams(max_tokens=n, ignore_eos=True, **kw))


def test_length_and_streaming(gen):
    chunks = []
    r = gen.generate(gen.prompt_ids("hello"), SamplingParams(max_tokens=12, ignore_eos=True), on_text=chunks.append)
    assert len(r.output_ids) == 12 and r.finish_reason == "length"
    assert "".join(chunks) == r.text == gen.tokenizer.decode(r.output_ids)
    assert r.timings["decode_tok_per_s"] > 0


def test_stop_token_ends_without_text(gen):
    first = greedy(gen, 5).output_ids
    r = gen.generate(gen.prompt_ids("The quick brown fox"), SamplingParams(max_tokens=5, stop_token_ids=[first[2]]))
    assert r.output_ids == first[:3] and r.finish_reason == "stop"
    assert r.text == gen.tokenizer.decode(first[:2])


def test_eos_ids_come_from_config_and_tokenizer(gen):
    im_end = gen.tokenizer.encode("<|im_end|>")
    assert len(im_end) == 1 and im_end[0] in gen.eos_ids
    assert set(gen.cfg.eos_token_ids) <= gen.eos_ids


def test_stop_string_truncates(gen):
    full = greedy(gen, 40)
    text = full.text
    stop = next(text[i:i + 3] for i in range(6, len(text) - 3) if "\ufffd" not in text[:i + 3])
    chunks = []
    r = gen.generate(gen.prompt_ids("The quick brown fox"),
                     SamplingParams(max_tokens=40, ignore_eos=True, stop=[stop, "never-seen-stop"]),
                     on_text=chunks.append)
    assert r.finish_reason == "stop" and r.stop == stop
    assert r.text == text[: text.index(stop)] == "".join(chunks)
    assert r.output_ids == full.output_ids[: len(r.output_ids)]


def test_seeded_sampling_repeats(gen):
    p = dict(max_tokens=16, temperature=0.9, top_p=0.95, top_k=40, seed=11, ignore_eos=True)
    ids = gen.prompt_ids("abc")
    a, b = gen.generate(ids, SamplingParams(**p)), gen.generate(ids, SamplingParams(**p))
    c = gen.generate(ids, SamplingParams(**{**p, "seed": 12}))
    assert a.output_ids == b.output_ids != c.output_ids


def test_context_and_prompt_errors(gen):
    with pytest.raises(MoetierError, match="exceeds the context of 4096 tokens"):
        gen.generate([1] * 4000, SamplingParams(max_tokens=200))
    with pytest.raises(MoetierError, match="prompt token ids must be integers in"):
        gen.generate([gen.cfg.vocab_size], SamplingParams(max_tokens=2))
    with pytest.raises(MoetierError, match="empty"):
        gen.prompt_ids("")


def test_chat_prompt_uses_template(gen):
    ids = gen.prompt_ids("hi", chat=True, system="be brief")
    text = gen.tokenizer.decode(ids, skip_special_tokens=False)
    assert text == "<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_bfloat16_generates_deterministically(tiny_ckpt):
    g = Generator(LLM(tiny_ckpt, dtype="bfloat16", device="cpu"))
    assert g.model.embed.dtype == torch.bfloat16
    a, b = greedy(g, 10), greedy(g, 10)
    assert a.output_ids == b.output_ids and len(a.output_ids) == 10
