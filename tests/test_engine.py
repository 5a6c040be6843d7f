"""The engine end to end on the CPU: batched results equal solo results, under chunked prefill,
preemption and every expert backend; aborts; the async streaming interface; metrics; kept special
tokens in the output text."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

from moetier.engine import AsyncLLM, LLM
from moetier.experts.placement import ExpertOptions
from moetier.sampling_params import SamplingParams


def workload(n=32, seed=0, vocab=448):
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, vocab, (int(torch.randint(1, 60, (1,), generator=g)),), generator=g).tolist()
               for _ in range(n)]
    params = [SamplingParams(max_tokens=int(torch.randint(4, 24, (1,), generator=g)), ignore_eos=True)
              for _ in range(n)]
    return prompts, params


@pytest.fixture(scope="module")
def solo(tiny_ckpt):
    """Each request of the workload run alone, greedy."""
    llm = LLM(tiny_ckpt, device="cpu")
    prompts, params = workload()
    return [llm.generate([p], sp)[0].outputs[0].token_ids for p, sp in zip(prompts, params)]


@pytest.mark.parametrize("engine", [
    dict(),  # a 512-token budget: whole prompts, many sequences per step
    dict(max_num_tokens=24),  # chunked prefill mixed with decode
    dict(kv_tokens=256, page_size=8, max_num_tokens=64),  # 32 pages for 32 requests: preemption
    dict(experts=ExpertOptions("slots", slots=4)),
    dict(experts=ExpertOptions("uva")),
], ids=["plain", "chunked", "preempting", "slots", "uva"])
def test_batch_of_32_equals_each_alone(tiny_ckpt, solo, engine):
    llm = LLM(tiny_ckpt, device="cpu", **engine)
    prompts, params = workload()
    outs = llm.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in outs] == solo
    assert all(o.outputs[0].finish_reason == "length" for o in outs)
    llm.scheduler.check()
    assert llm.scheduler.cache.num_in_use == 0
    if "kv_tokens" in engine:
        assert sum(o.metrics["preemptions"] for o in outs) > 0
    if "experts" in engine and engine["experts"].backend == "slots":
        m = llm.metrics()
        s = m["expert_stats"]  # batched steps need more experts than 4 slots: most pairs overflow
        assert 0 < m["expert_hit_rate"] < 1 and s["misses"] > 20 and s["overflow"] > 100


def test_seeded_sampling_in_a_batch_equals_alone(tiny_ckpt):
    llm = LLM(tiny_ckpt, device="cpu")
    prompts = [[5, 6, 7], [100, 200], [42] * 30]
    params = [SamplingParams(max_tokens=12, temperature=0.9, top_p=0.9, seed=s, ignore_eos=True) for s in (1, 2, 3)]
    batch = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    alone = [llm.generate([p], SamplingParams(**{**sp.__dict__}))[0].outputs[0].token_ids for p, sp in zip(prompts, params)]
    assert batch == alone


def test_abort_and_metrics(tiny_ckpt):
    llm = LLM(tiny_ckpt, device="cpu", max_num_tokens=32)
    a = llm.add_request("a long prompt " * 10, SamplingParams(max_tokens=50, ignore_eos=True))
    b = llm.add_request("short", SamplingParams(max_tokens=3, ignore_eos=True))
    llm.step()
    m = llm.metrics()
    assert m["running"] + m["waiting"] == 2 and m["kv_pages_used"] > 0 and 0 < m["kv_usage"] < 1
    assert llm.abort(a) and not llm.abort("nope")
    outs = []
    while llm.has_unfinished():
        outs += llm.step()
    final = [o for o in outs if o.finished]
    assert [o.request_id for o in final] == [b] and final[0].outputs[0].finish_reason == "length"
    met = final[0].metrics
    assert met["ttft_s"] > 0 and len(met["token_times"]) == 3 and met["token_times"] == sorted(met["token_times"])
    # token times are seconds from arrival: the first is the time to first token, the last end to end
    assert met["token_times"][0] == met["ttft_s"] and met["token_times"][-1] == met["e2e_s"] >= met["queue_s"]
    assert llm.metrics()["kv_pages_used"] == 0


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "async-scheduling"])
def test_async_streams_match_the_batch(tiny_ckpt, overlap):
    llm = LLM(tiny_ckpt, device="cpu", async_scheduling=overlap)
    prompts, params = workload(n=6, seed=1)
    want = [o.outputs[0].text for o in llm.generate(prompts, params)]
    engine = AsyncLLM(llm)

    async def one(p, sp):
        deltas, final = [], None
        async for out in engine.generate(p, sp):
            deltas.append(out.outputs[0].delta)
            final = out
        assert "".join(deltas) == final.outputs[0].text and final.finished
        return final.outputs[0].text

    async def all_of_them():
        return await asyncio.gather(*(one(p, sp) for p, sp in zip(prompts, params)))

    try:
        assert asyncio.run(all_of_them()) == want
    finally:
        engine.shutdown()


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "async-scheduling"])
def test_async_cancel_frees_pages(tiny_ckpt, overlap):
    llm = LLM(tiny_ckpt, device="cpu", async_scheduling=overlap)
    engine = AsyncLLM(llm)

    async def take_two():
        n = 0
        async for _ in engine.generate("hello", SamplingParams(max_tokens=200, ignore_eos=True)):
            n += 1
            if n == 2:
                break  # the client went away

    try:
        asyncio.run(take_two())
        # the abort is applied by the engine thread before its next step
        deadline = time.time() + 10
        while time.time() < deadline:
            with engine._lock:
                if llm.scheduler.cache.num_in_use == 0 and not llm.has_unfinished():
                    break
            time.sleep(0.01)
        with engine._lock:
            assert llm.scheduler.cache.num_in_use == 0 and not llm.has_unfinished()
    finally:
        engine.shutdown()


def test_kept_special_tokens_reach_the_text(tmp_path):
    """The engine's own output path honours SamplingParams.keep_special_ids (the server's parsers'
    markers): a special token is in the text only when the request keeps it."""
    from moetier.checkpoint.writer import make_checkpoint
    from moetier.tokenizer.synthetic import write_marker_tokenizer

    make_checkpoint(tmp_path, "tiny", dtype="float32")
    write_marker_tokenizer(tmp_path, ("<think>",))
    llm = LLM(tmp_path, device="cpu")
    think = llm.tokenizer.token_id("<think>")
    forced = {think: 100.0}  # greedy: <think> at every step
    for keep, want in ((frozenset(), ""), (frozenset({think}), "<think>" * 3)):
        params = SamplingParams(max_tokens=3, ignore_eos=True, logit_bias=forced, keep_special_ids=keep)
        out = llm.generate(["hi"], params)[0].outputs[0]
        assert out.token_ids == [think] * 3 and out.text == want
