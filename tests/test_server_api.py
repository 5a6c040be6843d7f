"""The server's API edges (issues 26 and 27), live on a loopback port over the default model: a bug's
500 carries a request id and not the exception's text, a wrong method is a client error, HEAD /health
and GET /v1/models/{id}, number fields' messages, chat roles and null content, text content parts
(joined) and image, video or audio parts (refused by name: text only, issue 29), a model without a
chat template, logit_bias (checked, and applied before sampling), and a client that goes away: one
log line, no traceback, counted under finished_reason "abort"."""

from __future__ import annotations

import json
import logging
import shutil

import httpx
import openai
import pytest

from server_helpers import live, serve, wait_idle  # noqa: F401 -- live: the module's server fixture

MODEL = "tiny-stdlib"
PROMPT = "def fibonacci(n):"


def post(live, route: str, **body) -> httpx.Response:
    return httpx.post(live.url + route, json={"model": MODEL, **body}, timeout=60)


def test_a_bug_is_a_500_with_a_request_id_and_no_exception_text(live, caplog, monkeypatch):
    def broken(*a, **k):
        raise RuntimeError("secret /home/someone/prompt.txt")

    monkeypatch.setattr(live.app.state.handlers, "completion", broken)
    with caplog.at_level(logging.ERROR, logger="moetier.server"):
        r = post(live, "/v1/completions", prompt="x", max_tokens=2)
    assert r.status_code == 500, r.text
    err = r.json()["error"]
    assert "secret" not in err["message"] and err["type"] == "server_error"
    rid = err["message"].split("request id ")[1].split(";")[0]
    assert rid.startswith("err-") and any(rid in m and "secret" in m for m in caplog.messages), caplog.messages


def test_methods_health_and_one_model(live):
    r = httpx.get(live.url + "/v1/completions")
    assert r.status_code == 405 and r.json()["error"]["type"] == "invalid_request_error"
    assert httpx.head(live.url + "/health").status_code == 200
    card = live.client().models.retrieve(MODEL)  # what the openai client's models.retrieve asks for
    assert card.id == MODEL and card.object == "model"
    with pytest.raises(openai.NotFoundError):
        live.client().models.retrieve("other")


@pytest.mark.parametrize("field", ["temperature", "top_p"])
def test_a_number_field_says_number(live, field):
    r = post(live, "/v1/completions", prompt="x", **{field: "abc"})
    assert r.status_code == 400 and r.json()["error"]["param"] == field
    assert "should be a number" in r.json()["error"]["message"] and "integer" not in r.json()["error"]["message"]


@pytest.mark.parametrize("messages,says", [
    ([{"role": "wizard", "content": "hi"}], "role 'wizard'"),
    ([{"role": "user", "content": None}], "content is missing or null"),
    ([{"role": "user"}], "content is missing or null"),
    ([{"role": "user", "content": "x"}, {"role": "assistant", "content": None}], "only an assistant message with"),
])
def test_chat_roles_and_null_content(live, messages, says):
    r = post(live, "/v1/chat/completions", messages=messages, max_tokens=2)
    assert r.status_code == 400 and says in r.json()["error"]["message"], r.text


