"""`moetier trace ...`: synthesize, inspect, simulate and plan from routing traces.

Bad input is refused before any work, in one line `error: <option> ...: <what to give instead>` and
exit code 2: numbers through the parsers below (click would print a usage box), ranges that depend on
the trace once it is read, paths by _input_file and _output_file (an output is tried before a
simulation that may take a while, not after).
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Callable, Optional

import typer

from moetier.errors import MoetierError

app = typer.Typer(add_completion=False, no_args_is_help=True, rich_markup_mode=None,
                  help="Routing traces (docs/traces.md).")

POLICIES = ("lru", "lfu", "lfru", "belady")


def _fail(e: Exception | str) -> None:
    typer.echo(f"error: {e}", err=True)
    raise typer.Exit(2)


def _whole(option: str) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            return int(text)
        except ValueError:
            _fail(f"{option} {text!r} is not a whole number; give one such as {option} 8")
    return parse


def _real(option: str) -> Callable[[str], float]:
    def parse(text: str) -> float:
        try:
            x = float(text)
        except ValueError:
            x = math.nan
        if not math.isfinite(x):
            _fail(f"{option} {text!r} is not a finite number; give one such as {option} 1.5")
        return x
    return parse


def _check(ok: bool, message: str) -> None:
    if not ok:
        _fail(message)


def _input_file(path: Path, option: str, what: str, hint: str) -> Path:
    _check(path.exists(), f"{option} {path}: no such file; give an existing {what} ({hint})")
    _check(not path.is_dir(), f"{option} {path} is a folder; give a {what} ({hint})")
    _check(os.access(path, os.R_OK), f"{option} {path}: cannot read it (permission denied); give a readable {what}")
    return path


def _output_file(path: Path | None, option: str, example: str) -> Path | None:
    """Fails unless `path` can be written: tried now (a file made only to try is removed again)."""
    if path is None:
        return None
    _check(not path.is_dir(), f"{option} {path} is a folder; give a file name, such as {path / example}")
    parent = path.parent
    _check(parent.is_dir(), f"{option} {path}: {parent} is not an existing folder; create it or write elsewhere")
    existed = path.exists()
    try:
        open(path, "ab").close()
        if not existed:
            path.unlink()
    except OSError as e:
        _fail(f"{option} {path}: cannot write there ({e.strerror}); give a path in a writable folder")
    return path


def _write(path: Path, text: str, option: str) -> None:
    try:
        path.write_text(text)
    except OSError as e:
        _fail(f"{option} {path}: cannot write it ({e.strerror}); give a path in a writable folder")


def _read_trace(path: Path):
    from moetier.traces.format import read_trace

    _input_file(path, "TRACE", "trace file", "`moetier trace synth` or `moetier generate --record-trace` makes one")
    try:
        t = read_trace(path)
    except MoetierError as e:
        _fail(f"TRACE {e}; give a file written by `moetier trace synth` or `moetier generate --record-trace`")
    except (ValueError, KeyError, TypeError, IndexError) as e:  # a damaged header (struct.error is a ValueError)
        _fail(f"TRACE {path}: not a readable moetier trace ({type(e).__name__}: {e}); record or synthesize it again")
    _check(t.num_tokens > 0, f"TRACE {path} holds no tokens; record or synthesize a trace with some")
    return t


def _check_slots(slots: list[int], experts: int, option: str = "--slots") -> None:
    for s in slots:
        _check(1 <= s <= experts, f"{option} {s}: slots per layer must be 1 to {experts} (the trace's experts)")


def _check_policy(policies: list[str], option: str = "--policy") -> None:
    for p in policies:
        _check(p in POLICIES, f"{option} {p!r} is not a cache policy; choose one of: {', '.join(POLICIES)}")


def _progress():
    """A progress bar on stderr (stdout carries the table), only on a terminal."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

    console = Console(stderr=True)
    return Progress("[progress.description]{task.description}", BarColumn(), MofNCompleteColumn(),
                    "tokens", TimeElapsedColumn(), console=console, transient=True, disable=not console.is_terminal)


