"""GLM's tool calls (GLM-4.5 and later, GLM-5, GLM-5.3-Flash): vLLM's `glm45` and `glm47` formats.

    <tool_call>get_weather
    <arg_key>city</arg_key>
    <arg_value>Paris</arg_value>
    <arg_key>days</arg_key>
    <arg_value>3</arg_value>
    </tool_call>

GLM-4.5/4.6 put a newline after the name and between the pairs; GLM-4.7 and later may write them
back to back (`<tool_call>get_weather<arg_key>city</arg_key><arg_value>Paris</arg_value></tool_call>`);
a call without arguments is the name alone. Both spellings are one grammar here: the name, then
pairs separated by any whitespace, nothing else.

A value is text, so its JSON type comes from the request's tools: a parameter whose schema says
`string` keeps its text exactly as written (code, paths, a number written as a string); any other
is read as JSON (numbers, booleans, objects, arrays), and kept as a string when it is not JSON.
A body that does not fit the grammar (no name, a name with spaces, text between the pairs, an
unclosed pair) is not a call: the block stays content. A body that is a Hermes JSON object is read
as one, since GLM models sometimes fall back to it.
"""

from __future__ import annotations

import json
import re

from moetier.server.tools import BlockToolParser, ToolCall, parse_block

KEY_OPEN = "<arg_key>"
PAIR = re.compile(r"\s*<arg_key>([^<]*)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.DOTALL)
NAME = re.compile(r"[^\s<>{}\"']+")


def schema_type(tools: list[dict], name: str, key: str):
    """The JSON-schema `type` of parameter key of tool name in the request's tools, or None."""
    for tool in tools:
        fn = tool.get("function") if isinstance(tool, dict) else None
        if isinstance(fn, dict) and fn.get("name") == name:
            params = fn.get("parameters")
            props = params.get("properties") if isinstance(params, dict) else None
            prop = props.get(key) if isinstance(props, dict) else None
            return prop.get("type") if isinstance(prop, dict) else None
    return None


def typed_value(raw: str, declared) -> object:
    """An argument's value: raw text for a string parameter, else its JSON reading, else the text."""
    if declared == "string" or (isinstance(declared, list) and "string" in declared):
        return raw
    text = raw.strip()
    try:
        return json.loads(text)
    except ValueError:
        return text


def read_glm_call(body: str, tools: list[dict]) -> ToolCall | None:
    """One call from the text between `<tool_call>` and `</tool_call>`, or None when it is not one."""
    if body.lstrip().startswith("{"):
        return parse_block(body.strip())
    cut = body.find(KEY_OPEN)
    name = (body if cut < 0 else body[:cut]).strip()
    if not NAME.fullmatch(name):
        return None
    args: dict = {}
    rest, pos = ("" if cut < 0 else body[cut:]), 0
    while (m := PAIR.match(rest, pos)) is not None:
        key = m.group(1).strip()
        if not key:
            return None
        args[key] = typed_value(m.group(2), schema_type(tools, name, key))
        pos = m.end()
    if rest[pos:].strip():
        return None  # text that is not a pair: an unclosed pair, a stray tag
    return ToolCall.of(name, args)


class GlmToolParser(BlockToolParser):
    """`<tool_call>name<arg_key>..</arg_key><arg_value>..</arg_value>...</tool_call>`, one call per block."""

    MARKERS = (*BlockToolParser.MARKERS, KEY_OPEN, "</arg_key>", "<arg_value>", "</arg_value>")

    def calls_in(self, body: str) -> list[ToolCall] | None:
        call = read_glm_call(body, self.tools)
        return None if call is None else [call]
