"""Issue 27's command-line items: nonsense refused in one line (exit 2) with a message that names the
real problem, sizes that cannot be made refused before anything is allocated, progress on stderr for
the long commands, and output that belongs under --verbose; issue 26's serve defaults (an empty API
key, --expert-backend auto) and Ray's usage stats off for a cluster we start."""

from __future__ import annotations

import re
import types

import pytest
from typer.testing import CliRunner

from moetier.cli.app import app
from tests.test_cli_errors import refuse


@pytest.mark.parametrize("args,says", [
    (("--gpu-memory", "139"), "say the unit"),
    (("--host-memory", "-5GiB"), "a size must be above zero"),
    (("--host-memory", "0GiB"), "a size must be above zero"),
    (("--gpu-memory", "1000000000000GiB"), "more memory than any machine has"),
    (("--max-model-len", "1000000000000"), "the model's limit is 4,096 tokens"),
    (("--max-model-len", "8192"), "the model's limit is 4,096 tokens"),
    (("--record-trace", "/etc/passwd/x"), "/etc/passwd is a file, not a directory"),
])
def test_generate_refuses_sizes_and_paths(args, says):
    assert says in refuse("generate", "x", "--max-tokens", "2", "--device", "cpu", *args)


def test_the_host_memory_limit_given_is_named_as_the_users():
    r = CliRunner().invoke(app, ["generate", "x", "--device", "cpu", "--host-memory", "1MiB"])
    assert r.exit_code == 2 and "raise --host-memory by at least" in r.stderr, r.output
    assert "other processes" not in r.stderr


@pytest.mark.parametrize("args,says", [
    (("--preset", "tiny", "--device", "cpu", "--gpu-memory", "1000000000000GiB"), "more memory than any machine"),
    (("--preset", "tiny", "--device", "cpu", "--max-model-len", "5000"), "the model's limit is 4,096 tokens"),
])
def test_plan_refuses(args, says):
    assert says in refuse("plan", *args)


def test_plan_validates_the_checkpoint_it_plans(tmp_path):
    from moetier.checkpoint.writer import make_checkpoint

    path = make_checkpoint(tmp_path / "sharded", "tiny", dtype="float32", shard_bytes=2 * 2**20)
    shard = sorted(path.glob("model-*.safetensors"))[1]
    shard.write_bytes(shard.read_bytes()[:1000])
    r = CliRunner().invoke(app, ["plan", "--model", str(path), "--device", "cpu"])
    assert r.exit_code == 2 and f"{shard.name}: unreadable safetensors file" in r.stderr, r.output


def test_a_large_make_checkpoint_seed_works(tmp_path):
    r = CliRunner().invoke(app, ["make-checkpoint", "--preset", "tiny", "--layers", "1", "--dtype", "float32",
                                 "--seed", str(2**63 - 1), "--out", str(tmp_path / "ck")])
    assert r.exit_code == 0, r.output


@pytest.mark.parametrize("args", [
    ("bench", "batch", "--device", "cpu", "--out", "/etc/passwd/x"),
    ("bench", "serve", "--url", "http://127.0.0.1:9", "--plot", "/etc/passwd/x.png"),
])
def test_bench_outputs_under_a_file_say_not_a_directory(args):
    assert "/etc/passwd is a file, not a directory" in refuse(*args)


@pytest.mark.parametrize("args,says", [
    (("--tokens", "1000000000000"), re.compile(r"needs [\d.,]+ GiB of memory \([\d,]+ bytes\)")),
    (("--layers", "100000", "--tokens", "100"), "--layers 100,000: at most 1,024"),
])
def test_trace_synth_refuses_sizes_that_cannot_be_made(args, says, tmp_path):
    err = refuse("trace", "synth", "--experts", "128", "--topk", "8", "--layers", "8", *args,
                 "--out", str(tmp_path / "s.mtrace"))
    assert (says.search(err) if isinstance(says, re.Pattern) else says in err), err
    assert not (tmp_path / "s.mtrace").exists()


def test_prefill_chunk_line_only_with_verbose():
    args = ["generate", "def f():", "--max-tokens", "2", "--device", "cpu"]
    r = CliRunner().invoke(app, args)
    assert r.exit_code == 0 and "prefill chunk" not in r.stderr, r.output
    r = CliRunner().invoke(app, [*args, "--verbose"])
    assert r.exit_code == 0 and "prefill chunk: 2048 tokens per step" in r.stderr, r.output


def test_help_defaults_and_one_metavar_style():
    import os

    env = {**os.environ, "COLUMNS": "200"}
    serve = " ".join(CliRunner().invoke(app, ["serve", "--help"], env=env).stdout.split())
    assert re.search(r"--expert-backend <str> Where routed experts live: auto [^[]*\[default: auto\]", serve), serve
    slots = " ".join(CliRunner().invoke(app, ["trace", "plan-slots", "--help"], env=env).stdout.split())
    assert re.search(r"--policy <str> The slot cache's victim policy [^[]*\[default: lfru\]", slots), slots
    for cmd in (["generate"], ["serve"], ["plan"], ["bench", "batch"], ["trace", "plan-slots"]):
        text = CliRunner().invoke(app, [*cmd, "--help"], env=env).stdout
        # typer writes types as <int>; our own metavars follow it (no DIR / FILE / INTEGER beside them)
        assert not re.search(r"--[a-z-]+ [A-Z]{2,}", text), (cmd, text)


def test_bench_batch_and_calibrate_show_progress():
    r = CliRunner().invoke(app, ["bench", "batch", "--device", "cpu", "--requests", "2", "--prompt-len", "4",
                                 "--max-tokens", "2"])
    assert r.exit_code == 0, r.output
    assert "bench batch: one after another: request 1 of 2" in r.stderr and "continuous batch" in r.stderr
    from moetier.traces.synth import calibrate

    said = []
    calibrate(tokens=16, layers=1, progress=said.append)
    assert said[0] == "qwen3-30b-like skew, step 1 of 12" and "glm-5.3-like reuse, step 10 of 10" in said


@pytest.mark.parametrize("env,args,says", [
    ({"MOETIER_API_KEY": ""}, (), "the API key is empty"),
    ({"MOETIER_API_KEY": "  "}, (), "the API key is empty"),
    ({}, ("--api-key", ""), "the API key is empty"),
])
def test_serve_refuses_an_empty_api_key(env, args, says, monkeypatch):
    monkeypatch.delenv("MOETIER_API_KEY", raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert says in refuse("serve", "--port", "0", *args)


def test_bench_serve_against_a_keyed_server_asks_for_the_key():
    from server_helpers import serve

    server = serve(api_key="k3y")
    try:
        assert "the server there wants an API key (give --api-key KEY)" in refuse("bench", "serve", "--url", server.url)
        assert "--api-key was refused" in refuse("bench", "serve", "--url", server.url, "--api-key", "nope")
    finally:
        server.close()


def test_ray_usage_stats_are_off_for_a_cluster_we_start(monkeypatch):
    from moetier.dist.ray_executor import connect

    seen = []

    def init(address=None, **kw):
        if address == "auto":
            raise ConnectionError("no cluster")
        import os
        seen.append(os.environ.get("RAY_USAGE_STATS_ENABLED"))

    monkeypatch.delenv("RAY_USAGE_STATS_ENABLED", raising=False)
    fake = types.SimpleNamespace(is_initialized=lambda: False, init=init)
    assert connect(fake) and seen == ["0"]
    import os
    assert "RAY_USAGE_STATS_ENABLED" not in os.environ  # only the cluster's processes see it
