"""The package's shape: imports point down (DESIGN.md "Rooms"; the levels in layout_rules.py cover
every room), no two modules import each other around a loop, modules stay one concept."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from layout_rules import LEVEL, LEVELS, cycles, unplaced_rooms, up_arrows

ROOT = Path(__file__).parents[1] / "moetier"
# package -> packages it must never import
# quant/ sits below every room: from moetier it imports only itself and moetier.errors
BELOW_ALL = ("quant", "errors")
EVERY_ROOM = tuple(sorted(f"moetier.{p.stem}" for p in ROOT.iterdir()
                          if (p.is_dir() and (p / "__init__.py").exists() or p.suffix == ".py")
                          and p.stem not in BELOW_ALL and p.stem != "__init__"))
FORBIDDEN = {
    "quant": EVERY_ROOM,
    # experts/ and layers/ never import each other but for the MoE block's use of the backend
    # interface (layers/moe.py -> experts/backends.py, test_layers_reach_experts_only_from_the_moe_block)
    "experts": ("moetier.models", "moetier.engine", "moetier.cli", "moetier.server", "moetier.checkpoint",
                "moetier.layers"),
    "layers": ("moetier.models", "moetier.engine", "moetier.cli", "moetier.server", "moetier.checkpoint"),
    "models": ("moetier.engine", "moetier.cli", "moetier.server", "moetier.checkpoint"),
    "checkpoint": ("moetier.engine", "moetier.cli", "moetier.server"),
    "engine": ("moetier.cli", "moetier.server"),
    # dist/ sits beside engine/: it builds ranks from checkpoint/, experts/, layers/ and the engine's
    # runner and records, and the engine reaches it only lazily for a parallel run
    "dist": ("moetier.cli", "moetier.server", "moetier.bench"),
    # spec/: speculative decoding's pure pieces (verify arithmetic, n-gram drafts, the choice of k),
    # called by the engine's step loop; it knows no model, layer, expert backend or engine
    "spec": ("moetier.models", "moetier.engine", "moetier.cli", "moetier.server", "moetier.checkpoint",
             "moetier.layers", "moetier.experts", "moetier.dist", "moetier.plan", "moetier.bench"),
    # eval/ talks to a server over HTTP (a spawned `moetier serve` or any URL), never to an engine
    "eval": ("moetier.engine", "moetier.server", "moetier.models", "moetier.experts", "moetier.layers",
             "moetier.dist"),
}


def imports(path: Path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
            if node.module == "moetier":  # `from moetier import presets` imports moetier.presets
                out |= {f"moetier.{a.name}" for a in node.names}
    return out


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_imports_point_down(package):
    bad = [f"{f.relative_to(ROOT)} imports {m}" for f in sorted((ROOT / package).rglob("*.py"))
           for m in sorted(imports(f)) if _forbidden(m, FORBIDDEN[package])]
    assert not bad, bad


def _forbidden(module: str, rooms: tuple[str, ...]) -> bool:
    return any(module == r or module.startswith(r + ".") for r in rooms)


def test_rooms_match_whole_names():
    # a room forbids itself and its modules, not another name that starts with the same letters
    assert _forbidden("moetier.layers.mlp", ("moetier.layers",))
    assert not _forbidden("moetier.layersx", ("moetier.layers",))


def test_layers_reach_experts_only_from_the_moe_block():
    bad = [f"{f.relative_to(ROOT)} imports {m}" for f in sorted((ROOT / "layers").rglob("*.py"))
           if f.name != "moe.py" for m in sorted(imports(f)) if _forbidden(m, ("moetier.experts",))]
    assert not bad, bad


def test_quant_has_a_room_below_every_other():
    assert "moetier.experts" in EVERY_ROOM and "moetier.layers" in EVERY_ROOM and "moetier.config" in EVERY_ROOM
    assert "moetier.errors" not in EVERY_ROOM and "moetier.quant" not in EVERY_ROOM


def test_modules_stay_small():
    big = [f"{f.relative_to(ROOT)}: {n} lines" for f in sorted(ROOT.rglob("*.py"))
           if (n := len(f.read_text().splitlines())) > 400]
    assert not big, big


def test_every_room_has_a_level():
    assert not unplaced_rooms(ROOT), f"add these rooms to tests/layout_rules.LEVELS: {unplaced_rooms(ROOT)}"
    for room in ("plan", "server", "traces", "bench", "dist", "quant", "config", "cli", "engine", "experts"):
        assert room in LEVEL, room
    assert LEVEL["cli"] == 0 and LEVELS[-1] == ("errors",)


def test_arrows_point_down_between_every_room():
    bad = up_arrows(ROOT)
    assert not bad, bad


def test_no_import_cycles():
    found = cycles(ROOT)
    assert not found, found


def test_the_checks_can_fail(tmp_path):
    # a tree with an up arrow (plan -> cli) and a cycle (a <-> b) is caught by both checks
    pkg = tmp_path / "moetier"
    for d in ("cli", "plan"):
        (pkg / d).mkdir(parents=True)
        (pkg / d / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "cli" / "a.py").write_text("from moetier.cli import b\n")
    (pkg / "cli" / "b.py").write_text("def f():\n    from moetier.cli import a\n")
    (pkg / "plan" / "c.py").write_text("from moetier.cli.a import x\n")
    assert up_arrows(pkg) == ["moetier.plan.c -> moetier.cli.a"]
    assert cycles(pkg) == [["moetier.cli.a", "moetier.cli.b"]]
