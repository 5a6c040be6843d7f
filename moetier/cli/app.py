"""The `moetier` command: generate and make-checkpoint here, `moetier bench ...` from bench/cli.py,
`moetier trace ...` from traces/cli.py. Shared options and argument checks live in options.py."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Optional

import typer

from moetier import presets
from moetier.cli import options as opt
from moetier.errors import MoetierError

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  rich_markup_mode=None,  # plain help: flags shown as flags, not as `<bool>`
                  help="moetier: serve Mixture-of-Experts models larger than GPU memory.")


@app.command()
def generate(
    prompt: str = typer.Argument(..., metavar="PROMPT", help="The prompt text."),
    model: opt.Model = None,
    max_tokens: int = typer.Option(64, "--max-tokens", help="Most tokens to generate."),
    temperature: float = typer.Option(0.0, "--temperature", help="0 = greedy."),
    top_p: float = typer.Option(1.0, "--top-p", help="Nucleus sampling mass (1 = off)."),
    top_k: int = typer.Option(0, "--top-k", help="Sample from the k most likely tokens (0 = off)."),
    seed: Optional[int] = typer.Option(None, "--seed", help="Seed for sampling (same seed, same tokens)."),
    chat: bool = typer.Option(False, "--chat", help="Apply the model's chat template to the prompt."),
    system: Optional[str] = typer.Option(None, "--system", metavar="TEXT", help="System message, with --chat."),
    stop: list[str] = typer.Option([], "--stop", metavar="TEXT",
                                   help="Stop string; not printed. Repeat the option for several."),
    ignore_eos: bool = typer.Option(False, "--ignore-eos", help="Keep generating past EOS tokens."),
    dtype: opt.Dtype = "auto",
    expert_backend: opt.ExpertBackend = "auto",
    expert_slots: opt.ExpertSlots = None,
    decode_tokens: opt.DecodeTokens = 64,
    max_model_len: Optional[int] = typer.Option(None, "--max-model-len",
                                                help="Prompt + output tokens (default: the model's); sizes the KV pool."),
    gpu_memory: opt.GpuMemory = None,
    host_memory: opt.HostMemory = None,
    expert_slots_file: opt.ExpertSlotsFile = None,
    cache_policy: opt.CachePolicy = "lfru",
    device: opt.Device = "auto",
    record_trace: Optional[Path] = typer.Option(None, "--record-trace", metavar="FILE",
                                                help="Write the routing of this run."),
    replay_trace: Optional[Path] = typer.Option(None, "--replay-trace", metavar="FILE",
                                                help="Route by this trace's experts instead of the router's."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object instead of streaming text."),
) -> None:
    """Generate text from a prompt, streaming tokens as they are produced."""
    from moetier.cli.progress import ByteBar
    from moetier.engine.generate import Generator
    from moetier.engine.llm import LLM, model_dir_of, pick_device
    from moetier.plan.preflight import preflight
    from moetier.sampling_params import SamplingParams
    from moetier.tokenizer import TokenizerError

    try:
        if system and not chat:
            raise MoetierError("--system needs --chat")
        params = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                                seed=seed, stop=list(stop), ignore_eos=ignore_eos).validate()
        model_dir = model_dir_of(model)
        experts = opt.expert_options(expert_backend, expert_slots, expert_slots_file, cache_policy)
        if record_trace is not None:
            opt.output_file(record_trace, "--record-trace")
        if replay_trace is not None:
            opt.input_file(replay_trace, "--replay-trace")
        dev = pick_device(device)
        config = opt.engine_config(model_dir, max_model_len, max_num_seqs=1, decode_tokens=decode_tokens,
                                   record_trace=record_trace, replay_trace=replay_trace)
        plan, experts = preflight(model_dir, dtype, dev, experts, config, gpu_memory, host_memory)
        with ByteBar("loading") as bar:
            llm = LLM(model_dir, dtype=dtype, device=dev, experts=experts, config=config, plan=plan, progress=bar,
                      on_audit=None if as_json else lambda text: typer.echo(text, err=True))
        gen = Generator(llm)
        ids = gen.prompt_ids(prompt, chat=chat, system=system)

        def stream(text: str) -> None:
            sys.stdout.write(text)
            sys.stdout.flush()

        result = gen.generate(ids, params, on_text=None if as_json else stream)
        gen.llm.close()
    except (MoetierError, TokenizerError) as e:
        opt.fail(e)
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
            "plan": plan.as_dict(),
            "audit": gen.llm.audits,
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
    out: Path = typer.Option(..., "--out", metavar="DIR", help="Directory to write (must be empty or absent)."),
    layers: Optional[int] = typer.Option(None, "--layers", help="Keep only the first N layers of the preset."),
    seed: int = typer.Option(0, "--seed"),
    dtype: str = typer.Option("bf16", "--dtype", help="bf16, float32 or float16."),
    fused_experts: bool = typer.Option(False, "--fused-experts",
                                       help="Store experts fused (transformers 5 layout) instead of per expert."),
    shard_gib: float = typer.Option(4.0, "--shard-size-gib", help="Largest shard, in GiB (2^30 bytes)."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace a non-empty --out."),
) -> None:
    """Write a random-weight checkpoint of a named shape, with a tokenizer."""
    from moetier.checkpoint.writer import make_checkpoint
    from moetier.cli.progress import ByteBar

    with ByteBar(f"{preset} ({layers or 'all'} layers)", force=True) as bar:
        try:
            opt.positive(shard_gib, "--shard-size-gib")
            path = make_checkpoint(out, preset, layers=layers, seed=seed, dtype=dtype, fused_experts=fused_experts,
                                   shard_bytes=int(shard_gib * 2**30), overwrite=overwrite, progress=bar)
        except MoetierError as e:
            bar.stop()
            opt.fail(e)
    typer.echo(f"wrote {path}")


from moetier.bench.cli import app as bench_app  # noqa: E402
from moetier.traces.cli import app as trace_app  # noqa: E402

app.add_typer(trace_app, name="trace")
app.add_typer(bench_app, name="bench")

from moetier.plan.cli import plan_cmd  # noqa: E402

app.command("plan")(plan_cmd)
