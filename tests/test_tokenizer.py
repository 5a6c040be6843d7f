"""Tokenizer loading, encode/decode, chat templates, and the built-in write_tokenizer output."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from datetime import datetime
from pathlib import Path

import numpy as np
import pytest

from moetier.tokenizer import Tokenizer, TokenizerError
from moetier.tokenizer.synthetic import _WORDS, MERGES, MIN_VOCAB, SPECIAL_TOKENS, write_tokenizer

SYSTEM_USER = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi 👋"}]
CHATML = "<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\nHi 👋<|im_end|>\n"
TEXTS = [
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog.",
    "héllo wörld — naïve café, Ångström",
    "日本語のテキスト 中文 한국어",
    "emoji 🎉👩‍👩‍👧 flags 🇫🇷 and ⚙️",
    "  leading and trailing spaces  ",
    "\n\nnewlines\n\n\n  and\ttabs\r\n",
    "def f(self, x: int) -> int:\n    if x == 0:\n        return None\n    return x + 1\n",
    "",
]


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("tok")
    write_tokenizer(d)
    return d


@pytest.fixture(scope="module")
def tok(tok_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(tok_dir)


def _copy_tokenizer(src: Path, dst: Path, config: dict | None = None) -> Path:
    """dst holding src's tokenizer.json and the given tokenizer_config.json (none if config is None)."""
    dst.mkdir(parents=True, exist_ok=True)
    (dst / "tokenizer.json").write_bytes((src / "tokenizer.json").read_bytes())
    if config is not None:
        (dst / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    return dst


# --- write_tokenizer --------------------------------------------------------------------------------------

def test_write_is_byte_identical(tmp_path: Path) -> None:
    assert write_tokenizer(tmp_path / "a") == MIN_VOCAB
    # A separate interpreter with another hash seed: output must not depend on set/dict hashing.
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    code = f"from moetier.tokenizer.synthetic import write_tokenizer; print(write_tokenizer({str(tmp_path / 'b')!r}))"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True,
                         cwd=Path(__file__).resolve().parents[1])
    assert out.stdout.strip() == str(MIN_VOCAB)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()


def test_layout(tok: Tokenizer, tok_dir: Path) -> None:
    # Pinned: presets size test checkpoints' vocab from this; changing the merges must be deliberate.
    assert MIN_VOCAB == 448 == 256 + len(MERGES) + len(SPECIAL_TOKENS)
    assert tok.vocab_size == len(tok) == MIN_VOCAB
    assert [tok.token_id(t) for t in SPECIAL_TOKENS] == [445, 446, 447]
    assert tok.special_ids == {445, 446, 447}
    assert tok.eos_token == "<|im_end|>" and tok.eos_token_ids == [447]
    assert tok.bos_token is None and tok.pad_token == "<|endoftext|>"
    # Ids 0..255 are raw bytes.
    assert tok.decode([72, 105, 10]) == "Hi\n"
    assert tok.decode([0xE4, 0xB8, 0x96]) == "世"
    assert tok.token_text(ord(" ")) == "Ġ" and tok.token_text(MIN_VOCAB) is None
    config = json.loads((tok_dir / "tokenizer_config.json").read_text())
    assert config["eos_token"] == "<|im_end|>" and config["bos_token"] is None
    assert config["model_max_length"] == 32768


def test_merges_make_words_single_tokens(tok: Tokenizer) -> None:
    assert 100 <= len(MERGES) <= 300
    assert [w for w in _WORDS if len(tok.encode(w)) != 1] == []
    assert len(tok.encode(" the")) == 1 and tok.decode(tok.encode(" return")) == " return"


# --- encode / decode --------------------------------------------------------------------------------------

@pytest.mark.parametrize("text", TEXTS)
def test_round_trip(tok: Tokenizer, text: str) -> None:
    ids = tok.encode(text)
    assert all(0 <= i < tok.vocab_size for i in ids)
    assert tok.decode(ids) == text


def test_special_tokens_in_text(tok: Tokenizer) -> None:
    ids = tok.encode("<|im_start|>user\nhi<|im_end|>")
    assert ids == [446, ord("u"), ord("s"), tok.token_id("er"), 10, ord("h"), ord("i"), 447]
    assert tok.decode(ids) == "user\nhi"
    assert tok.decode(ids, skip_special_tokens=False) == "<|im_start|>user\nhi<|im_end|>"
    # A special token's text written inside other text still splits out.
    assert tok.encode("a<|endoftext|>b") == [ord("a"), 445, ord("b")]


