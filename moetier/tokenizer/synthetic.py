"""The built-in byte-level BPE tokenizer that random-weight checkpoints ship (make-checkpoint, bench
decode, tests): GPT-2 byte symbols, merges for common English and Python pieces, ChatML special
tokens and template. Token id b < 256 is byte b. Same bytes on every run."""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import AddedToken, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as _HFTokenizer

from moetier.tokenizer.tokenizer import CONFIG_FILE, TOKENIZER_FILE


def _byte_symbols() -> list[str]:
    """GPT-2's bytes_to_unicode as a list indexed by byte value: printable bytes stand for themselves,
    the rest are shifted to 256+. Token id b is byte b, so ids 0..255 read as raw bytes."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    symbols: list[str] = []
    shifted = 0
    for b in range(256):
        if b in printable:
            symbols.append(chr(b))
        else:
            symbols.append(chr(256 + shifted))
            shifted += 1
    return symbols


BYTE_SYMBOLS: list[str] = _byte_symbols()

# Each entry is one GPT-2-regex pre-token, so the derived merges make it a single token.
# Order sets merge priority: shorter, more common pieces first.
_WORDS: tuple[str, ...] = (
    " t", " a", " s", " w", " c", " o", " i", " b", " f", " p", " m", " d", " h", " l", " n", " r", " e",
    "th", "he", "in", "er", "an", "re", "on", "at", "en", "nd", "es", "or", "te", "ed", "is", "it", "al",
    "ar", "st", "to", "nt", "ng", "se", "ou", "le", "ve", "me", "de", "ro", "ic", "ne", "ra", "ce", "el",
    "the", "ing", "ion", "and", "ent", "for", "tion", "The",
    " the", " of", " and", " to", " in", " is", " that", " for", " it", " with", " as", " on", " be",
    " this", " are", " was", " by", " an", " or", " not", " from", " at", " have", " you", " we", " can",
    " The", " I",
    "def", "self", " def", " return", " self", " import", " class", " if", " else", " elif", " None",
    " True", " False", " print", " range", " len", " lambda", " yield", " try", " except", " raise",
    " while", " assert", " pass", " int", " str", " list", " dict",
    "__", "):", "()", " =", " ==", " !=", " +=", " ->", "\n", "\n\n", "   ", "       ",
    "\n   ", "\n       ", " 0", " 1",
)


def _bpe(word: list[str], ranks: dict[tuple[str, str], int]) -> list[str]:
    # Plain lowest-rank-first BPE; matches tokenizers' BPE without dropout.
    while len(word) > 1:
        pairs = [(ranks.get(p, len(ranks)), i, p) for i, p in enumerate(zip(word, word[1:]))]
        rank, i, pair = min(pairs)
        if rank == len(ranks):
            break
        word = word[:i] + ["".join(pair)] + word[i + 2:]
    return word


def _merges() -> list[tuple[str, str]]:
    """Merges that turn each of _WORDS into one token: segment it with the merges so far, then join
    the pieces left to right. New merges rank after all earlier ones, so earlier words keep their tokens."""
    ranks: dict[tuple[str, str], int] = {}
    for text in _WORDS:
        pieces = _bpe([BYTE_SYMBOLS[b] for b in text.encode("utf-8")], ranks)
        while len(pieces) > 1:
            pair = (pieces[0], pieces[1])
            ranks.setdefault(pair, len(ranks))
            pieces = ["".join(pair)] + pieces[2:]
    return sorted(ranks, key=ranks.__getitem__)


MERGES: list[tuple[str, str]] = _merges()
SPECIAL_TOKENS: tuple[str, ...] = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
MODEL_MAX_LENGTH = 32768
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def _vocab() -> dict[str, int]:
    vocab = {s: b for b, s in enumerate(BYTE_SYMBOLS)}
    for a, b in MERGES:
        vocab.setdefault(a + b, len(vocab))
    return vocab


MIN_VOCAB: int = len(_vocab()) + len(SPECIAL_TOKENS)
"""Size of the write_tokenizer tokenizer; a model using it needs vocab_size >= MIN_VOCAB."""


def write_tokenizer(out_dir: str | Path) -> int:
    """Write tokenizer.json and tokenizer_config.json for a byte-level BPE (ids 0..255 are raw bytes,
    then MERGES, then SPECIAL_TOKENS) with a ChatML template. Same bytes on every run. Returns its size."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = _HFTokenizer(models.BPE(vocab=_vocab(), merges=MERGES, fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    size = tok.get_vocab_size(with_added_tokens=True)
    assert size == MIN_VOCAB, (size, MIN_VOCAB)
    # tokenizers serializes vocab and added tokens in id order, so to_str is already deterministic.
    (out / TOKENIZER_FILE).write_text(tok.to_str(pretty=True) + "\n", encoding="utf-8")
    config = {
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "chat_template": CHATML_TEMPLATE,
        "model_max_length": MODEL_MAX_LENGTH,
        "clean_up_tokenization_spaces": False,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    text = json.dumps(config, indent=2, sort_keys=True, ensure_ascii=False) + "\n"
    (out / CONFIG_FILE).write_text(text, encoding="utf-8")
    return size


def write_marker_tokenizer(out_dir: str | Path, markers: tuple[str, ...]) -> int:
    """write_tokenizer's tokenizer with `markers` added after SPECIAL_TOKENS as special tokens, one id
    each, as GLM's and DeepSeek's checkpoints mark their reasoning and tool-call tags (`<think>`,
    `<tool_call>`, `<｜tool▁calls▁begin｜>`). Returns its size."""
    write_tokenizer(out_dir)
    path = Path(out_dir) / TOKENIZER_FILE
    tok = _HFTokenizer.from_file(str(path))
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in markers])
    path.write_text(tok.to_str(pretty=True) + "\n", encoding="utf-8")
    return tok.get_vocab_size(with_added_tokens=True)
