"""Runs one of the *_interpreter.py scripts in a subprocess: TRITON_INTERPRET must be set before
triton is imported, so the kernels' CPU-interpreter checks cannot share the test process.

What the interpreter can promise: the kernels' logic (indices, masks, plans, integer bookkeeping) and
their values within a tolerance. Its tl.dot is numpy's matmul on OpenBLAS, whose summation order (and
so the last bits) depends on the CPU's BLAS kernel and, under some kernels (Haswell, Zen), on a row's
position in the tile. So bit-equality is claimed here only between launches that run the very same
matmuls on the same bytes; batch invariance is tests/test_gpu.py's to show on the compiled kernels."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


def run_script(name: str) -> str:
    """-> the script's stdout; fails the calling test with its output when it exits non-zero."""
    script = Path(__file__).with_name(name)
    root = str(Path(__file__).parents[1])
    env = {**os.environ, "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}
    p = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=600, env=env)
    assert p.returncode == 0, p.stdout + p.stderr
    return p.stdout
