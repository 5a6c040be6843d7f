"""Speculative decoding through the engine on the CPU (engine/speculation.py, engine/spec_step.py):
greedy outputs equal decoding without it, token for token, for n-gram drafts (the embedded model,
whose code text repeats) and MTP drafts (a tiny DeepSeek-V3 with its MTP layer); continuous batching
where sequences keep different numbers of drafts in one step (an oracle drafter that knows the plain
run's tokens and spoils one draft per request); recurrent state rolled back on a rejection (glm5_next);
chunked prefill, preemption, prefix caching, stop
tokens and stop strings inside the kept drafts; sampled acceptance reproducible and independent of
the batch; the engine's MTP drafts equal the reference loop's (tests/test_spec_loop.py)."""

from __future__ import annotations

import pytest
import torch

from moetier.checkpoint.writer import make_checkpoint
from moetier.engine.llm import LLM
from moetier.engine.spec_step import draft_probs, target_probs
from moetier.engine.step import SeqStep
from moetier.errors import MoetierError
from moetier.sampling_params import SamplingParams

# k fixed: expert-aware k (tests/test_spec_k.py) prices k by copies timed on this busy CPU
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "expert_aware_k": False}
MTP = {"method": "mtp", "num_speculative_tokens": 3, "expert_aware_k": False}
CODE = ["def foo(self):\n    return self.foo\n\ndef bar(self):\n    return self.",
        "import os\nimport sys\nimport os.path\nimport",
        "for i in range(10):\n    print(i)\nfor j in range(10):\n    print("]


@pytest.fixture(scope="module")
def mtp_ckpt(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("mtp") / "ckpt", "tiny-dsv3", seed=3, dtype="float32",
                           mtp_layers=1)


def tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def greedy(n: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=n, ignore_eos=True, **kw)


def workload(vocab: int, n: int = 6, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, vocab, (int(torch.randint(2, 30, (1,), generator=g)),), generator=g).tolist()
               for _ in range(n)]
    return prompts, [greedy(int(torch.randint(6, 20, (1,), generator=g))) for _ in range(n)]


def oracle(llm: LLM, want: dict[tuple, list[int]], spoil: dict[tuple, int]) -> list[int]:
    """Make the engine's drafts the plain run's next tokens, with draft number spoil[prompt] (counted
    over the request's whole output) wrong, so each request keeps a different run each step. -> the
    accepted lengths seen, one per verify row."""
    spec = llm.scheduler.spec

    def drafts(req, budget):
        k = spec.k_for(req, budget)
        key, done = tuple(req.prompt_ids), len(req.output_ids)
        d = list(want[key][done:done + k])
        bad = spoil[key] - done
        if 0 <= bad < len(d):
            d[bad] = (d[bad] + 1) % llm.cfg.vocab_size
        return d

    spec.drafts = drafts
    runner = getattr(llm.runner, "inner", llm.runner)  # rank 0's own under several ranks
    if runner.mtp is not None:  # the MTP passes still run (their KV rows), their drafts replaced
        run = runner.mtp.run
        runner.mtp.run = lambda *a: {r: [0] for r in run(*a)}
    seen = []
    execute = llm.runner.execute

    def watched(step):
        out = execute(step)
        seen.extend(len(t) - 1 for t in out.emitted.values())
        return out

    llm.runner.execute = watched
    return seen


def oracle_against_plain(path, lens: tuple[int, ...], seed: int, device: str, **plain_kw):
    """Prompts of the given lengths (random ids below 512, the tiny presets' vocabulary), 24 greedy
    tokens each from a plain engine (plain_kw: its options), and an n-gram engine whose drafts are
    those tokens with draft 3 + i of request i spoiled (oracle). -> (prompts, params, the plain
    tokens, the plain engine, the n-gram engine, its accepted lengths so far)."""
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, 512, (n,), generator=g).tolist() for n in lens]
    params = greedy(24)
    plain = LLM(path, device=device, dtype="float32", **plain_kw)
    want = tokens(plain.generate(prompts, params))
    llm = LLM(path, device=device, dtype="float32", speculative_config=NGRAM)
    seen = oracle(llm, {tuple(p): w for p, w in zip(prompts, want)}, {tuple(p): 3 + i for i, p in enumerate(prompts)})
    return prompts, params, want, plain, llm, seen


