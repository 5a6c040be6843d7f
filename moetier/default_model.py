"""The embedded default model of `moetier generate`: tiny-stdlib, a 3.4M-parameter qwen3_moe (32
experts, top-4) trained on the Python standard library by scripts/train_tiny.py and shipped with
the package (6.9 MB in bfloat16; docs/tiny-stdlib.md). It writes Python-looking code; its routing
is learned, so its traces are real routing, not noise.
"""

from __future__ import annotations

from pathlib import Path

from moetier.errors import MoetierError

ASSET = Path(__file__).parent / "assets" / "tiny-stdlib"


def default_model_dir() -> Path:
    if not (ASSET / "model.safetensors").is_file():
        raise MoetierError(f"the embedded model is missing from {ASSET}; reinstall moetier, or pass --model")
    return ASSET
