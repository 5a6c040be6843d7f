"""Nonsense on the command line gets one line on stderr and exit code 2: never a traceback, never
silent acceptance, never work done first (issue 10's list, and the rest of each command's options)."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from moetier.cli.app import app


def refuse(*args: str) -> str:
    r = CliRunner().invoke(app, list(args))
    assert r.exit_code == 2, (args, r.exit_code, r.output)
    assert r.exception is None or isinstance(r.exception, SystemExit), (args, r.exception)
    err = r.stderr.strip()
    assert err.startswith("error: ") and "\n" not in err and "Traceback" not in r.output, (args, r.output)
    return err


@pytest.mark.parametrize("args,says", [
    (("--temperature", "nan"), "temperature must be a finite number"),
    (("--temperature", "inf"), "temperature must be a finite number"),
    (("--temperature", "-1"), "temperature must be a finite number >= 0"),
    (("--top-p", "nan"), "top_p must be in (0, 1]"),
    (("--max-tokens", "-5"), "max_tokens must be at least 1"),
    (("--max-tokens", "0"), "max_tokens must be at least 1"),
    (("--expert-backend", "slots", "--expert-slots", "0"), "--expert-slots 0: it must be at least 1"),
    (("--expert-backend", "slots", "--expert-slots", "500"), "--expert-slots 500: it must be between 1 and"),
    (("--expert-backend", "resident", "--expert-slots", "4"), "need --expert-backend slots"),
    (("--model", "/etc/passwd"), "is a file; give the checkpoint directory"),
    (("--model", "/no/such/dir"), "no such directory"),
    (("--expert-backend", "slots", "--expert-slots-file", "/etc"), "--expert-slots-file /etc is a directory"),
    (("--expert-backend", "slots", "--expert-slots-file", "/no/file.json"), "no such file"),
    (("--record-trace", "/proc/x/run.mtrace"), "--record-trace /proc/x/run.mtrace: cannot write there"),
    (("--record-trace", "/etc/passwd/x"), "/etc/passwd is a file, not a directory"),
    (("--replay-trace", "/no/t.mtrace"), "--replay-trace /no/t.mtrace: no such file"),
    (("--decode-tokens", "0"), "decode_tokens must be a positive integer"),
    (("--device", "tpu"), "--device 'tpu': choose auto, cuda or cpu"),
    (("--system", "hi"), "--system needs --chat"),
])
def test_generate_refuses(args, says):
    assert says in refuse("generate", "x", "--max-tokens", "2", *args)


@pytest.mark.parametrize("args,says", [
    (("--out", "/etc/passwd/x"), "cannot write there"),
    (("--out", "/proc/x"), "cannot write there"),
    (("--out", "/etc/passwd"), "--out /etc/passwd is a file"),
    (("--shard-size-gib", "-1"), "--shard-size-gib -1.0: it must be a positive number"),
    (("--shard-size-gib", "nan"), "it must be a positive number"),
    (("--layers", "999"), "--layers 999: preset tiny has 4 layers; keep 1 to 4 of them"),
    (("--layers", "0"), "keep 1 to 4 of them"),
    (("--dtype", "int8"), "unsupported --dtype 'int8'"),
    (("--dtype", "int4", "--format", "modelopt"), "ModelOpt writes NVFP4 only"),
    (("--dtype", "nvfp4", "--format", "gguf"), "--format 'gguf': choose modelopt or compressed-tensors"),
    (("--format", "modelopt"), "--format modelopt names a 4-bit layout"),
    (("--seed", "-1"), "--seed -1: it must be in [0, 2^63)"),  # as generate's
    (("--out", ""), "--out is empty"),
    (("--out", "  "), "--out is empty"),
])
def test_make_checkpoint_refuses(args, says, tmp_path):
    args = ("--out", str(tmp_path / "ck"), *args) if "--out" not in args else args
    assert says in refuse("make-checkpoint", "--preset", "tiny", *args)


def test_make_checkpoint_checks_before_any_progress(tmp_path):
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "f").write_text("x")
    r = CliRunner().invoke(app, ["make-checkpoint", "--preset", "tiny", "--out", str(tmp_path / "full")])
    assert r.exit_code == 2 and "--overwrite" in r.stderr and r.stdout == ""  # no 0/? bytes bar first


@pytest.mark.parametrize("args,says", [
    (("batch", "--requests", "0"), "--requests 0: it must be at least 1"),
    (("batch", "--requests", "-1"), "--requests -1: it must be at least 1"),
    (("batch", "--prompt-len", "1"), "--prompt-len 1: it must be at least 2"),
    (("batch", "--max-tokens", "0"), "--max-tokens 0: it must be at least 1"),
    (("batch", "--out", "/proc/x/b.json"), "cannot write there"),
    (("batch", "--expert-backend", "resident", "--expert-slots", "3"), "need --expert-backend slots"),
    (("decode", "--batch", "0"), "--batch 0: it must be at least 1"),
    (("decode", "--tokens", "0"), "--tokens 0: it must be at least 1"),
    (("decode", "--expert-budget", "0%"), "must be above 0% and at most 100%"),
    (("decode", "--backends", "gpu"), "--backends 'gpu': choose from"),
    (("decode", "--trace", "/no/q.mtrace"), "--trace /no/q.mtrace: no such file"),
    (("decode", "--layers", "99"), "preset qwen3-30b-a3b has 48 layers"),
    (("decode", "--model", "/etc/passwd"), "is a file"),
    (("decode", "--hybrid-graphs", "nodes"), "--hybrid-graphs 'nodes': give eager, auto"),
    (("decode", "--prefetch", "sometimes"), "--prefetch 'sometimes': give off, router, trace"),
    (("decode", "--host-kernel", "pair"), "--host-kernel 'pair': choose one of auto, compiled, grouped"),
    (("layer", "--steps", "0"), "--steps 0: it must be at least 1"),
    (("layer", "--hits", "2"), "each rate must be in [0, 1]"),
    (("layer", "--hits", "most"), "give rates like"),
    (("layer", "--slots-frac", "0"), "--slots-frac 0.0: must be above 0"),
    (("layer", "--preset", "gpt-9"), "unknown preset 'gpt-9'"),
])
def test_bench_refuses(args, says):
    assert says in refuse("bench", *args)


def test_help_shows_flags_as_flags():
    text = CliRunner().invoke(app, ["generate", "--help"]).stdout
    assert "<bool>" not in text and "list[str]" not in text
    assert "--chat " in text and "--stop <text>" in text and "Repeat the option" in text
