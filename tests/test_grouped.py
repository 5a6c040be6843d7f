"""The grouped expert GEMM in Triton's CPU interpreter (CI has no GPU): plan, accuracy, exactness."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")


def test_grouped_kernel_in_the_interpreter():
    script = Path(__file__).with_name("grouped_interpreter.py")
    root = str(Path(__file__).parents[1])
    env = {**os.environ, "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}
    p = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=600, env=env)
    assert p.returncode == 0, p.stdout + p.stderr
    lines = [line for line in p.stdout.splitlines() if line.startswith("grouped ")]
    assert len(lines) == 16, p.stdout
    # the all-on-one-expert case of 64 x 8 pairs took 32 chunks of BLOCK_M = 16
    assert any("t=64 k=8" in line and " one " in line and "chunks=32" in line for line in lines), p.stdout
