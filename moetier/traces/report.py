"""Simulation reports: per-policy tables with bytes and predicted decode time, and the PNG curve."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

import numpy as np

from moetier.errors import MoetierError
from moetier.presets import MOE_SHAPES
from moetier.traces.format import Trace
from moetier.traces.slot_plan import grid_for
from moetier.traces.simulate import Physics, simulate_many

# Measured HBM and link rates (docs/measured-defaults.md), used when nothing else is given.
DEFAULT_HBM_GBPS, DEFAULT_LINK_GBPS = 4165.0, 55.4


def physics_for(preset: str, trace: Trace, hbm: float | None, link: float | None, measured: Path | None) -> Physics:
    if measured is not None:
        try:
            data = json.loads(Path(measured).read_text())
            links = next(iter(data["shapes"].values()))["links"]
            hbm, link = hbm or links["d2d_GBps"], link or links["h2d_copy_engine_GBps"]
        except (OSError, ValueError, KeyError, StopIteration) as e:
            raise MoetierError(f"--measured {measured}: not a `moetier bench layer` JSON ({e})") from None
    dense, layers = 0, len(trace.layers)
    if preset in MOE_SHAPES:  # the experts alone: no dense bytes known
        h, i = MOE_SHAPES[preset].hidden, MOE_SHAPES[preset].inter
    else:
        from moetier.presets import preset as model_preset

        c = model_preset(preset)
        h, i, layers = c.hidden_size, c.moe_intermediate_size, len(c.moe_layers)
        routed = layers * c.num_experts * 3 * h * i
        dense = (c.num_parameters() - routed) * 2  # bf16 weights read every token (LM head included)
    return Physics(hbm or DEFAULT_HBM_GBPS, link or DEFAULT_LINK_GBPS, 3 * h * i * 2, layers, dense)


def run_simulation(trace: Trace, policies: list[str], slots: list[int], per_layer: dict[int, int] | None,
                   phys: Physics, progress: Callable[[int], None] | None = None) -> dict:
    """The table: per slot count (or the per-layer file) and policy, every traced layer simulated.
    `progress(tokens done)` is passed to simulate_many (one pass over the trace)."""
    layers, n = trace.layers, trace.num_tokens
    configs = [("per-layer file", per_layer)] if per_layer else [(str(s), {layer: s for layer in layers})
                                                                    for s in slots]
    jobs = [(i, plan[layer], pol) for _, plan in configs for pol in policies for i, layer in enumerate(layers)]
    counts = iter(simulate_many(trace.ids, jobs, trace.num_experts, trace.top_k, progress))
    rows, lines = [], []
    lines.append(f"{'policy':<8}{'slots':>16}{'hit rate':>10}{'link MB/token':>15}{'ms/token':>10}"
                 f"{'tok/s':>10}   (row {phys.row_bytes / 1e6:.2f} MB, HBM {phys.hbm_GBps:.0f} GB/s, "
                 f"link {phys.link_GBps:.1f} GB/s, {phys.moe_layers} MoE layers from {len(layers)} traced)")
    for name, plan in configs:
        for pol in policies:
            per = [next(counts) for _ in layers]
            hits = sum(c.hits for c in per)
            misses = sum(c.misses for c in per)
            over = sum(c.overflow for c in per)
            rate = hits / max(1, hits + misses + over)
            per_layer = len(layers) * n
            ms = phys.ms_per_token(trace.top_k, misses / per_layer, over / per_layer)
            link_mb = (misses + over) / per_layer * phys.moe_layers * phys.row_bytes / 1e6
            rows.append({"policy": pol, "slots": name, "hit_rate": rate, "link_MB_per_token": link_mb,
                         "ms_per_token": ms, "per_layer_hit_rate": [c.hit_rate for c in per]})
            lines.append(f"{pol:<8}{name:>16}{rate:>10.1%}{link_mb:>15.1f}{ms:>10.3f}{1e3 / ms:>10.1f}"
                         f"   per layer: {' '.join(f'{c.hit_rate:.0%}' for c in per)}")
    return {"trace_tokens": n, "layers": layers, "physics": phys.__dict__, "rows": rows, "table": "\n".join(lines)}


def curves(trace: Trace, policies: list[str], progress: Callable[[int], None] | None = None
           ) -> tuple[list[int], dict[str, list[float]]]:
    """Mean hit rate over the traced layers at each grid point, per policy (one pass over the trace)."""
    grid = grid_for(trace.num_experts, trace.top_k)
    layers = range(trace.ids.shape[1])
    jobs = [(i, s, pol) for pol in policies for s in grid for i in layers]
    counts = iter(simulate_many(trace.ids, jobs, trace.num_experts, trace.top_k, progress))
    out = {}
    for pol in policies:
        out[pol] = [float(np.mean([next(counts).hit_rate for _ in layers])) for _ in grid]
    return grid, out


def plot_curves(trace: Trace, policies: list[str], path: Path, title: str | None = None,
                progress: Callable[[int], None] | None = None) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise MoetierError("--plot needs matplotlib: pip install 'moetier[plot]'") from None
    grid, hit = curves(trace, policies, progress)
    fig, ax = plt.subplots(figsize=(6.4, 4.2), dpi=120)
    for pol, rates in hit.items():
        ax.plot(grid, [100 * r for r in rates], marker="o", ms=3, label=pol)
    ax.set_xlabel(f"slots per layer (of {trace.num_experts} experts)")
    ax.set_ylabel("hit rate (%)")
    ax.set_ylim(0, 100)
    ax.grid(alpha=0.3)
    ax.legend()
    ax.set_title(title or f"{trace.meta.get('model', 'trace')}: {trace.num_tokens} tokens, top-{trace.top_k}")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
