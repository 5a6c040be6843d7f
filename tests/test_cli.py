"""The `moetier` command as a user runs it: a subprocess, the embedded default model."""

from __future__ import annotations

import json
import subprocess
import sys



def run(*args, check=True):
    p = subprocess.run([sys.executable, "-m", "moetier.cli", *args], capture_output=True, text=True, timeout=300)
    if check:
        assert p.returncode == 0, p.stderr
    return p


def test_generate_default_model_json_and_stream():
    p = run("generate", "Tell me a story", "--max-tokens", "12", "--ignore-eos", "--json")
    out = json.loads(p.stdout)
    assert len(out["token_ids"]) == 12 and out["finish_reason"] == "length"
    assert out["prompt_token_ids"] and set(out["timings"]) >= {"prefill_s", "ttft_s", "decode_tok_per_s"}
    assert out["model"].endswith("tiny-stdlib")
    streamed = run("generate", "Tell me a story", "--max-tokens", "12", "--ignore-eos")
    assert streamed.stdout == out["text"] + "\n"
    assert "12 tokens" in streamed.stderr and "tok/s" in streamed.stderr


def test_seed_and_sampling_flags():
    args = ("generate", "x", "--max-tokens", "10", "--ignore-eos", "--temperature", "0.8", "--top-p", "0.9",
            "--top-k", "20", "--seed", "5", "--json", "--chat", "--dtype", "bfloat16")
    a = json.loads(run(*args).stdout)
    b = json.loads(run(*args).stdout)
    assert a["token_ids"] == b["token_ids"]
    c = json.loads(run(*args, "--async-scheduling").stdout)  # overlapped steps: the same seeded tokens
    assert c["token_ids"] == a["token_ids"]


def test_errors_are_one_clear_line(tmp_path):
    p = run("generate", "x", "--model", str(tmp_path / "nope"), check=False)
    assert p.returncode == 2 and p.stderr.startswith("error: --model") and "Traceback" not in p.stderr
    p = run("generate", "x", "--temperature", "-1", check=False)
    assert p.returncode == 2 and "temperature must be a finite number >= 0" in p.stderr and "Traceback" not in p.stderr
    (tmp_path / "empty").mkdir()
    p = run("generate", "x", "--model", str(tmp_path / "empty"), check=False)
    assert p.returncode == 2 and "config.json not found" in p.stderr


def test_make_checkpoint_then_generate(tmp_path):
    out = tmp_path / "ck"
    run("make-checkpoint", "--preset", "tiny-odd", "--out", str(out), "--layers", "2", "--seed", "3",
        "--dtype", "bf16")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["num_hidden_layers"] == 2 and cfg["torch_dtype"] == "bfloat16"
    p = run("generate", "hi", "--model", str(out), "--max-tokens", "4", "--ignore-eos", "--json")
    assert len(json.loads(p.stdout)["token_ids"]) == 4
    again = run("make-checkpoint", "--preset", "tiny-odd", "--out", str(out), check=False)
    assert again.returncode == 2 and "--overwrite" in again.stderr
    bad = run("make-checkpoint", "--preset", "gpt-9", "--out", str(tmp_path / "x"), check=False)
    assert bad.returncode == 2 and "unknown preset 'gpt-9'" in bad.stderr
