"""DeepSeek's tool calls (V3/R1 and V3.1 forms) on hand-written replies: whole, and cut into deltas
at every boundary, the result is the same; a section that is not all well-formed calls is content."""

from __future__ import annotations

import json

import pytest

from moetier.server.parsers import Parsers
from moetier.server.tools_deepseek import CALLS_BEGIN, CALLS_END, DeepSeekToolParser, read_deepseek_call
from parser_helpers import check_every_cut, stream_tools, whole_tools

DS = Parsers("deepseek_v3", "deepseek_v3")
MARKERS = ("｜tool▁", "<｜", "｜>", "```")
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {
    "city": {"type": "string"}}}}}]
BEGIN, END, SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"


def v3(name: str, args: str) -> str:
    return f"{BEGIN}function{SEP}{name}\n```json\n{args}\n```{END}"


def v31(name: str, args: str) -> str:
    return f"{BEGIN}{name}{SEP}{args}{END}"


PARIS, OSLO = '{"city": "Paris"}', '{"city": "Oslo", "days": 2}'
# V3 (no thinking) and V3.1 non-thinking: the prompt ends on the assistant tag, or on a closed think
PROMPT = "<｜begin▁of▁sentence｜><｜User｜>Weather?<｜Assistant｜>"
PROMPT_THINK = PROMPT + "<think>"  # V3.1 thinking mode, R1


@pytest.mark.parametrize("prompt,text,want", [
    (PROMPT, CALLS_BEGIN + v3("get_weather", PARIS) + CALLS_END, ("", "", [("get_weather", {"city": "Paris"})])),
    (PROMPT, "Let me check." + CALLS_BEGIN + v3("get_weather", PARIS) + "\n" + v3("get_weather", OSLO) + CALLS_END,
     ("", "Let me check.", [("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Oslo", "days": 2})])),
    (PROMPT + "</think>", CALLS_BEGIN + v31("get_weather", PARIS) + v31("get_weather", OSLO) + CALLS_END,
     ("", "", [("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Oslo", "days": 2})])),
    # thinking first (R1, V3.1 thinking): the reasoning is split off, the calls follow it
    (PROMPT_THINK, "Need weather.</think>\n\n" + CALLS_BEGIN + v31("get_weather", PARIS) + CALLS_END,
     ("Need weather.", "", [("get_weather", {"city": "Paris"})])),
    # one bad call makes the whole section content, as written
    (PROMPT, CALLS_BEGIN + v31("get_weather", PARIS) + v31("get_weather", "{city: Oslo}") + CALLS_END,
     ("", CALLS_BEGIN + v31("get_weather", PARIS) + v31("get_weather", "{city: Oslo}") + CALLS_END, [])),
    # the reply stops inside the section (max_tokens): content
    (PROMPT, "ok " + CALLS_BEGIN + v3("get_weather", PARIS), ("", "ok " + CALLS_BEGIN + v3("get_weather", PARIS), [])),
    (PROMPT, "plain ｜ text < with bars ▁", ("", "plain ｜ text < with bars ▁", [])),
])
def test_deepseek_replies_whole_and_at_every_cut(prompt, text, want):
    check_every_cut(DS, prompt, TOOLS, text, want, MARKERS if want[2] else ())


@pytest.mark.parametrize("body,want", [
    (f"function{SEP}get_weather\n```json\n{PARIS}\n```", ("get_weather", {"city": "Paris"})),
    (f"function{SEP}get_weather\n```\n{PARIS}```", ("get_weather", {"city": "Paris"})),  # fence without a tag
    (f"function{SEP}list_files\n```json\n{{}}\n```", ("list_files", {})),
    (f"get_weather{SEP}{PARIS}", ("get_weather", {"city": "Paris"})),
    (f"get_weather{SEP}\n```json\n{PARIS}\n```\n", ("get_weather", {"city": "Paris"})),  # V3.1 with a fence
    (f"list_files{SEP}", ("list_files", {})),
    (f"get_weather{SEP}" + '{"q": "a```b", "n": [1, {"x": null}]}', ("get_weather", {"q": "a```b", "n": [1, {"x": None}]})),
    # malformed: no separator, no name, arguments that are not a JSON object
    (f"get_weather {PARIS}", None), (f"{SEP}{PARIS}", None), (f"get_weather{SEP}[1, 2]", None),
    (f"function{SEP}get_weather\n```json\n{{not json}}\n```", None), (f"get_weather{SEP}{{", None),
])
def test_deepseek_call_bodies(body, want):
    call = read_deepseek_call(body)
    assert (None if call is None else (call.name, json.loads(call.arguments))) == want
    text = f"{CALLS_BEGIN}{BEGIN}{body}{END}{CALLS_END}"
    expect = ("", [want]) if want is not None else (text, [])
    assert whole_tools(DeepSeekToolParser, text) == expect
    for cut in range(1, len(text)):
        assert stream_tools(DeepSeekToolParser, text, [cut]) == expect, cut


@pytest.mark.parametrize("section", [
    CALLS_BEGIN + CALLS_END,  # no call in it
    CALLS_BEGIN + "junk" + v31("get_weather", PARIS) + CALLS_END,  # text that is not a call
    CALLS_BEGIN + BEGIN + f"get_weather{SEP}{PARIS}" + CALLS_END,  # a call never closed
    CALLS_BEGIN + v31("get_weather", PARIS) + "and more" + CALLS_END,  # text after a good call
    CALLS_BEGIN + v31("get_weather", PARIS) + BEGIN + f"get_weather{SEP}{OSLO}" + CALLS_END,  # the second unclosed
])
def test_deepseek_malformed_sections_are_content(section):
    assert whole_tools(DeepSeekToolParser, section) == (section, [])


def test_both_names_read_both_forms():
    text = CALLS_BEGIN + v3("get_weather", PARIS) + v31("get_weather", OSLO) + CALLS_END
    for name in ("deepseek_v3", "deepseek_v31"):
        _, calls = Parsers(name, "deepseek_v3").tool_parser(TOOLS).parse(text)
        assert [json.loads(c.arguments)["city"] for c in calls] == ["Paris", "Oslo"]
