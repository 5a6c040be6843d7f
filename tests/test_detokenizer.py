"""Streaming detokenization and stop strings."""

from __future__ import annotations

import itertools
import random

import pytest
from tokenizers import AddedToken, decoders, models, normalizers
from tokenizers import Tokenizer as HFTokenizer

from moetier.tokenizer.detokenizer import MAX_HELD, StopStrings, StreamDecoder
from moetier.tokenizer import Tokenizer, TokenizerError
from moetier.tokenizer.synthetic import write_marker_tokenizer, write_tokenizer

TEXTS = [
    "Hello, world! The answer is 42.",
    "héllo wörld — naïve café",
    "日本語のテキスト 中文 한국어",
    "emoji 🎉👩‍👩‍👧 flags 🇫🇷 ⚙️ done",
    "def f(self):\n    return None\n\n",
]


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    d = tmp_path_factory.mktemp("tok")
    write_tokenizer(d)
    return Tokenizer.from_dir(d)


@pytest.fixture(scope="module")
def sp_tok(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    """A Llama-2-style SentencePiece BPE: '▁' for spaces, byte fallback, decoder strips one leading space."""
    chars = ["▁", *"abcdefghijklmnopqrstuvwxyz", *"HW,.!"]
    merges = [("▁", "h"), ("▁h", "e"), ("▁he", "l"), ("▁hel", "l"), ("▁hell", "o"),
              ("▁", "w"), ("o", "r"), ("▁w", "or"), ("▁wor", "l"), ("▁worl", "d")]
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"<0x{b:02X}>": 3 + b for b in range(256)}}
    for piece in [*chars, *("".join(m) for m in merges)]:
        vocab.setdefault(piece, len(vocab))
    hf = HFTokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", fuse_unk=True, byte_fallback=True))
    hf.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    hf.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                    decoders.Strip(" ", 1, 0)])
    hf.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in ("<unk>", "<s>", "</s>")])
    d = tmp_path_factory.mktemp("sp")
    hf.save(str(d / "tokenizer.json"))
    return Tokenizer.from_dir(d)


GLM_MARKERS = ("<think>", "</think>", "<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>", "<arg_value>",
               "</arg_value>")


