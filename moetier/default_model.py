"""The embedded default model: a tiny qwen3_moe checkpoint made deterministically, without network,
the first time it is needed, and kept in the cache directory after that.

Its weights are random (seeded), so its text is noise; it exists so that `moetier generate` runs
end to end on a fresh machine, through the same loader as any downloaded checkpoint.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

DEFAULT_PRESET = "tiny"
DEFAULT_SEED = 0
VERSION = 1  # bump when the preset, the tokenizer or the writer changes what gets written
COMPLETE = ".complete"


def cache_dir() -> Path:
    if os.environ.get("MOETIER_CACHE"):
        return Path(os.environ["MOETIER_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "moetier"


def default_model_dir() -> Path:
    """Path of the default model, written on first use. Safe when several processes race to write it."""
    from moetier.writer import make_checkpoint

    target = cache_dir() / "models" / f"{DEFAULT_PRESET}-seed{DEFAULT_SEED}-v{VERSION}"
    if (target / COMPLETE).is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".writing-", dir=target.parent))
    try:
        make_checkpoint(tmp, DEFAULT_PRESET, seed=DEFAULT_SEED, dtype="float32", overwrite=True)
        (tmp / COMPLETE).write_text("written by moetier\n")
        if target.exists():  # an incomplete earlier attempt
            shutil.rmtree(target, ignore_errors=True)
        try:
            tmp.rename(target)
        except OSError:
            if not (target / COMPLETE).is_file():  # lost the race to a writer that did not finish
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target
