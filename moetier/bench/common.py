"""Timing and bookkeeping shared by the benchmarks: event-timed CUDA graphs, link measurements,
and the JSON record (machine, commit and dirty flag, the command as run) every result carries."""

from __future__ import annotations

import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import torch

GB = 1e9
GiB = 2**30


def machine() -> dict:
    info = {"host": platform.node(), "python": platform.python_version(), "torch": torch.__version__,
            "cpu_count": os.cpu_count()}
    try:
        import triton
        info["triton"] = triton.__version__
    except ImportError:
        pass
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        info.update(gpu=p.name, sms=p.multi_processor_count, gpu_mem_gib=round(p.total_memory / GiB, 1))
    return info


PACKAGE = Path(__file__).parents[1]  # the moetier package directory
BUILD_INFO = PACKAGE / "_build_info.json"  # scripts/stamp_version.py writes it


def project_root(package: Path = PACKAGE) -> Path | None:
    """The git toplevel of this package's directory when it is the project's own checkout (its
    pyproject.toml names moetier); None for a copy that is not (an archive unpacked inside another
    repository, a wheel): that repository's HEAD says nothing about this code."""
    try:
        out = subprocess.run(["git", "rev-parse", "--show-toplevel"], capture_output=True, text=True,
                             cwd=package)
    except OSError:
        return None
    root = Path(out.stdout.strip()) if out.returncode == 0 and out.stdout.strip() else None
    if root is None or root.resolve() != package.resolve().parent:
        return None
    try:
        import tomllib

        name = tomllib.loads((root / "pyproject.toml").read_text())["project"]["name"]
    except (OSError, KeyError, ValueError):
        return None
    return root if name == "moetier" else None


def git_state(root: Path) -> dict:
    """{"commit", "dirty", "dirty_paths"} of a checkout: HEAD, and whether `git status --porcelain`
    lists anything (the first 20 paths it lists)."""
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], capture_output=True, text=True, cwd=root, check=True).stdout

    changed = [line[3:] for line in git("status", "--porcelain").splitlines() if line.strip()]
    return {"commit": git("rev-parse", "HEAD").strip(), "dirty": bool(changed), "dirty_paths": changed[:20]}


def version(package: Path = PACKAGE) -> str:
    """The package version: this tree's pyproject.toml where it sits beside the package (a checkout or
    an unpacked archive), else the installed distribution's."""
    import tomllib
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as installed

    try:
        project = tomllib.loads((package.parent / "pyproject.toml").read_text())["project"]
        if project["name"] == "moetier":
            return project["version"]
    except (OSError, KeyError, ValueError):
        pass
    try:
        return installed("moetier")
    except PackageNotFoundError:
        return "unknown"


def provenance(package: Path = PACKAGE) -> dict:
    """What code ran: the package version, the commit and whether the tree was dirty. From git when
    the package sits in the project's own checkout (source "git"), else from the stamp written when
    the tree was archived or installed (source "stamp"), else unknown (source "none")."""
    out = {"version": version(package)}
    try:
        stamp = json.loads((package / BUILD_INFO.name).read_text())
        stamped = {**out, "commit": stamp["commit"], "dirty": stamp["dirty"],
                   "dirty_paths": stamp.get("dirty_paths", []), "commit_source": "stamp"}
    except (OSError, KeyError, ValueError):
        stamped = None
    root = project_root(package)
    if root is not None:
        try:
            state = git_state(root)
            if stamped is None or not stamp_is_newer(root, state["commit"], stamped["commit"]):
                return {**out, **state, "commit_source": "git"}
        except (OSError, subprocess.CalledProcessError):
            pass
    return stamped or {**out, "commit": "unknown", "dirty": None, "commit_source": "none"}


def stamp_is_newer(root: Path, head: str, stamp: str) -> bool:
    """Whether a stamp names newer code than the checkout's git: its commit is unknown to this git (a
    tree shipped with an older copy of .git) or descends from HEAD. A stamp left behind in a checkout
    that moved on (its commit an ancestor of HEAD, or HEAD itself) is not."""
    if stamp == head:
        return False
    known = subprocess.run(["git", "cat-file", "-e", f"{stamp}^{{commit}}"], cwd=root, capture_output=True)
    if known.returncode != 0:
        return True
    return subprocess.run(["git", "merge-base", "--is-ancestor", head, stamp], cwd=root,
                          capture_output=True).returncode == 0


