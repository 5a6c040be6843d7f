"""The server through the official `openai` client, live on a loopback port, on the default model:
completions and chat, streaming and not, usage, stop, the reasoning split, tool calls, errors,
disconnects, the API key, the queue limit and the metrics."""

from __future__ import annotations

import json
import threading

import httpx
import openai
import pytest

from moetier.sampling_params import SamplingParams
from server_helpers import ScriptedEngine, live, serve, think_model, wait_idle  # noqa: F401 -- live: the module's server fixture

MODEL = "tiny-stdlib"
PROMPT = "def fibonacci(n):"


@pytest.fixture(scope="module")
def client(live):
    return live.client()


@pytest.fixture(scope="module")
def think(tmp_path_factory):
    server = serve(think_model(tmp_path_factory.mktemp("think")), name="tiny-think")
    yield server
    server.close()


@pytest.fixture(scope="module")
def scripted(tmp_path_factory):
    server = serve(think_model(tmp_path_factory.mktemp("scripted")), engine_cls=ScriptedEngine, name="tiny-think")
    yield server
    server.close()


def completion_text(client, prompt, **kw):
    return client.completions.create(model=MODEL, prompt=prompt, temperature=0, **kw).choices[0].text


# -- completions ------------------------------------------------------------------------------------
def test_completion_matches_the_engine_and_counts_usage(live, client):
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0)
    with live.engine._lock:  # the engine thread waits while the test drives the LLM directly
        direct = live.llm.generate([PROMPT], SamplingParams(max_tokens=24))[0].outputs[0]
    assert r.choices[0].text == direct.text and r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 24 and r.usage.prompt_tokens == len(live.llm.encode(PROMPT))
    assert r.usage.total_tokens == r.usage.prompt_tokens + 24
    assert r.model == MODEL and r.object == "text_completion"


def test_completion_stream_equals_whole_and_carries_usage(client):
    whole = completion_text(client, PROMPT, max_tokens=24)
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 24
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert all(c.usage is None for c in chunks[:-1])


def test_stream_sends_a_chunk_per_token_even_without_text(scripted):
    # Multi-byte characters arrive over several byte tokens, only the last of which has text; every
    # token still gets its chunk, so a client times each one (bench serve's TTFT and ITL).
    ScriptedEngine.script = "é日本"
    ids = scripted.llm.tokenizer.encode(ScriptedEngine.script)
    chunks = [c for c in scripted.client().completions.create(model="tiny-think", prompt="x", max_tokens=16,
                                                              stream=True) if c.choices]
    assert len(ids) == 8 and len(chunks) == len(ids)
    assert "".join(c.choices[0].text for c in chunks) == "é日本" and sum(bool(c.choices[0].text) for c in chunks) == 3


def test_stop_strings_string_and_list(client):
    whole = completion_text(client, PROMPT, max_tokens=24)
    stop = whole[6:9]
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0, stop=stop)
    assert r.choices[0].text == whole[:whole.index(stop)] and r.choices[0].finish_reason == "stop"
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0, stop=["@@@", stop])
    assert r.choices[0].text == whole[:whole.index(stop)]
    streamed = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0, stop=stop,
                                         stream=True)
    assert "".join(c.choices[0].text for c in streamed) == whole[:whole.index(stop)]


def test_token_id_prompt_seed_and_ignore_eos(live, client):
    ids = live.llm.encode(PROMPT)
    assert completion_text(client, ids, max_tokens=12) == completion_text(client, PROMPT, max_tokens=12)
    a = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0.9, top_p=0.9, seed=7,
                                  extra_body={"top_k": 20, "ignore_eos": True})
    b = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0.9, top_p=0.9, seed=7,
                                  extra_body={"top_k": 20, "ignore_eos": True})
    assert a.choices[0].text == b.choices[0].text and a.usage.completion_tokens == 16


