"""The accuracy gate (moetier/eval/gate.py): its verdicts on made-up runs, and `moetier eval --compare`
end to end over spawned servers of the embedded model: resident, slots, uva and hybrid experts, and
an FP8 copy of the same weights (scripts/fp8_copy.py), on 2 documents of two tasks (CPU, bounded time)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from moetier.default_model import default_model_dir
from moetier.eval.gate import compare, judge, paired_se
from moetier.eval.lmeval import EvalRun, TaskResult

ROOT = Path(__file__).parents[1]


def result(outputs=(), lls=(), acc=(), tokens=None) -> TaskResult:
    r = TaskResult("generate_until", max(len(outputs), len(acc), 1), outputs=list(outputs), lls=list(lls),
                   ll_tokens=list(tokens or [1] * len(lls)))
    if acc:
        r.metrics["acc"], r.per_doc["acc"] = sum(acc) / len(acc), list(acc)
    return r


def test_exact_means_equal_scores_and_identical_outputs():
    ref = result(["a", "b"], [-1.0, -2.0])
    assert judge("x", "t", ref, result(["a", "b"], [-1.0, -2.0]), 0.0).problem is None
    assert "differs by 1e-06 nats per token" in judge("x", "t", ref, result(["a", "b"], [-1.0, -2.000001]), 0.0).problem
    assert "1 of 2 greedy outputs differ" in judge("x", "t", ref, result(["a", "c"], [-1.0, -2.0]), 0.0).problem
    # a format's tolerance: scores within it pass, and changed generations are counted, not failed
    v = judge("x", "t", ref, result(["a", "c"], [-1.05, -2.0]), 0.1)
    assert v.problem is None and v.outputs_differing == 1 and v.max_ll_diff == pytest.approx(0.05)
    assert "differs by 0.2" in judge("x", "t", ref, result(["a", "b"], [-1.2, -2.0]), 0.1).problem
    # per token of the item: 0.2 nats over 4 tokens is 0.05 per token
    long = result(["a", "b"], [-1.0, -2.0], tokens=[4, 4])
    v = judge("x", "t", long, result(["a", "b"], [-1.2, -2.0]), 0.1)
    assert v.problem is None and v.max_ll_diff_per_token == pytest.approx(0.05)
    assert "other documents" in judge("x", "t", ref, result(["a"], [-1.0]), 1.0).problem


def test_paired_errors_of_metric_differences():
    a, b = [1.0, 0.0, 1.0, 0.0], [1.0, 1.0, 1.0, 0.0]
    assert paired_se(a, b) == pytest.approx(0.25)  # differences 0, 1, 0, 0: sample sd 0.5, over sqrt(4)
    assert paired_se(a, a) == 0.0 and paired_se([1.0], [0.0]) is None
    runs = [EvalRun("ref", "", "", 0, {"t": result(acc=a)}), EvalRun("x", "", "", 0, {"t": result(acc=b)})]
    assert [v.label for v in compare(runs, {})] == ["x"]


needs_lm_eval = pytest.mark.skipif(importlib.util.find_spec("lm_eval") is None,
                                   reason="lm-eval is not installed: pip install 'moetier[eval]'")


@needs_lm_eval
def test_the_gate_over_backends_and_fp8_on_the_embedded_model(tmp_path):
    fp8 = tmp_path / "tiny-stdlib-fp8"
    subprocess.run([sys.executable, str(ROOT / "scripts" / "fp8_copy.py"), str(default_model_dir()), str(fp8)],
                   check=True, capture_output=True, timeout=120)
    out = tmp_path / "gate.json"
    configs = {"resident": "--expert-backend resident", "slots": "--expert-backend slots --expert-slots 8",
               "uva": "--expert-backend uva", "hybrid": "--expert-backend hybrid --expert-slots 8",
               "fp8": f"--model {fp8} --expert-backend resident"}
    cmd = [sys.executable, "-m", "moetier.cli", "eval", "--device", "cpu", "--tasks",
           "stdlib_next_line,stdlib_choose_line", "--limit", "2", "--out", str(out), "--jobs", "2",
           "--tolerance", "hybrid=0.05", "--tolerance", "fp8=0.5"]
    for label, flags in configs.items():
        cmd += ["--compare", f"{label}={flags}"]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    got = json.loads(out.read_text())
    verdicts = {(v["label"], v["task"]): v for v in got["gate"]}
    assert len(verdicts) == 8 and all(v["problem"] is None for v in verdicts.values())
    for label in ("slots", "uva"):  # one format, the same kernels: exact
        assert verdicts[label, "stdlib_choose_line"]["max_ll_diff"] == 0
        assert verdicts[label, "stdlib_next_line"]["outputs_differing"] == 0
    # FP8 weights are another model: its log-likelihoods move (by a measured amount, within the tolerance)
    assert verdicts["fp8", "stdlib_choose_line"]["max_ll_diff"] > 0
    assert "| fp8 | stdlib_choose_line | acc |" in p.stdout and "gate: passed" in p.stderr


class FakeServer:
    """spawn.SpawnedServer's interface without a process: records starts, stops and how many are up."""
    up, most, events = 0, 0, []
    fail: set[str] = set()

    def __init__(self, flags, label=""):
        import threading

        self.flags, self.label, self.url, self.cancelled = flags, label, "", threading.Event()

    def __enter__(self):
        from moetier.errors import MoetierError

        FakeServer.up += 1
        FakeServer.most = max(FakeServer.most, FakeServer.up)
        FakeServer.events.append(("start", self.label))
        if self.label in FakeServer.fail:
            FakeServer.up -= 1
            raise MoetierError(f"moetier serve did not start (configuration {self.label})")
        self.url = f"http://{self.label}"
        return self

    def stop(self):
        if self.url:
            FakeServer.up -= 1
            FakeServer.events.append(("stop", self.label))
            self.url = ""

    def __exit__(self, *exc):
        self.stop()


@pytest.mark.parametrize("jobs", [1, 2, 3])
def test_servers_start_ahead_in_order_and_all_stop(monkeypatch, jobs):
    from moetier.errors import MoetierError
    from moetier.eval import spawn

    monkeypatch.setattr(spawn, "SpawnedServer", FakeServer)
    FakeServer.up, FakeServer.most, FakeServer.events, FakeServer.fail = 0, 0, [], set()
    configs = [(c, [f"--{c}"]) for c in "abcde"]
    seen = []
    for label, flags, server in spawn.started_ahead(configs, jobs):
        assert server.url == f"http://{label}" and flags == [f"--{label}"]
        seen.append(label)
    assert seen == list("abcde") and FakeServer.up == 0 and FakeServer.most == min(jobs, 5)
    # a start that fails surfaces in its turn; the servers started ahead of it are all stopped
    FakeServer.up, FakeServer.most, FakeServer.events, FakeServer.fail = 0, 0, [], {"c"}
    seen = []
    with pytest.raises(MoetierError, match="configuration c"):
        for label, _, _ in spawn.started_ahead(configs, jobs):
            seen.append(label)
    assert seen == ["a", "b"] and FakeServer.up == 0
    # the caller stopping early (an evaluation's error) stops every server still up
    FakeServer.up, FakeServer.fail = 0, set()
    with pytest.raises(RuntimeError):
        for label, _, _ in spawn.started_ahead(configs, jobs):
            raise RuntimeError("lm-eval failed")
    assert FakeServer.up == 0
