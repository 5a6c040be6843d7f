"""Streaming text out of generated token ids: incremental decoding and stop strings."""

from __future__ import annotations

import operator
from collections.abc import Sequence

from moetier.tokenizer.tokenizer import Tokenizer, TokenizerError

_REPLACEMENT = "\ufffd"
# Tokens a run of byte-fallback pieces may be held before it is released at a character boundary.
# Holding bounds the window of invalid byte streams (random weights), whose decode cost would grow.
MAX_HELD = 16
# A UTF-8 character needs at most 3 bytes after its first, so valid text completes within 3 more tokens.
_UTF8_TAIL = 3


class StreamDecoder:
    """Incremental detokenization: feed ids one at a time, get text deltas.

    Prefix-offset method: each push decodes a window starting one emitted chunk back and returns what
    the window adds beyond its already-emitted prefix. Decoding from a context token keeps
    context-dependent rendering (SentencePiece leading spaces) identical to decoding the whole sequence.
    Text is held back while its decode ends in U+FFFD (an unfinished UTF-8 character) and while the last
    token is a byte-fallback piece, whose run the decoder renders all-or-nothing (one invalid byte turns
    the whole run into U+FFFD).

    Special tokens are skipped (skip_special_tokens) except those in keep: the markers a reasoning or
    tool-call parser reads downstream, which a checkpoint may have made special (GLM's `<think>`,
    `<tool_call>`; DeepSeek's `<｜tool▁calls▁begin｜>`), while EOS, BOS and padding stay out of the text.

    Invariant: ''.join(deltas) + flush() == tokenizer.decode(kept ids, skip_special_tokens=False) for all
    valid UTF-8 output, which is tokenizer.decode(all_ids, skip_special_tokens) when keep is empty.
    Invalid bytes may break it only after more than MAX_HELD held tokens (a byte-fallback run) or
    MAX_HELD + 3 (text still ending in U+FFFD), where text is released to bound the window.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True,
                 keep: frozenset[int] = frozenset()) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.keep = frozenset(keep)
        # Only tokens that decode keeps are stored: a window that starts with a skipped token would
        # otherwise decode its first real token as if it began the text (stripping a leading space).
        self._ids: list[int] = []
        self._prefix = 0  # window start: the first token of the last emitted chunk
        self._read = 0  # tokens before this index have been emitted
        self._prefix_text = ""  # decode(ids[_prefix:_read]), constant until the window moves

    def _kept(self, token_id: int) -> bool:
        if not self.tokenizer.known(token_id):
            return False
        skipped = self.skip_special_tokens and token_id in self.tokenizer.special_ids and token_id not in self.keep
        return not skipped

    def _decode(self, ids: list[int]) -> str:
        # ids holds kept tokens only (_kept), so nothing in it is to be skipped
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    def push(self, token_id: int) -> str:
        """Text that token_id completes; '' while it is held back or skipped."""
        token_id = operator.index(token_id)  # numpy/torch integers too; floats are a bug upstream
        if not self._kept(token_id):
            return ""
        self._ids.append(token_id)
        text = self._decode(self._ids[self._prefix:])
        held = len(self._ids) - self._read
        run = token_id in self.tokenizer.byte_fallback_ids and held <= MAX_HELD
        unfinished = text.endswith(_REPLACEMENT) and held <= MAX_HELD + _UTF8_TAIL
        if run or unfinished or len(text) <= len(self._prefix_text):
            return ""
        return self._advance(text)

    def _advance(self, text: str) -> str:
        delta = text[len(self._prefix_text):]
        self._prefix, self._read = self._read, len(self._ids)
        self._prefix_text = self._decode(self._ids[self._prefix:self._read])
        return delta

    def flush(self) -> str:
        """Release held-back text (an unfinished UTF-8 sequence renders as U+FFFD, as decode would)."""
        if self._read == len(self._ids):
            return ""
        text = self._decode(self._ids[self._prefix:])
        return self._advance(text) if len(text) > len(self._prefix_text) else ""


class StopStrings:
    """Stop strings over streamed text.

    push(delta) returns (text to emit, stopped). Text that could begin a stop string is held back until
    it cannot; when a stop string completes, everything before it is emitted and the stop string is not.
    Among occurrences, the one that ends first wins (ties: the longer one), which is the stop a
    token-by-token stream reaches first, so the result never depends on how the text is split into
    deltas. After a stop, push returns ('', True).
    """

    def __init__(self, stops: Sequence[str]) -> None:
        if isinstance(stops, str):
            raise TokenizerError(f"stop strings must be a list of strings, got the string {stops!r}; "
                                 f"wrap it: [{stops!r}]")
        stops = list(stops)
        for i, s in enumerate(stops):
            if not isinstance(s, str):
                raise TokenizerError(f"stop string {i} must be a str, got {type(s).__name__}")
            if not s:
                raise TokenizerError(f"stop string {i} is empty; it would match everywhere, so remove it")
        self.stops: tuple[str, ...] = tuple(dict.fromkeys(stops))
        self._longest = max(map(len, self.stops), default=0)
        self._held = ""
        self.matched: str | None = None

    @property
    def stopped(self) -> bool:
        return self.matched is not None

    def push(self, delta: str) -> tuple[str, bool]:
        if self.matched is not None:
            return "", True
        if not self.stops:
            return delta, False
        text = self._held + delta
        hit = self._first_match(text)
        if hit is not None:
            start, stop = hit
            self.matched = stop
            self._held = ""
            return text[:start], True
        keep = self._partial_start(text)
        self._held = text[keep:]
        return text[:keep], False

    def _first_match(self, text: str) -> tuple[int, str] | None:
        # Invariant: no stop lies wholly inside the held text, so every occurrence found here is new.
        best: tuple[int, int, str] | None = None  # (end, start, stop)
        for stop in self.stops:
            start = text.find(stop)
            if start >= 0:
                key = (start + len(stop), start, stop)
                if best is None or key[:2] < best[:2]:
                    best = key
        return None if best is None else (best[1], best[2])

    def _partial_start(self, text: str) -> int:
        """Start of the longest suffix of text that is a proper prefix of some stop (len(text) if none)."""
        for start in range(max(0, len(text) - self._longest + 1), len(text)):
            tail = text[start:]
            if any(stop.startswith(tail) for stop in self.stops):
                return start
        return len(text)

    def flush(self) -> str:
        """Held-back text, once the stream has ended without completing a stop."""
        held, self._held = self._held, ""
        return "" if self.matched is not None else held
