"""The `moetier` command: generate, serve and make-checkpoint here, `moetier bench ...` from bench.py
and bench_prefill.py, `moetier trace ...` from trace.py, `moetier plan` from plan.py, `moetier eval`
from eval.py. Shared options and argument checks live in options.py."""

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
    prompt: str = typer.Argument(..., help="The prompt text."),
    model: opt.Model = None,
    max_tokens: int = typer.Option(64, "--max-tokens", help="Most tokens to generate."),
    temperature: float = typer.Option(0.0, "--temperature", help="0 = greedy."),
    top_p: float = typer.Option(1.0, "--top-p", help="Nucleus sampling mass (1 = off)."),
    top_k: int = typer.Option(0, "--top-k", help="Sample from the k most likely tokens (0 = off)."),
    seed: Optional[int] = typer.Option(None, "--seed", help="Seed for sampling (same seed, same tokens)."),
    chat: bool = typer.Option(False, "--chat", help="Apply the model's chat template to the prompt."),
    system: Optional[str] = typer.Option(None, "--system", metavar="<text>", help="System message, with --chat."),
    stop: list[str] = typer.Option([], "--stop", metavar="<text>",
                                   help="Stop string; not printed. Repeat the option for several."),
    ignore_eos: bool = typer.Option(False, "--ignore-eos", help="Keep generating past EOS tokens."),
    dtype: opt.Dtype = "auto",
    expert_backend: opt.ExpertBackend = opt.CLI_DEFAULTS["--expert-backend"],
    expert_slots: opt.ExpertSlots = opt.EXPERTS.slots,
    decode_tokens: opt.DecodeTokens = opt.ENGINE.decode_tokens,
    dense_weights: opt.DenseWeights = opt.ENGINE.dense_weights,
    speculative_config: opt.SpeculativeConfigOption = opt.ENGINE.speculative_config,
    max_num_tokens: opt.MaxNumTokens = opt.ENGINE.max_num_tokens,
    prefill_cache: opt.PrefillCache = opt.EXPERTS.prefill,
    prefill_stream: opt.PrefillStream = opt.EXPERTS.prefill_stream,
    enable_prefix_caching: opt.PrefixCaching = opt.ENGINE.enable_prefix_caching,
    kv_host_memory: opt.KvHostMemory = opt.CLI_DEFAULTS["--kv-host-memory"],
    async_scheduling: opt.AsyncScheduling = opt.ENGINE.async_scheduling,
    max_model_len: opt.MaxModelLen = opt.ENGINE.max_model_len,
    gpu_memory: opt.GpuMemory = None,
    host_memory: opt.HostMemory = None,
    expert_slots_file: opt.ExpertSlotsFile = opt.CLI_DEFAULTS["--expert-slots-file"],
    cache_policy: opt.CachePolicy = opt.EXPERTS.policy,
    device: opt.Device = "auto",
    tp: opt.TensorParallel = opt.ENGINE.tensor_parallel_size,
    expert_split: opt.ExpertSplit = opt.EXPERTS.split,
    pinned_experts_file: opt.PinnedExpertsFile = opt.CLI_DEFAULTS["--pinned-experts-file"],
    ep: opt.ExpertParallel = opt.ENGINE.expert_parallel_size,
    distributed_executor: opt.DistributedExecutor = opt.ENGINE.distributed_executor,
    record_trace: opt.RecordTrace = opt.ENGINE.record_trace,
    replay_trace: opt.ReplayTrace = opt.ENGINE.replay_trace,
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object instead of streaming text."),
    verbose: bool = typer.Option(False, "--verbose", help="Also print the run's choices (the prefill chunk and why)."),
) -> None:
    """Generate text from a prompt, streaming tokens as they are produced."""
    from moetier.engine.generate import Generator
    from moetier.engine.llm import model_dir_of, pick_device
    from moetier.engine.startup import plan_then_load
    from moetier.sampling_params import SamplingParams
    from moetier.tokenizer import TokenizerError

    try:
        if system and not chat:
            raise MoetierError("--system needs --chat")
        params = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                                seed=seed, stop=list(stop), ignore_eos=ignore_eos).validate()
        speculative = opt.speculative_config(speculative_config)
        model_dir = model_dir_of(model)
        experts = opt.expert_options(expert_backend, expert_slots, expert_slots_file, cache_policy, expert_split,
                                     prefill_cache, prefill_stream)
        if pinned_experts_file is not None:
            from dataclasses import replace

            experts = replace(experts, pinned=opt.pinned_experts(pinned_experts_file, experts.backend))
        if record_trace is not None:
            opt.output_file(record_trace, "--record-trace")
        if replay_trace is not None:
            opt.input_file(replay_trace, "--replay-trace")
        dev = pick_device(device)
        if max_num_tokens is not None:
            opt.at_least(max_num_tokens, 1, "--max-num-tokens")
        config = opt.engine_config(model_dir, max_model_len, max_num_seqs=opt.ONE_REQUEST, decode_tokens=decode_tokens,
                                   max_num_tokens=max_num_tokens,
                                   enable_prefix_caching=enable_prefix_caching,
                                   kv_host_bytes=opt.kv_host_memory(kv_host_memory), async_scheduling=async_scheduling,
                                   record_trace=record_trace, replay_trace=replay_trace,
                                   tensor_parallel_size=tp, expert_parallel_size=ep, dense_weights=dense_weights,
                                   distributed_executor=opt.executor(distributed_executor),
                                   speculative_config=speculative, experts=experts)
        llm, plan = plan_then_load(model_dir, dtype, dev, config, gpu_memory, host_memory,
                                   on_audit=None if as_json else lambda text: typer.echo(text, err=True))
        if verbose and not as_json and llm.chunk_reason:
            typer.echo(f"prefill chunk: {llm.config.max_num_tokens} tokens per step ({llm.chunk_reason})", err=True)
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
            "load_notes": gen.load_report.notes,
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


