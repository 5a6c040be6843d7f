"""scripts/profile_prefill.py on the CPU: the profiled run prefills the whole prompt. Every run of the
script prefills the same prompt, so with prefix caching (the engine's default) a run after the first
hit the pages the one before left and profiled only the tail after them."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_profiled_prefill_takes_every_chunk(tmp_path):
    out = tmp_path / "profile.json"
    p = subprocess.run([sys.executable, str(ROOT / "scripts" / "profile_prefill.py"), "--preset", "tiny-glm5-next",
                        "--layers", "5", "--prompt-len", "128", "--chunk", "32", "--out", str(out)],
                       capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert p.returncode == 0, p.stdout + p.stderr
    record = json.loads(out.read_text())
    assert record["steps"] == 4, record["steps"]  # 128 tokens in chunks of 32, none of them cached
    assert "(4 steps)" in p.stdout
