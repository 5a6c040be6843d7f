"""DeepSeek's tool calls: vLLM's `deepseek_v3` (DeepSeek-V3, R1) and `deepseek_v31` (V3.1 and later)
formats, read by one parser, since a call's body says which it is.

All calls of a reply sit in one section, each call in its own block:

    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather
    ```json
    {"city": "Paris"}
    ```<｜tool▁call▁end｜><｜tool▁call▁begin｜>...<｜tool▁call▁end｜><｜tool▁calls▁end｜>

V3.1 drops the type and the fence: `<｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Paris"}<｜tool▁call▁end｜>`.
The markers are the tokenizer's own tokens (full-width bars U+FF5C, the SentencePiece space U+2581).

The section is the block the scanner (tools.py) finds; its calls are emitted when it closes. A
section holding anything but well-formed calls with JSON-object arguments (separated by whitespace)
is not read at all: it stays content as written, so nothing half-read is ever sent as a call.
"""

from __future__ import annotations

import re

from moetier.server.tools import BlockToolParser, ToolCall, json_object

CALLS_BEGIN, CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CALL_BEGIN, CALL_END, SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
CALL = re.compile(r"\s*<｜tool▁call▁begin｜>(.*?)<｜tool▁call▁end｜>", re.DOTALL)
# V3: the type `function`, the separator, the name on its line, then the arguments in a json fence
V3_BODY = re.compile(r"\s*function\s*<｜tool▁sep｜>\s*([^\s<]+)[ \t]*\n\s*```(?:json)?[ \t]*\n(.*?)```\s*", re.DOTALL)
# V3.1: the name, the separator, the arguments (a fence around them is tolerated)
V31_BODY = re.compile(r"\s*([^\s<]+)\s*<｜tool▁sep｜>(.*)", re.DOTALL)
FENCE = re.compile(r"```(?:json)?\s*\n?(.*?)```", re.DOTALL)


def arguments(text: str) -> dict | None:
    text = text.strip()
    if (m := FENCE.fullmatch(text)) is not None:
        text = m.group(1).strip()
    return {} if not text else json_object(text)


def read_deepseek_call(body: str) -> ToolCall | None:
    """One call from the text between `<｜tool▁call▁begin｜>` and `<｜tool▁call▁end｜>`, or None."""
    for form in (V3_BODY, V31_BODY):
        m = form.fullmatch(body)
        if m is not None:
            args = arguments(m.group(2))
            if args is not None:
                return ToolCall.of(m.group(1), args)
    return None


class DeepSeekToolParser(BlockToolParser):
    """The `<｜tool▁calls▁begin｜>` section: every call in it, or none (the section is then content)."""

    OPEN, CLOSE = CALLS_BEGIN, CALLS_END
    MARKERS = (CALLS_BEGIN, CALLS_END, CALL_BEGIN, CALL_END, SEP)

    def calls_in(self, body: str) -> list[ToolCall] | None:
        calls, pos = [], 0
        while (m := CALL.match(body, pos)) is not None:
            call = read_deepseek_call(m.group(1))
            if call is None:
                return None
            calls.append(call)
            pos = m.end()
        return calls if calls and not body[pos:].strip() else None