@pytest.fixture(scope="module")
def glm_tok(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    """The synthetic tokenizer with GLM's reasoning and tool-call tags as special tokens."""
    d = tmp_path_factory.mktemp("glm")
    write_marker_tokenizer(d, GLM_MARKERS)
    return Tokenizer.from_dir(d)


def stream(tok: Tokenizer, ids: list[int], skip: bool = True, keep: frozenset[int] = frozenset()) -> list[str]:
    dec = StreamDecoder(tok, skip_special_tokens=skip, keep=keep)
    return [dec.push(i) for i in ids] + [dec.flush()]


# --- StreamDecoder ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("which", ["tok", "sp_tok"])
def test_random_ids_match_decode(which: str, request: pytest.FixtureRequest) -> None:
    t: Tokenizer = request.getfixturevalue(which)
    rng = random.Random(1234)
    # Half the draws avoid byte-fallback pieces so sp_tok also sees words between byte runs; ids run a
    # little past the vocabulary, as model vocabs are often padded beyond the tokenizer's.
    other = [i for i in range(t.vocab_size + 8) if i not in t.byte_fallback_ids]
    for _ in range(300):
        ids = [rng.choice(other) if rng.random() < 0.5 else rng.randrange(t.vocab_size + 8)
               for _ in range(rng.randrange(1, 60))]
        for skip in (True, False):
            assert "".join(stream(t, ids, skip)) == t.decode(ids, skip_special_tokens=skip), (ids, skip)


@pytest.mark.parametrize("which", ["tok", "sp_tok"])
@pytest.mark.parametrize("text", TEXTS)
def test_unicode_text_streams_whole_characters(which: str, text: str, request: pytest.FixtureRequest) -> None:
    t: Tokenizer = request.getfixturevalue(which)
    ids = t.encode(text)
    deltas = stream(t, ids)
    assert "".join(deltas) == t.decode(ids) == text
    assert not any("\ufffd" in d for d in deltas)


def test_split_character_is_held(tok: Tokenizer) -> None:
    ids = tok.encode("a🎉b")
    assert ids == [ord("a"), 0xF0, 0x9F, 0x8E, 0x89, ord("b")]
    assert stream(tok, ids) == ["a", "", "", "", "🎉", "b", ""]
    # An unfinished character at the end renders as decode renders it.
    assert stream(tok, [ord("x"), 0xE4, 0xB8]) == ["x", "", "", tok.decode([0xE4, 0xB8])]
    assert tok.decode([0xE4, 0xB8]).endswith("\ufffd")


def test_sentencepiece_spaces(sp_tok: Tokenizer) -> None:
    ids = sp_tok.encode("hello world")
    assert [sp_tok.token_text(i) for i in ids] == ["▁hello", "▁world"]
    assert stream(sp_tok, ids) == ["hello", " world", ""]
    # A skipped special token in between must not eat the space after it.
    bos, eos = sp_tok.token_id("<s>"), sp_tok.token_id("</s>")
    assert stream(sp_tok, [bos, ids[0], eos, ids[1]]) == ["", "hello", "", " world", ""]
    assert stream(sp_tok, [bos, ids[0], eos, ids[1]], skip=False) == ["<s>", " hello", "</s>", " world", ""]


def test_special_and_unknown_ids(tok: Tokenizer) -> None:
    ids = tok.encode("<|im_start|>assistant\nhé<|im_end|>")
    assert "".join(stream(tok, ids)) == "assistant\nhé"
    assert "".join(stream(tok, ids, skip=False)) == "<|im_start|>assistant\nhé<|im_end|>"
    dec = StreamDecoder(tok)
    assert [dec.push(i) for i in (72, tok.vocab_size + 3, -1, 105)] == ["H", "", "", "i"]


def test_parser_markers_are_kept_and_other_specials_skipped(glm_tok: Tokenizer) -> None:
    reply = ("<think>plan: héllo</think>\nSure.<tool_call>get_weather\n<arg_key>city</arg_key>\n"
             "<arg_value>Paris</arg_value>\n</tool_call>")
    ids = glm_tok.encode("<|im_start|>" + reply + "<|im_end|><|endoftext|>")
    keep = glm_tok.special_ids_of(GLM_MARKERS + ("<|im_end|>x", "plain"))  # not tokens: ignored
    assert len(keep) == len(GLM_MARKERS) and all(glm_tok.token_id(m) in keep for m in GLM_MARKERS)
    assert sum(i in keep for i in ids) == 8  # each tag is one special token, as in GLM's checkpoints
    assert glm_tok.special_ids_of(["he", "<|im_end|>x"]) == frozenset()  # ordinary vocab: nothing to keep
    # streamed token by token (the server's stream) and whole (its non-streamed reply: the same deltas)
    deltas = stream(glm_tok, ids, keep=keep)
    assert "".join(deltas) == reply
    assert "".join(deltas) == glm_tok.decode([i for i in ids if i not in glm_tok.special_ids or i in keep],
                                             skip_special_tokens=False)
    # without keep the tags vanish and the parsers would see plain content (the bug this prevents)
    assert "".join(stream(glm_tok, ids)) == glm_tok.decode(ids) == "plan: héllo\nSure.get_weather\ncity\nParis\n"


def test_random_ids_with_kept_specials_match_decode(glm_tok: Tokenizer) -> None:
    rng = random.Random(5)
    specials = sorted(glm_tok.special_ids)
    keep = frozenset(rng.sample(specials, 4))
    for _ in range(100):
        ids = [rng.choice(specials) if rng.random() < 0.2 else rng.randrange(glm_tok.vocab_size)
               for _ in range(rng.randrange(1, 20))]
        want = glm_tok.decode([i for i in ids if i not in glm_tok.special_ids or i in keep], skip_special_tokens=False)
        assert "".join(stream(glm_tok, ids, keep=keep)) == want, ids


def test_invalid_bytes_are_released(tok: Tokenizer) -> None:
    # 0xFF never completes; holding forever would make every push decode a growing window.
    dec = StreamDecoder(tok)
    out = [dec.push(0xFF) for _ in range(3 * MAX_HELD)]
    first = MAX_HELD + 3  # held while the text may still be an unfinished character
    assert out[:first] == [""] * first and out[first] == "\ufffd" * (first + 1)
    assert "".join(out) + dec.flush() == "\ufffd" * 3 * MAX_HELD
    assert dec.flush() == ""


def test_byte_fallback_run_is_held(sp_tok: Tokenizer) -> None:
    # "é" is not in sp_tok's vocabulary, so it streams as byte pieces <0xC3><0xA9>.
    ids = sp_tok.encode("hello é hello")
    assert [sp_tok.token_text(i) for i in ids] == ["▁hello", "▁", "<0xC3>", "<0xA9>", "▁hello"]
    assert stream(sp_tok, ids) == ["hello", " ", "", "", "é hello", ""]
    # A run later spoiled by an invalid byte decodes to U+FFFD as a whole; nothing was emitted early.
    e9 = sp_tok.token_id("<0xE9>")
    bad = [ids[0], ids[1], ids[2], ids[3], e9, ids[4]]
    assert "".join(stream(sp_tok, bad)) == sp_tok.decode(bad) == "hello \ufffd\ufffd\ufffd hello"


# --- StopStrings ------------------------------------------------------------------------------------------

def run_stops(stops: list[str], deltas: list[str]) -> tuple[str, str | None]:
    s = StopStrings(stops)
    out = []
    for d in deltas:
        text, stopped = s.push(d)
        out.append(text)
        assert stopped == (s.matched is not None)
    out.append(s.flush())
    return "".join(out), s.matched


def test_stop_in_one_delta() -> None:
    s = StopStrings(["STOP"])
    assert s.push("abcSTOPdef") == ("abc", True)
    assert s.matched == "STOP" and s.stopped
    assert s.push("more") == ("", True)
    assert s.flush() == ""


def test_stop_spanning_deltas() -> None:
    s = StopStrings(["STOP"])
    assert s.push("ab S") == ("ab ", False)
    assert s.push("TO") == ("", False)
    assert s.push("P!") == ("", True)
    assert s.matched == "STOP"


def test_stop_at_start() -> None:
    s = StopStrings(["<|user|>", "###"])
    assert s.push("###") == ("", True)
    assert s.matched == "###"


def test_overlapping_stops() -> None:
    # A stop that is a prefix of another: the shorter completes first in the stream, so it wins.
    assert run_stops(["ab", "abc"], ["xabcd"]) == ("x", "ab")
    # Both end together: the one starting earlier (longer) wins, so no part of it is emitted.
    assert run_stops(["bc", "abc"], ["xabc"]) == ("x", "abc")
    # A shared prefix held back for one stop string completes the other.
    s = StopStrings(["</s>", "</sys>"])
    assert s.push("a</s") == ("a", False)
    assert s.push("y") == ("", False)
    assert s.push("s> tail") == ("", True)
    assert s.matched == "</sys>"


def test_no_stop_flushes_everything() -> None:
    s = StopStrings(["###"])
    assert s.push("a#") == ("a", False)
    assert s.push("b##") == ("#b", False)
    assert s.flush() == "##"
    assert s.matched is None and s.flush() == ""


def test_partial_prefix_released() -> None:
    s = StopStrings(["STOP"])
    assert s.push("ST") == ("", False)
    assert s.push("AY") == ("STAY", False)
    assert s.push("STO") == ("", False)
    assert s.push("STOP") == ("STO", True)


def test_no_stops_pass_through() -> None:
    s = StopStrings([])
    assert s.push("abc") == ("abc", False)
    assert s.push("") == ("", False)
    assert s.flush() == "" and s.matched is None


def test_bad_stops() -> None:
    with pytest.raises(TokenizerError, match="stop string 1 is empty"):
        StopStrings(["x", ""])
    with pytest.raises(TokenizerError, match=r"wrap it: \['###'\]"):
        StopStrings("###")
    with pytest.raises(TokenizerError, match="stop string 0 must be a str, got int"):
        StopStrings([3])  # type: ignore[list-item]


def reference(stops: list[str], text: str) -> tuple[str, str | None]:
    """What a character-by-character stream produces: stop at the first position any stop ends."""
    for end in range(1, len(text) + 1):
        done = [s for s in stops if text[:end].endswith(s)]
        if done:
            stop = max(done, key=len)
            return text[:end - len(stop)], stop
    return text, None


def test_split_invariance() -> None:
    rng = random.Random(7)
    for _ in range(300):
        stops = ["".join(rng.choices("abc", k=rng.randint(1, 3))) for _ in range(rng.randint(1, 3))]
        text = "".join(rng.choices("abcd", k=rng.randint(0, 12)))
        want = reference(stops, text)
        for cuts in itertools.islice(itertools.combinations(range(1, len(text)), 2), 20):
            deltas = [text[:cuts[0]], text[cuts[0]:cuts[1]], text[cuts[1]:]]
            assert run_stops(stops, deltas) == want, (stops, deltas)
        assert run_stops(stops, list(text)) == want
        assert run_stops(stops, [text]) == want
