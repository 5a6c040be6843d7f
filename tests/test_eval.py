"""lm-eval against our server, offline (moetier/eval, docs/eval.md): its local-completions client on
the shipped tiny_stdlib tasks (generation, multiple choice, rolling log-likelihood), its scores
equal to the engine's own prompt logprobs, its local-chat-completions client on the generation task,
and `moetier eval`'s refusals. A few documents per task: CPU, bounded time. The gate over spawned
servers is tests/test_eval_gate.py."""

from __future__ import annotations

import json
import math

import pytest
from typer.testing import CliRunner

from moetier.default_model import default_model_dir
from moetier.sampling_params import SamplingParams
from server_helpers import live  # noqa: F401 -- the module's server fixture

lmeval = pytest.importorskip("moetier.eval.lmeval")
pytest.importorskip("lm_eval", reason="lm-eval is not installed: pip install 'moetier[eval]'")
from moetier.eval import tasks as shipped  # noqa: E402


def run(live, names, **kw):
    todo = shipped.resolve(names)
    return lmeval.run(live.url, default_model_dir(), todo, max_length=shipped.max_length_of(todo), **kw)


def test_local_completions_runs_the_shipped_tasks(live):
    got = run(live, ["tiny_stdlib"], limit=4, concurrent=2).tasks
    assert set(got) == {"stdlib_next_line", "stdlib_choose_line", "stdlib_perplexity"}
    gen, mc, ppl = got["stdlib_next_line"], got["stdlib_choose_line"], got["stdlib_perplexity"]
    assert gen.n == 4 and len(gen.outputs) == 4 and 0 <= gen.metrics["exact_match"] <= 1
    assert mc.n == 4 and len(mc.lls) == 16 and all(x < 0 for x in mc.lls)  # four choices each
    assert mc.per_doc["acc"] and set(mc.per_doc["acc"]) <= {0.0, 1.0}
    # four held-out files; the training run measured 1.51 nats per token on all eleven
    assert ppl.n == 4 and ppl.tokens > 5_000 and 1.2 < ppl.metrics["nats_per_token"] < 1.9
    assert ppl.metrics["bits_per_byte"] == pytest.approx(
        ppl.metrics["nats_per_token"] * ppl.tokens / sum(len(json.loads(line)["text"].encode())
                                                         for line in _lines("perplexity.jsonl")[:4]) / math.log(2),
        rel=1e-6)


def _lines(name: str) -> list[str]:
    return (shipped.TASKS_DIR / "tiny_stdlib" / name).read_text().splitlines()


def test_lm_evals_log_likelihoods_are_the_engines_prompt_logprobs(live):
    """lm-eval reads the continuation's logprobs out of an echoed prompt ([ctxlen:-1]): the same numbers
    as the engine's prompt logprobs for those tokens."""
    mc = run(live, ["stdlib_choose_line"], limit=1).tasks["stdlib_choose_line"]
    doc = json.loads(_lines("choose_line.jsonl")[0])
    tok = live.llm.tokenizer
    ctx = tok.encode(doc["context"].rstrip())  # lm-eval moves the context's trailing whitespace to the choice
    for choice, ll in zip(doc["choices"], mc.lls):
        whole = tok.encode(doc["context"] + choice)
        assert whole[:len(ctx)] == ctx
        with live.engine._lock:
            out = live.llm.generate([whole], SamplingParams(max_tokens=1, prompt_logprobs=0))[0]
        assert ll == pytest.approx(sum(e[0] for e in out.prompt_logprobs[len(ctx):]), abs=1e-4)


def test_local_chat_completions_runs_the_generation_task(live):
    gen = run(live, ["stdlib_next_line"], limit=3, api="chat").tasks["stdlib_next_line"]
    assert gen.n == 3 and len(gen.outputs) == 3


def test_chat_refuses_log_likelihood_tasks_in_one_line(live):
    with pytest.raises(Exception, match="--api chat"):
        run(live, ["stdlib_choose_line"], limit=1, api="chat")


def cli(*args: str):
    from moetier.cli.app import app

    return CliRunner().invoke(app, ["eval", *args])


@pytest.mark.parametrize("args, message", [
    (["--compare", "no label"], "give LABEL=FLAGS"),
    (["--compare", "a=--tp 2", "--compare", "a=--ep 2"], "given twice"),
    (["--compare", "a=", "--tolerance", "b=0.1"], "with a --compare label"),
    (["--compare", "a=", "--tolerance", "a=-1"], "a number >= 0"),
    (["--url", "http://127.0.0.1:9", "--compare", "a="], "--url evaluates a running server"),
    (["--api", "anthropic"], "choose completions or chat"),
    (["--jobs", "0"], "--jobs 0: it must be at least 1"),
    (["--url", "http://127.0.0.1:9", "--jobs", "2"], "--jobs starts servers of our own"),
    (["--limit", "0"], "--limit 0: it must be at least 1"),
    (["--tokenizer", "/nonexistent"], "no tokenizer.json there"),
    (["--include-path", "/nonexistent"], "no such directory"),
    (["--url", "http://127.0.0.1:9"], "GET /v1/models failed"),
])
def test_bad_arguments_are_one_line_and_exit_2(args, message):
    r = cli(*args)
    assert r.exit_code == 2, r.output
    assert message in r.output and "Traceback" not in r.output and len(r.output.strip().splitlines()) == 1


def test_lm_eval_missing_is_one_line(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "lm_eval", None)  # import lm_eval raises ImportError
    r = cli("--limit", "1")
    assert r.exit_code == 2 and "pip install 'moetier[eval]'" in r.output and len(r.output.strip().splitlines()) == 1
