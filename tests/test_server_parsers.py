"""The reasoning splitter and the tool-call parser on their own: every way of cutting a reply into
deltas gives the same result as the whole reply at once."""

from __future__ import annotations

import json

import pytest

from moetier.errors import MoetierError
from moetier.server.parsers import TOOL_CALL_PARSERS, Parsers, tool_call_parser_names
from moetier.server.reasoning import ReasoningSplitter, prompt_opens_reasoning
from moetier.server.tools import HermesToolParser, parse_block
from parser_helpers import all_cuts, stream_tools


def stream_split(text: str, opened: bool, cuts: list[int]) -> tuple[str, str]:
    s, r, c = ReasoningSplitter(opened), "", ""
    for a, b in zip([0] + cuts, cuts + [len(text)]):
        dr, dc = s.push(text[a:b])
        r, c = r + dr, c + dc
    dr, dc = s.flush()
    return r + dr, c + dc


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


@pytest.mark.parametrize("text,want_content,want_calls", [
    (CALL, "", [("get_weather", {"city": "Paris"})]),
    ("Let me look.\n" + CALL + CALL.replace("Paris", "Oslo"), "Let me look.",
     [("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Oslo"})]),
    ('<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>', "", [("f", {"a": 1})]),
    ("<tool_call>{not json}</tool_call>", "<tool_call>{not json}</tool_call>", []),  # malformed: content
    ('<tool_call>{"arguments": {}}</tool_call>', '<tool_call>{"arguments": {}}</tool_call>', []),  # no name
    ('<tool_call>{"name": "f", "arguments": [1]}</tool_call>', '<tool_call>{"name": "f", "arguments": [1]}</tool_call>', []),
    ('text <tool_call>{"name": "f"', 'text <tool_call>{"name": "f"', []),  # unclosed at the end: content
    ("a < b <tool", "a < b <tool", []),
    # whitespace next to a call is not content; other text around the calls is
    (" \n" + CALL + "\n\n" + CALL + "\n", "", [("get_weather", {"city": "Paris"})] * 2),
    ("Sure. " + CALL + "\nDone.  ", "Sure.Done.  ", [("get_weather", {"city": "Paris"})]),
    (CALL + "\n<tool_call>{bad}</tool_call> ", "<tool_call>{bad}</tool_call> ", [("get_weather", {"city": "Paris"})]),
])
def test_tool_calls_whole_and_streamed(text, want_content, want_calls):
    content, calls = HermesToolParser().parse(text)
    assert content == want_content
    assert [(c.name, json.loads(c.arguments)) for c in calls] == want_calls
    for cuts in all_cuts(text):
        assert stream_tools(HermesToolParser, text, cuts) == (want_content, want_calls), cuts


def test_call_ids_are_unique_and_openai_shaped():
    a, b = parse_block('{"name": "f", "arguments": {}}'), parse_block('{"name": "f", "arguments": {}}')
    assert a.id != b.id and a.id.startswith("call_")
    assert a.to_dict() == {"id": a.id, "type": "function", "function": {"name": "f", "arguments": "{}"}}


# -- the registry ----------------------------------------------------------------------------------
@pytest.mark.parametrize("model_type,want", [
    ("qwen3_moe", ("hermes", "qwen3")), ("glm_moe_dsa", ("glm45", "glm45")), ("glm5_next", ("glm45", "glm45")),
    ("deepseek_v3", ("deepseek_v3", "deepseek_v3")), ("something_else", ("hermes", "qwen3")), (None, ("hermes", "qwen3")),
])
def test_auto_is_the_family_default(model_type, want):
    chosen = Parsers().for_family(model_type)
    assert (chosen.tool_call, chosen.reasoning) == want


def test_explicit_choices_win_and_names_are_checked():
    chosen = Parsers("deepseek_v31", "none").for_family("qwen3_moe")
    assert (chosen.tool_call, chosen.reasoning) == ("deepseek_v31", "none")
    assert set(TOOL_CALL_PARSERS) <= set(tool_call_parser_names()) and "auto" in tool_call_parser_names()
    with pytest.raises(MoetierError, match="--tool-call-parser 'glm4'.*glm45"):
        Parsers("glm4")
    with pytest.raises(MoetierError, match="--reasoning-parser 'r1'.*deepseek_r1"):
        Parsers(reasoning="r1")
    with pytest.raises(ValueError):  # `auto` must be resolved against the family first
        Parsers().tool_parser([{}])


def test_none_turns_each_parser_off():
    off = Parsers("none", "none")
    assert off.tool_parser([{"type": "function", "function": {"name": "f"}}]) is None
    assert off.splitter("<|assistant|><think>").split("plan</think>answer") == ("", "plan</think>answer")
    assert Parsers("glm45", "glm45").tool_parser(None) is None  # a request without tools is not searched
    assert Parsers("glm45", "glm45").tool_parser([]) is None