def test_decode_skips_unknown_ids(tok: Tokenizer) -> None:
    ids = [72, tok.vocab_size + 5, 105, -1, 10**9, 33]
    assert tok.decode(ids) == "Hi!"
    assert tok.decode(np.array([72, 105], dtype=np.int64)) == "Hi"
    assert tok.decode([]) == ""


def test_bad_input(tok: Tokenizer) -> None:
    with pytest.raises(TokenizerError, match="integer token ids"):
        tok.decode([72.0, 105.0])
    with pytest.raises(TokenizerError, match="encode takes a str, got bytes"):
        tok.encode(b"hi")  # type: ignore[arg-type]


def test_matches_transformers(tok: Tokenizer, tok_dir: Path) -> None:
    from transformers import PreTrainedTokenizerFast

    oracle = PreTrainedTokenizerFast(tokenizer_file=str(tok_dir / "tokenizer.json"))
    for text in [*TEXTS, "<|im_start|>system\nx<|im_end|>"]:
        ids = tok.encode(text)
        assert ids == oracle.encode(text, add_special_tokens=False), text
        assert tok.decode(ids) == oracle.decode(ids, skip_special_tokens=True), text


# --- loading ----------------------------------------------------------------------------------------------

def test_missing_tokenizer_json(tmp_path: Path) -> None:
    with pytest.raises(TokenizerError, match=r"tokenizer\.json not found") as e:
        Tokenizer.from_dir(tmp_path)
    assert str(tmp_path) in str(e.value)