def test_ngram_greedy_equals_plain_on_the_embedded_model():
    plain = LLM(None, device="cpu", dtype="float32")
    ps = [plain.encode(p) for p in CODE]
    params = [greedy(n) for n in (40, 25, 33)]
    want = tokens(plain.generate(ps, params))
    spec = LLM(None, device="cpu", dtype="float32", speculative_config=NGRAM)
    assert tokens(spec.generate(ps, params)) == want
    m = spec.metrics()
    assert m["spec_decode_num_accepted_tokens"] > 10 and spec.steps < plain.steps
    assert m["spec_decode_num_draft_tokens"] >= m["spec_decode_num_accepted_tokens"]
    assert sum(m["spec_decode_num_accepted_tokens_per_pos"]) == m["spec_decode_num_accepted_tokens"]
    pos = m["spec_decode_num_accepted_tokens_per_pos"]
    assert len(pos) == 3 and pos[0] >= pos[1] >= pos[2]  # a draft is kept only after the ones before it
    spec.scheduler.check()
    assert spec.scheduler.cache.num_in_use == 0


@pytest.mark.parametrize("method", ["ngram", "mtp"])
@pytest.mark.parametrize("engine", [
    dict(),
    dict(max_num_tokens=8, page_size=4),  # chunked prefill beside verify rows
    dict(kv_tokens=96, page_size=4, max_num_tokens=64),  # 24 pages for 6 requests: preemption
], ids=["plain", "chunked", "preempting"])
def test_batch_with_different_accepted_lengths_equals_plain(mtp_ckpt, method, engine):
    plain = LLM(mtp_ckpt, device="cpu", dtype="float32", **engine)
    prompts, params = workload(plain.cfg.vocab_size)
    want = tokens(plain.generate(prompts, params))
    llm = LLM(mtp_ckpt, device="cpu", dtype="float32", speculative_config=MTP if method == "mtp" else NGRAM,
              **engine)
    keys = [tuple(p) for p in prompts]
    seen = oracle(llm, dict(zip(keys, want)), {k: 2 + 3 * i for i, k in enumerate(keys)})
    outs = llm.generate(prompts, params)
    assert tokens(outs) == want
    assert len(set(seen)) >= 3  # all kept, some kept, none kept: in the same run, often the same step
    m = llm.metrics()
    assert m["spec_decode_num_accepted_tokens"] == sum(seen) and m["spec_decode_num_drafts"] == len(seen)
    llm.scheduler.check()
    assert llm.scheduler.cache.num_in_use == 0
    if "kv_tokens" in engine:
        assert sum(o.metrics["preemptions"] for o in outs) > 0


@pytest.mark.parametrize("engine", [dict(), dict(page_size=4, max_num_tokens=16)], ids=["plain", "checkpointed"])
def test_recurrent_state_rolls_back_on_rejection(engine, tmp_path):
    """glm5_next (KDA layers): a verify step's state takes in every draft; where one is rejected the
    state before the step comes back and the kept tokens are recomputed. With prefix caching's state
    checkpoints (page-aligned chunks) too."""
    path = make_checkpoint(tmp_path / "ckpt", "tiny-glm5-next", seed=2, dtype="float32")
    plain = LLM(path, device="cpu", dtype="float32", **engine)
    prompts, params = workload(400, n=4, seed=2)
    want = tokens(plain.generate(prompts, params))
    llm = LLM(path, device="cpu", dtype="float32", speculative_config=NGRAM, **engine)
    assert llm.runner.moves.backup_base >= 0
    keys = [tuple(p) for p in prompts]
    seen = oracle(llm, dict(zip(keys, want)), {k: 1 + 2 * i for i, k in enumerate(keys)})
    assert tokens(llm.generate(prompts, params)) == want
    assert 0 in seen and 3 in seen  # rolled back and kept whole
    llm.scheduler.check()


def test_mtp_random_weights_equal_plain_and_drafts_equal_the_reference_loop(mtp_ckpt):
    from tests.test_spec_loop import _speculative

    llm = LLM(mtp_ckpt, device="cpu", dtype="float32", speculative_config=MTP, page_size=16)
    prompt = torch.randint(0, 400, (9,), generator=torch.Generator().manual_seed(11)).tolist()
    drafts = []
    execute = llm.runner.execute

    def watched(step):
        out = execute(step)
        drafts.extend(out.drafts.values())
        return out

    llm.runner.execute = watched
    got = tokens(llm.generate([prompt], greedy(20)))[0]
    log = []
    want, _ = _speculative(llm.model, prompt, 20, 3, "mtp", log)
    assert got == want
    # the engine's chain stops at the request's last reserved page: its drafts a prefix of the loop's
    assert all(d == w[:len(d)] and d for d, w in zip(drafts, log))
    assert sum(len(d) == 3 for d in drafts) >= len(drafts) // 2


