"""`moetier bench prefill` and `moetier bench chunk`: the large-step path through the engine, and the
prefill chunk against the decodes beside it (CUDA). Registered on cli/bench_common.py's app."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from moetier.cli.bench_common import (REPO_TRACE, WEIGHT_DTYPES, app, need_cuda, need_modules, parse_budget,
                                      parse_dtypes, preflight_rows)
from moetier.cli import options as opt
from moetier.errors import MoetierError
from moetier.experts.placement import ExpertOptions
from moetier.experts.registry import NAMES, Resident, Slots, backend_kind
from moetier.experts.prefill.ring import RING_DEPTH, RING_GROUP


@app.command("prefill")
def bench_prefill(
    preset: str = typer.Option("qwen3-30b-a3b", "--preset", help="Model shape of the random weights."),
    layers: Optional[int] = typer.Option(8, "--layers", help="Cut the preset to its first N layers."),
    budget: list[str] = typer.Option(["50%", "25%"], "--expert-budget", metavar="<share>",
                                     help="Share of routed-expert bytes in HBM for the slots rows; repeat the "
                                          "option for several."),
    trace: Optional[Path] = typer.Option(None, "--trace", metavar="<file>",
                                         help="Routing to replay (default: the repository's "
                                              "data/traces/qwen3-30b-like.mtrace)."),
    length: list[int] = typer.Option([128, 512, 2048, 8192], "--prompt-len", metavar="<int>",
                                     help="Prompt tokens; repeat the option for several."),
    batch: list[int] = typer.Option([1, 4], "--batch", metavar="<int>", help="Prompts at once; repeat for several."),
    backends: str = typer.Option("resident,slots,uva", "--backends", help="Comma-separated rows to run."),
    chunk: int = typer.Option(2048, "--chunk", help="Tokens per engine step (the prefill chunk)."),
    reps: int = typer.Option(5, "--reps", help="Timed runs per row (the median); fewer past 2 s a row."),
    prefill_cache: str = typer.Option("bypass,refresh", "--prefill-cache",
                                      help="Comma-separated prefill cache policies for the slots rows: bypass, "
                                           "refresh (a row each)."),
    prefill_stream: str = typer.Option("ring", "--prefill-stream",
                                       help="Comma-separated prefill stream modes for the slots rows under bypass: "
                                            "uva (misses read over the link in the GEMM), ring (staged by the copy "
                                            "engine; a row each)."),
    decode_steps: int = typer.Option(32, "--decode-steps", help="Decode steps timed after each row's prefill "
                                     "(tok/s and hit rate: the policy's trade-off); 0: none."),
    policy: opt.CachePolicy = opt.EXPERTS.policy,
    decode_tokens: opt.DecodeTokens = opt.ENGINE.decode_tokens,
    seed: int = typer.Option(0, "--seed"),
    dtype: str = typer.Option("bf16", "--dtype", help="Weight formats, comma-separated: bf16, fp8 (FP8 experts), "
                                                      "nvfp4, int4, int4-g32, int4-asym, int4-g32-asym (4-bit "
                                                      "weight-only experts), each with -dense (the dense "
                                                      "projections in that format too, e.g. fp8-dense)."),
    out: Optional[Path] = typer.Option(None, "--out", metavar="<file>", help="Write the JSON record here."),
    plot: Optional[Path] = typer.Option(None, "--plot", metavar="<file>", help="Write a PNG of tok/s by prompt length."),
) -> None:
    """Prefill tok/s through the engine: resident, slots at each budget (per prefill cache policy and
    stream mode), uva, with link and HBM/compute bounds measured in the same run (CUDA)."""
    from moetier.presets import preset as make_preset

    try:
        budgets = [parse_budget(b) for b in budget]
        dtypes = parse_dtypes(dtype, WEIGHT_DTYPES)
        names = [b.strip() for b in backends.split(",") if b.strip()]
        rows_of = [k for k in NAMES if not backend_kind(k).host_compute]  # hybrid has no prefill row
        if not names or set(names) - set(rows_of):
            raise MoetierError(f"--backends {backends!r}: choose from {', '.join(rows_of)}")
        for value in (*length, *batch):
            opt.at_least(value, 1, "--prompt-len" if value in length else "--batch")
        opt.at_least(chunk, decode_tokens + 1, "--chunk")
        opt.at_least(reps, 1, "--reps")
        opt.at_least(decode_steps, 0, "--decode-steps")
        policies = [opt.prefill_cache(p.strip()) for p in prefill_cache.split(",") if p.strip()]
        if not policies:
            raise MoetierError("--prefill-cache: give bypass, refresh or both (comma-separated)")
        streams = [opt.prefill_stream(s.strip()) for s in prefill_stream.split(",") if s.strip()]
        if not streams:
            raise MoetierError("--prefill-stream: give uva, ring or both (comma-separated)")
        trace = opt.input_file(trace or REPO_TRACE, "--trace")
        if plot is not None:
            need_modules("matplotlib", why="--plot")
            opt.output_file(plot, "--plot")
        if out is not None:
            opt.output_file(out, "--out")
        cfg = make_preset(preset, layers, "bfloat16")
    except MoetierError as e:
        opt.fail(e)
    need_cuda("prefill")
    preflight_rows(cfg, [(b, 1.0) for b in names if not backend_kind(b).cached]
                   + [(b, budget) for b in names if backend_kind(b).cached for budget in budgets],
                   tuple(dtypes), max_num_seqs=max(batch), max_num_tokens=chunk,
                   kv_tokens=max(batch) * (max(length) + decode_steps + 16), decode_tokens=decode_tokens,
                   experts=ExpertOptions(prefill_stream="ring" if "ring" in streams else "uva"))
    from moetier.bench import prefill
    from moetier.bench.common import links, record, write_json
    from moetier.bench.decode import make_bed

    args = {"chunk": chunk, "reps": reps, "policy": policy, "decode_tokens": decode_tokens, "seed": seed,
            "preset": preset, "dtype": dtype, "prefill_cache": policies, "prefill_stream": streams,
            "ring_group": RING_GROUP, "ring_depth": RING_DEPTH, "decode_steps": decode_steps}
    data, link = None, None
    for d in dtypes:  # one bed at a time, rows side by side (each tagged with its dtype)
        bed = make_bed(cfg, d, seed)
        link = link or links(row_bytes=bed.row_bytes)
        part = prefill.run(bed, str(trace), budgets, sorted(length), sorted(batch), names, args, link)
        data = part if data is None else {**data, "rows": data["rows"] + part["rows"],
                                          **{k: {**data[k], **part[k]} for k in ("output_checks", "output_references")}}
        for block in bed.model.moe_blocks():
            block.experts = None  # this bed's device rows go before the next is built
        del bed, part
    data["config"]["dtype"] = ",".join(dtypes)
    data = record("prefill", data)
    if out:
        write_json(out, data)
    if plot:
        prefill.plot(data, str(plot))
    typer.echo(prefill.table(data["rows"]))


@app.command("chunk")
def bench_chunk(
    preset: str = typer.Option("qwen3-30b-a3b", "--preset", help="Model shape of the random weights."),
    layers: Optional[int] = typer.Option(8, "--layers", help="Cut the preset to its first N layers."),
    budget: list[str] = typer.Option(["50%"], "--expert-budget", metavar="<share>",
                                     help="Share of routed-expert bytes in HBM for the slots rows; repeatable."),
    backends: str = typer.Option("resident,slots", "--backends", help="Comma-separated rows: resident, slots."),
    chunks: str = typer.Option("512,1024,2048,4096,8192", "--chunks", help="Tokens per step to compare."),
    prompt_len: int = typer.Option(8192, "--prompt-len", help="The long prompt's tokens."),
    streams: int = typer.Option(4, "--decode-streams", help="Requests decoding when the prompt arrives."),
    before: int = typer.Option(16, "--before", help="Timed decode-only steps before the prompt comes."),
    trace: Optional[Path] = typer.Option(None, "--trace", metavar="<file>",
                                         help="Routing to replay (default: data/traces/qwen3-30b-like.mtrace)."),
    policy: opt.CachePolicy = opt.EXPERTS.policy,
    prefill_cache: opt.PrefillCache = opt.EXPERTS.prefill,
    decode_tokens: opt.DecodeTokens = opt.ENGINE.decode_tokens,
    seed: int = typer.Option(0, "--seed"),
    out: Optional[Path] = typer.Option(None, "--out", metavar="<file>", help="Write the JSON record here."),
) -> None:
    """The prefill chunk under offload: a long prompt's TTFT against the inter-token latency of the
    requests decoding beside it, per chunk size (CUDA)."""
    from moetier.presets import preset as make_preset

    try:
        names = [b.strip() for b in backends.split(",") if b.strip()]
        if not names or set(names) - {Resident.name, Slots.name}:
            raise MoetierError(f"--backends {backends!r}: choose from {Resident.name}, {Slots.name}")
        sizes = opt.int_list(chunks, "--chunks")
        for c in sizes:
            opt.at_least(c, decode_tokens + 1, "--chunks")
        opt.at_least(prompt_len, 1, "--prompt-len")
        opt.at_least(streams, 1, "--decode-streams")
        opt.at_least(before, 1, "--before")
        opt.prefill_cache(prefill_cache)
        rows = [(Resident.name, 1.0)] * (Resident.name in names)
        rows += [(Slots.name, parse_budget(b)) for b in budget] if Slots.name in names else []
        trace = opt.input_file(trace or REPO_TRACE, "--trace")
        if out is not None:
            opt.output_file(out, "--out")
        cfg = make_preset(preset, layers, "bfloat16")
    except MoetierError as e:
        opt.fail(e)
    need_cuda("chunk")
    preflight_rows(cfg, rows, max_num_seqs=streams + 1, max_num_tokens=max(sizes),
                   kv_tokens=(streams + 1) * (prompt_len + 2048), decode_tokens=decode_tokens)
    from moetier.bench import chunk
    from moetier.bench.common import record, write_json
    from moetier.checkpoint.random_bed import random_bed

    args = {"policy": policy, "decode_tokens": decode_tokens, "seed": seed, "before": before, "preset": preset,
            "prefill_cache": prefill_cache}
    bed = random_bed(cfg, seed)
    data = record("chunk", chunk.run(bed, str(trace), rows, sizes, prompt_len, streams, args))
    if out:
        write_json(out, data)
    typer.echo(chunk.table(data["rows"]))