def test_corrupt_files(tmp_path: Path, tok_dir: Path) -> None:
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(TokenizerError, match=r"cannot load .*tokenizer\.json"):
        Tokenizer.from_dir(tmp_path)
    _copy_tokenizer(tok_dir, tmp_path)
    (tmp_path / "tokenizer_config.json").write_text("[1, 2")
    with pytest.raises(TokenizerError, match=r"cannot read .*tokenizer_config\.json"):
        Tokenizer.from_dir(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text('{"eos_token": 7}')
    with pytest.raises(TokenizerError, match="eos_token must be a string"):
        Tokenizer.from_dir(tmp_path)


def test_config_forms(tmp_path: Path, tok_dir: Path) -> None:
    d = _copy_tokenizer(tok_dir, tmp_path / "dict", {
        "bos_token": {"content": "<|im_start|>", "lstrip": False, "__type": "AddedToken"},
        "eos_token": {"content": "<|endoftext|>", "special": True},
        "chat_template": [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D{{ bos_token }}"}],
    })
    t = Tokenizer.from_dir(d)
    assert (t.bos_token, t.eos_token, t.eos_token_ids) == ("<|im_start|>", "<|endoftext|>", [445])
    assert t.apply_chat_template([{"role": "user", "content": "x"}]) == "D<|im_start|>"
    # eos not in the vocabulary: no ids (the engine adds the model config's eos ids).
    t = Tokenizer.from_dir(_copy_tokenizer(tok_dir, tmp_path / "none", {"eos_token": "</s>"}))
    assert t.eos_token_ids == [] and not t.has_chat_template


# --- chat template ----------------------------------------------------------------------------------------

def test_chatml(tok: Tokenizer, tok_dir: Path) -> None:
    assert tok.has_chat_template
    assert tok.apply_chat_template(SYSTEM_USER) == CHATML + "<|im_start|>assistant\n"
    assert tok.apply_chat_template(SYSTEM_USER, add_generation_prompt=False) == CHATML
    ids = tok.encode(tok.apply_chat_template(SYSTEM_USER))
    assert ids[0] == 446 and ids.count(447) == 2


def test_chatml_matches_transformers(tok: Tokenizer, tok_dir: Path) -> None:
    from transformers import AutoTokenizer

    oracle = AutoTokenizer.from_pretrained(str(tok_dir))
    for gen in (True, False):
        want = oracle.apply_chat_template(SYSTEM_USER, tokenize=False, add_generation_prompt=gen)
        assert tok.apply_chat_template(SYSTEM_USER, add_generation_prompt=gen) == want


# Exercises what HF templates lean on: tojson (non-ASCII, no HTML escaping), namespace, loop controls,
# {% generation %}, extra variables, undefined bos_token, whitespace control.
RICH_TEMPLATE = """{{ bos_token }}{% set ns = namespace(n=0) %}
{% for m in messages %}
  {% if m['role'] == 'skip' %}{% continue %}{% endif %}
  {% set ns.n = ns.n + 1 %}
  {% if m['role'] == 'assistant' %}{% generation %}[{{ m['content'] }}]{% endgeneration %}
  {% else %}{{ m['role'] }}: {{ m | tojson }}
  {% endif %}
{% endfor %}
{% if tools %}tools={{ tools | tojson(indent=2) }}
{% endif %}
{% if enable_thinking is defined and not enable_thinking %}<think></think>{% endif %}
n={{ ns.n }}{% if add_generation_prompt %} go{% endif %}
"""


def test_rich_template_matches_transformers(tmp_path: Path, tok_dir: Path) -> None:
    from transformers import AutoTokenizer

    d = _copy_tokenizer(tok_dir, tmp_path, {"eos_token": "<|im_end|>",
                                            "tokenizer_class": "PreTrainedTokenizerFast"})
    (d / "chat_template.jinja").write_text(RICH_TEMPLATE, encoding="utf-8")
    messages = [{"role": "user", "content": 'é <b>"x"</b>'}, {"role": "skip", "content": ""},
                {"role": "assistant", "content": "ok"}]
    tools = [{"name": "f", "description": "ü"}]
    ours = Tokenizer.from_dir(d).apply_chat_template(messages, enable_thinking=False, tools=tools)
    assert ours == ('user: {"role": "user", "content": "é <b>\\"x\\"</b>"}\n[ok]'
                    'tools=[\n  {\n    "name": "f",\n    "description": "ü"\n  }\n]\n<think></think>n=2 go')
    oracle = AutoTokenizer.from_pretrained(str(d))
    want = oracle.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                      enable_thinking=False, tools=tools)
    assert ours == want


def test_template_file_wins_over_config(tmp_path: Path, tok_dir: Path) -> None:
    d = _copy_tokenizer(tok_dir, tmp_path, {"chat_template": "from config"})
    assert Tokenizer.from_dir(d).apply_chat_template([{"role": "user", "content": "x"}]) == "from config"
    (d / "chat_template.jinja").write_text("from file {{ strftime_now('%Y') }}", encoding="utf-8")
    got = Tokenizer.from_dir(d).apply_chat_template([{"role": "user", "content": "x"}])
    assert got == f"from file {datetime.now().year}"


def test_raise_exception(tmp_path: Path, tok_dir: Path) -> None:
    template = ("{% if messages[0]['role'] != 'user' %}{{ raise_exception('Conversation must start with user') }}"
                "{% endif %}ok")
    t = Tokenizer.from_dir(_copy_tokenizer(tok_dir, tmp_path, {"chat_template": template}))
    assert t.apply_chat_template([{"role": "user", "content": "x"}]) == "ok"
    with pytest.raises(TokenizerError, match="refused these messages: Conversation must start with user"):
        t.apply_chat_template([{"role": "assistant", "content": "x"}])


def test_template_errors(tmp_path: Path, tok_dir: Path) -> None:
    msg = [{"role": "user", "content": "x"}]
    t = Tokenizer.from_dir(_copy_tokenizer(tok_dir, tmp_path / "none"))
    assert not t.has_chat_template
    with pytest.raises(TokenizerError, match="no chat template.*drop --chat"):
        t.apply_chat_template(msg)
    t = Tokenizer.from_dir(_copy_tokenizer(tok_dir, tmp_path / "syntax", {"chat_template": "{% for %}"}))
    with pytest.raises(TokenizerError, match="does not parse .line 1"):
        t.apply_chat_template(msg)
    t = Tokenizer.from_dir(_copy_tokenizer(tok_dir, tmp_path / "named",
                                           {"chat_template": [{"name": "rag", "template": "x"}]}))
    assert not t.has_chat_template
    with pytest.raises(TokenizerError, match="named rag but none named 'default'"):
        t.apply_chat_template(msg)
    t = Tokenizer.from_dir(_copy_tokenizer(tok_dir, tmp_path / "runtime", {"chat_template": "{{ 1 + 'a' }}"}))
    with pytest.raises(TokenizerError, match="failed on these messages: TypeError"):
        t.apply_chat_template(msg)


@pytest.mark.parametrize("messages, match", [
    ("hello", "must be a list of dicts.*got str"),
    ([], "messages is empty"),
    (["hello"], r"messages\[0\] must be a dict"),
    ([{"content": "x"}], r"messages\[0\]\['role'\] must be a string, but it is missing"),
    ([{"role": "user", "content": "a"}, {"role": "user", "content": None}],
     r"messages\[1\]\['content'\] must be a string, but it is a NoneType"),
    ([{"role": "user", "content": ["a"]}], r"messages\[0\]\['content'\] must be a string, but it is a list"),
])
def test_malformed_messages(tok: Tokenizer, messages: object, match: str) -> None:
    with pytest.raises(TokenizerError, match=match):
        tok.apply_chat_template(messages)  # type: ignore[arg-type]
