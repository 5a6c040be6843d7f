"""Splits a chat reply into reasoning and content at `</think>`, streaming or not.

Two ways a reply starts reasoning, and both must be seen (references 002 and 004 describe parsers
that silently dropped every reply, or never surfaced the reasoning, because they expected only one):
the chat template opens `<think>` at the end of the prompt (GLM, Qwen3 thinking templates), so the
model only ever writes the closing tag; or the model writes `<think>` itself as its first text.
A reply that never closes the tag is all reasoning; a reply that never opens one is all content.

Tags may arrive split over several deltas, so text that could be the start of a tag is held back
until it cannot be; the result never depends on how the text was cut into deltas.
"""

from __future__ import annotations

OPEN, CLOSE = "<think>", "</think>"
MARKERS = (OPEN, CLOSE)  # the tags read here: kept by the detokenizer when they are special tokens


def prompt_opens_reasoning(prompt: str) -> bool:
    """Whether the rendered prompt leaves a `<think>` open for the reply (its last tag is an opening one)."""
    return prompt.rfind(OPEN) > prompt.rfind(CLOSE)


def partial_suffix(text: str, tag: str) -> int:
    """Start of the longest suffix of text that is a proper prefix of tag (len(text) if none)."""
    for start in range(max(0, len(text) - len(tag) + 1), len(text)):
        if tag.startswith(text[start:]):
            return start
    return len(text)


class ReasoningSplitter:
    """push(delta) -> (reasoning delta, content delta); flush() at the end of the reply."""

    def __init__(self, opened_by_prompt: bool, enabled: bool = True):
        # "start": nothing seen yet (the reply may open <think>); "reasoning"; "content".
        # Not enabled (--reasoning-parser none): the whole reply is content, tags and all.
        self.state = "content" if not enabled else "reasoning" if opened_by_prompt else "start"
        self.markers: tuple[str, ...] = MARKERS if enabled else ()
        self._held = ""
        self._strip = False  # drop the newlines templates put after </think>

    def push(self, delta: str) -> tuple[str, str]:
        text = self._held + delta
        self._held = ""
        reasoning = content = ""
        while text:
            if self.state == "start":
                stripped = text.lstrip()
                if stripped.startswith(OPEN):
                    text, self.state = stripped[len(OPEN):], "reasoning"
                elif OPEN.startswith(stripped):  # may still become <think>
                    self._held = text
                    return reasoning, content
                else:
                    self.state = "content"
            elif self.state == "reasoning":
                end = text.find(CLOSE)
                if end >= 0:
                    reasoning += text[:end]
                    text, self.state, self._strip = text[end + len(CLOSE):], "content", True
                    continue
                keep = partial_suffix(text, CLOSE)
                reasoning += text[:keep]
                self._held = text[keep:]
                return reasoning, content
            else:
                if self._strip:
                    text = text.lstrip("\n")
                    self._strip = not text
                content += text
                text = ""
        return reasoning, content

    def flush(self) -> tuple[str, str]:
        """What was held back when the reply ended: a partial tag is plain text of its part."""
        held, self._held = self._held, ""
        if self.state == "reasoning":
            return held, ""
        return "", held

    def split(self, text: str) -> tuple[str, str]:
        """The whole reply at once: (reasoning, content)."""
        r1, c1 = self.push(text)
        r2, c2 = self.flush()
        return r1 + r2, c1 + c2
