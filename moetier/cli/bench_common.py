"""The `moetier bench` group and what its commands share: the argument checks (dtypes, budgets),
the optional-dependency and GPU checks, and the memory plan of the benchmark rows."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import typer

from moetier.cli import options as opt
from moetier.errors import MoetierError
from moetier.quant.registry import PACKED4

app = typer.Typer(add_completion=False, no_args_is_help=True, rich_markup_mode=None, help="Benchmarks.")

BENCH_EXTRA = "pip install 'moetier[bench]'"
# The committed trace of a checkout (an editable install); a wheel has none and asks for --trace.
REPO_TRACE = Path(__file__).parents[2] / "data" / "traces" / "qwen3-30b-like.mtrace"


def need_cuda(what: str) -> None:
    import torch

    if not torch.cuda.is_available():
        opt.fail(f"bench {what} needs a CUDA GPU")


def need_gpus(n: int, what: str) -> None:
    import torch

    if torch.cuda.device_count() < n:
        opt.fail(f"{what} needs {n} GPUs (one per rank) but {torch.cuda.device_count()} are visible")


def need_modules(*names: str, why: str) -> None:
    missing = [n for n in names if importlib.util.find_spec(n) is None]
    if missing:
        raise MoetierError(f"{why} needs {', '.join(missing)}, which this install lacks: {BENCH_EXTRA}")


EXPERT_DTYPES = ("bf16", "fp8", *PACKED4)  # nvfp4, int4...: 4-bit weight-only experts (quant/registry.py)
# <format>-dense: the experts and the dense projections in that format (--dense-weights keep)
WEIGHT_DTYPES = (*EXPERT_DTYPES, *(f"{q}-dense" for q in EXPERT_DTYPES[1:]))


def parse_dtypes(text: str, allowed: tuple[str, ...] = EXPERT_DTYPES) -> list[str]:
    """'bf16,fp8' -> ['bf16', 'fp8']: the weight formats whose rows run side by side."""
    names = [d.strip() for d in text.split(",") if d.strip()]
    bad = [d for d in names if d not in allowed]
    if bad or not names or len(set(names)) != len(names):
        dense = "; <format>-dense: the dense projections in that format too" if "fp8-dense" in allowed else ""
        raise MoetierError(f"--dtype {text!r}: give a comma-separated list of {', '.join(allowed)} (fp8: "
                           f"block-scaled e4m3 experts; nvfp4, int4...: 4-bit weight-only experts; dense "
                           f"weights bf16{dense})")
    return names


def preflight_rows(cfg, rows: list[tuple[str, float]], dtypes: tuple[str, ...] = ("bf16",),
                   ring: tuple[int, int] | None = None, pinned=None, gpu_memory: str | None = None,
                   host_memory: str | None = None, slots_per_layer: dict[int, int] | None = None,
                   **engine) -> None:
    """The memory plan of every row of every weight format in `dtypes` (WEIGHT_DTYPES) before the random
    weights are made (plan/preflight.bench_preflight): each format is planned with its own expert rows
    (an NVFP4 row is about a quarter of a bf16 one) and, for <format>-dense, its dense weights kept.
    gpu_memory, host_memory: budgets instead of this machine's (the tests'); slots_per_layer: a slots
    file's row too."""
    from moetier.checkpoint.random_bed import quantized
    from moetier.engine.config import EngineConfig
    from moetier.plan.preflight import bench_preflight

    for d in dtypes:
        fmt = None if d == "bf16" else d.removesuffix("-dense")
        config = EngineConfig(**engine, **({"dense_weights": "keep"} if d.endswith("-dense") else {}))
        try:
            bench_preflight(quantized(cfg, fmt), rows, config, gpu_memory, host_memory, ring=ring, pinned=pinned,
                            slots_per_layer=slots_per_layer)
        except MoetierError as e:
            opt.fail(f"--dtype {d}: {e}" if dtypes != ("bf16",) else e)


def parse_budget(text: str) -> float:
    """'50%' or '0.5' -> 0.5, in (0, 1]."""
    try:
        value = float(text[:-1]) / 100 if text.endswith("%") else float(text)
    except ValueError:
        raise MoetierError(f"--expert-budget {text!r}: give a share like 50% or 0.5") from None
    if not 0 < value <= 1:
        raise MoetierError(f"--expert-budget {text!r}: must be above 0% and at most 100%")
    return value