def test_stop_tokens_and_strings_inside_kept_drafts_end_as_plain_does():
    plain = LLM(None, device="cpu", dtype="float32")
    prompt = plain.encode(CODE[0])
    full = tokens(plain.generate([prompt], greedy(30)))[0]
    at = next(i for i in range(6, 30) if full[i] not in full[:i])  # its first occurrence, inside a kept run
    stop_token = full[at]
    text = plain.tokenizer.decode(full[10:13])
    cases = [greedy(30, stop_token_ids=[stop_token]), greedy(30, stop=[text]), SamplingParams(max_tokens=12)]
    want = plain.generate([prompt] * 3, cases)
    llm = LLM(None, device="cpu", dtype="float32", speculative_config=NGRAM)
    key = tuple(prompt)
    oracle(llm, {key: full}, {key: 99})  # every draft right: stops fall inside kept runs
    got = llm.generate([prompt] * 3, cases)
    for g, w in zip(got, want):
        assert (g.outputs[0].token_ids, g.outputs[0].text, g.outputs[0].finish_reason) == \
               (w.outputs[0].token_ids, w.outputs[0].text, w.outputs[0].finish_reason)
    assert want[0].outputs[0].token_ids[-1] == stop_token and len(want[0].outputs[0].token_ids) == at + 1
    llm.scheduler.check()


def test_prefix_caching_hashes_only_accepted_pages():
    """Requests after the first find its pages; with the cache on, outputs equal the plain run's."""
    plain = LLM(None, device="cpu", dtype="float32", enable_prefix_caching=False, page_size=4)
    ps = [plain.encode(CODE[0]), plain.encode(CODE[0][:40] + " x")]
    want = [tokens(plain.generate([p], greedy(24)))[0] for p in ps]
    llm = LLM(None, device="cpu", dtype="float32", page_size=4, speculative_config=NGRAM)
    got = [tokens(llm.generate([p], greedy(24)))[0] for p in ps]
    assert got == want
    assert llm.metrics()["prefix_cache_hits"] > 0
    llm.scheduler.check()


def test_logprobs_of_kept_drafts_equal_plain_decodings():
    plain = LLM(None, device="cpu", dtype="float32")
    ps = [plain.encode(p) for p in CODE[:2]]
    params = [greedy(24, logprobs=2), greedy(20, logprobs=0)]
    want = plain.generate(ps, params)
    llm = LLM(None, device="cpu", dtype="float32", speculative_config=NGRAM)
    got = llm.generate(ps, params)
    assert llm.metrics()["spec_decode_num_accepted_tokens"] > 0
    for g, w in zip(got, want):
        g, w = g.outputs[0], w.outputs[0]
        assert g.token_ids == w.token_ids and len(g.logprobs) == len(w.logprobs) == len(w.token_ids)
        for (gl, galt), (wl, walt) in zip(g.logprobs, w.logprobs):
            # a verify step's rows are another matrix shape than a one-token step's: BLAS may sum in
            # another order, so within 1e-4 (tests/test_prefix_engine.py's bound), alternatives the same
            assert abs(gl - wl) <= 1e-4 and [i for i, _ in galt] == [i for i, _ in walt]
            assert all(abs(a - b) <= 1e-4 for (_, a), (_, b) in zip(galt, walt))


def test_sampled_speculation_is_reproducible_and_batch_independent():
    llm = LLM(None, device="cpu", dtype="float32", speculative_config=NGRAM)
    ps = [llm.encode(p) for p in CODE]
    params = [SamplingParams(max_tokens=24, temperature=t, top_k=k, top_p=p, seed=s, ignore_eos=True)
              for t, k, p, s in ((0.7, 0, 1.0, 1), (1.0, 20, 0.9, 2), (0.0, 0, 1.0, 3))]
    batch = tokens(llm.generate(ps, params))
    alone = [tokens(llm.generate([p], sp))[0] for p, sp in zip(ps, params)]
    assert batch == alone
    assert batch == tokens(llm.generate(ps, params))
    assert llm.metrics()["spec_decode_num_accepted_tokens"] > 0