@app.command()
def synth(
    out: Path = typer.Option(..., "--out", help="Trace file to write."),
    preset: Optional[str] = typer.Option(None, "--preset", help="glm-5.3-like or qwen3-30b-like."),
    experts: Optional[int] = typer.Option(None, "--experts", parser=_whole("--experts"), metavar="<int>"),
    topk: Optional[int] = typer.Option(None, "--topk", parser=_whole("--topk"), metavar="<int>"),
    layers: Optional[int] = typer.Option(None, "--layers", parser=_whole("--layers"), metavar="<int>"),
    tokens: Optional[int] = typer.Option(None, "--tokens", parser=_whole("--tokens"), metavar="<int>"),
    skew: Optional[float] = typer.Option(None, "--skew", parser=_real("--skew"), metavar="<float>",
                                         help="Zipf exponent of expert popularity (0: uniform)."),
    reuse: Optional[float] = typer.Option(None, "--reuse", parser=_real("--reuse"), metavar="<float>",
                                          help="Chance a choice repeats a recent token's expert."),
    window: Optional[int] = typer.Option(None, "--window", parser=_whole("--window"), metavar="<int>",
                                         help="Recent tokens that reuse draws from."),
    layer_corr: Optional[float] = typer.Option(None, "--layer-corr", parser=_real("--layer-corr"), metavar="<float>",
                                               help="Chance a choice follows the layer before."),
    seed: Optional[int] = typer.Option(None, "--seed", parser=_whole("--seed"), metavar="<int>"),
) -> None:
    """Write a synthetic trace with stated parameters (a preset, overridden by any flag given)."""
    from moetier.traces.format import write_trace
    from moetier.traces.synth import PRESETS, SynthParams, meta_of, preset_params, synthesize

    _check(preset is None or preset in PRESETS, f"--preset {preset!r} is not a trace preset; choose one of: "
                                                f"{', '.join(PRESETS)}")
    _check(preset is not None or None not in (experts, topk, layers),
           "give --preset, or --experts, --topk and --layers")
    base = PRESETS[preset] if preset else {}
    num_experts = experts if experts is not None else base["experts"]
    # NOTE: traces store expert ids as uint16
    _check(1 <= num_experts <= 65535, f"--experts {num_experts}: must be 1 to 65535 (trace files store expert ids "
                                      "in 16 bits)")
    top_k = topk if topk is not None else base["top_k"]
    which = "" if topk is not None else " (the preset's)"
    _check(1 <= top_k <= num_experts, f"--topk {top_k}{which}: must be 1 to {num_experts} (the experts)")
    for option, value in (("--layers", layers), ("--tokens", tokens), ("--window", window)):
        _check(value is None or value >= 1, f"{option} {value}: must be 1 or more")
    for option, value in (("--reuse", reuse), ("--layer-corr", layer_corr)):
        _check(value is None or 0 <= value <= 1, f"{option} {value}: a probability, give 0 to 1")
    r = reuse if reuse is not None else base.get("reuse", 0.0)
    c = layer_corr if layer_corr is not None else base.get("layer_corr", 0.0)
    _check(r + c <= 1, f"--reuse {r} + --layer-corr {c} is more than 1; lower one of them")
    _check(seed is None or seed >= 0, f"--seed {seed}: give 0 or more (a negative seed repeats its absolute value's)")
    s = skew if skew is not None else base.get("skew", 1.0)
    _check(s >= 0, f"--skew {s}: must be 0 (uniform) or more")
    # A token's k-th distinct expert is drawn from popularity until it differs from the k-1 taken: if
    # the least popular experts almost never come up, that loop runs for hours (or forever).
    w = [1.0 / (rank + 1) ** s for rank in range(num_experts)]
    tail = sum(w[top_k - 1:]) / sum(w)
    _check(tail >= 1e-3, f"--skew {s}: a token's {top_k}th distinct expert would take about "
                         f"{1 / max(tail, 1e-300):.0e} draws; give a smaller --skew or --topk (the presets use skew "
                         "0.6 and 1.473)")
    _output_file(out, "--out", "trace.mtrace")
    given = dict(experts=experts, top_k=topk, layers=layers, tokens=tokens, skew=skew, reuse=reuse,
                 window=window, layer_corr=layer_corr, seed=seed)
    try:
        if preset:
            p = preset_params(preset, **given)
        else:
            p = SynthParams(**{k: v for k, v in given.items() if v is not None}).check()
        _check_synth_size(p)
        write_trace(out, synthesize(p), meta_of(p, preset))
    except MoetierError as e:
        _fail(e)
    except OSError as e:
        _fail(f"--out {out}: cannot write it ({e.strerror}); give a path in a writable folder")
    typer.echo(f"wrote {out}: {p.tokens} tokens, {p.layers} layers, top-{p.top_k} of {p.experts}")