@app.command()
def serve(
    model: opt.Model = None,
    host: str = typer.Option("127.0.0.1", "--host", help="Address to listen on (0.0.0.0: every interface)."),
    port: int = typer.Option(8000, "--port", help="Port to listen on."),
    api_key: Optional[str] = typer.Option(None, "--api-key", envvar="MOETIER_API_KEY", metavar="<key>",
                                          help="Require 'Authorization: Bearer <key>' on every route but /health "
                                               "(or set MOETIER_API_KEY)."),
    served_model_name: Optional[str] = typer.Option(None, "--served-model-name", metavar="<name>",
                                                    help="Model id clients send (default: the directory name)."),
    dtype: opt.Dtype = "auto",
    device: opt.Device = "auto",
    expert_backend: opt.ExpertBackend = opt.CLI_DEFAULTS["--expert-backend"],
    expert_slots: opt.ExpertSlots = opt.EXPERTS.slots,
    expert_slots_file: opt.ExpertSlotsFile = opt.CLI_DEFAULTS["--expert-slots-file"],
    cache_policy: opt.CachePolicy = opt.EXPERTS.policy,
    decode_tokens: opt.DecodeTokens = opt.ENGINE.decode_tokens,
    max_num_tokens: opt.MaxNumTokens = opt.ENGINE.max_num_tokens,
    prefill_cache: opt.PrefillCache = opt.EXPERTS.prefill,
    prefill_stream: opt.PrefillStream = opt.EXPERTS.prefill_stream,
    dense_weights: opt.DenseWeights = opt.ENGINE.dense_weights,
    enable_prefix_caching: opt.PrefixCaching = opt.ENGINE.enable_prefix_caching,
    kv_host_memory: opt.KvHostMemory = opt.CLI_DEFAULTS["--kv-host-memory"],
    speculative_config: opt.SpeculativeConfigOption = opt.ENGINE.speculative_config,
    async_scheduling: opt.AsyncScheduling = opt.ENGINE.async_scheduling,
    preset: Optional[str] = typer.Option(None, "--preset", help="Serve random weights of this shape, made in "
                                         f"memory, instead of --model ({', '.join(presets.names())})."),
    layers: Optional[int] = typer.Option(None, "--layers", help="With --preset: keep its first N layers."),
    expert_budget: Optional[str] = typer.Option(None, "--expert-budget", metavar="<share>",
                                                help="With --preset and --expert-backend slots: share of the "
                                                     "routed experts in HBM slots, like 50%."),
    replay_trace: opt.ReplayTrace = opt.ENGINE.replay_trace,
    max_num_seqs: opt.MaxNumSeqs = opt.ENGINE.max_num_seqs,
    kv_tokens: opt.KvTokens = opt.ENGINE.kv_tokens,
    max_model_len: opt.MaxModelLen = opt.ENGINE.max_model_len,
    max_queue: int = typer.Option(256, "--max-queue", help="Requests waiting beyond --max-num-seqs before "
                                  "new ones get 503 with Retry-After."),
    tp: opt.TensorParallel = opt.ENGINE.tensor_parallel_size,
    ep: opt.ExpertParallel = opt.ENGINE.expert_parallel_size,
    expert_split: opt.ExpertSplit = opt.EXPERTS.split,
    pinned_experts_file: opt.PinnedExpertsFile = opt.CLI_DEFAULTS["--pinned-experts-file"],
    distributed_executor: opt.DistributedExecutor = opt.ENGINE.distributed_executor,
    gpu_memory: opt.GpuMemory = None,
    host_memory: opt.HostMemory = None,
    drain_seconds: float = typer.Option(30.0, "--drain-seconds", help="On Ctrl-C, how long running requests "
                                        "may take to finish."),
    tool_call_parser: opt.ToolCallParser = "auto",
    reasoning_parser: opt.ReasoningParser = "auto",
) -> None:
    """Serve the OpenAI API (completions, chat, models, metrics) over HTTP; docs/server.md."""
    from moetier.server.run import EngineSpec, RandomModel, serve as run_server
    from moetier.tokenizer import TokenizerError

    try:
        opt.api_key(api_key)
        if not 0 <= port <= 65535:
            raise MoetierError(f"--port {port}: it must be in 0..65535")
        opt.at_least(max_queue, 0, "--max-queue")
        opt.positive(drain_seconds, "--drain-seconds")
        parsers = opt.parsers(tool_call_parser, reasoning_parser)
        if replay_trace is not None:
            opt.input_file(replay_trace, "--replay-trace")
        if max_num_tokens is not None:
            opt.at_least(max_num_tokens, 1, "--max-num-tokens")
        engine = {"max_num_seqs": max_num_seqs, "kv_tokens": kv_tokens, "max_model_len": max_model_len,
                  "decode_tokens": decode_tokens, "replay_trace": replay_trace, "tensor_parallel_size": tp,
                  "expert_parallel_size": ep, "distributed_executor": opt.executor(distributed_executor),
                  "max_num_tokens": max_num_tokens,
                  "dense_weights": dense_weights, "enable_prefix_caching": enable_prefix_caching,
                  "kv_host_bytes": opt.kv_host_memory(kv_host_memory), "async_scheduling": async_scheduling,
                  "speculative_config": opt.speculative_config(speculative_config)}
        if preset is not None:
            from moetier.cli.bench_common import parse_budget

            if model is not None:
                raise MoetierError("give --model or --preset, not both")
            if expert_slots is not None:
                raise MoetierError("with --preset, size the slots with --expert-budget (a share of the experts) "
                                   "or --expert-slots-file (a count per layer: a plan's --pinned-out file)")
            if expert_budget is not None and expert_slots_file is not None:
                raise MoetierError("give --expert-budget or --expert-slots-file, not both")
            from moetier.experts.registry import AUTO, Resident, Slots, backend_kind

            sized = expert_budget is not None or expert_slots_file is not None
            if sized and expert_backend not in (Slots.name, AUTO):
                flag = "--expert-budget" if expert_budget is not None else "--expert-slots-file"
                raise MoetierError(f"{flag} needs --expert-backend {Slots.name}")
            if expert_backend == AUTO:  # random weights have no plan to ask: slots when they are sized
                expert_backend = Slots.name if sized else Resident.name
            per_layer = opt.expert_slots_file(expert_slots_file) or None
            backend_kind(expert_backend)  # an unknown name: one line naming the choices
            presets.preset(preset, layers, "bfloat16")  # an unknown name or bad --layers fails here
            from moetier.quant.registry import FORMATS

            # --dtype fp8 (a weight format): random experts in that format, dense weights bf16, as plan's
            quant = dtype if dtype in FORMATS else None
            dtype = "bfloat16" if quant else dtype
            random = RandomModel(preset, layers, expert_backend, parse_budget(expert_budget or "50%"), cache_policy,
                                 quant=quant, split=opt.expert_split(expert_split),
                                 pinned=opt.pinned_experts(pinned_experts_file, expert_backend) or None,
                                 slots_per_layer=per_layer)
            # the random bed builds its own backends; the engine gives them the prefill options (llm.py)
            prefill = opt.expert_options(Resident.name, prefill=prefill_cache, stream=prefill_stream)
            spec = EngineSpec(random=random, dtype=dtype, device=device, engine={**engine, "experts": prefill},
                              gpu_memory=gpu_memory, host_memory=host_memory)
        else:
            if layers is not None or expert_budget is not None:
                raise MoetierError("--layers and --expert-budget go with --preset (random weights)")
            from moetier.engine.llm import model_dir_of

            experts = opt.expert_options(expert_backend, expert_slots, expert_slots_file, cache_policy, expert_split,
                                         prefill_cache, prefill_stream)
            if pinned_experts_file is not None:
                from dataclasses import replace

                experts = replace(experts, pinned=opt.pinned_experts(pinned_experts_file, experts.backend))
            spec = EngineSpec(model=model_dir_of(model), dtype=dtype, device=device, engine=engine,
                              experts=experts,
                              gpu_memory=gpu_memory, host_memory=host_memory)
        run_server(spec, host, port, api_key, max_queue, drain_seconds, served_model_name, parsers)
    except (MoetierError, TokenizerError) as e:
        opt.fail(e)


