""".ci/check_skips.py: CI fails when a CPU test was skipped; GPU tests skip with one reason (conftest)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.conftest import GPU_SKIP

CHECK = Path(__file__).parents[1] / ".ci" / "check_skips.py"


def run(tmp_path, text: str) -> subprocess.CompletedProcess:
    log = tmp_path / "pytest.log"
    log.write_text(text)
    return subprocess.run([sys.executable, str(CHECK), str(log)], capture_output=True, text=True, timeout=30)


def test_only_gpu_skips_pass(tmp_path):
    p = run(tmp_path, f"SKIPPED [3] tests/test_gpu.py:13: {GPU_SKIP}\nSKIPPED [1] tests/test_x.py: {GPU_SKIP}\n"
                      "10 passed, 4 skipped in 1.0s\n")
    assert p.returncode == 0, p.stdout
    assert f"skipped     4: {GPU_SKIP}" in p.stdout


def test_a_cpu_skip_fails_with_its_place_and_reason(tmp_path):
    p = run(tmp_path, f"SKIPPED [3] tests/test_gpu.py:13: {GPU_SKIP}\n"
                      "SKIPPED [2] tests/test_host_ext.py:31: no C++ compiler found\n"
                      "SKIPPED [1] tests/test_ray.py: could not import 'ray'\n")
    assert p.returncode == 1
    assert "2 at tests/test_host_ext.py:31: no C++ compiler found" in p.stdout
    assert "1 at tests/test_ray.py: could not import 'ray'" in p.stdout


def test_the_hook_gives_gpu_tests_the_one_reason_first(monkeypatch):
    import pytest
    import torch

    from tests import conftest

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)

    class Item:  # the hook's view of a collected test
        def __init__(self, gpu):
            self.gpu, self.marks = gpu, []

        def get_closest_marker(self, name):
            return object() if name == "gpu" and self.gpu else None

        def add_marker(self, mark, append=True):
            self.marks.insert(0 if not append else len(self.marks), mark)

    items = [Item(True), Item(False)]
    conftest.pytest_collection_modifyitems(None, items)
    assert [m.mark.kwargs.get("reason") for m in items[0].marks] == [GPU_SKIP] and items[1].marks == []
    assert isinstance(items[0].marks[0], pytest.MarkDecorator)
