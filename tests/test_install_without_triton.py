"""The README's first command installs torch's CPU build and moetier without the test extras: no
triton. The command line and a CPU generation must not import it (every Triton kernel module is
reached only on CUDA paths); CI's first README command runs this way, and this test fails first."""

from __future__ import annotations

import subprocess
import sys

SCRIPT = """
import sys
sys.modules["triton"] = None  # import triton -> ImportError, as on an install without it
from moetier.cli import main
sys.argv = ["moetier", "generate", "def f(x):", "--max-tokens", "2", "--device", "cpu"]
main()
"""


def test_generate_on_the_cpu_imports_no_triton():
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "finish=length" in done.stderr + done.stdout


def test_the_check_can_fail():
    # the same blocker on a module that imports triton at its top must fail
    bad = 'import sys\nsys.modules["triton"] = None\nimport moetier.experts.kernels.swiglu_clamp\n'
    done = subprocess.run([sys.executable, "-c", bad], capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and "triton" in done.stderr
