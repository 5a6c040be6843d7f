"""Tokenizers: a checkpoint's tokenizer.json and chat template (tokenizer.py), the incremental
detokenizer and stop strings (detokenizer.py), and the built-in tokenizer of random-weight
checkpoints (synthetic.py)."""

from moetier.tokenizer.tokenizer import Tokenizer, TokenizerError

__all__ = ["Tokenizer", "TokenizerError"]