def commit() -> str:
    return provenance()["commit"]


def command() -> tuple[str, list[str]]:
    """The command line as it was run -> (a readable line, the exact argv). The moetier CLI (its
    console script) reads `moetier ...`; anything else `python ...` with the interpreter's own
    arguments (`python -m pytest ...`, `python scripts/x.py ...`)."""
    argv = list(getattr(sys, "orig_argv", None) or [sys.executable, *sys.argv])
    if Path(sys.argv[0]).name == "moetier":
        return shlex.join(["moetier", *sys.argv[1:]]), argv
    return shlex.join(["python", *argv[1:]]), argv


def record(kind: str, results: dict) -> dict:
    line, argv = command()
    prov = provenance()
    return {"benchmark": kind, "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "machine": machine(),
            "commit": prov["commit"], "dirty": prov["dirty"], "provenance": prov, "command": line, "argv": argv,
            **results}


def trace_info(path: str | Path) -> dict:
    """What a replayed trace was, so a record can be rerun without the file it named: its path, bytes
    and sha256; for a synthetic trace its parameters and the `moetier trace synth` command that makes
    it again (synthesis is deterministic in its parameters)."""
    import hashlib

    from moetier.traces.format import read_trace

    data = Path(path).read_bytes()
    meta = read_trace(path).meta
    out = {"path": str(path), "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest(),
           "model": meta.get("model"), "source": meta.get("source")}
    synth = meta.get("synth")
    if synth:
        flags = {"experts": "experts", "top_k": "topk", "layers": "layers", "tokens": "tokens", "skew": "skew",
                 "reuse": "reuse", "window": "window", "layer_corr": "layer-corr", "seed": "seed"}
        out["synth"] = synth
        out["synth_command"] = shlex.join(["moetier", "trace", "synth", "--out", Path(path).name,
                                           *(f for k, flag in flags.items() if k in synth
                                             for f in (f"--{flag}", str(synth[k])))])
    return out


def write_json(path: str | Path, data: dict) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(data, indent=2) + "\n")


def time_graph(build: Callable[[], None], reset: Callable[[], None] | None = None, reps: int = 7) -> float:
    """Capture build() in a CUDA graph; median milliseconds of one replay, reset() before each (untimed)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up: compile kernels, allocate buffers
        if reset:
            reset()
        build()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    if reset:
        reset()
    with torch.cuda.graph(graph):
        build()
    times = []
    for _ in range(reps + 1):
        if reset:
            reset()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times[1:])


def time_eager(fn: Callable[[], None], reps: int = 7, reset: Callable[[], None] | None = None) -> float:
    """Median milliseconds of fn() on the current stream, reset() before each run (untimed)."""
    if reset:
        reset()
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        if reset:
            reset()
            torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def links(nbytes: int = GiB, row_bytes: int | None = None) -> dict[str, float]:
    """Host-to-device over the copy engine, device-to-device (read + write) in GB/s."""
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    host.random_(0, 255)
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dev2 = torch.empty_like(dev)
    out = {
        "h2d_copy_engine_GBps": nbytes / GB / (time_eager(lambda: dev.copy_(host, non_blocking=True)) / 1e3),
        "d2d_GBps": 2 * nbytes / GB / (time_eager(lambda: dev2.copy_(dev)) / 1e3),
    }
    if row_bytes:
        n = max(1, nbytes // row_bytes)

        def rows() -> None:
            for i in range(n):
                dev[i * row_bytes:(i + 1) * row_bytes].copy_(host[i * row_bytes:(i + 1) * row_bytes], non_blocking=True)
        out["h2d_copy_engine_row_GBps"] = n * row_bytes / GB / (time_eager(rows) / 1e3)
    return out


def batch_axes(batches: list[int]):
    """A figure with one panel per batch size (matplotlib's Agg backend: no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(batches), figsize=(6 * len(batches), 4.5), squeeze=False)
    return fig, axes[0]


def finish_axis(ax, xlabel: str, ylabel: str, title: str) -> None:
    """Log-scale y, labels, grid and legend of one panel of batch_axes()."""
    ax.set_yscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()


def save_figure(fig, title: str, path) -> None:
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
