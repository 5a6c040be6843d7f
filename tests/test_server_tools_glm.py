"""GLM's reasoning split and tool calls (GLM-4.5, GLM-4.7, GLM-5 spellings) on hand-written replies:
whole, and cut into deltas at every boundary, the result is the same; a malformed block is content."""

from __future__ import annotations

import json

import pytest

from moetier.server.parsers import Parsers
from moetier.server.tools_glm import GlmToolParser, read_glm_call
from parser_helpers import check_every_cut, stream_tools, whole_tools

GLM = Parsers("glm45", "glm45")
MARKERS = ("<tool_call>", "</tool_call>", "<arg_key>", "<arg_value>", "</arg_value>")
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "days": {"type": "integer"}, "metric": {"type": "boolean"},
        "zip": {"type": ["string", "null"]}}}}},
    {"type": "function", "function": {"name": "write_file", "parameters": {"type": "object", "properties": {
        "path": {"type": "string"}, "content": {"type": "string"}, "mode": {"type": "object"},
        "tags": {"type": "array"}}}}},
    {"type": "function", "function": {"name": "list_files", "parameters": {"type": "object", "properties": {}}}},
]
# GLM-5 / GLM-4.7 chat templates open <think> at the end of the prompt; GLM-4.5's lets the model open it
PROMPT_OPEN = "[gMASK]<sop><|user|>Weather in Paris?<|assistant|><think>"
PROMPT_SHUT = "[gMASK]<sop><|user|>Weather in Paris?<|assistant|>"

CALL_45 = "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n</tool_call>"
CALL_47 = "<tool_call>get_weather<arg_key>city</arg_key><arg_value>Oslo</arg_value><arg_key>days</arg_key><arg_value>2</arg_value></tool_call>"
CODE = 'def f(x):\n    return x < 3 and "a" != \'b\'\n'


MALFORMED_THEN_GOOD = "x</think><tool_call>get_weather<arg_key>city</arg_key><arg_value>Rome</tool_call>" + CALL_47


@pytest.mark.parametrize("prompt,text,want", [
    # GLM-5: the prompt opened <think>; the model closes it, then calls
    (PROMPT_OPEN, "The user wants weather.</think>\n" + CALL_45,
     ("The user wants weather.", "", [("get_weather", {"city": "Paris", "days": 3})])),
    # GLM-4.5: the model opens <think> itself; two calls, text before them
    (PROMPT_SHUT, "<think>two cities</think>\nChecking both.\n" + CALL_45 + "\n" + CALL_47,
     ("two cities", "Checking both.",
      [("get_weather", {"city": "Paris", "days": 3}), ("get_weather", {"city": "Oslo", "days": 2})])),
    # thinking off: the template closed an empty think block in the prompt
    (PROMPT_SHUT + "<think></think>", "Sure." + CALL_47, ("", "Sure.", [("get_weather", {"city": "Oslo", "days": 2})])),
    # no tool call at all; a literal "<" in the answer is content
    (PROMPT_OPEN, "Easy.</think>\nIt is 3 < 4 degrees <b>warm</b>.", ("Easy.", "It is 3 < 4 degrees <b>warm</b>.", [])),
    # a malformed block (an unclosed pair) is content, and the good call after it still counts
    (PROMPT_OPEN, MALFORMED_THEN_GOOD,
     ("x", "<tool_call>get_weather<arg_key>city</arg_key><arg_value>Rome</tool_call>",
      [("get_weather", {"city": "Oslo", "days": 2})])),
    # the reply ends inside a call (max_tokens): all of it is content
    (PROMPT_OPEN, "x</think>" + CALL_45[:60], ("x", CALL_45[:60], [])),
])
def test_glm_replies_whole_and_at_every_cut(prompt, text, want):
    check_every_cut(GLM, prompt, TOOLS, text, want, () if text == MALFORMED_THEN_GOOD else MARKERS)


@pytest.mark.parametrize("body,want", [
    # typed by the tools' schemas: a string parameter keeps its text exactly, others are JSON
    ("get_weather\n<arg_key>city</arg_key>\n<arg_value>123</arg_value>\n<arg_key>metric</arg_key>\n<arg_value>true"
     "</arg_value>\n<arg_key>zip</arg_key>\n<arg_value>07001</arg_value>\n",
     ("get_weather", {"city": "123", "metric": True, "zip": "07001"})),
    ("write_file<arg_key>path</arg_key><arg_value> /tmp/a b.py </arg_value><arg_key>content</arg_key><arg_value>"
     + CODE + '</arg_value><arg_key>mode</arg_key><arg_value>{"append": false, "n": [1, 2.5]}</arg_value>'
     '<arg_key>tags</arg_key><arg_value>["x", "y"]</arg_value>',
     ("write_file", {"path": " /tmp/a b.py ", "content": CODE, "mode": {"append": False, "n": [1, 2.5]},
                     "tags": ["x", "y"]})),
    # a non-string parameter that is not JSON stays a string; a tool the request did not list is read as JSON
    ("get_weather<arg_key>days</arg_key><arg_value>three</arg_value>", ("get_weather", {"days": "three"})),
    ("unlisted\n<arg_key>n</arg_key>\n<arg_value>42</arg_value>\n<arg_key>s</arg_key>\n<arg_value>Paris</arg_value>",
     ("unlisted", {"n": 42, "s": "Paris"})),
    # no arguments
    ("list_files", ("list_files", {})),
    ("list_files\n", ("list_files", {})),
    # a value holding markup that is not its closing tag
    ("write_file<arg_key>content</arg_key><arg_value><arg_key>x</arg_key> <b></arg_value>",
     ("write_file", {"content": "<arg_key>x</arg_key> <b>"})),
    # GLM falling back to Hermes JSON inside the same tags
    ('{"name": "get_weather", "arguments": {"city": "Paris"}}', ("get_weather", {"city": "Paris"})),
    # malformed: no name, a name with a space, text between pairs, an unclosed pair, an empty key
    ("", None), ("\n<arg_key>city</arg_key><arg_value>Paris</arg_value>", None),
    ("get weather\n<arg_key>city</arg_key><arg_value>Paris</arg_value>", None),
    ("get_weather\n<arg_key>city</arg_key>is<arg_value>Paris</arg_value>", None),
    ("get_weather\n<arg_key>city</arg_key><arg_value>Paris", None),
    ("get_weather\n<arg_key>city</arg_key><arg_value>Paris</arg_value>trailing", None),
    ("get_weather\n<arg_key> </arg_key><arg_value>Paris</arg_value>", None),
    ('{"name": get_weather}', None),
])
def test_glm_call_bodies(body, want):
    call = read_glm_call(body, TOOLS)
    assert (None if call is None else (call.name, json.loads(call.arguments))) == want
    text = f"<tool_call>{body}</tool_call>"
    expect = ("", [want]) if want is not None else (text, [])
    make = lambda: GlmToolParser(TOOLS)  # noqa: E731
    assert whole_tools(make, text) == expect
    for cut in range(1, len(text)):
        assert stream_tools(make, text, [cut]) == expect, cut
    assert stream_tools(make, text, list(range(1, len(text)))) == expect


def test_glm47_is_the_same_grammar():
    for name in ("glm45", "glm47"):
        content, calls = Parsers(name, "glm45").tool_parser(TOOLS).parse("ok " + CALL_47)
        assert content == "ok" and [c.name for c in calls] == ["get_weather"]


def test_partial_markers_at_the_end_are_content():
    for tail in ("<", "<tool", "<tool_call", "<tool_cal"):
        assert whole_tools(lambda: GlmToolParser(TOOLS), "a " + tail) == ("a " + tail, [])