@app.command("make-checkpoint")
def make_checkpoint_cmd(
    preset: str = typer.Option(..., "--preset", help=f"Shape: {', '.join(presets.names())}."),
    out: str = typer.Option(..., "--out", metavar="<dir>", help="Directory to write (must be empty or absent)."),
    layers: Optional[int] = typer.Option(None, "--layers", help="Keep only the first N layers of the preset."),
    seed: int = typer.Option(0, "--seed", help="Seed of the random weights, in [0, 2^63)."),
    dtype: str = typer.Option("bf16", "--dtype", help="bf16, float32, float16, fp8 (block-scaled float8 e4m3 with "
                       "128 x 128 scales, quantized from random bf16; docs/fp8.md), nvfp4, int4 or int4-g32 "
                       "(4-bit weight-only, groups of 16, 128 or 32), int4-asym or int4-g32-asym (INT4 with a "
                       "zero point per group)."),
    fmt: Optional[str] = typer.Option(None, "--format", help="Layout of --dtype nvfp4: modelopt (the default) or "
                                      "compressed-tensors (INT4 is always compressed-tensors)."),
    fused_experts: bool = typer.Option(False, "--fused-experts",
                                       help="Store experts fused (transformers 5 layout) instead of per expert."),
    shard_gib: float = typer.Option(4.0, "--shard-size-gib", help="Largest shard, in GiB (2^30 bytes)."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace a non-empty --out."),
) -> None:
    """Write a random-weight checkpoint of a named shape, with a tokenizer."""
    from moetier.checkpoint.writer import make_checkpoint
    from moetier.progress import ByteBar

    with ByteBar(f"{preset} ({layers or 'all'} layers)", force=True) as bar:
        try:
            opt.positive(shard_gib, "--shard-size-gib")
            if not out.strip():
                raise MoetierError("--out is empty: give the directory to write the checkpoint into")
            if not 0 <= seed < 2**63:  # as generate's --seed
                raise MoetierError(f"--seed {seed}: it must be in [0, 2^63)")
            path = make_checkpoint(Path(out), preset, layers=layers, seed=seed, dtype=dtype, fused_experts=fused_experts,
                                   shard_bytes=int(shard_gib * 2**30), overwrite=overwrite, progress=bar,
                                   format=fmt)
        except MoetierError as e:
            bar.stop()
            opt.fail(e)
    typer.echo(f"wrote {path}")


from moetier.cli import bench_prefill  # noqa: E402,F401  (registers bench prefill and bench chunk)
from moetier.cli.bench import app as bench_app  # noqa: E402
from moetier.cli.trace import app as trace_app  # noqa: E402

app.add_typer(trace_app, name="trace")
app.add_typer(bench_app, name="bench")

from moetier.cli.plan import plan_cmd  # noqa: E402

app.command("plan")(plan_cmd)

from moetier.cli.eval import eval_cmd  # noqa: E402

app.command("eval")(eval_cmd)
