"""scripts/ab_tree.sh: a commit's package in its own folder, stamped with that commit; bad input in one line."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.skipif(shutil.which("git") is None or not (ROOT / ".git").exists(), reason="needs the git checkout")


def run(*args, cwd=ROOT):
    return subprocess.run(["bash", str(ROOT / "scripts" / "ab_tree.sh"), *args], capture_output=True, text=True,
                          cwd=cwd, timeout=120)


def test_the_base_folder_holds_the_commits_package_and_its_stamp(tmp_path):
    clone = tmp_path / "repo"
    subprocess.run(["git", "clone", "-q", str(ROOT), str(clone)], check=True, timeout=300)
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=clone, capture_output=True, text=True).stdout.strip()
    shutil.copy(ROOT / "scripts" / "ab_tree.sh", clone / "scripts" / "ab_tree.sh")  # this tree's script
    r = subprocess.run(["bash", "scripts/ab_tree.sh", "HEAD", "ab/base"], cwd=clone, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr
    base = clone / "ab" / "base" / "moetier"
    assert (base / "__init__.py").read_bytes() == (clone / "moetier" / "__init__.py").read_bytes()
    stamp = json.loads((base / "_build_info.json").read_text())
    assert stamp["commit"] == head and stamp["dirty"] is False
    # the package's default traces resolve beside it (cli/bench_common.REPO_TRACE): the commit's data/ too
    for f in (clone / "data").rglob("*"):
        if f.is_file():
            assert (clone / "ab" / "base" / f.relative_to(clone)).read_bytes() == f.read_bytes()
    assert "/ab/" in (clone / ".git" / "info" / "exclude").read_text().splitlines()
    # run as the script says, the base folder's package is the one imported, and it names the stamped commit
    code = ("import moetier, moetier.bench.common as c, moetier.cli.bench_common as b; print(moetier.__file__); "
            "print(c.commit()); print(b.REPO_TRACE.is_file())")
    out = subprocess.run([sys.executable, "-c", code],
                         cwd=clone / "ab" / "base", capture_output=True, text=True, timeout=120,
                         env={"PYTHONPATH": str(clone / "ab" / "base"), "PATH": "/usr/bin:/bin"})
    assert out.stdout.split() == [str(base / "__init__.py"), head, "True"], out.stderr


@pytest.mark.parametrize("args,says", [(["no-such-ref"], "no commit"), (["HEAD", "/tmp/x"], "inside the repository"),
                                       ([], "usage")])
def test_bad_input_is_one_line_and_exit_2(args, says):
    r = run(*args)
    assert r.returncode == 2 and says in r.stderr and r.stderr.count("\n") == 1
