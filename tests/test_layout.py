"""The package's shape: imports point down (DESIGN.md "Rooms"), modules stay one concept."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1] / "moetier"
# package -> packages it must never import
FORBIDDEN = {
    "experts": ("moetier.models", "moetier.engine", "moetier.cli", "moetier.server", "moetier.checkpoint"),
    "layers": ("moetier.models", "moetier.engine", "moetier.cli", "moetier.server", "moetier.checkpoint"),
    "models": ("moetier.engine", "moetier.cli", "moetier.server", "moetier.checkpoint"),
    "checkpoint": ("moetier.engine", "moetier.cli", "moetier.server"),
    "engine": ("moetier.cli", "moetier.server"),
    # dist/ sits beside engine/: it builds ranks from checkpoint/, experts/, layers/ and the engine's
    # runner and records, and the engine reaches it only lazily for a parallel run
    "dist": ("moetier.cli", "moetier.server", "moetier.bench"),
}


def imports(path: Path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
    return out


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_imports_point_down(package):
    bad = [f"{f.relative_to(ROOT)} imports {m}" for f in sorted((ROOT / package).rglob("*.py"))
           for m in sorted(imports(f)) if m.startswith(FORBIDDEN[package])]
    assert not bad, bad


def test_modules_stay_small():
    big = [f"{f.relative_to(ROOT)}: {n} lines" for f in sorted(ROOT.rglob("*.py"))
           if (n := len(f.read_text().splitlines())) > 400]
    assert not big, big
