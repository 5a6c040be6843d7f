"""GLM-5.3-Flash (glm5_next) through the engine: the KDA layers' recurrent state in state slots next
to the paged MLA latents. The engine's float32 logits over 20 decode steps against transformers',
greedy tokens against generate(); chunked prefill, batching, preemption and the expert backends
against an uninterrupted single run."""

from __future__ import annotations

import pytest
import torch

from moetier.engine.llm import LLM
from moetier.experts.placement import ExpertOptions
from moetier.sampling_params import SamplingParams
from tests.conftest import hf_glm5_next_checkpoint
from tests.test_parity import rel_err

STEPS = 20


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return hf_glm5_next_checkpoint(tmp_path_factory.mktemp("glm5next") / "ckpt", seed=2)


def captured(llm: LLM) -> list[torch.Tensor]:
    """Every logits row the engine computes from now on, in order (the model's logits() wrapped)."""
    rows, inner = [], llm.model.logits

    def logits(hidden):
        out = inner(hidden)
        rows.extend(out.clone())
        return out
    llm.model.logits = logits
    return rows


def transformers_generate(ref, prompt: list[int], steps: int) -> tuple[list[int], list[torch.Tensor]]:
    """transformers' greedy generate(): its tokens and the logits of each step (with its cache, so
    KDA decodes by the recurrent step, as ours; its full forward over a context instead runs the
    chunked form, which on this tiny random model parts from the step by more than 1e-5 at some
    positions: a KDA output can be small against the state it is read from)."""
    with torch.no_grad():
        # the mask given: a prompt token equal to pad_token_id is no padding
        out = ref.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                           max_new_tokens=steps, min_new_tokens=steps, do_sample=False, eos_token_id=None,
                           pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    return out.sequences[0, len(prompt):].tolist(), [x[0].float() for x in out.logits]


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, ignore_eos=True)


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    lens = [70, 3, 1, 25, 9]  # past a KDA chunk, short, one token
    return [torch.randint(0, 512, (n,), generator=g).tolist() for n in lens]


@pytest.fixture(scope="module")
def alone(checkpoint):
    """Each prompt alone through the engine, greedy, with the logits of every step."""
    llm = LLM(checkpoint[0], dtype="float32", device="cpu")
    out = []
    for p in prompts():
        rows = captured(llm)
        tokens = llm.generate([p], greedy(8))[0].outputs[0].token_ids
        out.append((tokens, torch.stack(rows)))
        llm.model.logits = type(llm.model).logits.__get__(llm.model)
    return out


def test_engine_logits_and_greedy_match_transformers(checkpoint):
    path, ref = checkpoint
    llm = LLM(path, dtype="float32", device="cpu", page_size=8)
    rows = captured(llm)
    prompt = prompts()[0]
    tokens = llm.generate([prompt], greedy(STEPS))[0].outputs[0].token_ids
    assert len(rows) == STEPS
    hf_tokens, want = transformers_generate(ref, prompt, STEPS)
    assert tokens == hf_tokens
    for i in range(STEPS):
        assert rel_err(rows[i], want[i]) <= 1e-5, f"step {i}"
    llm.scheduler.check()
    assert llm.scheduler.states.num_used == 0


@pytest.mark.parametrize("engine", [
    dict(max_num_tokens=16, page_size=4),  # prompts split over several steps, next to decode
    dict(kv_tokens=96, page_size=8, max_num_tokens=64),  # 12 pages for five requests: preemption
    dict(max_num_seqs=2),  # two state slots: requests wait for one
    dict(max_num_seqs=2, async_scheduling=True),  # overlapped steps run past an ended request's state
], ids=["chunked", "preempting", "two-slots", "async"])
def test_batch_equals_each_alone(checkpoint, alone, engine):
    llm = LLM(checkpoint[0], dtype="float32", device="cpu", **engine)
    outs = llm.generate(prompts(), greedy(8))
    assert [o.outputs[0].token_ids for o in outs] == [tokens for tokens, _ in alone]
    llm.scheduler.check()
    assert llm.scheduler.cache.num_in_use == 0 and llm.scheduler.states.num_used == 0
    if "kv_tokens" in engine:
        assert sum(o.metrics["preemptions"] for o in outs) > 0


def test_chunked_prefill_equals_one_step(checkpoint, alone):
    """A 70-token prompt in steps of 16 (KDA chunks start at each step's first token, the state
    carried between steps): logits within 1e-5 of the one-step prefill's, at every step."""
    llm = LLM(checkpoint[0], dtype="float32", device="cpu", max_num_tokens=16, page_size=4)
    rows = captured(llm)
    tokens = llm.generate([prompts()[0]], greedy(8))[0].outputs[0].token_ids
    want_tokens, want = alone[0]
    assert tokens == want_tokens
    assert rel_err(torch.stack(rows), want) <= 1e-5


def test_backends_bit_exact(checkpoint):
    """resident, slots and uva over 20 engine steps (prefill past a KDA chunk, then decode, two
    sequences sampled so that the routing churns): equal bits."""
    runs = {}
    for name, opts in {"resident": ExpertOptions("resident"), "slots": ExpertOptions("slots", slots=4),
                       "uva": ExpertOptions("uva")}.items():
        llm = LLM(checkpoint[0], dtype="float32", device="cpu", experts=opts)
        rows = captured(llm)
        params = SamplingParams(max_tokens=20, temperature=1.0, seed=5, ignore_eos=True)  # routing churns
        outs = llm.generate(prompts()[:2], params)
        runs[name] = ([o.outputs[0].token_ids for o in outs], torch.stack(rows), llm)
    for name in ("slots", "uva"):
        assert runs[name][0] == runs["resident"][0]
        assert torch.equal(runs[name][1], runs["resident"][1]), name
    stats = runs["slots"][2].metrics()["expert_stats"]
    assert stats["misses"] > 100


def test_routing_trace_records_and_replays(checkpoint, tmp_path):
    """The engine records GLM-5.3-Flash's routing (the MoE layers after the dense first one) and a
    replay of it reproduces a sampled run."""
    from moetier.traces.format import read_trace

    path = checkpoint[0]
    prompt, sp = [prompts()[3]], SamplingParams(max_tokens=8, temperature=1.0, seed=3, ignore_eos=True)
    llm = LLM(path, dtype="float32", device="cpu", record_trace=tmp_path / "t.mtrace")
    first = llm.generate(prompt, sp)[0].outputs[0].token_ids
    llm.close()
    t = read_trace(tmp_path / "t.mtrace")
    assert t.layers == [1, 2, 3, 4] and t.top_k == 4 and t.num_tokens == 25 + 7
    replay = LLM(path, dtype="float32", device="cpu", replay_trace=tmp_path / "t.mtrace")
    assert replay.generate(prompt, sp)[0].outputs[0].token_ids == first
