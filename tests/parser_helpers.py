"""Drive the reply parsers the way the chat handler does, whole or cut into deltas anywhere, so that
a test can demand the same result from every cut (references 002 and 004: parsers that worked on
whole replies and broke on the deltas a server really sees)."""

from __future__ import annotations

import json
import random

from moetier.server.parsers import Parsers


def all_cuts(text: str, seed: int = 0, n_random: int = 40):
    """Cut points: none, every character, every single boundary, and random sets of several."""
    yield []
    yield list(range(1, len(text)))
    for i in range(1, len(text)):
        yield [i]
    rng = random.Random(seed)
    for _ in range(n_random if len(text) > 2 else 0):
        yield sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(2, 6))))


def pieces(text: str, cuts: list[int]) -> list[str]:
    return [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]


def calls_of(calls) -> list[tuple[str, dict]]:
    return [(c.name, json.loads(c.arguments)) for c in calls]


def stream_tools(make, text: str, cuts: list[int]) -> tuple[str, list[tuple[str, dict]]]:
    """A fresh parser from make(), fed text cut at cuts: (content, calls)."""
    p, content, calls = make(), "", []
    for piece in pieces(text, cuts):
        c, got = p.push(piece)
        content, calls = content + c, calls + got
    assert calls == p.calls
    return content + p.flush(), calls_of(calls)


def whole_tools(make, text: str) -> tuple[str, list[tuple[str, dict]]]:
    content, calls = make().parse(text)
    return content, calls_of(calls)


def reply(parsers: Parsers, prompt: str, tools: list[dict] | None, deltas: list[str]):
    """(reasoning, content, calls) of a reply as the handler streams it: reasoning split first, the
    content through the tool-call parser, both flushed at the end."""
    split, parser = parsers.splitter(prompt), parsers.tool_parser(tools)
    reasoning = content = ""
    calls = []

    def take(r: str, c: str, final: bool) -> None:
        nonlocal reasoning, content
        reasoning += r
        if parser is not None:
            c, got = parser.push(c)
            calls.extend(got)
            if final:
                c += parser.flush()
        content += c

    for d in deltas:
        take(*split.push(d), final=False)
    take(*split.flush(), final=True)
    return reasoning, content, calls_of(calls)


def check_every_cut(parsers: Parsers, prompt: str, tools, text: str, want, markers: tuple[str, ...] = ()) -> None:
    """The whole reply gives want; so does every cut of it; and when it makes calls, no marker of the
    format is left in the content."""
    assert reply(parsers, prompt, tools, [text]) == want
    for cuts in all_cuts(text):
        assert reply(parsers, prompt, tools, pieces(text, cuts)) == want, cuts
    if want[2]:
        assert not any(m in want[1] for m in markers), want[1]
