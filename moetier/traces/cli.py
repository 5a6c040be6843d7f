"""`moetier trace ...`: synthesize, inspect, simulate and plan from routing traces."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer

from moetier.errors import MoetierError

app = typer.Typer(add_completion=False, no_args_is_help=True, help="Routing traces (docs/traces.md).")


def _fail(e: Exception) -> None:
    typer.echo(f"error: {e}", err=True)
    raise typer.Exit(2)


@app.command()
def synth(
    out: Path = typer.Option(..., "--out", help="Trace file to write."),
    preset: Optional[str] = typer.Option(None, "--preset", help="glm-5.3-like or qwen3-30b-like."),
    experts: Optional[int] = typer.Option(None, "--experts"),
    topk: Optional[int] = typer.Option(None, "--topk"),
    layers: Optional[int] = typer.Option(None, "--layers"),
    tokens: Optional[int] = typer.Option(None, "--tokens"),
    skew: Optional[float] = typer.Option(None, "--skew", help="Zipf exponent of expert popularity (0: uniform)."),
    reuse: Optional[float] = typer.Option(None, "--reuse", help="Chance a choice repeats a recent token's expert."),
    window: Optional[int] = typer.Option(None, "--window", help="Recent tokens that reuse draws from."),
    layer_corr: Optional[float] = typer.Option(None, "--layer-corr", help="Chance a choice follows the layer before."),
    seed: Optional[int] = typer.Option(None, "--seed"),
) -> None:
    """Write a synthetic trace with stated parameters (a preset, overridden by any flag given)."""
    from moetier.traces.format import write_trace
    from moetier.traces.synth import SynthParams, meta_of, preset_params, synthesize

    given = dict(experts=experts, top_k=topk, layers=layers, tokens=tokens, skew=skew, reuse=reuse,
                 window=window, layer_corr=layer_corr, seed=seed)
    try:
        if preset:
            p = preset_params(preset, **given)
        else:
            if experts is None or topk is None or layers is None:
                raise MoetierError("give --preset, or --experts, --topk and --layers")
            p = SynthParams(**{k: v for k, v in given.items() if v is not None}).check()
        write_trace(out, synthesize(p), meta_of(p, preset))
    except MoetierError as e:
        _fail(e)
    typer.echo(f"wrote {out}: {p.tokens} tokens, {p.layers} layers, top-{p.top_k} of {p.experts}")


@app.command()
def stats(
    trace: Path = typer.Argument(..., help="Trace file."),
    slots: list[int] = typer.Option([], "--slots", help="Also LRU hit rate at these slot counts."),
) -> None:
    """Popularity skew (share of experts covering 90% of routing), reuse, LRU hit rates."""
    from moetier.traces.format import read_trace
    from moetier.traces.stats import summary

    try:
        t = read_trace(trace)
    except MoetierError as e:
        _fail(e)
    s = summary(t.ids, t.num_experts, t.top_k, list(slots))
    typer.echo(f"{trace}: {s['tokens']} tokens, {s['layers']} layers, top-{t.top_k} of {t.num_experts} experts")
    typer.echo(f"  experts covering 90% of routing: {s['coverage90']:.1%} (per layer "
               f"{min(s['coverage90_per_layer']):.1%} to {max(s['coverage90_per_layer']):.1%})")
    typer.echo(f"  experts reused from the token before: {s['reuse']:.1%}")
    for n, r in s.get("hit_rate", {}).items():
        typer.echo(f"  LRU hit rate with {n} slots per layer: {r:.1%}")


@app.command()
def simulate(
    trace: Path = typer.Argument(..., help="Trace file."),
    slots: list[int] = typer.Option([], "--slots", help="Slots per layer (repeatable)."),
    slots_file: Optional[Path] = typer.Option(None, "--slots-file", help="Per-layer slots (plan-slots output)."),
    policy: list[str] = typer.Option(["lru", "lfu", "lfru", "belady"], "--policy", help="Policies (repeatable)."),
    preset: str = typer.Option("qwen3-30b-a3b", "--preset", help="Model shape for bytes (row size, dense bytes)."),
    hbm_gbps: Optional[float] = typer.Option(None, "--hbm-GBps", help="HBM bandwidth, GB/s."),
    link_gbps: Optional[float] = typer.Option(None, "--link-GBps", help="Host-to-GPU bandwidth, GB/s."),
    measured: Optional[Path] = typer.Option(None, "--measured",
                                            help="JSON of `moetier bench layer` to read both bandwidths from."),
    plot: Optional[Path] = typer.Option(None, "--plot", help="PNG: hit rate against slots, a line per policy."),
    out: Optional[Path] = typer.Option(None, "--json", help="Write the results as JSON."),
) -> None:
    """Hit rates, bytes moved and predicted decode time per token, per policy."""
    from moetier.traces.format import read_trace
    from moetier.traces.report import physics_for, plot_curves, run_simulation

    try:
        t = read_trace(trace)
        phys = physics_for(preset, t, hbm_gbps, link_gbps, measured)
        per_layer = None
        if slots_file:
            from moetier.experts.placement import read_slots_file

            per_layer = read_slots_file(slots_file)
        if not slots and per_layer is None:
            slots = [t.num_experts // 4, t.num_experts // 2]
        result = run_simulation(t, list(policy), list(slots), per_layer, phys)
        if plot:
            plot_curves(t, list(policy), plot)
    except MoetierError as e:
        _fail(e)
    if out:
        out.write_text(json.dumps(result, indent=2) + "\n")
    typer.echo(result["table"])


@app.command("plan-slots")
def plan_slots(
    trace: Path = typer.Argument(..., help="Trace file."),
    budget: int = typer.Option(..., "--budget", help="Total slots over all MoE layers."),
    policy: str = typer.Option("lru", "--policy"),
    out: Path = typer.Option(..., "--out", help="Slots file for `moetier generate --expert-slots-file`."),
) -> None:
    """Slots per layer that save the most transfer bytes per HBM byte, from simulated curves."""
    from moetier.traces.format import read_trace
    from moetier.traces.slot_plan import plan

    try:
        p = plan(read_trace(trace), budget, policy)
    except MoetierError as e:
        _fail(e)
    p["trace"] = str(trace)
    out.write_text(json.dumps(p, indent=2) + "\n")
    typer.echo(f"wrote {out}: {p['used']} of {budget} slots; link reads per token {p['link_reads_per_token']:.2f} "
               f"(even split of {p['even_slots']} per layer: {p['even_link_reads_per_token']:.2f})")
    typer.echo("slots per layer: " + ", ".join(f"{k}:{v}" for k, v in p["slots"].items()))


@app.command()
def calibrate(out: Optional[Path] = typer.Option(None, "--json")) -> None:
    """Fit the synthetic presets to the published figures and print the parameters."""
    from moetier.traces.synth import calibrate as fit

    result = fit()
    if out:
        out.write_text(json.dumps(result, indent=2) + "\n")
    typer.echo(json.dumps(result, indent=2))
