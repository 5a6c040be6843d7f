"""The reasoning splitter and the tool-call parser on their own: every way of cutting a reply into
deltas gives the same result as the whole reply at once."""

from __future__ import annotations

import json

import pytest

from moetier.server.reasoning import ReasoningSplitter, prompt_opens_reasoning
from moetier.server.tools import HermesToolParser, parse_block


def stream_split(text: str, opened: bool, cuts: list[int]) -> tuple[str, str]:
    s, r, c = ReasoningSplitter(opened), "", ""
    for a, b in zip([0] + cuts, cuts + [len(text)]):
        dr, dc = s.push(text[a:b])
        r, c = r + dr, c + dc
    dr, dc = s.flush()
    return r + dr, c + dc


def all_cuts(text: str):
    yield []
    yield list(range(1, len(text)))  # one character at a time
    for i in range(1, len(text)):
        yield [i]


@pytest.mark.parametrize("text,opened,want", [
    ("I add 2 and 2.</think>\n\nIt is 4.", True, ("I add 2 and 2.", "It is 4.")),  # GLM/Qwen: prompt opened it
    ("never closes the tag", True, ("never closes the tag", "")),  # reply that never closes: all reasoning
    ("<think>plan</think>answer", False, ("plan", "answer")),  # the model opens it itself
    ("\n<think>plan</think>\n\nanswer", False, ("plan", "answer")),
    ("plain answer, no tags", False, ("", "plain answer, no tags")),
    ("<thin", False, ("", "<thin")),  # a partial tag at the end is text
    ("a </thin", True, ("a </thin", "")),
    ("x < y and </think> done", True, ("x < y and ", " done")),  # only the newlines after </think> go
    ("", True, ("", "")),
])
def test_reasoning_split_whole_and_streamed(text, opened, want):
    assert ReasoningSplitter(opened).split(text) == want
    for cuts in all_cuts(text):
        assert stream_split(text, opened, cuts) == want, cuts


def test_prompt_opens_reasoning():
    assert prompt_opens_reasoning("<|im_start|>assistant\n<think>\n")
    assert not prompt_opens_reasoning("<|im_start|>assistant\n<think>\n\n</think>\n\n")  # enable_thinking false
    assert not prompt_opens_reasoning("<|im_start|>assistant\n")


CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def stream_tools(text: str, cuts: list[int]):
    p, content, calls = HermesToolParser(), "", []
    for a, b in zip([0] + cuts, cuts + [len(text)]):
        c, got = p.push(text[a:b])
        content, calls = content + c, calls + got
    return content + p.flush(), calls


@pytest.mark.parametrize("text,want_content,want_calls", [
    (CALL, "", [("get_weather", {"city": "Paris"})]),
    ("Let me look.\n" + CALL + CALL.replace("Paris", "Oslo"), "Let me look.\n",
     [("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Oslo"})]),
    ('<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>', "", [("f", {"a": 1})]),
    ("<tool_call>{not json}</tool_call>", "<tool_call>{not json}</tool_call>", []),  # malformed: content
    ('<tool_call>{"arguments": {}}</tool_call>', '<tool_call>{"arguments": {}}</tool_call>', []),  # no name
    ('<tool_call>{"name": "f", "arguments": [1]}</tool_call>', '<tool_call>{"name": "f", "arguments": [1]}</tool_call>', []),
    ('text <tool_call>{"name": "f"', 'text <tool_call>{"name": "f"', []),  # unclosed at the end: content
    ("a < b <tool", "a < b <tool", []),
])
def test_tool_calls_whole_and_streamed(text, want_content, want_calls):
    content, calls = HermesToolParser().parse(text)
    assert content == want_content
    assert [(c.name, json.loads(c.arguments)) for c in calls] == want_calls
    for cuts in all_cuts(text):
        content, calls = stream_tools(text, cuts)
        assert content == want_content, cuts
        assert [(c.name, json.loads(c.arguments)) for c in calls] == want_calls, cuts


def test_call_ids_are_unique_and_openai_shaped():
    a, b = parse_block('{"name": "f", "arguments": {}}'), parse_block('{"name": "f", "arguments": {}}')
    assert a.id != b.id and a.id.startswith("call_")
    assert a.to_dict() == {"id": a.id, "type": "function", "function": {"name": "f", "arguments": "{}"}}
