"""`moetier trace ...` refuses bad input in one line `error: ...` with exit code 2, before any work:
numbers that are 0, negative, out of range or not numbers, and paths that are missing, folders, or
cannot be written. Run in-process through typer's CliRunner."""

from __future__ import annotations

import json

import numpy as np
import pytest
from typer.testing import CliRunner

from moetier.cli.app import app
from moetier.traces.format import write_trace

E, K, LAYERS = 32, 4, 2


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("trace-cli")
    rng = np.random.default_rng(0)
    ids = np.stack([rng.permutation(E)[:K] for _ in range(200 * LAYERS)]).reshape(200, LAYERS, K)
    write_trace(d / "t.mtrace", ids, {"experts": E, "top_k": K, "layers": [0, 1]})
    (d / "slots.json").write_text(json.dumps({"slots": {"0": 8, "1": 8}}))
    (d / "half.json").write_text(json.dumps({"slots": {"0": 8}}))
    (d / "zero.json").write_text(json.dumps({"slots": {"0": 0, "1": 8}}))
    (d / "junk.json").write_text("not json")
    (d / "folder").mkdir()
    return d


def run(*args: str):
    return CliRunner().invoke(app, ["trace", *args])


def refused(result, *words: str) -> None:
    """Exit 2, one line on stderr starting `error:` with every word in it, nothing on stdout, no traceback."""
    assert result.exit_code == 2, (result.exit_code, result.output, result.exception)
    assert isinstance(result.exception, SystemExit), result.exception
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert "Traceback" not in result.output and result.stdout == "", result.output
    for w in words:
        assert w in lines[0], (w, lines[0])


SYNTH = ["synth", "--experts", "8", "--topk", "2", "--layers", "1", "--tokens", "10"]

NUMBERS = [  # (args after the subcommand's own, words the one line must hold)
    (SYNTH + ["--experts", "0"], ["--experts", "1 to 65535"]),
    (SYNTH + ["--experts", "70000"], ["--experts", "1 to 65535"]),
    (SYNTH + ["--experts", "nan"], ["--experts", "not a whole number"]),
    (SYNTH + ["--topk", "0"], ["--topk", "1 to 8"]),
    (SYNTH + ["--topk", "9"], ["--topk", "1 to 8"]),
    (SYNTH + ["--layers", "0"], ["--layers", "1 or more"]),
    (SYNTH + ["--tokens", "-5"], ["--tokens", "1 or more"]),
    (SYNTH + ["--window", "0"], ["--window", "1 or more"]),
    (SYNTH + ["--skew", "-1"], ["--skew", "0 (uniform) or more"]),
    (SYNTH + ["--skew", "nan"], ["--skew", "not a finite number"]),
    (SYNTH + ["--skew", "50"], ["--skew", "smaller --skew"]),  # would loop forever drawing distinct experts
    (SYNTH + ["--reuse", "1.5"], ["--reuse", "0 to 1"]),
    (SYNTH + ["--reuse", "nan"], ["--reuse", "not a finite number"]),
    (SYNTH + ["--layer-corr", "-0.1"], ["--layer-corr", "0 to 1"]),
    (SYNTH + ["--reuse", "0.6", "--layer-corr", "0.6"], ["--reuse", "--layer-corr", "more than 1"]),
    (SYNTH + ["--seed", "-1"], ["--seed", "0 or more"]),
    (["synth", "--preset", "gpt-like"], ["--preset", "qwen3-30b-like"]),
    (["synth", "--experts", "8"], ["--preset", "--topk"]),
    (["stats", "{t}", "--slots", "0"], ["--slots", "1 to 32"]),
    (["stats", "{t}", "--slots", "33"], ["--slots", "1 to 32"]),
    (["stats", "{t}", "--slots", "nan"], ["--slots", "not a whole number"]),
    (["simulate", "{t}", "--slots", "0"], ["--slots 0", "1 to 32"]),
    (["simulate", "{t}", "--slots", "500"], ["--slots 500", "1 to 32"]),
    (["simulate", "{t}", "--slots", "8", "--slots", "-3"], ["--slots -3", "1 to 32"]),
    (["simulate", "{t}", "--slots", "1.5"], ["--slots", "not a whole number"]),
    (["simulate", "{t}", "--hbm-GBps", "0"], ["--hbm-GBps", "more than 0 GB/s"]),
    (["simulate", "{t}", "--hbm-GBps", "nan"], ["--hbm-GBps", "not a finite number"]),
    (["simulate", "{t}", "--link-GBps", "-1"], ["--link-GBps", "more than 0 GB/s"]),
    (["simulate", "{t}", "--link-GBps", "inf"], ["--link-GBps", "not a finite number"]),
    (["simulate", "{t}", "--policy", "fifo"], ["--policy", "lru, lfu, lfru, belady"]),
    (["simulate", "{t}", "--preset", "gpt-9"], ["--preset", "qwen3-30b-a3b"]),
    (["simulate", "{t}", "--slots", "8", "--slots-file", "{d}/slots.json"], ["--slots", "--slots-file", "not both"]),
    (["simulate", "{t}", "--slots-file", "{d}/half.json"], ["--slots-file", "no slots for layers [1]"]),
    (["simulate", "{t}", "--slots-file", "{d}/zero.json"], ["--slots-file", "layer 0", "1 to 32"]),
    (["simulate", "{t}", "--slots-file", "{d}/junk.json"], ["--slots-file", "plan-slots"]),
    (["simulate", "{t}", "--measured", "{d}/junk.json"], ["--measured", "bench layer"]),
    (["plan-slots", "{t}", "--budget", "0", "--out", "{d}/p.json"], ["--budget 0", "2 to 64"]),
    (["plan-slots", "{t}", "--budget", "1", "--out", "{d}/p.json"], ["--budget 1", "2 to 64"]),
    (["plan-slots", "{t}", "--budget", "65", "--out", "{d}/p.json"], ["--budget 65", "2 to 64"]),
    (["plan-slots", "{t}", "--budget", "nan", "--out", "{d}/p.json"], ["--budget", "not a whole number"]),
    (["plan-slots", "{t}", "--budget", "16", "--policy", "fifo", "--out", "{d}/p.json"], ["--policy"]),
]


