"""Every `moetier` command in README.md and docs/ runs as written on this machine (CPU): a command
that needs CUDA refuses in one line instead. What the test changes is listed in SUBSTITUTE: paths
that stand for a user's own files, and one shape too large for CI (the command stays the same)."""

from __future__ import annotations

import os
import re
import shlex
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from moetier.cli.app import app

ROOT = Path(__file__).parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
CUDA_ONLY = ("bench decode", "bench layer", "bench prefill", "bench chunk")
# What the docs write -> what the test runs. {tiny}: a tiny random checkpoint; {default}: the
# embedded model, whose routing the working folder's q.mtrace holds.
SUBSTITUTE = {
    "~/models/Qwen3-30B-A3B": "{tiny}", "DIR": "{default}", "TRACE": "q.mtrace", "TOTAL": "64",
    "/data/q30b": "q30b",
    # the published Qwen3-30B-A3B shape is 2.4 GB a layer: the same command on the tiny shape
    "--preset qwen3-30b-a3b --out q30b --layers 8": "--preset tiny --out q30b --layers 2",
    # the H200 serving benchmark: the same server on the tiny shape and the default model's routing,
    # the same sweep on fewer and shorter requests
    "--preset qwen3-30b-a3b --layers 8": "--preset tiny --layers 2",
    "--replay-trace data/traces/qwen3-30b-like.mtrace": "--replay-trace q.mtrace",
    "--concurrency 1,2,4,8,16,32,64": "--concurrency 1,2 --num-prompts 4 --input-len 8 --output-len 4",
    # lm-eval runs (docs/eval.md): the same command on 2 documents per task; the embedded model stands in
    # for its FP8 copy (scripts/fp8_copy.py writes it: not a moetier command)
    "moetier eval": "moetier eval --limit 2", "--limit 40": "--limit 2", "/tmp/tiny-stdlib-fp8": "{default}",
}
# commands over the user's own data files (GSM8K, MMLU): they refuse in one line here, for want of them
USER_DATA = "--include-path my_tasks"
# `moetier serve` runs until Ctrl-C: the test starts it (on a free port), asks /health and
# /v1/models, sends SIGINT and wants exit 0. `moetier bench serve` lines load a live server instead
# of the one the docs start on port 8000.
SERVE_URL = "http://127.0.0.1:8000"


def commands() -> list[tuple[str, str, str | None]]:
    """(where, command, the output the doc shows or None). A doc shows a command's output as a plain
    fenced block right after a command written outside any fence (docs/tiny-stdlib.md's samples)."""
    out = []
    for doc in DOCS:
        lines = doc.read_text().splitlines()
        i, fenced = 0, False
        while i < len(lines):
            line = lines[i].strip()
            if line.startswith("```"):
                fenced = not fenced
            while line.endswith("\\") and i + 1 < len(lines):
                i += 1
                line = line[:-1] + " " + lines[i].strip()
            i += 1
            if line.startswith("moetier "):
                line = re.sub(r"\s+#.*$", "", line).replace(" ...", ' "def f():"')  # "...": the rest
                shown = None if fenced else shown_output(lines, i)
                out.append((f"{doc.name}: {line}", line, shown))
    return out


def shown_output(lines: list[str], i: int) -> str | None:
    """The plain fenced block starting at lines[i] (after blank lines), or None."""
    while i < len(lines) and not lines[i].strip():
        i += 1
    if i >= len(lines) or lines[i].strip() != "```":
        return None
    end = lines.index("```", i + 1)
    return "\n".join(lines[i + 1:end])


def prompt_of(args: list[str]) -> str:
    """generate's prompt: its one positional argument (every option but these flags takes a value)."""
    i = 1
    while args[i].startswith("--"):
        i += 1 if args[i] in ("--chat", "--ignore-eos", "--json", "--verbose") else 2
    return args[i]


def same_text(a: str) -> str:
    # Markdown keeps no trailing blanks: compare lines without them, and without blank lines at the end
    return "\n".join(line.rstrip() for line in a.rstrip().splitlines())