# -- chat ----------------------------------------------------------------------------------------------
def test_chat_whole_stream_and_max_completion_tokens(client):
    msgs = [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "def add(a, b):"}]
    r = client.chat.completions.create(model=MODEL, messages=msgs, max_completion_tokens=16, temperature=0)
    m = r.choices[0].message
    assert m.role == "assistant" and m.content and r.usage.completion_tokens == 16
    assert r.choices[0].finish_reason == "length" and not m.tool_calls
    chunks = list(client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=16, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == m.content
    assert chunks[-1].usage.total_tokens == r.usage.total_tokens


def test_models_version_health_tokenize_detokenize(live, client):
    assert [m.id for m in client.models.list()] == [MODEL]
    assert httpx.get(live.url + "/health").status_code == 200
    assert httpx.get(live.url + "/version").json()["version"]
    t = httpx.post(live.url + "/tokenize", json={"prompt": PROMPT}).json()
    assert t["tokens"] == live.llm.encode(PROMPT) and t["count"] == len(t["tokens"])
    assert httpx.post(live.url + "/detokenize", json={"tokens": t["tokens"]}).json()["prompt"] == PROMPT
    chat = httpx.post(live.url + "/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}).json()
    assert live.llm.tokenizer.decode(chat["tokens"], skip_special_tokens=False).endswith("assistant\n")


# -- reasoning (references 002 and 004) ------------------------------------------------------------------
def raw_completion(server, messages, max_tokens, **template_kwargs):
    """What the model writes for this chat, by /v1/completions on the rendered prompt: the ground truth
    that reasoning + content must add up to."""
    ids = httpx.post(server.url + "/tokenize", json={"messages": messages, "chat_template_kwargs": template_kwargs}).json()
    r = server.client().completions.create(model="tiny-think", prompt=ids["tokens"], max_tokens=max_tokens, temperature=0)
    return r.choices[0].text


def test_prompt_ends_in_think_and_reply_never_closes_it(think):
    """The template opens <think>; the tiny model never writes </think>: everything is reasoning, and
    none of it is lost (002: a parser waiting for an opening tag returned nothing)."""
    msgs = [{"role": "user", "content": "def parse(text):"}]
    raw = raw_completion(think, msgs, 20)
    assert raw and "</think>" not in raw
    c = think.client()
    r = c.chat.completions.create(model="tiny-think", messages=msgs, max_tokens=20, temperature=0)
    m = r.choices[0].message
    assert m.content is None
    assert m.reasoning_content == raw and m.reasoning == raw  # both names (002: `reasoning`, not `_content`)
    chunks = list(c.chat.completions.create(model="tiny-think", messages=msgs, max_tokens=20, temperature=0, stream=True))
    deltas = [c.choices[0].delta for c in chunks]
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == raw
    assert "".join(getattr(d, "reasoning", None) or "" for d in deltas) == raw
    assert not "".join(d.content or "" for d in deltas)


def test_enable_thinking_false_goes_through_chat_template_kwargs(think):
    msgs = [{"role": "user", "content": "def parse(text):"}]
    kwargs = {"enable_thinking": False}
    raw = raw_completion(think, msgs, 20, **kwargs)
    r = think.client().chat.completions.create(model="tiny-think", messages=msgs, max_tokens=20, temperature=0,
                                               extra_body={"chat_template_kwargs": kwargs})
    m = r.choices[0].message
    assert m.content == raw and getattr(m, "reasoning_content", None) is None
    assert raw != raw_completion(think, msgs, 20)  # the template really rendered another prompt


@pytest.mark.parametrize("stream", [False, True])
def test_reasoning_then_content(scripted, stream):
    scripted.engine.script = "The user wants 2 + 2.</think>\n\nIt is 4."
    msg = chat(scripted, [{"role": "user", "content": "2 + 2?"}], stream)
    assert msg["reasoning_content"] == msg["reasoning"] == "The user wants 2 + 2."
    assert msg["content"] == "It is 4." and msg["finish_reason"] == "stop"


def chat(server, messages, stream, **kw) -> dict:
    """One chat reply as a dict (content, reasoning_content, reasoning, tool_calls, finish_reason),
    whole or assembled from the stream."""
    c = server.client()
    if not stream:
        r = c.chat.completions.create(model="tiny-think", messages=messages, **kw)
        m = r.choices[0].message
        return {"content": m.content, "reasoning_content": getattr(m, "reasoning_content", None),
                "reasoning": getattr(m, "reasoning", None), "finish_reason": r.choices[0].finish_reason,
                "tool_calls": [(t.id, t.function.name, json.loads(t.function.arguments)) for t in m.tool_calls or []]}
    out = {"content": "", "reasoning_content": "", "reasoning": "", "tool_calls": {}, "finish_reason": None}
    for ch in c.chat.completions.create(model="tiny-think", messages=messages, stream=True, **kw):
        d = ch.choices[0].delta
        for key in ("content", "reasoning_content", "reasoning"):
            out[key] += getattr(d, key, None) or ""
        for t in d.tool_calls or []:
            prev = out["tool_calls"].setdefault(t.index, [t.id, "", ""])
            prev[1] += t.function.name or ""
            prev[2] += t.function.arguments or ""
        out["finish_reason"] = ch.choices[0].finish_reason or out["finish_reason"]
    out["tool_calls"] = [(i, n, json.loads(a)) for i, n, a in out["tool_calls"].values()]
    return {k: (v or None) if k not in ("tool_calls",) else v for k, v in out.items()}


# -- tool calls ----------------------------------------------------------------------------------------
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]


def test_tools_are_rendered_through_the_template(scripted):
    msgs = [{"role": "user", "content": "Weather in Paris?"}]
    ids = httpx.post(scripted.url + "/tokenize", json={"messages": msgs, "tools": TOOLS}).json()["tokens"]
    assert '"name": "get_weather"' in httpx.post(scripted.url + "/detokenize", json={"tokens": ids}).json()["prompt"]


@pytest.mark.parametrize("stream", [False, True])
def test_tool_calls_parsed(scripted, stream):
    scripted.engine.script = ('I need the weather.</think>\n\n<tool_call>\n{"name": "get_weather", "arguments": '
                              '{"city": "Paris"}}\n</tool_call>')
    msg = chat(scripted, [{"role": "user", "content": "Weather in Paris?"}], stream, tools=TOOLS)
    assert [(n, a) for _, n, a in msg["tool_calls"]] == [("get_weather", {"city": "Paris"})]
    assert msg["tool_calls"][0][0].startswith("call_")
    assert msg["finish_reason"] == "tool_calls" and msg["content"] is None
    assert msg["reasoning_content"] == "I need the weather."


@pytest.mark.parametrize("stream", [False, True])
def test_malformed_tool_call_is_plain_content(scripted, stream):
    scripted.engine.script = "ok</think><tool_call>{\"name\": get_weather}</tool_call>"
    msg = chat(scripted, [{"role": "user", "content": "Weather?"}], stream, tools=TOOLS)
    assert msg["content"] == "<tool_call>{\"name\": get_weather}</tool_call>"
    assert msg["tool_calls"] == [] and msg["finish_reason"] == "stop"


def test_tool_call_history_renders(scripted):
    scripted.engine.script = "done</think>It is sunny."
    msgs = [{"role": "user", "content": "Weather?"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    assert chat(scripted, msgs, False, tools=TOOLS)["content"] == "It is sunny."


# -- errors ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("body,status,param", [
    ({"model": "nope", "prompt": "x"}, 404, "model"),
    ({"prompt": "x", "max_tokens": -1}, 400, "max_tokens"),
    ({"prompt": "x", "max_tokens": 10**9}, 400, "max_tokens"),
    ({"prompt": "x " * 600}, 400, "prompt"),  # longer than the 512-token context
    ({"prompt": "x", "temperature": -1}, 400, None),
    ({"prompt": "x", "top_p": 0}, 400, None),
    ({"prompt": "x", "max_tokens": "ten"}, 400, "max_tokens"),
    ({"prompt": 5}, 400, "prompt"),
    ({"prompt": ""}, 400, "prompt"),
    ({"prompt": [10**6]}, 400, "prompt"),
    ({"prompt": "x", "n": 2}, 400, "n"),
    ({"prompt": "x", "logprobs": 21}, 400, "logprobs"),
    ({"prompt": "x", "logprobs": -1}, 400, "logprobs"),
    ({"prompt": "x", "stop": [""]}, 400, None),
    ({}, 400, "prompt"),
])
def test_bad_completion_requests(live, body, status, param):
    r = httpx.post(live.url + "/v1/completions", json={"model": MODEL, **body})
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["message"] and err["code"] == status and err["param"] == param


@pytest.mark.parametrize("body", [
    {"messages": []},
    {"messages": "hi"},
    {"messages": [{"content": "no role"}]},
    {"messages": [{"role": "user", "content": 5}]},
    {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2},  # needs logprobs: true
    {"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 50},
    {"messages": [{"role": "user", "content": "x"}], "tool_choice": "required", "tools": TOOLS},
    {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]},
    {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 0},
])
def test_bad_chat_requests(live, body):
    r = httpx.post(live.url + "/v1/chat/completions", json={"model": MODEL, **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["type"] == "invalid_request_error"


def test_malformed_json_unknown_route_and_the_server_keeps_serving(live, client):
    r = httpx.post(live.url + "/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
    assert httpx.post(live.url + "/v1/completions", content=b"[1, 2]").status_code == 400
    assert httpx.get(live.url + "/v1/nothing").json()["error"]["code"] == 404
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="other", prompt="x")
    with pytest.raises(openai.BadRequestError, match="logprobs must be in 0..20"):
        client.completions.create(model=MODEL, prompt="x", logprobs=30)
    assert completion_text(client, PROMPT, max_tokens=4)


# -- disconnects --------------------------------------------------------------------------------------
def test_disconnected_stream_aborts_and_frees_pages(live):
    wait_idle(live.llm)
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 400, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", live.url + "/v1/completions", json=body) as r:
        lines = r.iter_lines()
        got = [next(lines) for _ in range(6)]
        assert any(line.startswith("data: ") for line in got)
        assert live.llm.scheduler.cache.num_in_use > 0
    wait_idle(live.llm)  # pages back to zero long before 400 tokens would have been made


def test_disconnected_plain_request_aborts_and_frees_pages(live):
    wait_idle(live.llm)
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 480, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(live.url + "/v1/completions", json=body, timeout=0.3)
    wait_idle(live.llm)


# -- API key, queue limit, metrics ------------------------------------------------------------------------
def test_api_key():
    server = serve(api_key="s3cret")
    try:
        with pytest.raises(openai.AuthenticationError):
            server.client("wrong").models.list()
        with pytest.raises(openai.AuthenticationError):
            server.client("wrong").completions.create(model=MODEL, prompt="x", max_tokens=2)
        assert httpx.get(server.url + "/metrics").status_code == 401
        assert httpx.get(server.url + "/health").status_code == 200  # open for load balancers
        assert server.client("s3cret").completions.create(model=MODEL, prompt="x", max_tokens=2).usage.completion_tokens == 2
    finally:
        server.close()


def test_queue_limit_503_with_retry_after():
    server = serve(llm_options={"max_num_seqs": 1}, max_queue=1)
    try:
        statuses, headers = [], []
        # NOTE: all six post at once; staggered by a loaded machine, each could finish before the next
        # arrives and none would be refused
        together = threading.Barrier(6)

        def call():
            together.wait()
            r = httpx.post(server.url + "/v1/completions", timeout=60,
                           json={"model": MODEL, "prompt": PROMPT, "max_tokens": 400, "ignore_eos": True})
            statuses.append(r.status_code)
            headers.append(r.headers.get("retry-after"))

        threads = [threading.Thread(target=call) for _ in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert statuses.count(200) >= 2 and 503 in statuses and set(statuses) <= {200, 503}
        assert all(h == "1" for s, h in zip(statuses, headers) if s == 503)
        wait_idle(server.llm)
    finally:
        server.close()


def test_metrics_have_vllm_names_and_expert_tiers(live, client):
    completion_text(client, PROMPT, max_tokens=8)
    text = httpx.get(live.url + "/metrics").text
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "prompt_tokens_total",
                 "generation_tokens_total", "time_to_first_token_seconds_bucket", "inter_token_latency_seconds_count",
                 "e2e_request_latency_seconds_sum", "request_queue_time_seconds_count", "num_preemptions_total",
                 "request_success_total", "expert_hits_total", "expert_misses_total", "expert_overflow_total",
                 "expert_link_bytes_total", "prefix_cache_queries_total", "prefix_cache_hits_total",
                 "kv_cache_cached_pages", "engine_steps_total", "engine_large_steps_total",
                 "engine_large_step_tokens_total", "engine_step_seconds_total", "engine_large_step_seconds_total"):
        assert f"moetier:{name}" in text, name
    step_s = [line for line in text.splitlines() if line.startswith("moetier:engine_step_seconds_total")]
    assert float(step_s[0].split()[-1]) > 0
    assert 'moetier:expert_hits_total{layer="total",model_name="tiny-stdlib"}' in text
    assert 'moetier:expert_hits_total{layer="0",model_name="tiny-stdlib"}' in text
    assert 'moetier:expert_rank_misses_total{model_name="tiny-stdlib",rank="0"}' in text  # one process: rank 0
    assert 'rank="1"' not in text
    gen = [line for line in text.splitlines() if line.startswith("moetier:generation_tokens_total")]
    assert float(gen[0].split()[-1]) >= 8