@pytest.mark.parametrize("args,words", NUMBERS, ids=[" ".join(a[:1] + a[-2:]) for a, _ in NUMBERS])
def test_numbers_out_of_range_are_refused(files, args, words):
    args = [a.format(t=files / "t.mtrace", d=files) for a in args]
    if args[0] == "synth":
        args += ["--out", str(files / "s.mtrace")]
    refused(run(*args), *words)


PATHS = [  # a missing file, a folder for a file, an output that cannot be written
    (["stats", "{d}/none.mtrace"], ["TRACE", "no such file"]),
    (["stats", "{d}/folder"], ["TRACE", "is a folder"]),
    (["stats", "{d}/junk.json"], ["TRACE", "not a moetier trace"]),
    (["simulate", "{d}/none.mtrace"], ["TRACE", "no such file"]),
    (["simulate", "{d}/folder"], ["TRACE", "is a folder"]),
    (["simulate", "{t}", "--slots-file", "{d}/none.json"], ["--slots-file", "no such file", "plan-slots"]),
    (["simulate", "{t}", "--slots-file", "{d}/folder"], ["--slots-file", "is a folder"]),
    (["simulate", "{t}", "--measured", "{d}/none.json"], ["--measured", "no such file"]),
    (["simulate", "{t}", "--measured", "{d}/folder"], ["--measured", "is a folder"]),
    (["simulate", "{t}", "--json", "{d}/folder"], ["--json", "is a folder"]),
    (["simulate", "{t}", "--json", "/proc/x"], ["--json", "cannot write"]),
    (["simulate", "{t}", "--json", "/etc/passwd/x"], ["--json", "not an existing folder"]),
    (["simulate", "{t}", "--plot", "{d}/folder"], ["--plot"]),
    (["simulate", "{t}", "--plot", "/proc/x.png"], ["--plot", "cannot write"]),
    (["simulate", "{t}", "--plot", "{d}/curves.txt"], ["--plot", ".png"]),
    (["plan-slots", "{d}/none.mtrace", "--budget", "16", "--out", "{d}/p.json"], ["TRACE", "no such file"]),
    (["plan-slots", "{t}", "--budget", "16", "--out", "{d}/folder"], ["--out", "is a folder"]),
    (["plan-slots", "{t}", "--budget", "16", "--out", "/proc/x"], ["--out", "cannot write"]),
    (["plan-slots", "{t}", "--budget", "16", "--out", "/etc/passwd/x"], ["--out", "not an existing folder"]),
    (SYNTH + ["--out", "{d}/folder"], ["--out", "is a folder"]),
    (SYNTH + ["--out", "/proc/x"], ["--out", "cannot write"]),
    (SYNTH + ["--out", "/etc/passwd/x"], ["--out", "not an existing folder"]),
    (SYNTH + ["--out", "{d}/no/such/dir/s.mtrace"], ["--out", "not an existing folder"]),
    (["calibrate", "--json", "/proc/x"], ["--json", "cannot write"]),  # before the minutes of fitting
    (["calibrate", "--json", "{d}/folder"], ["--json", "is a folder"]),
]


@pytest.mark.parametrize("args,words", PATHS, ids=[" ".join(a[:1] + a[-2:]) for a, _ in PATHS])
def test_bad_paths_are_refused(files, args, words):
    refused(run(*[a.format(t=files / "t.mtrace", d=files) for a in args]), *words)


def test_a_refused_run_leaves_no_file_and_good_input_still_runs(files, tmp_path):
    out = tmp_path / "sim.json"
    refused(run("simulate", str(files / "t.mtrace"), "--slots", "0", "--json", str(out)), "--slots")
    assert not out.exists()  # the output was tried (made and removed) but nothing written
    r = run("simulate", str(files / "t.mtrace"), "--slots", "8", "--slots", "32", "--policy", "lru",
            "--hbm-GBps", "4000", "--link-GBps", "50.5", "--json", str(out))
    assert r.exit_code == 0, r.output
    rows = json.loads(out.read_text())["rows"]
    assert [row["slots"] for row in rows] == ["8", "32"] and rows[1]["hit_rate"] > rows[0]["hit_rate"]
    r = run("simulate", str(files / "t.mtrace"), "--slots-file", str(files / "slots.json"), "--policy", "lru")
    assert r.exit_code == 0 and "per-layer file" in r.stdout, r.output
    r = run("plan-slots", str(files / "t.mtrace"), "--budget", "2", "--out", str(tmp_path / "p.json"))
    assert r.exit_code == 0 and json.loads((tmp_path / "p.json").read_text())["used"] == 2, r.output
