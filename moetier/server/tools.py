"""Qwen3-style tool calls out of a reply's content, streaming or not.

The model writes `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks (Hermes format,
which Qwen3's chat template asks for). A block whose body is not a JSON object with a string `name`
and an object (or JSON string) `arguments` is not a call: it comes back as plain content, exactly as
written, so a malformed reply is never lost and never an error. An unclosed block at the end of the
reply is content too.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass

from moetier.server.reasoning import partial_suffix

OPEN, CLOSE = "<tool_call>", "</tool_call>"


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text, as the OpenAI API carries it
    id: str

    def to_dict(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def parse_block(body: str) -> ToolCall | None:
    """A call from the text between the tags, or None when it is not one."""
    try:
        data = json.loads(body)
    except ValueError:
        return None
    if not isinstance(data, dict) or not isinstance(data.get("name"), str) or not data["name"]:
        return None
    args = data.get("arguments", data.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(data["name"], json.dumps(args, ensure_ascii=False), f"call_{uuid.uuid4().hex[:24]}")


class ToolCallParser:
    """push(content delta) -> (content delta, calls completed by it); flush() at the end."""

    def __init__(self) -> None:
        self._held = ""  # a possible start of <tool_call>, or an open block's text
        self._in_block = False
        self.calls: list[ToolCall] = []

    def push(self, delta: str) -> tuple[str, list[ToolCall]]:
        text = self._held + delta
        self._held = ""
        content, calls = "", []
        while text:
            if not self._in_block:
                start = text.find(OPEN)
                if start < 0:
                    keep = partial_suffix(text, OPEN)
                    content += text[:keep]
                    self._held = text[keep:]
                    break
                content += text[:start]
                text, self._in_block = text[start:], True
            else:
                end = text.find(CLOSE)
                if end < 0:
                    self._held = text
                    break
                block, text = text[:end + len(CLOSE)], text[end + len(CLOSE):]
                self._in_block = False
                call = parse_block(block[len(OPEN):-len(CLOSE)].strip())
                if call is None:
                    content += block
                else:
                    calls.append(call)
        self.calls += calls
        return content, calls

    def flush(self) -> str:
        """Text held at the end: a partial tag or an unclosed block, returned as content."""
        held, self._held, self._in_block = self._held, "", False
        return held

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        """The whole content at once: (content without the calls, the calls)."""
        content, calls = self.push(text)
        return content + self.flush(), calls
