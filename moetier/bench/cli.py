"""`moetier bench ...`: the benchmarks' command line. Each checks its arguments and its optional
dependencies before any work, and writes its JSON record (machine, commit, command) with --out."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Optional

import typer

from moetier.cli import options as opt
from moetier.errors import MoetierError

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


EXPERT_DTYPES = ("bf16", "fp8")
WEIGHT_DTYPES = (*EXPERT_DTYPES, "fp8-dense")  # fp8-dense: FP8 experts and FP8 dense projections


def parse_dtypes(text: str, allowed: tuple[str, ...] = EXPERT_DTYPES) -> list[str]:
    """'bf16,fp8' -> ['bf16', 'fp8']: the weight formats whose rows run side by side."""
    names = [d.strip() for d in text.split(",") if d.strip()]
    bad = [d for d in names if d not in allowed]
    if bad or not names or len(set(names)) != len(names):
        dense = ", fp8-dense (FP8 dense projections too, layers/fp8_linear.py)" if "fp8-dense" in allowed else ""
        raise MoetierError(f"--dtype {text!r}: give a comma-separated list of {', '.join(allowed)} (fp8: "
                           f"block-scaled e4m3 experts, dense weights bf16{dense})")
    return names


def preflight_rows(cfg, rows: list[tuple[str, float]], ring: tuple[int, int] | None = None, pinned=None,
                   **engine) -> None:
    """The memory plan of every row before the random weights are made (plan/preflight.bench_preflight)."""
    from moetier.engine.config import EngineConfig
    from moetier.plan.preflight import bench_preflight

    try:
        bench_preflight(cfg, rows, EngineConfig(**engine), ring=ring, pinned=pinned)
    except MoetierError as e:
        opt.fail(e)


def parse_budget(text: str) -> float:
    """'50%' or '0.5' -> 0.5, in (0, 1]."""
    try:
        value = float(text[:-1]) / 100 if text.endswith("%") else float(text)
    except ValueError:
        raise MoetierError(f"--expert-budget {text!r}: give a share like 50% or 0.5") from None
    if not 0 < value <= 1:
        raise MoetierError(f"--expert-budget {text!r}: must be above 0% and at most 100%")
    return value


@app.command("layer")
def bench_layer(
    preset: list[str] = typer.Option(["qwen3-30b-a3b", "glm-5"], "--preset", metavar="<name>",
                                     help="MoE shape; repeat the option for several."),
    steps: int = typer.Option(200, "--steps", help="Layer calls per graph replay."),
    hits: str = typer.Option("1.0,0.85,0.75", "--hits", help="Hit rates of the slots rows, comma-separated."),
    slot_frac: float = typer.Option(0.5, "--slots-frac", help="Slots per layer as a share of the experts."),
    tune: bool = typer.Option(True, "--tune/--no-tune", help="Sweep expert-kernel block sizes first."),
    policy: opt.CachePolicy = "lfru",
    extras: bool = typer.Option(True, "--extras/--no-extras", help="Also both fills and the prefill crossover."),
    dtype: str = typer.Option("bf16", "--dtype", help="Expert formats, comma-separated: bf16, fp8 or bf16,fp8 "
                                                      "(every row for each, side by side)."),
    out: Optional[Path] = typer.Option(None, "--out", metavar="<file>", help="Write the JSON record here."),
) -> None:
    """One MoE layer at decode (M = 1), graph-replayed: resident, uva, slots at set hit rates (CUDA)."""
    from moetier.presets import moe_shape

    try:
        opt.at_least(steps, 1, "--steps")
        try:
            hit_rates = [float(h) for h in hits.split(",")]
        except ValueError:
            raise MoetierError(f"--hits {hits!r}: give rates like 1.0,0.85,0.75") from None
        if any(not 0 <= h <= 1 for h in hit_rates):
            raise MoetierError(f"--hits {hits!r}: each rate must be in [0, 1]")
        if not 0 < slot_frac <= 1:
            raise MoetierError(f"--slots-frac {slot_frac}: must be above 0 and at most 1")
        dtypes = parse_dtypes(dtype)
        for p in preset:
            moe_shape(p)
        if out is not None:
            opt.output_file(out, "--out")
    except MoetierError as e:
        opt.fail(e)
    need_cuda("layer")
    from moetier.bench.common import write_json
    from moetier.bench.layer import run, table

    data = run(list(preset), steps, hit_rates, slot_frac, tune, policy, extras, dtypes)
    if out:
        write_json(out, data)
    typer.echo(table(data))


@app.command("decode")
def bench_decode(
    preset: str = typer.Option("qwen3-30b-a3b", "--preset", help="Model shape of the random weights."),
    layers: Optional[int] = typer.Option(None, "--layers", help="Cut the preset to its first N layers."),
    model: opt.Model = None,
    budget: list[str] = typer.Option(["100%", "50%", "25%"], "--expert-budget", metavar="<share>",
                                     help="Share of routed-expert bytes in HBM; repeat the option for several."),
    trace: Optional[Path] = typer.Option(None, "--trace", metavar="<file>",
                                         help="Routing to replay (default: the repository's "
                                              "data/traces/qwen3-30b-like.mtrace)."),
    batch: list[int] = typer.Option([1, 8], "--batch", metavar="<int>",
                                    help="Decode batch size; repeat the option for several."),
    backends: str = typer.Option("resident,uva,slots,hf", "--backends", help="Comma-separated rows to run."),
    tokens: int = typer.Option(64, "--tokens", help="Timed decode steps per run."),
    warmup: int = typer.Option(32, "--warmup", help="Untimed decode steps first (they also fill the cache)."),
    repeats: int = typer.Option(1, "--repeats", help="Timed runs per one-GPU row: the row reports their median "
                                "tok/s and spread (min-max)."),
    prompt_len: int = typer.Option(32, "--prompt-len", help="Prompt tokens per request."),
    hf_tokens: int = typer.Option(3, "--hf-tokens", help="Timed decode steps of the transformers peer."),
    policy: opt.CachePolicy = "lfru",
    decode_tokens: opt.DecodeTokens = 64,
    seed: int = typer.Option(0, "--seed"),
    host_kernel: str = typer.Option("auto", "--host-kernel",
                                    help="hybrid rows: host expert kernel (auto: compiled where it builds, else "
                                         "grouped; compiled or grouped)."),
    host_threads: Optional[int] = typer.Option(None, "--host-threads",
                                               help="hybrid rows: host threads (default: the usable cores "
                                                    "less one; with --host-profile at most its winner's)."),
    hybrid_graphs: str = typer.Option("auto", "--hybrid-graphs",
                                      help="hybrid rows: comma-separated decode modes: eager (no CUDA graphs) "
                                           "and/or auto (the engine's default: the host path's graph, nodes "
                                           "on CUDA with the compiled kernel, else pieces, and the whole "
                                           "slots-step graph, switched per step)."),
    host_profile: Optional[Path] = typer.Option(None, "--host-profile", metavar="<file>",
                                                help="hybrid rows: scripts/bench_cpu_experts.py JSON; its winner "
                                                     "kernel, threads and rates (default: measured at build)."),
    dtype: str = typer.Option("bf16", "--dtype", help="Weight formats of the random weights, comma-separated: "
                                                      "bf16, fp8 (FP8 experts), fp8-dense (FP8 experts and dense "
                                                      "projections); every row for each, side by side."),
    parallel: str = typer.Option("1", "--parallel", metavar="<rows>",
                                 help="Rows by world size, comma-separated: 1 (one GPU), tpN, epN, tpNepN (N GPUs, "
                                      "one process each; random weights only), e.g. 1,tp2,ep2. The expert budget "
                                      "is per GPU; parallel rows run resident, uva and slots."),
    step_records: str = typer.Option("world", "--step-record-group",
                                     help="Parallel rows: the group each step's record goes to the workers on: "
                                          "world (NCCL on GPUs), gloo (host sockets) or pipe (one OS pipe per "
                                          "worker)."),
    expert_split: opt.ExpertSplit = "auto",
    pinned_experts_file: opt.PinnedExpertsFile = None,
    out: Optional[Path] = typer.Option(None, "--out", metavar="<file>", help="Write the JSON record here."),
    plot: Optional[Path] = typer.Option(None, "--plot", metavar="<file>",
                                        help="Write a PNG of tok/s against expert budget."),
) -> None:
    """Decode tok/s through the engine for resident, slots, uva, hybrid and transformers+accelerate (CUDA)."""
    from moetier.experts.hybrid.host_kernels import CHOICES as HOST_KERNELS
    from moetier.config import config_from_dir
    from moetier.presets import preset as make_preset

    try:
        budgets = [parse_budget(b) for b in budget]
        dtypes = parse_dtypes(dtype, WEIGHT_DTYPES)
        from moetier.bench.decode_parallel import parse_layouts

        layouts = parse_layouts(parallel)
        from moetier.engine.config import STEP_RECORD_GROUPS

        if step_records not in STEP_RECORD_GROUPS:
            raise MoetierError(f"--step-record-group {step_records!r}: choose world, gloo or pipe")
        opt.expert_split(expert_split)
        if model is not None and layouts != [(1, 1)]:
            raise MoetierError("--parallel rows run random weights (--preset); a checkpoint runs over several GPUs "
                               "with `moetier generate/serve --tp/--ep`")
        if model is not None and dtype != "bf16":
            raise MoetierError("--dtype picks the format of random weights (--preset); a --model checkpoint runs in "
                               "its own format (make one with `moetier make-checkpoint --dtype fp8`)")
        names = [b.strip() for b in backends.split(",") if b.strip()]
        unknown = sorted(set(names) - {"resident", "uva", "slots", "hybrid", "hf"})
        if unknown or not names:
            raise MoetierError(f"--backends {backends!r}: choose from resident, uva, slots, hybrid, hf")
        pinned = opt.pinned_experts(pinned_experts_file, "slots")
        if pinned and (set(names) - {"slots", "hybrid"} or model is not None or layouts != [(1, 1)]):
            raise MoetierError("--pinned-experts-file runs slots and hybrid rows of random weights on one GPU "
                               "(--backends slots,hybrid, no --model or --parallel): the bed has no host copy "
                               "of the pinned experts")
        if host_kernel not in HOST_KERNELS:
            raise MoetierError(f"--host-kernel {host_kernel!r}: choose one of {', '.join(HOST_KERNELS)}")
        if host_threads is not None:
            opt.at_least(host_threads, 1, "--host-threads")
        from moetier.bench.decode import HYBRID_GRAPH_MODES

        modes = [m.strip() for m in hybrid_graphs.split(",") if m.strip()]
        if not modes or set(modes) - set(HYBRID_GRAPH_MODES):
            raise MoetierError(f"--hybrid-graphs {hybrid_graphs!r}: give {', '.join(HYBRID_GRAPH_MODES)} "
                               "(comma-separated)")
        for b in batch:
            opt.at_least(b, 1, "--batch")
        for value, name in ((tokens, "--tokens"), (prompt_len, "--prompt-len"), (hf_tokens, "--hf-tokens")):
            opt.at_least(value, 1, name)
        opt.at_least(warmup, 0, "--warmup")
        opt.at_least(repeats, 1, "--repeats")
        trace = opt.input_file(trace or REPO_TRACE, "--trace")
        if "hf" in names:
            need_modules("transformers", "accelerate", why="the transformers + accelerate peer (--backends hf)")
        if plot is not None:
            need_modules("matplotlib", why="--plot")
            opt.output_file(plot, "--plot")
        if out is not None:
            opt.output_file(out, "--out")
        if model is not None:
            from moetier.engine.llm import model_dir_of

            cfg = config_from_dir(model_dir_of(model))
        else:
            cfg = make_preset(preset, layers, "bfloat16")
    except MoetierError as e:
        opt.fail(e)
    need_cuda("decode")
    need_gpus(max(max(lay) for lay in layouts), f"--parallel {parallel}")
    if model is None and (1, 1) in layouts:  # parallel rows: each rank's share is checked per node at start
        rows = [(b, 1.0) for b in ("resident", "uva") if b in names]
        rows += [(b, budget) for b in ("slots", "hybrid") if b in names for budget in budgets]
        preflight_rows(cfg, rows, max_num_seqs=max(batch), decode_tokens=decode_tokens, pinned=pinned or None)
    if host_profile is not None:  # after the CUDA check: the profile is made on the CUDA machine
        try:
            opt.input_file(host_profile, "--host-profile")
        except MoetierError as e:
            opt.fail(e)
    from moetier.bench import decode
    from moetier.bench.common import record, write_json

    args = {"tokens": tokens, "warmup": warmup, "repeats": repeats, "prompt_len": prompt_len, "hf_tokens": hf_tokens,
            "policy": policy, "decode_tokens": decode_tokens, "seed": seed, "preset": preset,
            "host_kernel": host_kernel, "host_threads": host_threads, "hybrid_graphs": modes,
            "host_profile": str(host_profile) if host_profile else None, "dtype": dtype, "layers": layers,
            "parallel": parallel, "step_record_group": step_records, "expert_split": expert_split,
            "pinned": pinned}
    data = record("decode", decode.run(cfg, str(trace), budgets, list(batch), names, args,
                                       str(model) if model else None, dtypes=tuple(dtypes), layouts=tuple(layouts)))
    if out:
        write_json(out, data)
    if plot:
        decode.plot(data, str(plot))
    typer.echo(decode.table(data["rows"]))
    for line in decode.ratios(data["rows"]):
        typer.echo(line)
    typer.echo(f"greedy tokens equal to resident: {data['greedy_tokens_equal_to_resident']}")
    differ = [name for name, v in data["output_checks"].items() if v.startswith(("MISMATCH", "DIFFERS"))]
    typer.echo(f"outputs against {', '.join(sorted(set(data['output_references'].values())))}: "
               + (f"{len(differ)} row(s) DIFFER: {', '.join(differ)}" if differ else "every row exact or within tolerance"))


@app.command("batch")
def bench_batch(
    model: opt.Model = None,
    requests: int = typer.Option(32, "--requests", help="Requests in the batch."),
    prompt_len: int = typer.Option(64, "--prompt-len", help="Longest prompt in tokens; prompts are half to all of it."),
    max_tokens: int = typer.Option(32, "--max-tokens", help="Output tokens per request."),
    device: opt.Device = "auto",
    expert_backend: opt.ExpertBackend = "auto",
    expert_slots: opt.ExpertSlots = None,
    gpu_memory: opt.GpuMemory = None,
    host_memory: opt.HostMemory = None,
    out: Optional[Path] = typer.Option(None, "--out", metavar="<file>", help="Write the JSON record here."),
) -> None:
    """The same requests one after another and as one continuous batch (CPU or CUDA)."""
    from moetier.bench.batch import run, table
    from moetier.bench.common import write_json
    from moetier.engine.config import EngineConfig
    from moetier.engine.llm import model_dir_of, pick_device
    from moetier.plan.preflight import preflight

    try:
        opt.at_least(requests, 1, "--requests")
        opt.at_least(prompt_len, 2, "--prompt-len")  # prompts are half to all of it: at least one token
        opt.at_least(max_tokens, 1, "--max-tokens")
        if out is not None:
            opt.output_file(out, "--out")
        experts = opt.expert_options(expert_backend, expert_slots)
        dev = pick_device(device)
        plan, experts = preflight(model_dir_of(model), "auto", dev, experts, EngineConfig(), gpu_memory, host_memory)
        data = run(str(model) if model else None, requests, prompt_len, max_tokens, dev, experts, plan=plan,
                   progress=lambda text: typer.echo(f"bench batch: {text} ...", err=True))
    except MoetierError as e:
        opt.fail(e)
    if out:
        write_json(out, data)
    typer.echo(table(data))


@app.command("serve")
def bench_serve(
    url: str = typer.Option(..., "--url", help="The server, e.g. http://127.0.0.1:8000 (a /v1 suffix is fine)."),
    api_key: Optional[str] = typer.Option(None, "--api-key", envvar="MOETIER_API_KEY", metavar="<key>",
                                          help="Bearer token (or set MOETIER_API_KEY)."),
    concurrency: str = typer.Option("1,2,4,8,16,32,64", "--concurrency",
                                    help="Comma-separated concurrency levels, one measurement each."),
    request_rate: Optional[float] = typer.Option(None, "--request-rate", help="Poisson arrivals at this many "
                                                 "requests per second instead of the concurrency sweep."),
    num_prompts: int = typer.Option(0, "--num-prompts", help="Measured requests per level (0: 4 x concurrency, "
                                    "at least 16)."),
    input_len: int = typer.Option(128, "--input-len", help="Prompt tokens (the median with sharegpt-like)."),
    output_len: int = typer.Option(128, "--output-len", help="Output tokens (the median with sharegpt-like)."),
    dataset: str = typer.Option("random", "--dataset", help="random (fixed lengths) or sharegpt-like (a "
                                "log-normal mix of lengths)."),
    warmup: int = typer.Option(4, "--warmup", help="Untimed requests before each level."),
    seed: int = typer.Option(0, "--seed"),
    timeout: float = typer.Option(600.0, "--timeout", help="Seconds before a request counts as cancelled."),
    num_gpus: int = typer.Option(1, "--num-gpus", help="GPUs of the server, for throughput per GPU in the plot."),
    out: Optional[Path] = typer.Option(None, "--out", metavar="<file>", help="Write the JSON record here."),
    plot: Optional[Path] = typer.Option(None, "--plot", metavar="<file>",
                                        help="Write a PNG of throughput per GPU against interactivity."),
) -> None:
    """Load an OpenAI-compatible server: concurrency sweep or request rate, vLLM bench-serve fields."""
    try:
        if not url.startswith(("http://", "https://")):
            raise MoetierError(f"--url {url!r}: give an http:// or https:// address")
        try:
            levels = [int(c) for c in concurrency.split(",") if c.strip()]
        except ValueError:
            raise MoetierError(f"--concurrency {concurrency!r}: give levels like 1,2,4,8") from None
        if not levels or min(levels) < 1:
            raise MoetierError(f"--concurrency {concurrency!r}: every level must be at least 1")
        if request_rate is not None:
            opt.positive(request_rate, "--request-rate")
        if dataset not in ("random", "sharegpt-like"):
            raise MoetierError(f"--dataset {dataset!r}: choose random or sharegpt-like")
        for value, name in ((input_len, "--input-len"), (output_len, "--output-len"), (num_gpus, "--num-gpus")):
            opt.at_least(value, 1, name)
        for value, name in ((num_prompts, "--num-prompts"), (warmup, "--warmup")):
            opt.at_least(value, 0, name)
        opt.positive(timeout, "--timeout")
        if plot is not None:
            need_modules("matplotlib", why="--plot")
            opt.output_file(plot, "--plot")
        if out is not None:
            opt.output_file(out, "--out")
        from moetier.bench import serve as bench

        data = bench.run(url, api_key, levels, request_rate, num_prompts, input_len, output_len, dataset, warmup,
                         seed, timeout)
    except MoetierError as e:
        opt.fail(e)
    from moetier.bench.common import record, write_json

    data = record("serve", data)
    if out:
        write_json(out, data)
    if plot:
        bench.plot(data, str(plot), num_gpus)
    typer.echo(bench.table(data))


from moetier.bench import cli_prefill  # noqa: E402,F401  (registers bench prefill and bench chunk)
