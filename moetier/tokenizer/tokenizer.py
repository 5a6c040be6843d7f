"""Text <-> token ids for a checkpoint directory, and its chat template.

Reads the Hugging Face files (tokenizer.json, tokenizer_config.json, chat_template.jinja) with
`tokenizers` and `jinja2` only, so serving never imports transformers.
"""

from __future__ import annotations

import json
import operator
import re
from collections.abc import Sequence
from datetime import datetime
from functools import cached_property
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as _HFTokenizer


class TokenizerError(ValueError):
    """Bad tokenizer files or bad input to the tokenizer; the message says what and how to fix it."""


TOKENIZER_FILE = "tokenizer.json"
CONFIG_FILE = "tokenizer_config.json"
TEMPLATE_FILE = "chat_template.jinja"
TEMPLATE_DIR = "additional_chat_templates"


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise TokenizerError(f"cannot read {path}: {e}; fix or remove the file") from None
    if not isinstance(data, dict):
        raise TokenizerError(f"{path} must hold a JSON object, got {type(data).__name__}")
    return data


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise TokenizerError(f"cannot read {path}: {e}; fix or remove the file") from None


def _token_str(config: dict[str, Any], key: str, path: Path) -> str | None:
    # HF writes special tokens either as plain strings or as serialized AddedToken dicts.
    value = config.get(key)
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    raise TokenizerError(f"{path}: {key} must be a string or {{'content': ...}}, got {value!r}")


def _templates(path: Path, config: dict[str, Any]) -> tuple[dict[str, str], str]:
    """Named chat templates and where they came from. Template files win over the config, as in HF."""
    files: dict[str, str] = {}
    main = path / TEMPLATE_FILE
    if main.is_file():
        files["default"] = _read_text(main)
    extra = path / TEMPLATE_DIR
    if extra.is_dir():
        for f in sorted(extra.glob("*.jinja")):
            files[f.stem] = _read_text(f)
    if files:
        return files, str(main if "default" in files else extra)
    source = f"{path / CONFIG_FILE} (chat_template)"
    raw = config.get("chat_template")
    if raw is None:
        return {}, source
    if isinstance(raw, str):
        return {"default": raw}, source
    if isinstance(raw, list) and all(
        isinstance(t, dict) and isinstance(t.get("name"), str) and isinstance(t.get("template"), str) for t in raw
    ):
        return {t["name"]: t["template"] for t in raw}, source
    raise TokenizerError(f"{source} must be a string or a list of {{'name', 'template'}} entries")


class _Generation(jinja2.ext.Extension):
    # HF templates may mark assistant spans with {% generation %}; only HF's training masks use them,
    # so the body renders unchanged.
    tags = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Any) -> str:
        return caller()


def _raise_exception(message: str) -> None:
    raise TokenizerError(f"the chat template refused these messages: {message}")


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    # HF's filter: jinja's own tojson HTML-escapes, which would change what the model sees.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _check_messages(messages: Any) -> None:
    example = "[{'role': 'user', 'content': 'Hello'}]"
    if not isinstance(messages, (list, tuple)):
        raise TokenizerError(f"messages must be a list of dicts like {example}, got {type(messages).__name__}")
    if not messages:
        raise TokenizerError(f"messages is empty; pass at least one message, e.g. {example}")
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise TokenizerError(f"messages[{i}] must be a dict like {example[1:-1]}, got {type(m).__name__}")
        for key in ("role", "content"):
            if not isinstance(m.get(key), str):
                got = "missing" if key not in m else f"a {type(m[key]).__name__}"
                raise TokenizerError(f"messages[{i}]['{key}'] must be a string, but it is {got}")


