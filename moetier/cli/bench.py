"""`moetier bench layer|decode|batch|serve`: the benchmarks' command line (bench/ holds the
benchmarks). Each checks its arguments and its optional dependencies before any work, and writes its
JSON record (machine, commit, command) with --out."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from moetier.cli import options as opt
from moetier.cli.bench_common import (REPO_TRACE, WEIGHT_DTYPES, app, need_cuda, need_gpus, need_modules,
                                      parse_budget, parse_dtypes, preflight_rows)
from moetier.errors import MoetierError
from moetier.experts.registry import NAMES, Slots, backend_kind


@app.command("layer")
def bench_layer(
    preset: list[str] = typer.Option(["qwen3-30b-a3b", "glm-5"], "--preset", metavar="<name>",
                                     help="MoE shape; repeat the option for several."),
    steps: int = typer.Option(200, "--steps", help="Layer calls per graph replay."),
    hits: str = typer.Option("1.0,0.85,0.75", "--hits", help="Hit rates of the slots rows, comma-separated."),
    slot_frac: float = typer.Option(0.5, "--slots-frac", help="Slots per layer as a share of the experts."),
    tune: bool = typer.Option(True, "--tune/--no-tune", help="Sweep expert-kernel block sizes first."),
    policy: opt.CachePolicy = opt.EXPERTS.policy,
    extras: bool = typer.Option(True, "--extras/--no-extras", help="Also both fills and the prefill crossover."),
    dtype: str = typer.Option("bf16", "--dtype", help="Expert formats, comma-separated: bf16, fp8, nvfp4, int4, "
                                                      "int4-g32, int4-asym, int4-g32-asym (every row for each, "
                                                      "side by side)."),
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
    policy: opt.CachePolicy = opt.EXPERTS.policy,
    decode_tokens: opt.DecodeTokens = opt.ENGINE.decode_tokens,
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
    prefetch: str = typer.Option("off", "--prefetch",
                                 help="slots rows: comma-separated next-layer expert prefetch modes, a row "
                                      "each: off, router (the next layer's router on this layer's input), "
                                      "trace (the replayed trace's next-layer experts: a perfect guess; "
                                      "experts/prefetch.py)."),
    host_profile: Optional[Path] = typer.Option(None, "--host-profile", metavar="<file>",
                                                help="hybrid rows: scripts/bench_cpu_experts.py JSON; its winner "
                                                     "kernel, threads and rates (default: measured at build)."),
    dtype: str = typer.Option("bf16", "--dtype", help="Weight formats of the random weights, comma-separated: "
                                                      "bf16, fp8 (FP8 experts), nvfp4, int4, int4-g32, int4-asym, "
                                                      "int4-g32-asym (4-bit weight-only experts), each with "
                                                      "-dense (the dense projections in that format too, e.g. "
                                                      "fp8-dense, nvfp4-dense); every row for each, side by side."),
    parallel: str = typer.Option("1", "--parallel", metavar="<rows>",
                                 help="Rows by world size, comma-separated: 1 (one GPU), tpN, epN, tpNepN (N GPUs, "
                                      "one process each; random weights only), e.g. 1,tp2,ep2. The expert budget "
                                      "is per GPU; parallel rows run resident, uva and slots."),
    step_records: str = typer.Option(opt.ENGINE.step_record_group, "--step-record-group",
                                     help="Parallel rows: the group each step's record goes to the workers on: "
                                          "world (NCCL on GPUs), gloo (host sockets) or pipe (one OS pipe per "
                                          "worker)."),
    expert_split: opt.ExpertSplit = opt.EXPERTS.split,
    pinned_experts_file: opt.PinnedExpertsFile = opt.CLI_DEFAULTS["--pinned-experts-file"],
    expert_slots_file: opt.ExpertSlotsFile = opt.CLI_DEFAULTS["--expert-slots-file"],
    speculative_config: opt.SpeculativeConfigOption = opt.ENGINE.speculative_config,
    async_scheduling: opt.AsyncScheduling = opt.ENGINE.async_scheduling,
    out: Optional[Path] = typer.Option(None, "--out", metavar="<file>", help="Write the JSON record here."),
    plot: Optional[Path] = typer.Option(None, "--plot", metavar="<file>",
                                        help="Write a PNG of tok/s against expert budget."),
) -> None:
    """Decode tok/s through the engine for resident, slots, uva, hybrid and transformers+accelerate (CUDA)."""
    from moetier.experts.hybrid.host_kernels import CHOICES as HOST_KERNELS
    from moetier.models.registry import config_from_dir
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
        unknown = sorted(set(names) - {*NAMES, "hf"})  # hf: the transformers + accelerate peer
        if unknown or not names:
            raise MoetierError(f"--backends {backends!r}: choose from {', '.join(NAMES)}, hf")
        cached = {b for b in NAMES if backend_kind(b).cached}
        pinned = opt.pinned_experts(pinned_experts_file, Slots.name)
        if pinned and (set(names) - cached or model is not None or layouts != [(1, 1)]):
            raise MoetierError("--pinned-experts-file runs slots and hybrid rows of random weights on one GPU "
                               "(--backends slots,hybrid, no --model or --parallel): the bed has no host copy "
                               "of the pinned experts")
        if expert_slots_file is not None and (not set(names) & cached or layouts != [(1, 1)]):
            raise MoetierError("--expert-slots-file adds a slots (and hybrid) row on one GPU: give --backends "
                               "slots or hybrid, no --parallel")
        per_layer = opt.expert_slots_file(expert_slots_file)
        if host_kernel not in HOST_KERNELS:
            raise MoetierError(f"--host-kernel {host_kernel!r}: choose one of {', '.join(HOST_KERNELS)}")
        if host_threads is not None:
            opt.at_least(host_threads, 1, "--host-threads")
        from moetier.bench.decode import HYBRID_GRAPH_MODES

        modes = [m.strip() for m in hybrid_graphs.split(",") if m.strip()]
        if not modes or set(modes) - set(HYBRID_GRAPH_MODES):
            raise MoetierError(f"--hybrid-graphs {hybrid_graphs!r}: give {', '.join(HYBRID_GRAPH_MODES)} "
                               "(comma-separated)")
        from moetier.experts.prefetch import MODES as PREFETCH_MODES

        prefetches = [m.strip() for m in prefetch.split(",") if m.strip()]
        if not prefetches or set(prefetches) - set(PREFETCH_MODES):
            raise MoetierError(f"--prefetch {prefetch!r}: give {', '.join(PREFETCH_MODES)} (comma-separated)")
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
        from moetier.bench.decode_spec import parse as parse_spec

        parse_spec(speculative_config)  # each one-GPU engine row again with it (bench/decode_spec.py)
    except MoetierError as e:
        opt.fail(e)
    need_cuda("decode")
    need_gpus(max(max(lay) for lay in layouts), f"--parallel {parallel}")
    if model is None and (1, 1) in layouts:  # parallel rows: each rank's share is checked per node at start
        rows = [(b, 1.0) for b in NAMES if b in names and not backend_kind(b).cached]
        rows += [(b, budget) for b in NAMES if b in names and backend_kind(b).cached for budget in budgets]
        preflight_rows(cfg, rows, tuple(dtypes), max_num_seqs=max(batch), decode_tokens=decode_tokens,
                       pinned=pinned or None, slots_per_layer=per_layer or None)
    if host_profile is not None:  # after the CUDA check: the profile is made on the CUDA machine
        try:
            opt.input_file(host_profile, "--host-profile")
        except MoetierError as e:
            opt.fail(e)
    from moetier.bench import decode
    from moetier.bench.common import record, write_json

    args = {"tokens": tokens, "warmup": warmup, "repeats": repeats, "prompt_len": prompt_len, "hf_tokens": hf_tokens,
            "policy": policy, "decode_tokens": decode_tokens, "seed": seed, "preset": preset,
            "host_kernel": host_kernel, "host_threads": host_threads, "hybrid_graphs": modes, "prefetch": prefetches,
            "host_profile": str(host_profile) if host_profile else None, "dtype": dtype, "layers": layers,
            "parallel": parallel, "step_record_group": step_records, "expert_split": expert_split,
            "pinned": pinned, "slots_per_layer": per_layer, "speculative_config": speculative_config,
            "async_scheduling": async_scheduling}
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
    expert_backend: opt.ExpertBackend = opt.CLI_DEFAULTS["--expert-backend"],
    expert_slots: opt.ExpertSlots = opt.EXPERTS.slots,
    gpu_memory: opt.GpuMemory = None,
    host_memory: opt.HostMemory = None,
    out: Optional[Path] = typer.Option(None, "--out", metavar="<file>", help="Write the JSON record here."),
) -> None:
    """The same requests one after another and as one continuous batch (CPU or CUDA)."""
    from moetier.bench.batch import run, table
    from moetier.bench.common import write_json
    from moetier.engine.config import EngineConfig
    from moetier.engine.llm import model_dir_of, pick_device
    from moetier.engine.startup import plan_then_load

    try:
        opt.at_least(requests, 1, "--requests")
        opt.at_least(prompt_len, 2, "--prompt-len")  # prompts are half to all of it: at least one token
        opt.at_least(max_tokens, 1, "--max-tokens")
        if out is not None:
            opt.output_file(out, "--out")
        experts = opt.expert_options(expert_backend, expert_slots)
        dev = pick_device(device)
        # the batch repeats the one-after-another prompts: both sides compute them (no prefix cache)
        llm, plan = plan_then_load(model_dir_of(model), "auto", dev,
                                   EngineConfig(enable_prefix_caching=False, experts=experts), gpu_memory, host_memory)
        data = run(llm, requests, prompt_len, max_tokens, plan=plan,
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
    dataset: str = typer.Option("random", "--dataset", help="random (fixed lengths), sharegpt-like (a "
                                "log-normal mix of lengths), shared-prefix (requests over --num-prefixes long "
                                "prefixes) or multi-turn (conversations of --turns turns carrying their history)."),
    prefix_len: int = typer.Option(0, "--prefix-len", help="shared-prefix, multi-turn: tokens of each shared prefix "
                                   "(the system prompt) (0: three quarters of --input-len)."),
    num_prefixes: int = typer.Option(4, "--num-prefixes", help="shared-prefix: distinct prefixes."),
    turns: int = typer.Option(4, "--turns", help="multi-turn: turns per conversation, sent one after the other."),
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
        from moetier.bench import serve as bench

        if dataset not in bench.DATASETS:
            raise MoetierError(f"--dataset {dataset!r}: choose {', '.join(bench.DATASETS)}")
        for value, name in ((input_len, "--input-len"), (output_len, "--output-len"), (num_gpus, "--num-gpus"),
                            (num_prefixes, "--num-prefixes"), (turns, "--turns")):
            opt.at_least(value, 1, name)
        opt.at_least(prefix_len, 0, "--prefix-len")
        if prefix_len >= input_len:
            raise MoetierError(f"--prefix-len {prefix_len} must be below --input-len {input_len} (each request "
                               "adds tokens of its own)")
        for value, name in ((num_prompts, "--num-prompts"), (warmup, "--warmup")):
            opt.at_least(value, 0, name)
        opt.positive(timeout, "--timeout")
        if plot is not None:
            need_modules("matplotlib", why="--plot")
            opt.output_file(plot, "--plot")
        if out is not None:
            opt.output_file(out, "--out")
        data = bench.run(url, api_key, levels, request_rate, num_prompts, input_len, output_len, dataset, warmup,
                         seed, timeout, bench.Prefixes(prefix_len, num_prefixes, turns))
    except MoetierError as e:
        opt.fail(e)
    from moetier.bench.common import record, write_json

    data = record("serve", data)
    if out:
        write_json(out, data)
    if plot:
        bench.plot(data, str(plot), num_gpus)
    typer.echo(bench.table(data))

