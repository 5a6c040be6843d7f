"""`moetier`: one command with subcommands."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Optional

import typer

from moetier import presets
from moetier.errors import MoetierError

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="moetier: serve Mixture-of-Experts models larger than GPU memory.")


def _fail(e: Exception) -> None:
    typer.echo(f"error: {e}", err=True)
    raise typer.Exit(2)


@app.command()
def generate(
    prompt: str = typer.Argument(..., help="The prompt text."),
    model: Optional[Path] = typer.Option(None, "--model", help="Hugging Face checkpoint directory "
                                         "(default: the embedded tiny model, made on first use)."),
    max_tokens: int = typer.Option(64, "--max-tokens", help="Most tokens to generate."),
    temperature: float = typer.Option(0.0, "--temperature", help="0 = greedy."),
    top_p: float = typer.Option(1.0, "--top-p", help="Nucleus sampling mass (1 = off)."),
    top_k: int = typer.Option(0, "--top-k", help="Sample from the k most likely tokens (0 = off)."),
    seed: Optional[int] = typer.Option(None, "--seed", help="Seed for sampling (same seed, same tokens)."),
    chat: bool = typer.Option(False, "--chat", help="Apply the model's chat template to the prompt."),
    system: Optional[str] = typer.Option(None, "--system", help="System message, with --chat."),
    stop: list[str] = typer.Option([], "--stop", help="Stop string (repeatable); not printed."),
    ignore_eos: bool = typer.Option(False, "--ignore-eos", help="Keep generating past EOS tokens."),
    dtype: str = typer.Option("auto", "--dtype", help="auto (the checkpoint's), float32 or bfloat16."),
    expert_backend: str = typer.Option("resident", "--expert-backend",
                                       help="Where routed experts live: resident, slots (an HBM slot cache over "
                                            "pinned host memory) or uva (read from host memory on every use)."),
    expert_slots: Optional[int] = typer.Option(None, "--expert-slots",
                                               help="Slots per MoE layer for --expert-backend slots "
                                                    "(default: half the experts)."),
    decode_tokens: int = typer.Option(64, "--decode-tokens",
                                      help="Steps of more tokens than this (prefill) bypass the expert cache."),
    expert_slots_file: Optional[Path] = typer.Option(None, "--expert-slots-file",
                                                     help="Slots per MoE layer (from `moetier trace plan-slots`)."),
    cache_policy: str = typer.Option("lfru", "--cache-policy",
                                     help="Slot cache victims: lfru (frequency-weighted LRU) or lru."),
    device: str = typer.Option("auto", "--device", help="auto (cuda when available), cuda or cpu."),
    record_trace: Optional[Path] = typer.Option(None, "--record-trace", help="Write the routing of this run."),
    replay_trace: Optional[Path] = typer.Option(None, "--replay-trace",
                                                help="Route by this trace's experts instead of the router's."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object instead of streaming text."),
) -> None:
    """Generate text from a prompt, streaming tokens as they are produced."""
    from moetier.default_model import default_model_dir
    from moetier.engine import pick_device
    from moetier.experts.placement import ExpertOptions, read_slots_file
    from moetier.generate import Generator
    from moetier.sampler import SamplingParams
    from moetier.tokenizer import TokenizerError

    try:
        if system and not chat:
            raise MoetierError("--system needs --chat")
        if (expert_slots is not None or expert_slots_file is not None) and expert_backend != "slots":
            raise MoetierError("--expert-slots and --expert-slots-file need --expert-backend slots")
        params = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                                seed=seed, stop=list(stop), ignore_eos=ignore_eos).validate()
        model_dir = model if model is not None else default_model_dir()
        per_layer = read_slots_file(expert_slots_file) if expert_slots_file else {}
        experts = ExpertOptions(backend=expert_backend, slots=expert_slots, slots_per_layer=per_layer,
                                decode_tokens=decode_tokens, policy=cache_policy)
        gen = Generator.from_dir(model_dir, dtype=dtype, experts=experts, device=pick_device(device),
                                 record_trace=record_trace, replay_trace=replay_trace)
        ids = gen.prompt_ids(prompt, chat=chat, system=system)

        def stream(text: str) -> None:
            sys.stdout.write(text)
            sys.stdout.flush()

        result = gen.generate(ids, params, on_text=None if as_json else stream)
        gen.llm.close()
    except (MoetierError, TokenizerError) as e:
        _fail(e)
    if as_json:
        typer.echo(json.dumps({
            "model": str(model_dir),
            "prompt_token_ids": result.prompt_ids,
            "token_ids": result.output_ids,
            "text": result.text,
            "finish_reason": result.finish_reason,
            "stop": result.stop,
            "timings": {**result.timings, "load_s": gen.load_report.seconds},
            "experts": gen.llm.metrics()["expert_stats"],
        }))
    else:
        t = result.timings
        sys.stdout.write("\n")
        typer.echo(f"[{len(result.output_ids)} tokens, finish={result.finish_reason}; prefill "
                   f"{len(ids)} tokens in {t['prefill_s'] * 1e3:.1f} ms, decode {t['decode_tok_per_s']:.1f} tok/s]",
                   err=True)


@app.command("make-checkpoint")
def make_checkpoint_cmd(
    preset: str = typer.Option(..., "--preset", help=f"Shape: {', '.join(presets.names())}."),
    out: Path = typer.Option(..., "--out", help="Directory to write (must be empty or absent)."),
    layers: Optional[int] = typer.Option(None, "--layers", help="Keep only the first N layers."),
    seed: int = typer.Option(0, "--seed"),
    dtype: str = typer.Option("bf16", "--dtype", help="bf16, float32 or float16."),
    fused_experts: bool = typer.Option(False, "--fused-experts",
                                       help="Store experts fused (transformers 5 layout) instead of per expert."),
    shard_gib: float = typer.Option(4.0, "--shard-size-gib", help="Largest shard, in GiB."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace a non-empty --out."),
) -> None:
    """Write a random-weight checkpoint of a named shape, with a tokenizer."""
    from rich.progress import BarColumn, DownloadColumn, Progress, TimeRemainingColumn, TransferSpeedColumn

    from moetier.writer import make_checkpoint

    try:
        cfg = presets.preset(preset, layers)
        with Progress("[progress.description]{task.description}", BarColumn(), DownloadColumn(binary_units=True),
                      TransferSpeedColumn(), TimeRemainingColumn(), transient=False) as bar:
            task = bar.add_task(f"{preset} ({cfg.num_layers} layers)", total=None)
            path = make_checkpoint(out, preset, layers=layers, seed=seed, dtype=dtype, fused_experts=fused_experts,
                                   shard_bytes=int(shard_gib * 2**30), overwrite=overwrite,
                                   progress=lambda done, total: bar.update(task, completed=done, total=total))
    except MoetierError as e:
        _fail(e)
    typer.echo(f"wrote {path}")


from moetier.traces.cli import app as trace_app  # noqa: E402

app.add_typer(trace_app, name="trace")

bench_app = typer.Typer(add_completion=False, no_args_is_help=True, help="Benchmarks.")
app.add_typer(bench_app, name="bench")


@bench_app.command("layer")
def bench_layer(
    preset: list[str] = typer.Option(["qwen3-30b-a3b", "glm-5"], "--preset", help="MoE shapes (repeatable)."),
    steps: int = typer.Option(200, "--steps", help="Layer calls per graph replay."),
    hits: str = typer.Option("1.0,0.85,0.75", "--hits", help="Hit rates of the slots rows."),
    slot_frac: float = typer.Option(0.5, "--slots-frac", help="Slots per layer as a share of the experts."),
    tune: bool = typer.Option(True, "--tune/--no-tune", help="Sweep expert-kernel block sizes first."),
    policy: str = typer.Option("lfru", "--cache-policy", help="Slot cache policy of the slots rows."),
    extras: bool = typer.Option(True, "--extras/--no-extras", help="Also both fills and the prefill crossover."),
    out: Optional[Path] = typer.Option(None, "--out", help="Write the JSON record here."),
) -> None:
    """One MoE layer at decode (M = 1), graph-replayed: resident, uva, slots at set hit rates (CUDA)."""
    import torch

    if not torch.cuda.is_available():
        _fail(MoetierError("bench layer needs a CUDA GPU"))
    from moetier.bench.common import write_json
    from moetier.bench.layer import run, table

    data = run(list(preset), steps, [float(h) for h in hits.split(",")], slot_frac, tune, policy, extras)
    if out:
        write_json(out, data)
    typer.echo(table(data))


@bench_app.command("decode")
def bench_decode(
    preset: str = typer.Option("qwen3-30b-a3b", "--preset", help="Model shape of the random weights."),
    layers: Optional[int] = typer.Option(None, "--layers", help="Cut the preset to this many layers."),
    model: Optional[Path] = typer.Option(None, "--model", help="A checkpoint to use instead of random weights."),
    budget: list[str] = typer.Option(["100%", "50%", "25%"], "--expert-budget",
                                     help="Share of routed-expert bytes in HBM (repeatable)."),
    trace: Path = typer.Option(Path("data/traces/qwen3-30b-like.mtrace"), "--trace", help="Routing to replay."),
    batch: list[int] = typer.Option([1, 8], "--batch", help="Decode batch sizes (repeatable)."),
    backends: str = typer.Option("resident,uva,slots,hf", "--backends", help="Comma-separated rows to run."),
    tokens: int = typer.Option(64, "--tokens", help="Timed decode steps per run."),
    warmup: int = typer.Option(32, "--warmup", help="Untimed decode steps first (they also fill the cache)."),
    prompt_len: int = typer.Option(32, "--prompt-len", help="Prompt tokens per request."),
    hf_tokens: int = typer.Option(3, "--hf-tokens", help="Timed decode steps of the transformers peer."),
    policy: str = typer.Option("lfru", "--cache-policy", help="Slot cache policy."),
    decode_tokens: int = typer.Option(64, "--decode-tokens", help="Steps up to this many tokens use the cache."),
    seed: int = typer.Option(0, "--seed"),
    out: Optional[Path] = typer.Option(None, "--out", help="Write the JSON record here."),
    plot: Optional[Path] = typer.Option(None, "--plot", help="Write a PNG of tok/s against expert budget."),
) -> None:
    """Decode tok/s through the engine for resident, slots, uva and transformers+accelerate (CUDA)."""
    import torch

    if not torch.cuda.is_available():
        _fail(MoetierError("bench decode needs a CUDA GPU"))
    from moetier.bench import decode
    from moetier.bench.common import record, write_json
    from moetier.presets import preset as make_preset

    try:
        budgets = [parse_budget(b) for b in budget]
        names = [b.strip() for b in backends.split(",") if b.strip()]
        unknown = sorted(set(names) - {"resident", "uva", "slots", "hf"})
        if unknown:
            raise MoetierError(f"--backends: unknown {unknown}; choose from resident, uva, slots, hf")
        if not trace.is_file():
            raise MoetierError(f"--trace {trace}: no such file; make one with `moetier trace synth`")
        cfg = None if model else make_preset(preset, layers, "bfloat16")
    except MoetierError as e:
        _fail(e)
    args = {"tokens": tokens, "warmup": warmup, "prompt_len": prompt_len, "hf_tokens": hf_tokens,
            "policy": policy, "decode_tokens": decode_tokens, "seed": seed, "preset": preset}
    if model:
        from moetier.config import ModelConfig

        cfg = ModelConfig.from_dir(model)
    data = record("decode", decode.run(cfg, str(trace), budgets, list(batch), names, args,
                                       str(model) if model else None))
    if out:
        write_json(out, data)
    if plot:
        decode.plot(data, str(plot))
    typer.echo(decode.table(data["rows"]))
    typer.echo(f"greedy tokens equal to resident: {data['greedy_tokens_equal_to_resident']}")


def parse_budget(text: str) -> float:
    """'50%' or '0.5' -> 0.5, in (0, 1]."""
    try:
        value = float(text[:-1]) / 100 if text.endswith("%") else float(text)
    except ValueError:
        raise MoetierError(f"--expert-budget {text!r}: give a share like 50% or 0.5") from None
    if not 0 < value <= 1:
        raise MoetierError(f"--expert-budget {text!r}: must be above 0% and at most 100%")
    return value


@bench_app.command("batch")
def bench_batch(
    model: Optional[Path] = typer.Option(None, "--model", help="Checkpoint (default: the embedded model)."),
    requests: int = typer.Option(32, "--requests"),
    prompt_len: int = typer.Option(64, "--prompt-len", help="Longest prompt; prompts are half to all of it."),
    max_tokens: int = typer.Option(32, "--max-tokens"),
    device: str = typer.Option("auto", "--device"),
    expert_backend: str = typer.Option("resident", "--expert-backend"),
    expert_slots: Optional[int] = typer.Option(None, "--expert-slots"),
    out: Optional[Path] = typer.Option(None, "--out", help="Write the JSON record here."),
) -> None:
    """The same requests one after another and as one continuous batch (CPU or CUDA)."""
    from moetier.bench.batch import run, table
    from moetier.bench.common import write_json

    try:
        data = run(str(model) if model else None, requests, prompt_len, max_tokens, device, expert_backend,
                   expert_slots)
    except MoetierError as e:
        _fail(e)
    if out:
        write_json(out, data)
    typer.echo(table(data))


def main() -> None:
    app()


if __name__ == "__main__":
    main()