def _check_synth_size(p) -> None:
    """Sizes that cannot be made are refused before anything is allocated: a layer count beyond any
    model's, more tokens than a trace record holds, or ids that would not fit the host's memory."""
    from moetier.plan.machine import host_available
    from moetier.plan.units import gib
    from moetier.traces.synth import MAX_LAYERS, MAX_TOKENS, synth_bytes

    _check(p.layers <= MAX_LAYERS, f"--layers {p.layers:,}: at most {MAX_LAYERS:,} (more than any model has; each "
                                   "layer is drawn token by token)")
    need = synth_bytes(p)
    avail, source = host_available()
    _check(need <= avail, f"--tokens {p.tokens:,} x --layers {p.layers} x top-{p.top_k} needs {gib(need)} of memory "
                          f"({need:,} bytes) but {source} has {gib(avail)}; give fewer --tokens or --layers")
    _check(p.tokens <= MAX_TOKENS, f"--tokens {p.tokens:,}: at most {MAX_TOKENS:,} (a trace record counts tokens "
                                   "in 32 bits)")


@app.command()
def stats(
    trace: Path = typer.Argument(..., help="Trace file."),
    slots: list[int] = typer.Option([], "--slots", parser=_whole("--slots"), metavar="<int>",
                                    help="Also LRU hit rate at these slot counts."),
) -> None:
    """Popularity skew (share of experts covering 90% of routing), reuse, LRU hit rates."""
    from moetier.traces.stats import summary

    t = _read_trace(trace)
    _check_slots(list(slots), t.num_experts)
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
    slots: list[int] = typer.Option([], "--slots", parser=_whole("--slots"), metavar="<int>",
                                    help="Slots per layer (repeatable)."),
    slots_file: Optional[Path] = typer.Option(None, "--slots-file", help="Per-layer slots (plan-slots output)."),
    policy: list[str] = typer.Option(list(POLICIES), "--policy", help="Policies (repeatable)."),
    preset: str = typer.Option("qwen3-30b-a3b", "--preset", help="Model shape for bytes (row size, dense bytes)."),
    hbm_gbps: Optional[float] = typer.Option(None, "--hbm-GBps", parser=_real("--hbm-GBps"), metavar="<float>",
                                             help="HBM bandwidth, GB/s."),
    link_gbps: Optional[float] = typer.Option(None, "--link-GBps", parser=_real("--link-GBps"), metavar="<float>",
                                              help="Host-to-GPU bandwidth, GB/s."),
    measured: Optional[Path] = typer.Option(None, "--measured",
                                            help="JSON of `moetier bench layer` to read both bandwidths from."),
    plot: Optional[Path] = typer.Option(None, "--plot", help="PNG: hit rate against slots, a line per policy."),
    out: Optional[Path] = typer.Option(None, "--json", help="Write the results as JSON."),
) -> None:
    """Hit rates, bytes moved and predicted decode time per token, per policy."""
    from moetier.presets import MOE_SHAPES, names
    from moetier.traces.slot_plan import grid_for
    from moetier.traces.report import physics_for, plot_curves, run_simulation

    _check_policy(list(policy))
    shapes = [*names(), *MOE_SHAPES]
    _check(preset in shapes, f"--preset {preset!r} is not a model shape; choose one of: {', '.join(shapes)}")
    for option, value in (("--hbm-GBps", hbm_gbps), ("--link-GBps", link_gbps)):
        _check(value is None or value > 0, f"{option} {value}: a bandwidth must be more than 0 GB/s")
    _check(not (slots and slots_file), "give --slots or --slots-file, not both")
    if measured is not None:
        _input_file(measured, "--measured", "JSON file", "`moetier bench layer --out` writes one")
    if slots_file is not None:
        _input_file(slots_file, "--slots-file", "slots file", "`moetier trace plan-slots` writes one")
    _check(plot is None or plot.suffix.lower() in (".png", ".svg", ".pdf"),
           f"--plot {plot}: give a file name ending in .png, .svg or .pdf")
    _output_file(plot, "--plot", "curves.png")
    _output_file(out, "--json", "simulation.json")
    t = _read_trace(trace)
    _check_slots(list(slots), t.num_experts)
    per_layer = None
    if slots_file:
        from moetier.experts.placement import read_slots_file

        try:
            per_layer = read_slots_file(slots_file)
        except MoetierError:
            _fail(f"--slots-file {slots_file}: not a slots file; make one with `moetier trace plan-slots`")
        missing = [layer for layer in t.layers if layer not in per_layer]
        _check(not missing, f"--slots-file {slots_file} has no slots for layers {missing} of the trace; "
                            "plan it from this trace with `moetier trace plan-slots`")
        for layer in t.layers:
            _check(1 <= per_layer[layer] <= t.num_experts, f"--slots-file {slots_file}: layer {layer} has "
                   f"{per_layer[layer]} slots; each layer needs 1 to {t.num_experts} (the trace's experts)")
    if not slots and per_layer is None:
        slots = [t.num_experts // 4, t.num_experts // 2]
    try:
        phys = physics_for(preset, t, hbm_gbps, link_gbps, measured)
        with _progress() as bar:  # every cache of a pass is simulated at once: progress is in tokens
            caches = (1 if per_layer else len(slots)) * len(policy) * len(t.layers)
            task = bar.add_task(f"table: {caches} caches", total=t.num_tokens)
            result = run_simulation(t, list(policy), list(slots), per_layer, phys,
                                    progress=lambda done: bar.update(task, completed=done))
            bar.remove_task(task)
            if plot:
                caches = len(grid_for(t.num_experts, t.top_k)) * len(policy) * len(t.layers)
                task = bar.add_task(f"plot: {caches} caches", total=t.num_tokens)
                plot_curves(t, list(policy), plot, progress=lambda done: bar.update(task, completed=done))
    except MoetierError as e:
        _fail(e)
    except OSError as e:
        _fail(f"--plot {plot}: cannot write it ({e.strerror}); give a path in a writable folder")
    if out:
        _write(out, json.dumps(result, indent=2) + "\n", "--json")
    typer.echo(result["table"])


@app.command("plan-slots")
def plan_slots(
    trace: Path = typer.Argument(..., help="Trace file."),
    budget: int = typer.Option(..., "--budget", parser=_whole("--budget"), metavar="<int>",
                               help="Total slots over all MoE layers."),
    policy: str = typer.Option("lfru", "--policy", help="The slot cache's victim policy the curves are simulated "
                               "with: lfru (frequency-weighted LRU, the engine's default) or lru."),
    out: Path = typer.Option(..., "--out", help="Slots file for `moetier generate --expert-slots-file`."),
) -> None:
    """Slots per layer that save the most transfer bytes per HBM byte, from simulated curves."""
    from moetier.traces.slot_plan import plan

    _check_policy([policy])
    _output_file(out, "--out", "slots.json")
    t = _read_trace(trace)
    n, e = len(t.layers), t.num_experts
    # NOTE: plan() starts from an even split of 1 to `experts` slots per layer
    _check(n <= budget <= n * e, f"--budget {budget}: give {n} to {n * e} slots in all (1 to {e} per layer for the "
                                 f"trace's {n} layers)")
    try:
        p = plan(t, budget, policy)
    except MoetierError as e:
        _fail(e)
    p["trace"] = str(trace)
    _write(out, json.dumps(p, indent=2) + "\n", "--out")
    typer.echo(f"wrote {out}: {p['used']} of {budget} slots; link reads per token {p['link_reads_per_token']:.2f} "
               f"(even split of {p['even_slots']} per layer: {p['even_link_reads_per_token']:.2f})")
    typer.echo("slots per layer: " + ", ".join(f"{k}:{v}" for k, v in p["slots"].items()))


@app.command()
def calibrate(out: Optional[Path] = typer.Option(None, "--json")) -> None:
    """Fit the synthetic presets to the published figures and print the parameters."""
    from moetier.traces.synth import calibrate as fit

    _output_file(out, "--json", "calibration.json")
    result = fit(progress=lambda text: typer.echo(f"calibrate: {text} ...", err=True))
    if out:
        _write(out, json.dumps(result, indent=2) + "\n", "--json")
    typer.echo(json.dumps(result, indent=2))
