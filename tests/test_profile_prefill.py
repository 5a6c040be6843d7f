"""scripts/profile_prefill.py on the CPU: the profiled run prefills the whole prompt. Every run of the
script prefills the same prompt, so with prefix caching (the engine's default) a run after the first
hit the pages the one before left and profiled only the tail after them."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def script():
    # loaded when a test asks (it imports the engine); it puts scripts/ on sys.path for its own imports
    spec = importlib.util.spec_from_file_location("profile_prefill", ROOT / "scripts" / "profile_prefill.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_kernels_count_in_every_part_whose_range_holds_them():
    kernels = [(0, 2), (3, 5), (6, 9), (10, 11), (12, 20), (21, 22)]
    ranges = {"attention": [(2.5, 9.5)], "indexer": [(5.5, 9.5)],
              "MoE": [(9.5, 12.5), (11.5, 30)],  # overlapping ranges of one part count their kernels once
              "mHC": [(0, 1)], "MLP": [(13, 21)]}  # mHC: a kernel that outlives the range; MLP: one that starts before it
    got = script().kernels_by_part(kernels, ranges)
    assert got == {"attention": 5.0, "indexer": 3.0, "MoE": 1.0 + 8.0 + 1.0, "mHC": 0.0, "MLP": 0.0}


def test_profiled_prefill_takes_every_chunk(tmp_path):
    out = tmp_path / "profile.json"
    p = subprocess.run([sys.executable, str(ROOT / "scripts" / "profile_prefill.py"), "--preset", "tiny-glm5-next",
                        "--layers", "5", "--prompt-len", "128", "--chunk", "32", "--out", str(out)],
                       capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert p.returncode == 0, p.stdout + p.stderr
    record = json.loads(out.read_text())
    assert record["steps"] == 4, record["steps"]  # 128 tokens in chunks of 32, none of them cached
    assert "(4 steps)" in p.stdout
    assert record["parts_attribution"] == "CPU ranges' wall" and "attention" in record["parts_ms"]
