"""Device scripts (fill_align_bench.py, tune_prefill.py) refuse nonsense in one line with exit 2, and a
machine without CUDA likewise, never with a traceback."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("args,says", [
    (["--experts", "3"], "--experts 3"),
    (["--preset", "no-such-model"], "--preset no-such-model"),
])
def test_nonsense_arguments_are_one_line_and_exit_2(tmp_path, args, says):
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "fill_align_bench.py"), str(tmp_path / "o.json"), *args],
                       capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert r.returncode == 2 and says in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "o.json").exists()


def test_a_directory_for_out_is_refused(tmp_path):
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "fill_align_bench.py"), str(tmp_path)],
                       capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert r.returncode == 2 and "give a file path" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.parametrize("args,says", [
    (["--tokens", "0"], "at least 1 token"),
    (["--tokens", "a,b"], "comma list"),
    (["--preset", "no-such-model"], "--preset no-such-model"),
    ([], "no CUDA device"),
])
def test_tune_prefill_refuses_in_one_line(tmp_path, args, says):
    if says == "no CUDA device":
        pytest.importorskip("torch")
        import torch
        if torch.cuda.is_available():
            pytest.skip("a CUDA machine runs the sweep")
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "tune_prefill.py"), str(tmp_path / "o.json"), *args],
                       capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert r.returncode == 2 and says in r.stderr and "Traceback" not in r.stderr