@pytest.fixture(scope="module")
def workdirs(tmp_path_factory):
    """One working folder per document: its commands run in order there, as a reader would run them.
    Each starts with the files the document takes as given: q.mtrace (a trace for the model the
    document's generate commands use) and slots.json."""
    made = {}

    def get(doc: str) -> Path:
        if doc not in made:
            d = made[doc] = tmp_path_factory.mktemp(doc.replace(".", "_"))
            heldout = ROOT / "data" / "traces" / "tiny-stdlib-heldout.mtrace"  # the default model's routing
            (d / "q.mtrace").write_bytes(heldout.read_bytes())
            (d / "slots.json").write_text('{"slots": {"0": 16, "1": 16, "2": 16, "3": 16}}')
        return made[doc]
    return get


@pytest.mark.parametrize("where,line,shown", commands(), ids=[w for w, _, _ in commands()])
def test_documented_command_runs(where, line, shown, workdirs, tiny_ckpt, monkeypatch):
    from moetier.default_model import default_model_dir

    cwd = workdirs(where.split(":")[0])
    places = {"tiny": str(tiny_ckpt), "default": str(default_model_dir())}
    for doc_text, run_text in SUBSTITUTE.items():
        line = re.sub(rf"(?<![\w/.-]){re.escape(doc_text)}(?![\w/.-])", run_text, line)
    # only the placeholders: a documented JSON option ('{"method": ...}') keeps its braces
    args = [re.sub(r"\{(tiny|default)\}", lambda m: places[m.group(1)], a) for a in shlex.split(line)[1:]]
    # repository paths (data/traces/..., moetier/assets/...) read from the checkout
    args = [str(ROOT / a) if not a.startswith("/") and "/" in a and (ROOT / a).exists() else a for a in args]
    monkeypatch.chdir(cwd)
    if line.startswith("moetier serve"):
        run_server_command(args, cwd)
        return
    if line.startswith("moetier bench serve"):
        server = live_server()
        args = [a.replace(SERVE_URL, server.url) for a in args]
    r = CliRunner().invoke(app, args)
    if USER_DATA in line:
        assert r.exit_code == 2 and "--include-path my_tasks: no such directory" in r.output, (args, r.output)
        return
    if line.startswith(tuple(f"moetier {c}" for c in CUDA_ONLY)) and not torch.cuda.is_available():
        assert r.exit_code == 2 and "needs a CUDA GPU" in r.stderr, (args, r.output)
        return
    assert r.exit_code == 0, (args, r.output, r.exception)
    if shown is not None:  # the doc shows what it prints: a generate block is the prompt, then the output
        printed = (prompt_of(args) if args[0] == "generate" else "") + r.stdout
        assert same_text(printed) == same_text(shown), (where, printed)


_live = []


def live_server():
    """One server on the default model for the documented `bench serve` lines (closed at exit: daemon)."""
    if not _live:
        from server_helpers import serve

        _live.append(serve())
    return _live[0]


def run_server_command(args: list[str], cwd: Path) -> None:
    import signal
    import subprocess
    import sys
    import time

    import httpx

    env = {k: v for k, v in os.environ.items() if k != "MOETIER_API_KEY"}
    key = args[args.index("--api-key") + 1] if "--api-key" in args else None
    proc = subprocess.Popen([sys.executable, "-m", "moetier.cli", *args, "--port", "0", "--device", "cpu"], cwd=cwd,
                            env=env, stderr=subprocess.PIPE, text=True)
    try:
        url = None
        deadline = time.time() + 120
        while url is None:
            assert time.time() < deadline and proc.poll() is None, (args, proc.poll())
            m = re.search(r"(http://[\d.]+:\d+)/v1", proc.stderr.readline())
            url = m and m.group(1)
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        while httpx.get(url + "/health").status_code != 200:
            time.sleep(0.1)
        assert httpx.get(url + "/v1/models", headers=headers).status_code == 200
        proc.send_signal(signal.SIGINT)
        assert proc.wait(60) == 0, args
    finally:
        if proc.poll() is None:
            proc.kill()
