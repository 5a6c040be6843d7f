"""Print the package's shape for the closing notes of a restructuring: files and lines per room, up
arrows and import cycles (the rules of tests/layout_rules.py), environment variables read, and the
user options of every command.

    python scripts/layout_report.py                 # this checkout
    python scripts/layout_report.py --root /tmp/old # another tree (git archive <commit> | tar -x -C /tmp/old)
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(HERE / "tests"))

from layout_rules import cycles, sizes, unplaced_rooms, up_arrows  # noqa: E402

ENV = re.compile(r"os\.environ|getenv\(")
ENV_NAME = re.compile(r"""(?:environ(?:\.get|\.setdefault|\.pop)?\(|environ\[|getenv\()\s*["']([A-Z0-9_]+)["']""")

# walks the click tree of `moetier` in a child process whose import path is the tree's own
OPTIONS = r"""
import json, typer
from moetier.cli.app import app
cmd = typer.main.get_command(app)
out = {}
def walk(c, name):  # typer's own click: groups have .commands, options have opts starting with --
    if hasattr(c, "commands"):
        for sub, child in c.commands.items():
            walk(child, f"{name} {sub}".strip())
    else:
        out[name] = sorted(o for p in c.params for o in getattr(p, "opts", []) if o.startswith("--"))
walk(cmd, "")
print(json.dumps(out))
"""


def environment(root: Path) -> tuple[int, list[str]]:
    lines, names = 0, set()
    for f in sorted(root.rglob("*.py")):
        for line in f.read_text().splitlines():
            if ENV.search(line) and not line.lstrip().startswith("#"):
                lines += 1
                names |= set(ENV_NAME.findall(line))
    return lines, sorted(names)


def options(tree: Path) -> dict[str, list[str]]:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    out = subprocess.run([sys.executable, "-c", OPTIONS], env=env, capture_output=True, text=True, cwd=tree)
    if out.returncode:
        raise SystemExit(f"error: could not read the options of {tree}: {out.stderr.strip().splitlines()[-1]}")
    return json.loads(out.stdout)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--root", type=Path, default=HERE, help="the tree (holding moetier/) to report on")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    a = ap.parse_args()
    pkg = a.root / "moetier"
    if not (pkg / "__init__.py").is_file():
        raise SystemExit(f"error: --root {a.root}: no moetier/ package there; give a checkout's top folder")
    per_room = sizes(pkg)
    ups, loops = up_arrows(pkg), cycles(pkg)
    env_lines, env_names = environment(pkg)
    opts = options(a.root)
    distinct = sorted({o for names in opts.values() for o in names} - {"--help"})
    main_cmds = {c: opts[c] for c in opts if c.split(" ")[0] in ("generate", "serve", "plan", "bench")}
    report = {"rooms": {k: {"files": f, "lines": n} for k, (f, n) in per_room.items()},
              "total": {"files": sum(f for f, _ in per_room.values()), "lines": sum(n for _, n in per_room.values())},
              "unplaced_rooms": unplaced_rooms(pkg), "up_arrows": ups, "cycles": loops,
              "environment_lines": env_lines, "environment_names": env_names,
              "options_distinct": len(distinct),
              "options_generate_serve_plan_bench": len({o for v in main_cmds.values() for o in v} - {"--help"}),
              "options_per_command": {c: len(set(v) - {"--help"}) for c, v in sorted(opts.items())}}
    if a.json:
        print(json.dumps(report, indent=1))
        return
    print(f"{'room':<16}{'files':>6}{'lines':>8}")
    for k, v in report["rooms"].items():
        print(f"{k:<16}{v['files']:>6}{v['lines']:>8}")
    print(f"{'total':<16}{report['total']['files']:>6}{report['total']['lines']:>8}")
    print(f"up arrows: {len(ups)}" + "".join(f"\n  {u}" for u in ups))
    print(f"import cycles: {len(loops)}" + "".join(f"\n  {' <-> '.join(c)}" for c in loops))
    if report["unplaced_rooms"]:
        print(f"rooms without a level (not checked): {', '.join(report['unplaced_rooms'])}")
    print(f"environment: {env_lines} lines read it; names: {', '.join(env_names)}")
    print(f"user options: {len(distinct)} distinct over every command; "
          f"{report['options_generate_serve_plan_bench']} in generate, serve, plan and bench *")
    for c, n in report["options_per_command"].items():
        print(f"  moetier {c}: {n}")


if __name__ == "__main__":
    main()
