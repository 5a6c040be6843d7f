"""Every name a script under scripts/ takes from moetier exists: `from moetier.x import y` and, where
a script binds a moetier module to a name, every `name.attr` it reads. Scripts run on the GPU machine
only, where a name moved by a refactor fails minutes into a paid call (profile_glm5_next.py read
bench.decode.replay_ms after it moved to bench/decode_steps.py); this finds that on the CPU, without
running them."""

from __future__ import annotations

import ast
import importlib
import importlib.util
from pathlib import Path

import pytest

SCRIPTS = sorted((Path(__file__).resolve().parents[1] / "scripts").glob("*.py"))


def moetier_refs(tree: ast.Module) -> tuple[list[tuple[str, str]], dict[str, str]]:
    """(module, name) of every `from moetier... import name`, and the local names bound to moetier
    modules (by `import moetier.x as m` or by a from-import of a submodule) -> module path."""
    names, modules = [], {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "moetier":
            for a in node.names:
                names.append((node.module, a.name))
                if is_package(node.module) and importlib.util.find_spec(f"{node.module}.{a.name}"):
                    modules[a.asname or a.name] = f"{node.module}.{a.name}"
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == "moetier" and a.asname:
                    modules[a.asname] = a.name
    return names, modules


def is_package(module: str) -> bool:
    spec = importlib.util.find_spec(module)
    return spec is not None and spec.submodule_search_locations is not None


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_script_names_exist(script):
    tree = ast.parse(script.read_text())
    names, modules = moetier_refs(tree)
    missing = []
    for module, name in names:
        mod = importlib.import_module(module)
        if not hasattr(mod, name) and not (is_package(module) and importlib.util.find_spec(f"{module}.{name}")):
            missing.append(f"from {module} import {name}")
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in modules:
            mod = importlib.import_module(modules[node.value.id])
            if not hasattr(mod, node.attr):
                missing.append(f"{node.value.id}.{node.attr} ({modules[node.value.id]} has no {node.attr})")
    assert not missing, f"{script.name} reads names moetier does not have: {missing}"


def test_the_check_sees_a_moved_name():
    # the failure this file exists for: a submodule imported by name, an attribute it no longer has
    tree = ast.parse("from moetier.bench import decode\nx = decode.replay_ms\n")
    names, modules = moetier_refs(tree)
    assert modules == {"decode": "moetier.bench.decode"}
    assert not hasattr(importlib.import_module(modules["decode"]), "replay_ms")
