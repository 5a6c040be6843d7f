"""GLM's and DeepSeek's formats through the whole server (the official `openai` client, streaming and
not), over a scripted engine whose reply goes token by token through the real tokenizer and
detokenizer, so markers arrive cut wherever the tokens cut them; and with a tokenizer that makes the
tags special tokens (GLM's and DeepSeek's checkpoints do), which the detokenizer must keep for the
parsers while it still skips EOS."""

from __future__ import annotations

import json

import pytest

from moetier.server import reasoning
from moetier.server.parsers import TOOL_CALL_PARSERS, Parsers
from server_helpers import ScriptedEngine, marker_model, serve, think_model

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {
    "city": {"type": "string"}, "days": {"type": "integer"}}}}}]
USER = [{"role": "user", "content": "Weather in Paris and Oslo?"}]


@pytest.fixture(scope="module", params=["glm45", "deepseek_v3", "glm45 special", "deepseek_v3 special"])
def server(request, tmp_path_factory):
    """`special`: the checkpoint's tokenizer makes every tag of the format a special token, one id each."""
    fmt, special = request.param.split()[0], request.param.endswith("special")
    markers = reasoning.MARKERS + TOOL_CALL_PARSERS[fmt].MARKERS
    tmp = tmp_path_factory.mktemp("formats")
    s = serve(marker_model(tmp, markers) if special else think_model(tmp), engine_cls=ScriptedEngine,
              name="tiny-think", parsers=Parsers(fmt, fmt))
    tok = s.llm.tokenizer
    assert all(tok.encode(m) == [tok.token_id(m)] and tok.token_id(m) in tok.special_ids for m in markers) == special
    s.format = fmt
    yield s
    s.close()


def reply_with_two_calls(fmt: str) -> str:
    if fmt == "glm45":
        return ("Two cities.</think>\nChecking.<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris"
                "</arg_value>\n<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n</tool_call>\n<tool_call>get_weather"
                "<arg_key>city</arg_key><arg_value>Oslo</arg_value><arg_key>days</arg_key><arg_value>1</arg_value>"
                "</tool_call>")
    return ("Two cities.</think>\nChecking.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n"
            '```json\n{"city": "Paris", "days": 3}\n```<｜tool▁call▁end｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>'
            '{"city": "Oslo", "days": 1}<｜tool▁call▁end｜><｜tool▁calls▁end｜>')


def chat(server, stream: bool, **kw) -> dict:
    c = server.client()
    if not stream:
        r = c.chat.completions.create(model="tiny-think", messages=USER, **kw)
        m = r.choices[0].message
        return {"content": m.content, "reasoning": getattr(m, "reasoning_content", None),
                "finish": r.choices[0].finish_reason,
                "calls": [(t.id, t.function.name, json.loads(t.function.arguments)) for t in m.tool_calls or []]}
    content, reasoning, calls, finish = "", "", {}, None
    for ch in c.chat.completions.create(model="tiny-think", messages=USER, stream=True, **kw):
        d = ch.choices[0].delta
        content += d.content or ""
        reasoning += getattr(d, "reasoning_content", None) or ""
        for t in d.tool_calls or []:
            got = calls.setdefault(t.index, [t.id, "", ""])
            got[1] += t.function.name or ""
            got[2] += t.function.arguments or ""
        finish = ch.choices[0].finish_reason or finish
    return {"content": content or None, "reasoning": reasoning or None, "finish": finish,
            "calls": [(i, n, json.loads(a)) for i, n, a in calls.values()]}


@pytest.mark.parametrize("stream", [False, True])
def test_two_calls_with_reasoning(server, stream):
    server.engine.script = reply_with_two_calls(server.format) + "<|im_end|>"  # EOS: still skipped
    msg = chat(server, stream, tools=TOOLS)
    assert [(n, a) for _, n, a in msg["calls"]] == [("get_weather", {"city": "Paris", "days": 3}),
                                                     ("get_weather", {"city": "Oslo", "days": 1})]
    ids = [i for i, _, _ in msg["calls"]]
    assert all(i.startswith("call_") for i in ids) and len(set(ids)) == 2
    assert msg["reasoning"] == "Two cities." and msg["content"] == "Checking." and msg["finish"] == "tool_calls"


@pytest.mark.parametrize("stream", [False, True])
def test_without_tools_or_with_tool_choice_none_the_text_is_content(server, stream):
    server.engine.script = reply_with_two_calls(server.format)
    for kw in ({}, {"tools": TOOLS, "tool_choice": "none"}):
        msg = chat(server, stream, **kw)
        assert msg["calls"] == [] and msg["finish"] == "stop"
        # no tool-call parser runs, so its tags are not kept: special ones drop out as decode drops them
        tail = server.engine.script.split("</think>\n", 1)[1]
        assert msg["content"] == server.llm.tokenizer.decode(server.llm.tokenizer.encode(tail))


@pytest.mark.parametrize("stream", [False, True])
def test_a_malformed_call_is_content(server, stream):
    bad = ("<tool_call>get weather<arg_key>city</arg_key><arg_value>Paris</arg_value></tool_call>"
           if server.format == "glm45" else
           "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{city: Paris}<｜tool▁call▁end｜><｜tool▁calls▁end｜>")
    server.engine.script = "ok</think>" + bad
    msg = chat(server, stream, tools=TOOLS)
    assert msg["content"] == bad and msg["calls"] == [] and msg["finish"] == "stop"