def test_target_probs_are_the_samplers_distribution():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 2, 50, generator=g)
    rows = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.5), SamplingParams(temperature=2.0, top_k=4)]
    seqs = [(i, SeqStep(f"r{i}", 0, [1, 2], [0], True, p, 0, 0, num_draft=1)) for i, p in enumerate(rows)]
    p = target_probs(logits, seqs)
    assert torch.equal(p[0], torch.nn.functional.one_hot(logits[0].argmax(-1), 50).float())
    torch.testing.assert_close(p[1], torch.softmax(logits[1] / 0.5, -1))
    top = logits[2].topk(4, dim=-1)
    want = torch.zeros(2, 50).scatter(1, top.indices, torch.softmax(top.values / 2.0, -1))
    torch.testing.assert_close(p[2], want)


def test_sampled_requests_draft_from_the_mtp_distribution(monkeypatch):
    """tiny-stdlib's MTP layer: a sampled request's drafts are draws from q (the sampler's distribution
    over the MTP logits), kept with their q for the next step's verify, which tests them against it; a
    greedy request's are the argmax, kept without. Runs are reproducible and equal alone and batched,
    and drafts are kept."""
    from moetier.engine import spec_step

    given = []
    accept = spec_step.rejection_accept
    monkeypatch.setattr(spec_step, "rejection_accept",
                        lambda d, n, p, q, **kw: given.append(q) or accept(d, n, p, q, **kw))
    mtp = {"method": "mtp", "num_speculative_tokens": 2, "expert_aware_k": False}
    llm = LLM(None, device="cpu", dtype="float32", speculative_config=mtp)
    ps = [llm.encode(p) for p in CODE]
    params = [SamplingParams(max_tokens=24, temperature=t, top_k=k, top_p=p, seed=s, ignore_eos=True)
              for t, k, p, s in ((0.8, 0, 1.0, 1), (1.0, 20, 0.9, 2), (0.0, 0, 1.0, 3))]
    for p, sp in zip(ps, params):
        llm.add_request(p, sp)
    llm.step()  # the prefills: each request's first drafts
    q = llm.runner.mtp.q
    reqs = list(llm.scheduler.running)
    assert {r.id for r in reqs if r.params.temperature > 0} == set(q)
    for r in reqs:
        if r.id in q:
            drafts, dist = q[r.id]
            assert drafts == r.draft_ids and dist.shape == (2, llm.cfg.vocab_size)
            torch.testing.assert_close(dist.sum(-1), torch.ones(2))
            assert all(float(dist[j, t]) > 0 for j, t in enumerate(drafts))
    while llm.has_unfinished():
        llm.step()
    batch = tokens(llm.generate(ps, params))
    assert batch == [tokens(llm.generate([p], sp))[0] for p, sp in zip(ps, params)]
    assert batch == tokens(llm.generate(ps, params))
    assert llm.metrics()["spec_decode_num_accepted_tokens"] > 0
    assert given and all(q is not None for q in given)  # every sampled verify had its drafts' q


def test_draft_probs_are_q_where_the_drafter_kept_it_and_one_hot_elsewhere():
    v = 6
    q = torch.softmax(torch.arange(12.0).reshape(2, v), -1)
    hot = SamplingParams(temperature=1.0)
    seqs = [(0, SeqStep("a", 0, [1, 2, 3], [0], True, hot, 0, 0, num_draft=2)),  # q kept for 2, 3
            (1, SeqStep("b", 0, [1, 4], [0], True, hot, 0, 0, num_draft=1)),  # q kept for other drafts
            (2, SeqStep("c", 0, [1, 5], [0], True, SamplingParams(temperature=0.0), 0, 0, num_draft=1))]
    draft = torch.tensor([[2, 3], [4, -1], [5, -1]])
    kept = {"a": ([2, 3], q), "b": ([1], q), "c": ([5], q)}
    out = draft_probs(draft, seqs, kept, v)
    torch.testing.assert_close(out[0], q)
    onehot = torch.nn.functional.one_hot(draft.clamp_min(0), v).float()
    assert torch.equal(out[1], onehot[1]) and torch.equal(out[2], onehot[2])  # b's q is not its drafts'; c greedy
    assert draft_probs(draft, seqs, {"b": ([1], q)}, v) is None and draft_probs(draft, seqs, None, v) is None


