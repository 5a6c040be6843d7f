"""The package's layering, as data, and the import graph it is checked against: tests/test_layout.py
asserts it, scripts/layout_report.py prints it (sizes per room, up arrows, cycles) for any tree.

A room is a top-level package or module of moetier/. LEVELS lists them from the top (the command
line) down; a module may import rooms on lower levels only, and rooms on its own level only where
SIBLINGS says so. Imports inside functions count: a lazy import is still an arrow."""

from __future__ import annotations

import ast
from pathlib import Path

LEVELS = (
    ("cli",),                      # every command and the user options
    ("server", "bench", "eval"),   # the HTTP server; the benchmarks; lm-eval against a server
    ("engine", "dist"),            # LLM, scheduler, runner; one process per rank
    ("plan",),                     # memory plan, sizing, preflight, audit
    ("traces",),                   # routing traces, simulation, slot plans
    ("checkpoint",),               # safetensors, loader, writer
    ("tokenizer",),
    ("presets",),                  # named shapes
    ("models",),                   # one file per family, the registry
    ("layers",),                   # attention, norms, the MoE block
    ("config",),                   # ModelConfig
    ("experts",),                  # expert backends, caches, kernels
    ("spec",),                     # speculative decoding's pure pieces (verify, n-gram, choice of k)
    ("activation", "parallel", "sampling_params", "default_model", "progress"),
    ("quant",),                    # weight formats
    ("errors",),
)
# dist/ builds ranks on the engine's runner and records; the engine reaches dist/ lazily for a
# parallel run: the one pair of rooms that may import each other
SIBLINGS = {("engine", "dist"), ("dist", "engine")}
LEVEL = {room: i for i, rooms in enumerate(LEVELS) for room in rooms}


def module_name(root: Path, path: Path) -> str:
    parts = path.relative_to(root.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules(root: Path) -> dict[str, Path]:
    return {module_name(root, f): f for f in sorted(root.rglob("*.py"))}


def imports(path: Path, known: dict[str, Path] | None = None) -> set[str]:
    """Every moetier module this file imports, at the top or inside a function. `from a import b`
    names a.b when that is a module (known), else a."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for a in node.names:
                sub = f"{node.module}.{a.name}"
                out.add(sub if known is not None and sub in known else node.module)
    return {m for m in out if m == "moetier" or m.startswith("moetier.")}


def room(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def graph(root: Path) -> dict[str, set[str]]:
    known = modules(root)
    return {m: {t for t in imports(f, known) if t in known and t != m} for m, f in known.items()}


def up_arrows(root: Path) -> list[str]:
    """'module -> module' for every import that runs up (or sideways between rooms not SIBLINGS)."""
    bad = []
    for m, targets in sorted(graph(root).items()):
        src = room(m)
        if src not in LEVEL:  # moetier/__init__.py: the package's exports sit above every room
            continue
        for t in sorted(targets):
            dst = room(t)
            if dst == src or dst not in LEVEL:
                continue
            if LEVEL[dst] < LEVEL[src] or (LEVEL[dst] == LEVEL[src] and (src, dst) not in SIBLINGS):
                bad.append(f"{m} -> {t}")
    return bad


def unplaced_rooms(root: Path) -> list[str]:
    rooms = {room(m) for m in modules(root)} - {""}
    return sorted(rooms - set(LEVEL))


def cycles(root: Path) -> list[list[str]]:
    """Groups of modules that import each other, directly or around a loop (Tarjan's strongly
    connected components of more than one module)."""
    g = graph(root)
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in g[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                out.append(sorted(group))

    import sys

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))
    for v in sorted(g):
        if v not in index:
            visit(v)
    return sorted(out)


def sizes(root: Path) -> dict[str, tuple[int, int]]:
    """room -> (files, lines) of its .py files."""
    out: dict[str, list[int]] = {}
    for m, f in modules(root).items():
        key = room(m) or "__init__"
        files_lines = out.setdefault(key, [0, 0])
        files_lines[0] += 1
        files_lines[1] += len(f.read_text().splitlines())
    return {k: (v[0], v[1]) for k, v in sorted(out.items())}
