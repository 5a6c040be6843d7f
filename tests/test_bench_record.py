"""The bench record's provenance (bench/common.py): the commit and dirty flag of the project's own
checkout, the stamp of scripts/stamp_version.py where the tree is not its own checkout (never a
foreign repository's HEAD), and the command line as it was run."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from moetier.bench import common


def git(cwd, *args) -> str:
    return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=cwd, check=True,
                          capture_output=True, text=True).stdout.strip()


def make_project(root, name="moetier"):
    (root / "moetier").mkdir(parents=True)
    (root / "moetier" / "x.py").write_text("A = 1\n")
    (root / "pyproject.toml").write_text(f'[project]\nname = "{name}"\nversion = "0.1.0"\n')
    return root / "moetier"


def test_own_checkout_records_its_commit_and_dirty_tree(tmp_path):
    pkg = make_project(tmp_path / "proj")
    git(tmp_path / "proj", "init", "-q")
    git(tmp_path / "proj", "add", ".")
    git(tmp_path / "proj", "commit", "-qm", "one")
    head = git(tmp_path / "proj", "rev-parse", "HEAD")
    clean = common.provenance(pkg)
    assert clean["commit"] == head and clean["dirty"] is False and clean["commit_source"] == "git"
    (pkg / "x.py").write_text("A = 2\n")
    dirty = common.provenance(pkg)
    assert dirty["commit"] == head and dirty["dirty"] is True and dirty["dirty_paths"] == ["moetier/x.py"]


def test_a_stamp_wins_over_an_older_git_and_loses_to_a_newer_one(tmp_path):
    """The GPU machine's copy carries an older .git than its tree: the stamp (a commit that git does
    not know) is what ran. A stamp left behind in a checkout that moved on is stale: git wins."""
    root = tmp_path / "proj"
    pkg = make_project(root)
    git(root, "init", "-q")
    git(root, "add", ".")
    git(root, "commit", "-qm", "one")
    first = git(root, "rev-parse", "HEAD")
    (pkg / common.BUILD_INFO.name).write_text(json.dumps({"commit": "f" * 40, "dirty": False}))
    shipped = common.provenance(pkg)
    assert shipped["commit"] == "f" * 40 and shipped["commit_source"] == "stamp"
    (pkg / common.BUILD_INFO.name).write_text(json.dumps({"commit": first, "dirty": False}))
    (pkg / "y.py").write_text("B = 1\n")
    git(root, "add", "moetier/y.py")
    git(root, "commit", "-qm", "two")
    moved_on = common.provenance(pkg)
    assert moved_on["commit"] == git(root, "rev-parse", "HEAD") != first and moved_on["commit_source"] == "git"


def test_a_copy_inside_another_repository_never_records_that_head(tmp_path):
    git(tmp_path, "init", "-q")
    (tmp_path / "other.txt").write_text("x\n")
    git(tmp_path, "add", ".")
    git(tmp_path, "commit", "-qm", "foreign")
    foreign = git(tmp_path, "rev-parse", "HEAD")
    pkg = make_project(tmp_path / "unpacked")  # the archive, unpacked inside the foreign checkout
    assert common.project_root(pkg) is None
    bare = common.provenance(pkg)
    assert bare["commit"] == "unknown" and bare["commit_source"] == "none" and bare["dirty"] is None
    (pkg / common.BUILD_INFO.name).write_text(json.dumps({"commit": "abc123", "dirty": True}))
    stamped = common.provenance(pkg)
    assert stamped["commit"] == "abc123" and stamped["dirty"] is True and stamped["commit_source"] == "stamp"
    assert stamped["version"] == "0.1.0"  # the unpacked tree's own pyproject
    assert foreign not in json.dumps(stamped)


def test_a_directory_named_otherwise_is_not_the_project(tmp_path):
    pkg = make_project(tmp_path / "proj", name="someone-else")
    git(tmp_path / "proj", "init", "-q")
    assert common.project_root(pkg) is None
    assert common.project_root(common.PACKAGE) is not None  # this test runs in the project's checkout


@pytest.mark.parametrize("orig, argv, want", [
    (["/v/bin/python", "-m", "pytest", "tests/x.py"], ["/v/lib/pytest/__main__.py", "tests/x.py"],
     "python -m pytest tests/x.py"),
    (["/v/bin/python", "/v/bin/moetier", "bench", "decode", "--out", "a b.json"],
     ["/v/bin/moetier", "bench", "decode", "--out", "a b.json"], "moetier bench decode --out 'a b.json'"),
    (["python3", "scripts/tune_prefill.py", "o.json"], ["scripts/tune_prefill.py", "o.json"],
     "python scripts/tune_prefill.py o.json"),
])
def test_command_is_the_real_command_line(monkeypatch, orig, argv, want):
    monkeypatch.setattr(sys, "orig_argv", orig)
    monkeypatch.setattr(sys, "argv", argv)
    line, exact = common.command()
    assert line == want and exact == orig
    rec = common.record("x", {"rows": []})
    assert rec["command"] == want and rec["argv"] == orig
    assert rec["commit"] == rec["provenance"]["commit"] and rec["dirty"] == rec["provenance"]["dirty"]


def test_no_environment_override(monkeypatch):
    monkeypatch.setenv("MOETIER_COMMIT", "hand-set")
    assert common.commit() != "hand-set"


def test_trace_info_names_the_file_and_the_command_that_makes_it_again(tmp_path):
    from typer.testing import CliRunner

    from moetier.cli.app import app

    first = tmp_path / "a" / "uniform.mtrace"
    first.parent.mkdir()
    args = ["trace", "synth", "--experts", "16", "--topk", "2", "--layers", "2", "--tokens", "64", "--skew", "0.5"]
    assert CliRunner().invoke(app, [*args, "--out", str(first)]).exit_code == 0
    info = common.trace_info(first)
    assert info["synth"]["experts"] == 16 and info["bytes"] == first.stat().st_size
    cmd = info["synth_command"].split()
    assert cmd[:3] == ["moetier", "trace", "synth"] and cmd[cmd.index("--out") + 1] == "uniform.mtrace"
    cmd[cmd.index("--out") + 1] = str(tmp_path / "again.mtrace")
    assert CliRunner().invoke(app, cmd[1:]).exit_code == 0
    assert common.trace_info(tmp_path / "again.mtrace")["sha256"] == info["sha256"]


def test_the_committed_uniform_trace_is_its_synth_command():
    info = common.trace_info(common.PACKAGE.parent / "data" / "traces" / "uniform.mtrace")
    assert info["synth"] == {"experts": 128, "top_k": 8, "layers": 8, "tokens": 8192, "skew": 0.0, "reuse": 0.0,
                             "window": 1, "layer_corr": 0.0, "seed": 0}
    assert info["sha256"] == "7a51989274668ac1fffe08bc66e97eb72b1f59ae4c84962fd303eba9aee24967"