def test_refusals(tiny_ckpt):
    # a qwen3_moe checkpoint without MTP layers (the default model ships one: test_mtp_tiny_stdlib.py)
    with pytest.raises(MoetierError, match="use method ngram"):
        LLM(str(tiny_ckpt), device="cpu", speculative_config=MTP)


def test_the_plan_counts_the_mtp_layer_when_it_drafts(mtp_ckpt):
    from moetier.engine.config import EngineConfig
    from moetier.models.registry import config_from_dir
    from moetier.plan.memory import count
    from moetier.plan.preflight import request_for

    cfg = config_from_dir(mtp_ckpt)
    reqs = [request_for(cfg, torch.float32, "cpu", EngineConfig.of(speculative_config=spec, kv_tokens=256,
                                                                   max_num_tokens=64, max_num_seqs=4))
            for spec in (None, NGRAM, MTP)]
    plans = [count(r) for r in reqs]
    layers = [p.request["moe_layers"] for p in plans]
    assert layers[0] == layers[1] == len(cfg.moe_layers) and layers[2] == layers[0] + 1
    items = [{i["name"]: i for i in p.as_dict()["host"]} for p in plans]
    # a verify step's logits: 4 sequences' last token and 3 drafts each, 16 rows against 4
    act = "activations at the largest step (in host memory)"
    assert "16 logit rows" in items[1][act]["note"] and "4 logit rows" in items[0][act]["note"]
    assert {n: i for n, i in items[0].items() if n != act} == {n: i for n, i in items[1].items() if n != act}
    # MTP: the sampled drafts' distributions, kept for the next step's verify
    q = items[2]["MTP draft distributions (in host memory)"]
    assert q["bytes"] >= 4 * 3 * cfg.vocab_size * 4 and "MTP draft distributions (in host memory)" not in items[1]
    # an engine drafting with MTP runs every step eagerly: no decode graphs planned
    assert reqs[1].cuda_graphs and not reqs[2].cuda_graphs


def test_server_metrics_carry_vllms_speculative_counters():
    import httpx

    from tests.server_helpers import serve, wait_idle

    server = serve(llm_options={"max_model_len": 256, "device": "cpu", "speculative_config": NGRAM})
    try:
        body = {"model": "tiny-stdlib", "prompt": CODE[0], "max_tokens": 30, "ignore_eos": True, "temperature": 0}
        assert httpx.post(server.url + "/v1/completions", json=body, timeout=60).status_code == 200
        wait_idle(server.llm)
        m = server.llm.metrics()
        lines = {x.split(" ")[0]: float(x.split(" ")[1]) for x in httpx.get(server.url + "/metrics").text.splitlines()
                 if x.startswith("moetier:spec_decode")}
    finally:
        server.close()
    label = '{model_name="tiny-stdlib"}'
    assert lines["moetier:spec_decode_num_drafts_total" + label] == m["spec_decode_num_drafts"] > 0
    assert lines["moetier:spec_decode_num_draft_tokens_total" + label] == m["spec_decode_num_draft_tokens"]
    assert lines["moetier:spec_decode_num_accepted_tokens_total" + label] == m["spec_decode_num_accepted_tokens"] > 0
    per_pos = [lines[f'moetier:spec_decode_num_accepted_tokens_per_pos_total{{model_name="tiny-stdlib",position="{j}"}}']
               for j in range(3)]
    assert per_pos == m["spec_decode_num_accepted_tokens_per_pos"]


def test_the_plan_counts_the_state_backups_of_speculation():
    from moetier.engine.config import EngineConfig
    from moetier.plan.memory import count
    from moetier.plan.preflight import request_for
    from moetier.presets import preset

    cfg = preset("tiny-glm5-next")
    plans = [count(request_for(cfg, torch.float32, "cpu", EngineConfig.of(speculative_config=spec, kv_tokens=256,
                                                                          max_num_tokens=64, max_num_seqs=4)))
             for spec in (None, NGRAM)]
    names = [[i["name"] for i in p.as_dict()["host"] + p.as_dict()["device"]] for p in plans]
    assert not any("backups" in n for n in names[0])
    [item] = [i for i in plans[1].as_dict()["host"] + plans[1].as_dict()["device"] if "backups" in i["name"]]
    slots = [i for i in plans[1].as_dict()["host"] + plans[1].as_dict()["device"] if i["name"].startswith("KDA state slots")]
    assert item["bytes"] * 5 == slots[0]["bytes"] * 4  # 4 backups beside 4 + 1 slots
