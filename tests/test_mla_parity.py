"""Parity of the DeepSeek-V3 family (deepseek_v3, glm_moe_dsa) against transformers: float32 logits
to 1e-5 relative at prefill and 20 decode steps, greedy tokens identical to generate(do_sample=False).
Weights go through save_pretrained and our loader; GLM-5's prompts run below and above index_topk."""

from __future__ import annotations

import pytest
import torch

from moetier.engine.generate import Generator
from moetier.engine.llm import LLM
from moetier.experts.placement import ExpertOptions
from moetier.sampling_params import SamplingParams
from tests.conftest import hf_mla_checkpoint
from tests.helpers import Sequence
from tests.test_parity import assert_matches_transformers, rel_err
from tests.test_slots import lockstep

CASES = [
    # preset, seed, prompt length: low-rank q + YaRN + groups 4 pick 2 (tiny-dsv3); q_proj, rotate-half,
    # one group, 2 shared experts, tied embeddings (tiny-dsv3-plain); DSA with index_topk 8 from a
    # prompt below it (5: decode crosses it) and above it (13) (tiny-glm5).
    ("tiny-dsv3", 1, 13),
    ("tiny-dsv3-plain", 2, 11),
    ("tiny-glm5", 3, 5),
    ("tiny-glm5", 4, 13),
]


@pytest.mark.parametrize("preset,seed,prompt_len", CASES)
def test_logits_and_greedy_match_transformers(tmp_path, preset, seed, prompt_len):
    path, ref = hf_mla_checkpoint(tmp_path / preset, preset, seed)
    gen = Generator(LLM(path, dtype="float32", device="cpu"))
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, gen.cfg.vocab_size, (prompt_len,), generator=g)

    assert_matches_transformers(gen, ref, prompt, page_size=4)  # several pages per sequence


def test_attention_bias_and_mlp_layer_types(tmp_path):
    """attention_bias (q_a, kv_a and o_proj biases) and GLM-5's explicit mlp_layer_types (a dense
    layer after MoE layers), both absent from the presets."""
    path, ref = hf_mla_checkpoint(tmp_path / "glm", "tiny-glm5", 9, attention_bias=True,
                                  mlp_layer_types=["sparse", "dense", "sparse", "sparse"])
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if name.endswith("proj.bias"):
                p.uniform_(-0.1, 0.1)
    ref.save_pretrained(path)
    gen = Generator(LLM(path, dtype="float32", device="cpu"))
    assert gen.cfg.attention_bias and gen.cfg.moe_layers == [0, 2, 3]
    prompt = torch.randint(0, gen.cfg.vocab_size, (12,), generator=torch.Generator().manual_seed(9))
    assert_matches_transformers(gen, ref, prompt)


def test_sparse_attention_is_what_matches(tmp_path):
    """The parity above is not vacuous for DSA: attending over every causal key instead of the
    indexer's top-8 misses transformers by far at a 30-token context."""
    path, ref = hf_mla_checkpoint(tmp_path / "glm", "tiny-glm5", 5)
    model = Generator(LLM(path, dtype="float32", device="cpu")).model
    ids = torch.randint(0, model.cfg.vocab_size, (30,), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        want = ref(ids[None]).logits[0].float()
    assert rel_err(model.logits(Sequence(model, 64).forward(ids)), want) <= 1e-5
    for layer in model.layers:
        if layer.attn.indexer is not None:
            layer.attn.indexer.topk = 64  # more than the context: every causal key
    assert rel_err(model.logits(Sequence(model, 64).forward(ids)), want) > 1e-3


@pytest.mark.parametrize("preset", ["tiny-dsv3", "tiny-glm5"])
def test_backends_bit_exact(tmp_path, preset):
    path, _ = hf_mla_checkpoint(tmp_path / preset, preset, 6)
    models = lockstep(path, 60, {
        "resident": ExpertOptions("resident"),
        "slots": ExpertOptions("slots", slots=4),  # top_k = 4: as small as it can be
        "uva": ExpertOptions("uva"),
    })
    stats = models["slots"].expert_stats()
    moe_layers = len(models["slots"].cfg.moe_layers)
    assert stats["steps"] == moe_layers * 60 and stats["misses"] > 100


@pytest.mark.parametrize("preset", ["tiny-dsv3", "tiny-glm5"])
def test_batch_equals_each_alone(tmp_path, preset):
    """Mixed steps (chunked prefill next to decode, several sequences) give each request the tokens
    it gets alone."""
    path, _ = hf_mla_checkpoint(tmp_path / preset, preset, 7)
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, 512, (int(torch.randint(1, 30, (1,), generator=g)),), generator=g).tolist()
               for _ in range(8)]
    params = [SamplingParams(max_tokens=int(torch.randint(4, 16, (1,), generator=g)), ignore_eos=True)
              for _ in range(8)]
    alone_llm = LLM(path, dtype="float32", device="cpu")
    alone = [alone_llm.generate([p], sp)[0].outputs[0].token_ids for p, sp in zip(prompts, params)]
    for engine in ({}, {"max_num_tokens": 16, "page_size": 4}):
        llm = LLM(path, dtype="float32", device="cpu", **engine)
        outs = llm.generate(prompts, params)
        assert [o.outputs[0].token_ids for o in outs] == alone
        llm.scheduler.check()


def test_routing_trace_records_and_replays(tmp_path):
    """The engine records GLM-5's routing (MoE layers only, grouped top-k ids) and a replay of it
    reproduces a sampled run."""
    from moetier.traces.format import read_trace

    path, _ = hf_mla_checkpoint(tmp_path / "glm", "tiny-glm5", 8)
    prompt, sp = [[7, 8, 9, 10] * 5], SamplingParams(max_tokens=12, temperature=1.0, seed=3, ignore_eos=True)
    llm = LLM(path, dtype="float32", device="cpu", record_trace=tmp_path / "t.mtrace")
    first = llm.generate(prompt, sp)[0].outputs[0].token_ids
    llm.close()
    t = read_trace(tmp_path / "t.mtrace")
    assert t.layers == [1, 2, 3] and t.top_k == 4 and t.num_tokens == 20 + 11
    assert ((t.ids >= 0) & (t.ids < 16)).all()
    # groups of 4 experts, 2 groups kept: each token's experts fall in at most 2 groups
    assert max(len(set((row // 4).tolist())) for row in t.ids.reshape(-1, 4)) <= 2
    replay = LLM(path, dtype="float32", device="cpu", replay_trace=tmp_path / "t.mtrace")
    assert replay.generate(prompt, sp)[0].outputs[0].token_ids == first


@pytest.mark.parametrize("preset", ["tiny-dsv3", "tiny-glm5"])
def test_bfloat16_tracks_transformers(tmp_path, preset):
    """bfloat16 on the CPU, both engines in bf16 (router gate and bias float32 in both): logits
    close at bf16 precision."""
    path, ref = hf_mla_checkpoint(tmp_path / preset, preset, 5)
    ref = type(ref).from_pretrained(path, dtype=torch.bfloat16).eval()
    model = LLM(path, dtype="bfloat16", device="cpu").model
    assert model.embed.dtype == torch.bfloat16 and model.moe_blocks()[0].router.weight.dtype == torch.float32
    ids = torch.arange(5, 30)
    with torch.no_grad():
        want = ref(ids[None]).logits[0].float()
    assert rel_err(model.logits(Sequence(model, 64).forward(ids)), want) <= 2e-2