def test_assistant_tool_calls_may_have_null_content(live):
    call = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    messages = [{"role": "user", "content": "x"}, {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_1", "content": "1"}]
    assert post(live, "/v1/chat/completions", messages=messages, max_tokens=2).status_code == 200


def test_text_parts_are_joined_like_a_string(live):
    c = live.client()
    parts = [{"type": "text", "text": "def fib"}, {"type": "text", "text": "onacci(n):"}]
    got = [c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": content}], max_tokens=4,
                                     temperature=0) for content in (parts, PROMPT)]
    assert got[0].usage.prompt_tokens == got[1].usage.prompt_tokens
    assert got[0].choices[0].message.content == got[1].choices[0].message.content


@pytest.mark.parametrize("part", [
    {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}},
    {"type": "input_image", "image_url": "https://example.com/cat.png"},
    {"type": "video_url", "video_url": {"url": "https://example.com/cat.mp4"}},
    {"type": "input_audio", "input_audio": {"data": "UklGRg==", "format": "wav"}},
])
@pytest.mark.parametrize("stream", [False, True])
def test_non_text_content_is_refused_by_name(live, part, stream):
    content = [{"type": "text", "text": "What is this?"}, part]
    with pytest.raises(openai.BadRequestError) as e:
        live.client().chat.completions.create(model=MODEL, messages=[{"role": "user", "content": content}],
                                              max_tokens=2, stream=stream)
    err = e.value.body  # the openai client's parsed error object
    assert e.value.status_code == 400 and err["param"] == "messages", err
    assert f"messages[0].content[1] is a part of type {part['type']!r}" in err["message"], err
    assert "serves text only" in err["message"] and "vision tower" in err["message"], err


def test_chat_without_a_template_gives_api_advice(tmp_path):
    from moetier.default_model import default_model_dir

    model = tmp_path / "no-template"
    shutil.copytree(default_model_dir(), model)
    tc = json.loads((model / "tokenizer_config.json").read_text())
    tc.pop("chat_template", None)
    (model / "tokenizer_config.json").write_text(json.dumps(tc))
    server = serve(model, name="no-template")
    try:
        r = httpx.post(server.url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]})
        msg = r.json()["error"]["message"]
        assert r.status_code == 400 and "no chat template" in msg and "/v1/completions" in msg and "--chat" not in msg
    finally:
        server.close()


def test_logit_bias_forces_a_token_under_greedy(live):
    token = live.llm.encode("x")[0]
    r = post(live, "/v1/completions", prompt=PROMPT, max_tokens=6, temperature=0, logit_bias={str(token): 100})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == "x" * 6, r.text
    plain = post(live, "/v1/completions", prompt=PROMPT, max_tokens=6, temperature=0).json()["choices"][0]["text"]
    banned = live.llm.encode(plain)[0]  # the greedy first token, forbidden: another comes first
    r = post(live, "/v1/completions", prompt=PROMPT, max_tokens=1, temperature=0, logit_bias={str(banned): -100})
    assert live.llm.encode(r.json()["choices"][0]["text"])[:1] != [banned]


@pytest.mark.parametrize("bias,says", [
    ({"100000": 1}, "not a token id in [0, 448)"),
    ({"abc": 1}, "not a token id"),
    ({"5": 101}, "must be in [-100, 100]"),
    ({"5": "up"}, "should be a number"),
])
def test_bad_logit_bias(live, bias, says):
    r = post(live, "/v1/completions", prompt="x", logit_bias=bias)
    assert r.status_code == 400 and says in r.json()["error"]["message"] and r.json()["error"]["param"] == "logit_bias"


def test_a_disconnect_is_one_line_and_counted_as_aborted(live, caplog, capfd):
    wait_idle(live.llm)
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 480, "ignore_eos": True}
    with caplog.at_level(logging.INFO, logger="moetier.server"):
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(live.url + "/v1/completions", json=body, timeout=0.3)
        wait_idle(live.llm)
        with httpx.stream("POST", live.url + "/v1/completions", json={**body, "stream": True}) as r:
            next(r.iter_lines())
        wait_idle(live.llm)
    aborted = [m for m in caplog.messages if "aborted: the client disconnected" in m]
    assert len(aborted) == 2 and all(m.startswith("request cmpl-") for m in aborted), caplog.messages
    err = capfd.readouterr().err
    assert "Traceback" not in err and "Exception in ASGI application" not in err, err
    text = httpx.get(live.url + "/metrics").text
    line = next(x for x in text.splitlines() if x.startswith("moetier:request_success_total")
                and 'finished_reason="abort"' in x)
    assert float(line.split()[-1]) >= 2
