"""The embedded default model of `moetier generate`: tiny-stdlib, a 3.4M-parameter qwen3_moe (32
experts, top-4) trained on the Python standard library by scripts/train_tiny.py and shipped with
the package (6.9 MB in bfloat16; docs/tiny-stdlib.md). It writes Python-looking code; its routing
is learned, so its traces are real routing, not noise.
"""

from __future__ import annotations

import sysconfig
from pathlib import Path

from moetier.errors import MoetierError

ASSET = Path(__file__).parent / "assets" / "tiny-stdlib"


def default_model_dir() -> Path:
    if not (ASSET / "model.safetensors").is_file():
        raise MoetierError(f"the embedded model is missing from {ASSET}; reinstall moetier, or pass --model")
    return ASSET


def held_out_files(limit: int | None = None) -> list[Path]:
    """The standard-library files tiny-stdlib was not trained on (held_out.txt, scripts/train_tiny.py),
    those this Python has, in the list's order, at most `limit`: the scripts' held-out text."""
    lib = Path(sysconfig.get_paths()["stdlib"])
    files = [lib / name for name in (ASSET / "held_out.txt").read_text(encoding="utf-8").split()]
    return [f for f in files if f.is_file()][:limit]
