"""`moetier serve` as a user runs it (a subprocess: binds loopback, answers, Ctrl-C drains and exits
0; bad options are one line and exit 2), and `moetier bench serve` against a live server."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from typer.testing import CliRunner

from moetier.cli.app import app

from server_helpers import serve

MOETIER = [sys.executable, "-m", "moetier.cli"]


def cli(*args: str):
    """The command in this process (a subprocess costs seconds of imports): exit code, stdout, stderr."""
    r = CliRunner().invoke(app, list(args))
    return r.exit_code, r.stdout, r.stderr


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_up(url: str, proc: subprocess.Popen, timeout: float = 60) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        assert proc.poll() is None, proc.stderr.read()
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            time.sleep(0.1)
    raise AssertionError("moetier serve did not come up")


def test_serve_binds_loopback_needs_the_key_and_ctrl_c_drains():
    port = free_port()
    env = {**os.environ, "MOETIER_API_KEY": "k3y"}
    proc = subprocess.Popen(MOETIER + ["serve", "--port", str(port), "--device", "cpu"], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_up(url, proc)
        assert httpx.get(url + "/v1/models").status_code == 401
        auth = {"Authorization": "Bearer k3y"}
        assert httpx.get(url + "/v1/models", headers=auth).json()["data"][0]["id"] == "tiny-stdlib"
        # a long request in flight when Ctrl-C comes: it finishes (drain), then the server exits 0
        result = {}

        def long_request():
            result["r"] = httpx.post(url + "/v1/completions", headers=auth, timeout=60, json={
                "model": "tiny-stdlib", "prompt": "def f(x):", "max_tokens": 200, "ignore_eos": True})

        t = threading.Thread(target=long_request)
        t.start()
        time.sleep(0.5)
        proc.send_signal(signal.SIGINT)
        t.join(60)
        assert result["r"].status_code == 200 and result["r"].json()["usage"]["completion_tokens"] == 200
        assert proc.wait(30) == 0
        err = proc.stderr.read()
        assert "127.0.0.1" in err and "memory plan:" in err and "host (" in err, err
    finally:
        if proc.poll() is None:
            proc.kill()


@pytest.mark.parametrize("args,message", [
    (["--port", "70000"], "--port 70000"),
    (["--model", "/no/such/dir"], "no such directory"),
    (["--preset", "nope"], "unknown preset"),
    (["--layers", "2"], "go with --preset"),
    (["--preset", "tiny", "--expert-backend", "resident", "--expert-budget", "50%"], "needs --expert-backend slots"),
    (["--preset", "tiny", "--expert-slots", "4"], "or --expert-slots-file (a count per layer"),
    (["--preset", "tiny", "--expert-budget", "50%", "--expert-slots-file", "/no/file"], "not both"),
    (["--preset", "tiny", "--expert-slots-file", "/no/file"], "no such file"),
    (["--max-queue", "-1"], "--max-queue"),
    (["--replay-trace", "/no/file"], "no such file"),
    (["--tool-call-parser", "glm4"], "--tool-call-parser 'glm4' is not a parser moetier has; choose one of auto, hermes, glm45"),
    (["--reasoning-parser", "r1"], "--reasoning-parser 'r1'"),
])
def test_serve_bad_options_one_line_exit_2(args, message):
    code, _, err = cli("serve", *args)
    assert code == 2 and message in err and "Traceback" not in err, err


def test_serve_port_taken_is_one_line():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        code, _, err = cli("serve", "--port", str(s.getsockname()[1]))
    assert code == 2 and "cannot listen" in err


def test_bench_serve_against_a_live_server(tmp_path: Path):
    server = serve()
    try:
        out, png = tmp_path / "serve.json", tmp_path / "serve.png"
        code, _, err = cli("bench", "serve", "--url", server.url + "/v1", "--concurrency", "1,4", "--num-prompts", "8",
                           "--input-len", "12", "--output-len", "6", "--warmup", "2", "--out", str(out),
                           "--plot", str(png))
        assert code == 0, err
        data = json.loads(out.read_text())
        assert data["benchmark"] == "serve" and [x["max_concurrency"] for x in data["results"]] == [1, 4]
        for row in data["results"]:
            assert row["completed"] == 8 and row["failed"] == row["cancelled"] == 0
            assert row["total_input_tokens"] == 8 * 12 and row["total_output_tokens"] == 8 * 6
            for key in ("request_throughput", "output_throughput", "total_token_throughput", "mean_ttft_ms",
                        "median_tpot_ms", "p99_itl_ms", "p90_e2el_ms", "engine_steps", "step_seconds",
                        "server_ttft_ms_mean"):
                assert row[key] > 0, key
            # the engine's own TTFT starts when the request reaches it: never after the client's
            assert row["queue_ms_mean"] <= row["server_ttft_ms_mean"] <= row["mean_ttft_ms"] * 1.05
        assert png.stat().st_size > 1000
        code, stdout, err = cli("bench", "serve", "--url", server.url, "--request-rate", "50", "--num-prompts", "6",
                                "--input-len", "8", "--output-len", "4", "--dataset", "sharegpt-like")
        assert code == 0 and "inf" not in stdout.splitlines()[1], err
        assert "spec_decode_num_drafts" not in data["results"][0]  # this server does not speculate
    finally:
        server.close()


def test_bench_serve_rows_carry_the_speculative_counters(tmp_path: Path):
    server = serve(llm_options={"speculative_config": {"method": "ngram", "num_speculative_tokens": 3,
                                                       "expert_aware_k": False}})
    try:
        out = tmp_path / "serve.json"
        code, _, err = cli("bench", "serve", "--url", server.url, "--concurrency", "2", "--num-prompts", "4",
                           "--input-len", "16", "--output-len", "24", "--warmup", "1", "--out", str(out))
        assert code == 0, err
        [row] = json.loads(out.read_text())["results"]
        m = server.llm.metrics()
    finally:
        server.close()
    # the measured level's share of the engine's totals (the warm-up's counted before it)
    assert 0 < row["spec_decode_num_drafts"] <= m["spec_decode_num_drafts"]
    assert 0 <= row["spec_decode_num_accepted_tokens"] <= row["spec_decode_num_draft_tokens"]
    if row["spec_decode_num_draft_tokens"]:
        assert row["spec_decode_acceptance_rate"] == row["spec_decode_num_accepted_tokens"] / \
            row["spec_decode_num_draft_tokens"]


@pytest.mark.parametrize("args,message", [
    (["--url", "localhost:8000"], "http://"),
    (["--url", "http://127.0.0.1:9", "--concurrency", "0"], "at least 1"),
    (["--url", "http://127.0.0.1:9", "--dataset", "x"], "--dataset"),
    (["--url", "http://127.0.0.1:9"], "no OpenAI server answers"),
])
def test_bench_serve_bad_options(args, message):
    code, _, err = cli("bench", "serve", *args)
    assert code == 2 and message in err and "Traceback" not in err, err
