"""echo, logprobs and prompt_logprobs on /v1/completions, as vLLM answers them (server/echo.py): what
log-likelihood clients (lm-eval's local-completions) send, with the edge cases: scoring only
(max_tokens 0), a prompt of one token, an empty continuation, logprobs beyond 20, stop strings,
streaming."""

from __future__ import annotations

import httpx
import pytest

from moetier.sampling_params import SamplingParams
from server_helpers import live  # noqa: F401 -- the module's server fixture

MODEL = "tiny-stdlib"
PROMPT = "def fibonacci(n):\n    return"


@pytest.fixture(scope="module")
def client(live):
    return live.client()


def post(live, **body) -> httpx.Response:
    return httpx.post(live.url + "/v1/completions", json={"model": MODEL, **body}, timeout=60)


def test_echo_returns_the_prompt_tokens_with_the_engines_prompt_logprobs(live, client):
    ids = live.llm.encode(PROMPT)
    with live.engine._lock:
        direct = live.llm.generate([ids], SamplingParams(max_tokens=3, temperature=0, prompt_logprobs=1,
                                                         logprobs=1))[0]
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0, logprobs=1, echo=True)
    c = r.choices[0]
    assert c.text == PROMPT + direct.outputs[0].text
    lp = c.logprobs
    n = len(ids)
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == n + 3
    assert "".join(lp.tokens) == c.text and lp.text_offset[0] == 0
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.token_logprobs[1:n] == pytest.approx([e[0] for e in direct.prompt_logprobs[1:]], abs=1e-6)
    assert lp.token_logprobs[n:] == pytest.approx([e[0] for e in direct.outputs[0].logprobs], abs=1e-6)
    for tok, chosen, top in zip(lp.tokens[1:], lp.token_logprobs[1:], lp.top_logprobs[1:]):
        assert top[tok] == pytest.approx(chosen, abs=1e-6) and 1 <= len(top) <= 2  # the token and the top one
    assert r.usage.prompt_tokens == n and r.usage.completion_tokens == 3


def test_max_tokens_zero_scores_the_prompt_only(live):
    body = post(live, prompt=PROMPT, max_tokens=0, echo=True, logprobs=0, temperature=0).json()
    c = body["choices"][0]
    n = len(live.llm.encode(PROMPT))
    assert c["text"] == PROMPT and c["finish_reason"] == "length"
    assert len(c["logprobs"]["tokens"]) == n and c["logprobs"]["token_logprobs"][0] is None
    assert all(len(t) == 1 for t in c["logprobs"]["top_logprobs"][1:])
    assert body["usage"] == {"prompt_tokens": n, "completion_tokens": 0, "total_tokens": n}
    refused = post(live, prompt=PROMPT, max_tokens=0)
    assert refused.status_code == 400 and "needs echo: true" in refused.json()["error"]["message"]


def test_a_prompt_of_one_token_and_token_id_prompts(live):
    one = post(live, prompt=[[42]], max_tokens=0, echo=True, logprobs=1).json()["choices"][0]["logprobs"]
    assert one["token_logprobs"] == [None] and one["top_logprobs"] == [None]
    # lm-eval's shape: token ids in a list of one; an empty continuation scores nothing ([ctxlen:-1])
    ids = live.llm.encode(PROMPT)
    got = post(live, prompt=[ids], max_tokens=1, echo=True, logprobs=1, temperature=0).json()["choices"][0]
    assert len(got["logprobs"]["token_logprobs"]) == len(ids) + 1
    assert got["logprobs"]["token_logprobs"][len(ids):-1] == []


def test_prompt_logprobs_in_vllms_format(live):
    ids = live.llm.encode(PROMPT)
    c = post(live, prompt=PROMPT, max_tokens=1, prompt_logprobs=2, temperature=0).json()["choices"][0]
    scored = c["prompt_logprobs"]
    assert len(scored) == len(ids) and scored[0] is None and c["logprobs"] is None
    for tok, entry in zip(ids[1:], scored[1:]):
        mine = entry[str(tok)]
        assert set(mine) == {"logprob", "rank", "decoded_token"} and mine["rank"] >= 1
        ranks = sorted(e["rank"] for k, e in entry.items() if k != str(tok) or mine["rank"] <= 2)
        assert ranks[:2] == [1, 2] and 2 <= len(entry) <= 3
    streamed = post(live, prompt=PROMPT, max_tokens=1, prompt_logprobs=1, stream=True)
    assert streamed.status_code == 400 and streamed.json()["error"]["param"] == "prompt_logprobs"


def test_logprobs_beyond_20_are_refused(live):
    for field in ("logprobs", "prompt_logprobs"):
        r = post(live, prompt=PROMPT, max_tokens=1, echo=True, **{field: 21})
        assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text


def test_stop_strings_with_echo(live):
    plain = post(live, prompt=PROMPT, max_tokens=12, temperature=0).json()["choices"][0]["text"]
    stop = plain[3:5]
    assert stop.strip()
    c = post(live, prompt=PROMPT, max_tokens=12, temperature=0, echo=True, stop=[stop]).json()["choices"][0]
    assert c["text"] == PROMPT + plain[:plain.index(stop)] and c["finish_reason"] == "stop"


def test_echo_streams_the_prompt_first(live, client):
    whole = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0, logprobs=1,
                                      echo=True).choices[0]
    chunks = [c.choices[0] for c in client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0,
                                                              logprobs=1, echo=True, stream=True) if c.choices]
    assert chunks[0].text == PROMPT and "".join(c.text for c in chunks) == whole.text
    assert [x for c in chunks for x in c.logprobs.token_logprobs] == pytest.approx(whole.logprobs.token_logprobs,
                                                                                   abs=1e-6)
    assert [x for c in chunks for x in c.logprobs.text_offset] == whole.logprobs.text_offset
    scoring = [c.choices[0] for c in client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=0, echo=True,
                                                               stream=True) if c.choices]
    assert [c.text for c in scoring] == [PROMPT, ""] and scoring[-1].finish_reason == "length"
