"""Every user option that sets the engine or the experts is declared once: a field of EngineConfig or
ExpertOptions holds its default, cli/options.py maps the flag to it, and every command that offers
the flag shows the same help and the same default (cli/options.py "the record")."""

from __future__ import annotations

from dataclasses import fields

import pytest
import typer

from moetier.cli import options as opt
from moetier.cli.app import app
from moetier.engine.config import EngineConfig
from moetier.experts.placement import ExpertOptions

# the commands whose options configure a run
RUNS = ("generate", "serve", "plan", "bench batch", "bench decode", "bench prefill", "bench chunk", "bench layer")
# bench flags that name several values, one row each (comma-separated axes), not one run's setting
AXES = {("bench prefill", "--prefill-cache"), ("bench prefill", "--prefill-stream"), ("bench chunk", "--prefill-cache")}
ONE_REQUEST = {("plan", "--max-num-seqs")}


def commands() -> dict[str, dict[str, object]]:
    out = {}

    def walk(c, name):
        if hasattr(c, "commands"):
            for sub, child in c.commands.items():
                walk(child, f"{name} {sub}".strip())
        else:
            out[name] = {o: p for p in c.params for o in getattr(p, "opts", []) if o.startswith("--")}

    walk(typer.main.get_command(app), "")
    return out


def record_default(flag: str):
    if flag in opt.CLI_DEFAULTS:
        return opt.CLI_DEFAULTS[flag]
    if flag in opt.ENGINE_FIELDS:
        return getattr(opt.ENGINE, opt.ENGINE_FIELDS[flag])
    return getattr(opt.EXPERTS, opt.EXPERT_FIELDS[flag])


def test_the_tables_name_real_fields():
    engine, experts = {f.name for f in fields(EngineConfig)}, {f.name for f in fields(ExpertOptions)}
    assert set(opt.ENGINE_FIELDS.values()) <= engine
    assert set(opt.EXPERT_FIELDS.values()) <= experts


@pytest.mark.parametrize("command", RUNS)
def test_defaults_are_the_records(command):
    params = commands()[command]
    bad = []
    for flag, p in sorted(params.items()):
        if flag not in opt.ENGINE_FIELDS and flag not in opt.EXPERT_FIELDS or (command, flag) in AXES:
            continue
        want = opt.ONE_REQUEST if (command, flag) in ONE_REQUEST else record_default(flag)
        if p.default != want:
            bad.append(f"{command} {flag}: default {p.default!r}, the record says {want!r}")
    assert not bad, bad


def test_each_flag_has_one_declaration():
    # the same flag reads the same everywhere: one Annotated declaration in cli/options.py
    helps: dict[str, set[str]] = {}
    for command, params in commands().items():
        for flag, p in params.items():
            if (flag in opt.ENGINE_FIELDS or flag in opt.EXPERT_FIELDS) and (command, flag) not in AXES:
                helps.setdefault(flag, set()).add(p.help)
    assert {f: h for f, h in helps.items() if len(h) > 1} == {}


def test_tuning_knobs_are_no_options():
    every = {flag for params in commands().values() for flag in params}
    assert not every & {"--ring-group", "--ring-depth", "--gemm", "--hybrid-nodes", "--block-m"}


def test_the_check_can_fail(monkeypatch):
    monkeypatch.setattr(opt, "ENGINE", EngineConfig(decode_tokens=32))
    with pytest.raises(AssertionError, match="--decode-tokens"):
        test_defaults_are_the_records("generate")
