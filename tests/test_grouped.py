"""The grouped expert GEMM in Triton's CPU interpreter (CI has no GPU): plan, accuracy, and bit-equality
across backends that run the same chunks (not across batches: see grouped_interpreter.py)."""

from __future__ import annotations

import pytest

pytest.importorskip("triton")

from tests.interpreter import run_script  # noqa: E402


def test_grouped_kernel_in_the_interpreter():
    out = run_script("grouped_interpreter.py")
    lines = [line for line in out.splitlines() if line.startswith("grouped ")]
    assert len(lines) == 16, out
    # the all-on-one-expert case of 64 x 8 pairs took 32 chunks of BLOCK_M = 16
    assert any("t=64 k=8" in line and " one " in line and "chunks=32" in line for line in lines), out
    large = [line for line in out.splitlines() if line.startswith("large ")]
    assert len(large) == 8, out
    assert sum(" dense " in line for line in large) == 2, out
    # 96 tokens x 2 on 3 experts: runs of ~64 pairs per row cut into chunks of 16
    assert all(int(line.split("chunks=")[1].split()[0]) >= 12 for line in large if "t=96" in line), out
