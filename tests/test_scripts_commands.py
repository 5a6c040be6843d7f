"""Every `moetier` command the GPU-machine scripts (scripts/*.sh) run names a command that exists and
only options it has. The scripts run only on the H200, where a renamed option fails minutes into a
paid call; this reads them on the CPU: the command words after `python3 -m moetier.cli` (or the
scripts' names for it, or an `args="..."` string of them), then every `--flag`
up to the end of the shell command, against the CLI's own click tree. Options passed through shell
variables are not seen."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
import typer

from moetier.cli.app import app

SCRIPTS = sorted((Path(__file__).resolve().parents[1] / "scripts").glob("*.sh"))
# the CLI as the scripts spell it: python3 -m moetier.cli, its arrays "${mt[@]}", ${mt[*]}, "${MT[@]}",
# prefix_cache_h200.sh's $M, pinned_h200.sh's function mt
CALL = re.compile(r'(?:"?\$\{(?:mt|MT)\[[@*]\]\}"?|python3 -m moetier\.cli|\$M\b|(?:^\s*|[;&|(]\s*)mt)\s+(.*)')
ARGS = re.compile(r'\bargs="([a-z][^"]*)"')
END = {";", "&&", "||", "|", "&", ")"}  # and any redirection: the shell command ends there


def shell_lines(text: str) -> list[str]:
    """The script's lines with continuations joined and comment lines dropped."""
    out, cur = [], ""
    for line in text.splitlines():
        if not cur and line.strip().startswith("#"):
            continue
        if line.rstrip().endswith("\\"):
            cur += line.rstrip()[:-1] + " "
            continue
        out.append(cur + line)
        cur = ""
    return out


def invocations(text: str) -> list[str]:
    """The argument strings of every moetier call the script makes (after the program's name)."""
    found = []
    for line in shell_lines(text):
        found += [m.group(1) for m in CALL.finditer(line) if not m.group(1).startswith("$")]  # $args: below
        found += [m.group(1) for m in ARGS.finditer(line)]
    return found


def check(args: str, root) -> list[str]:
    """Problems of one call: an unknown command word, or an option its command lacks."""
    try:
        words = shlex.split(args, comments=True)
    except ValueError:  # an unbalanced quote over a line we cut: nothing to check in it
        return []
    cmd, i = root, 0
    while hasattr(cmd, "commands") and i < len(words):  # a group (typer's own click types)
        sub = cmd.commands.get(words[i])
        if sub is None:
            return [f"`{' '.join(words[:i + 1])}`: no such moetier command"] if not words[i].startswith("$") else []
        cmd, i = sub, i + 1
    known = {o for p in cmd.params for o in (*p.opts, *p.secondary_opts)} | {"--help"}
    bad = []
    for w in words[i:]:
        if w in END or w.startswith((">", "2>")):
            break
        name = w.split("=", 1)[0]
        if name.startswith("--") and name not in known:
            bad.append(f"`{cmd.name}` has no option {name}")
    return bad


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_script_calls_name_real_options(script):
    root = typer.main.get_command(app)
    problems = [p for call in invocations(script.read_text()) for p in check(call, root)]
    assert not problems, f"{script.name}: {problems}"


def test_the_check_sees_a_renamed_option():
    root = typer.main.get_command(app)
    text = 'stage d 30 "${mt[@]}" bench decode --layers 8 \\\n  --no-such-flag 3 > "$out/d.log"\n# "${mt[@]}" bench decode --commented-out\n'
    (call,) = invocations(text)
    assert check(call, root) == ["`decode` has no option --no-such-flag"]
    assert check("bench no-such-command --x", root) == ["`bench no-such-command`: no such moetier command"]
    assert check("bench decode --layers 8 --out x.json 2>&1 | tee log --not-ours", root) == []
