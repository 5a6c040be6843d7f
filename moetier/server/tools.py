"""Tool calls out of a reply's content, streaming or not: the block scanner every format shares, and
the Hermes format Qwen3 writes.

A format is a pair of markers around a block and a reading of the block's body into calls. The
scanner finds the blocks in the content as it streams: text outside blocks is content; text that
could be the start of an opening marker is held back until it cannot be; a block is read once its
closing marker has arrived; whitespace between the content and a call, or between calls, is not
content (the OpenAI message holds the text and the calls apart). A block whose body the format cannot read is not a call: it comes back
as plain content, exactly as written, so a malformed reply is never lost and never an error. An
unclosed block at the end of the reply is content too. Because a block is read only whole, the
calls and the content never depend on how the reply was cut into deltas.

Hermes (Qwen3's chat template asks for it): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`,
one call per block; `arguments` is an object or a JSON string holding one.
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
    arguments: str  # JSON text of an object, as the OpenAI API carries it
    id: str

    @classmethod
    def of(cls, name: str, arguments: dict) -> "ToolCall":
        return cls(name, json.dumps(arguments, ensure_ascii=False), f"call_{uuid.uuid4().hex[:24]}")

    def to_dict(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def json_object(text: str) -> dict | None:
    """text as a JSON object, or None when it is not one."""
    try:
        data = json.loads(text)
    except ValueError:
        return None
    return data if isinstance(data, dict) else None


def parse_block(body: str) -> ToolCall | None:
    """A Hermes call from the text between the tags, or None when it is not one."""
    data = json_object(body)
    if data is None or not isinstance(data.get("name"), str) or not data["name"]:
        return None
    args = data.get("arguments", data.get("parameters", {}))
    if isinstance(args, str):
        args = json_object(args)
    if not isinstance(args, dict):
        return None
    return ToolCall.of(data["name"], args)


class BlockToolParser:
    """push(content delta) -> (content delta, calls completed by it); flush() at the end of the reply.

    A format sets OPEN and CLOSE and reads a block's body in calls_in(); tools is the request's list
    of tools (OpenAI's shape), for formats whose arguments are typed by the tools' schemas. MARKERS
    are every tag the format reads: a checkpoint may make each one a special token, which the
    detokenizer must then keep in the text (Tokenizer.special_ids_of)."""

    OPEN, CLOSE = OPEN, CLOSE
    MARKERS: tuple[str, ...] = (OPEN, CLOSE)

    def __init__(self, tools: list[dict] | None = None) -> None:
        self.tools = tools or []
        self._held = ""  # a possible start of OPEN, or an open block's text (OPEN included)
        self._in_block = False
        self._space = ""  # whitespace at the end of the content so far: it is dropped if a call follows
        self._after_call = False  # the last thing read was a call: whitespace now is next to it
        self.calls: list[ToolCall] = []

    def calls_in(self, body: str) -> list[ToolCall] | None:
        """The calls of one block's body (the text between OPEN and CLOSE), or None if it is malformed."""
        raise NotImplementedError

    def push(self, delta: str) -> tuple[str, list[ToolCall]]:
        text = self._held + delta
        self._held = ""
        content, calls = "", []
        while text:
            if not self._in_block:
                start = text.find(self.OPEN)
                if start < 0:
                    keep = partial_suffix(text, self.OPEN)
                    content += self._text(text[:keep])
                    self._held = text[keep:]
                    break
                content += self._text(text[:start])
                text, self._in_block = text[start:], True
            else:
                end = text.find(self.CLOSE, len(self.OPEN))
                if end < 0:
                    self._held = text
                    break
                block, text = text[:end + len(self.CLOSE)], text[end + len(self.CLOSE):]
                self._in_block = False
                got = self.calls_in(block[len(self.OPEN):-len(self.CLOSE)])
                if got:
                    calls += got
                    self._space, self._after_call = "", True
                else:  # malformed, or a block with no call in it: the text stays the reply's
                    content += self._text(block)
        self.calls += calls
        return content, calls

    def _text(self, text: str) -> str:
        """Content outside blocks, less the whitespace next to a call (held until what follows shows).

        So "Checking.\n<call>\n<call>\n" gives the content "Checking.", however it was cut."""
        text = self._space + text
        body = text.rstrip()
        if not body:
            self._space = text
            return ""
        self._space = text[len(body):]
        if self._after_call:
            body, self._after_call = body.lstrip(), False
        return body

    def flush(self) -> str:
        """Text held at the end: a partial marker or an unclosed block, returned as content, and the
        trailing whitespace unless a call came right before it."""
        held, self._held, self._in_block = self._held, "", False
        content = self._text(held) if held else ""
        space, self._space = self._space, ""
        return content + ("" if self._after_call else space)

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        """The whole content at once: (content without the calls, the calls)."""
        content, calls = self.push(text)
        return content + self.flush(), calls


class HermesToolParser(BlockToolParser):
    """Qwen3's `<tool_call>{json}</tool_call>` blocks (vLLM's `hermes`)."""

    def calls_in(self, body: str) -> list[ToolCall] | None:
        call = parse_block(body.strip())
        return None if call is None else [call]