class Tokenizer:
    """A checkpoint's tokenizer: encode/decode without implicit special tokens, plus its chat template.

    vocab_size is one past the largest id, added tokens included: the model's vocab must cover it.
    """

    def __init__(self, tok: _HFTokenizer, *, bos_token: str | None = None, eos_token: str | None = None,
                 pad_token: str | None = None, unk_token: str | None = None,
                 templates: dict[str, str] | None = None, template_source: str = "chat template") -> None:
        self._tok = tok
        # Literal special tokens in prompts ("<|im_start|>") must map to their ids, whatever the file says.
        tok.encode_special_tokens = False
        vocab = tok.get_vocab(with_added_tokens=True)
        # Ids may have holes in real checkpoints; the mask lets decode drop unknown ids instead of raising.
        self.vocab_size: int = max(vocab.values(), default=-1) + 1
        self._known = bytearray(self.vocab_size)
        for i in vocab.values():
            self._known[i] = 1
        self.special_ids: frozenset[int] = frozenset(
            i for i, t in tok.get_added_tokens_decoder().items() if t.special)
        # SentencePiece byte-fallback pieces ("<0xE4>"): their decoder renders a run of them all-or-nothing,
        # so streaming must not cut inside a run (see detokenizer.StreamDecoder).
        self.byte_fallback_ids: frozenset[int] = frozenset(
            i for t, i in vocab.items() if len(t) == 6 and re.fullmatch(r"<0x[0-9A-Fa-f]{2}>", t))
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.pad_token = pad_token
        self.unk_token = unk_token
        eos_id = self.token_id(eos_token) if eos_token is not None else None
        self.eos_token_ids: list[int] = [] if eos_id is None else [eos_id]
        self._templates = templates or {}
        self._template_source = template_source

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer:
        path = Path(path)
        file = path / TOKENIZER_FILE
        if not file.is_file():
            raise TokenizerError(
                f"{file} not found; point at a checkpoint directory that contains {TOKENIZER_FILE} "
                f"(or write a test tokenizer there with moetier.tokenizer.write_tokenizer)")
        try:
            tok = _HFTokenizer.from_file(str(file))
        except Exception as e:  # the Rust loader raises bare Exception on malformed files
            raise TokenizerError(f"cannot load {file}: {e}; re-download or regenerate it") from None
        config_file = path / CONFIG_FILE
        config = _read_json(config_file) if config_file.is_file() else {}
        templates, source = _templates(path, config)
        return cls(tok, bos_token=_token_str(config, "bos_token", config_file),
                   eos_token=_token_str(config, "eos_token", config_file),
                   pad_token=_token_str(config, "pad_token", config_file),
                   unk_token=_token_str(config, "unk_token", config_file),
                   templates=templates, template_source=source)

    def __len__(self) -> int:
        return self.vocab_size

    def __repr__(self) -> str:
        return f"Tokenizer(vocab_size={self.vocab_size}, eos={self.eos_token!r}, chat={self.has_chat_template})"

    def known(self, token_id: int) -> bool:
        """Whether decode renders this id (a model's vocab may be larger than the tokenizer's)."""
        return 0 <= token_id < self.vocab_size and self._known[token_id] == 1

    def token_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def special_ids_of(self, texts: Sequence[str]) -> frozenset[int]:
        """The ids of those texts that are each one special token: markers (`<think>`, `<tool_call>`)
        that decode would skip, for a detokenizer that must keep them (StreamDecoder's keep)."""
        ids = (self._tok.token_to_id(t) for t in texts)
        return frozenset(i for i in ids if i is not None and i in self.special_ids)

    def token_text(self, token_id: int) -> str | None:
        """The raw vocabulary entry (byte-level symbols, not decoded text), None if unknown."""
        return self._tok.id_to_token(token_id) if self.known(token_id) else None

    def encode(self, text: str) -> list[int]:
        if not isinstance(text, str):
            raise TokenizerError(f"encode takes a str, got {type(text).__name__}")
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        try:
            # operator.index accepts numpy/torch integers and rejects floats, which would truncate silently.
            kept = [i for i in map(operator.index, ids) if self.known(i)]
        except TypeError as e:
            raise TokenizerError(f"decode takes a sequence of integer token ids: {e}") from None
        return self._tok.decode(kept, skip_special_tokens=skip_special_tokens)

    @property
    def has_chat_template(self) -> bool:
        return "default" in self._templates

    @cached_property
    def _template(self) -> jinja2.Template:
        if not self._templates:
            raise TokenizerError(
                "this checkpoint has no chat template (no chat_template.jinja and no chat_template in "
                "tokenizer_config.json); drop --chat and give a plain prompt instead")
        if "default" not in self._templates:
            names = ", ".join(sorted(self._templates))
            raise TokenizerError(
                f"{self._template_source} has chat templates named {names} but none named 'default'; "
                f"add {TEMPLATE_FILE} or drop --chat")
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=[_Generation, jinja2.ext.loopcontrols])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        try:
            return env.from_string(self._templates["default"])
        except jinja2.TemplateSyntaxError as e:
            raise TokenizerError(
                f"{self._template_source} does not parse (line {e.lineno}: {e.message}); fix the template "
                "or drop --chat") from None

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **extra: Any) -> str:
        """Render messages to the prompt string; tokens in it are literal text, so encode() it next."""
        _check_messages(messages)
        template = self._template
        # Unset special tokens stay undefined (render as ""), as in HF, rather than rendering "None".
        specials = {k: v for k, v in (("bos_token", self.bos_token), ("eos_token", self.eos_token),
                                      ("pad_token", self.pad_token), ("unk_token", self.unk_token))
                    if v is not None}
        variables = {"tools": None, "documents": None, **specials, **extra,
                     "messages": list(messages), "add_generation_prompt": add_generation_prompt}
        try:
            return template.render(**variables)
        except TokenizerError:
            raise
        except (jinja2.TemplateError, TypeError, ValueError, KeyError, AttributeError, IndexError) as e:
            raise TokenizerError(
                f"chat template ({self._template_source}) failed on these messages: "
                f"{type(e).__name__}: {e}") from None
