"""`moetier plan`: the memory plan of a model on this machine (or on the sizes given), before loading
anything. Every bad argument is one `error:` line and exit code 2; a plan that does not fit prints
its table and what would fit instead, and also exits with 2."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from moetier.cli import options as opt
from moetier.errors import MoetierError
from moetier.experts.registry import AUTO, Slots, backend_kind

def expert_request(cfg, backend: str, slots: int | None, slots_file: Path | None, budget: str | None, trace,
                   policy: str):
    """ExpertOptions from plan's flags; --expert-budget (a share of the experts or a size) becomes slots."""
    from moetier.plan.sizing import split_slots
    from moetier.plan.units import parse_size

    given = [n for n, v in (("--expert-slots", slots), ("--expert-slots-file", slots_file),
                            ("--expert-budget", budget)) if v is not None]
    if len(given) > 1:
        raise MoetierError(f"give one of {', '.join(given)}, not several")
    if given and backend == AUTO:
        backend = Slots.name
    if budget is None:
        return opt.expert_options(backend, slots, slots_file, policy)
    if backend != Slots.name:
        raise MoetierError(f"--expert-budget needs --expert-backend {Slots.name} (or {AUTO})")
    layers, e = cfg.moe_layers, cfg.num_experts
    row = cfg.moe_shape.layout.row_bytes(cfg_dtype(cfg))  # exact bytes of one expert row (FP8: with scales)
    text = budget.strip()
    if text.endswith("%") or text.replace(".", "", 1).isdigit():
        from moetier.cli.bench_common import parse_budget

        total = round(parse_budget(text) * e * len(layers))
    else:
        total = parse_size(text, "--expert-budget") // row
    if total < len(layers):
        raise MoetierError(f"--expert-budget {budget}: {total} slots is less than one per MoE layer "
                           f"({len(layers)} layers)")
    from moetier.experts.placement import ExpertOptions

    return ExpertOptions(Slots.name, slots_per_layer=split_slots(min(total, e * len(layers)), layers, e, trace, policy),
                         policy=policy)


def cfg_dtype(cfg):
    from moetier.checkpoint.loader import resolve_dtype

    return resolve_dtype("auto", cfg)


def predict(plan, cfg, trace, policy: str) -> dict:
    """Hit rate and batch-1 tok/s the trace's simulation predicts for the plan's slots (traces/report.py),
    and for its pinned experts too when it pins (traces/split_plan.py)."""
    from moetier.traces.report import DEFAULT_HBM_GBPS, DEFAULT_LINK_GBPS, run_simulation
    from moetier.traces.simulate import Physics

    if trace.num_experts != cfg.num_experts:
        raise MoetierError(f"--trace routes over {trace.num_experts} experts, the model has {cfg.num_experts}")
    e = cfg.num_experts
    kind = backend_kind(plan.backend)
    slots = plan.slots_per_layer if kind.cached else {}
    mean = round(sum(slots.values()) / len(slots)) if slots else e
    per_layer = {layer: slots.get(layer, mean) if slots else e for layer in trace.layers}
    dense = next(i.bytes for i in plan.device + plan.host if i.name.startswith("dense: decoder layers"))
    head = next(i.bytes for i in plan.device + plan.host if i.name.startswith("dense: embedding"))
    read = dense + (head if cfg.tie_word_embeddings else head // 2)  # the embedding is read by row only
    phys = Physics(DEFAULT_HBM_GBPS, DEFAULT_LINK_GBPS, plan.row_bytes, len(cfg.moe_layers), read)
    pinned_rate = None
    if not kind.cached and kind.host_store:  # uva: every row read across the link
        per_layer = dict.fromkeys(trace.layers, 0)
        row = {"hit_rate": 0.0, "ms_per_token": phys.ms_per_token(trace.top_k, 0.0, trace.top_k)}
    elif plan.pinned_per_layer:
        from moetier.plan.split import predict_split

        row = predict_split(plan, trace, policy, phys)
        pinned_rate = row["pinned_rate"]
    else:
        row = run_simulation(trace, [policy], [], per_layer, phys)["rows"][0]
    return {"trace": str(trace.meta.get("path", "")) or "given", "policy": policy, "hit_rate": row["hit_rate"],
            "pinned_rate": pinned_rate, "tok_per_s": 1e3 / row["ms_per_token"], "slots_per_traced_layer": per_layer,
            "physics": f"HBM {phys.hbm_GBps:.0f} GB/s, link {phys.link_GBps:.1f} GB/s, H200 figures"}


def quantized_preset(cfg, dtype: str, from_checkpoint: bool):
    """--dtype fp8 | nvfp4 | int4 | int4-g32 (quant/registry.FORMATS) with --preset: the preset with its routed
    experts in that format (rows counted exactly, quant/rows.RowLayout) and dense weights in bf16, as
    such a checkpoint loads; -> (cfg, the model dtype). Other --dtype values pass through."""
    from moetier.checkpoint.random_bed import quantized
    from moetier.quant.registry import FORMATS

    if dtype not in FORMATS:
        return cfg, dtype
    if from_checkpoint:
        raise MoetierError(f"--dtype {dtype}: a checkpoint's weight format is its own (config.json); with --model, "
                           "--dtype is the model dtype (auto, bfloat16, float16, float32)")
    return quantized(cfg, dtype), "bfloat16"


def plan_cmd(
    model: opt.Model = None,
    preset: Optional[str] = typer.Option(None, "--preset", metavar="<name>", help="A named shape instead of --model."),
    layers: Optional[int] = typer.Option(None, "--layers", help="Cut the preset to its first N layers."),
    dtype: opt.Dtype = "auto",
    device: opt.Device = "auto",
    gpu_memory: opt.GpuMemory = None,
    host_memory: opt.HostMemory = None,
    max_model_len: opt.MaxModelLen = opt.ENGINE.max_model_len,
    max_num_seqs: opt.MaxNumSeqs = opt.ONE_REQUEST,
    max_num_tokens: opt.MaxNumTokens = opt.ENGINE.max_num_tokens,
    decode_tokens: opt.DecodeTokens = opt.ENGINE.decode_tokens,
    expert_backend: opt.ExpertBackend = opt.CLI_DEFAULTS["--expert-backend"],
    expert_slots: opt.ExpertSlots = opt.EXPERTS.slots,
    expert_slots_file: opt.ExpertSlotsFile = opt.CLI_DEFAULTS["--expert-slots-file"],
    expert_budget: Optional[str] = typer.Option(None, "--expert-budget", metavar="<share|size>",
                                                help="Slots as a share of the experts (50%) or a size (40GiB)."),
    trace: Optional[Path] = typer.Option(None, "--trace", metavar="<file>",
                                         help="Routing trace: slots per layer from it, and the predicted hit rate "
                                              "and tok/s."),
    policy: opt.CachePolicy = opt.EXPERTS.policy,
    dense_weights: opt.DenseWeights = opt.ENGINE.dense_weights,
    enable_prefix_caching: opt.PrefixCaching = opt.ENGINE.enable_prefix_caching,
    kv_host_memory: opt.KvHostMemory = opt.CLI_DEFAULTS["--kv-host-memory"],
    speculative_config: opt.SpeculativeConfigOption = opt.ENGINE.speculative_config,
    pinned_experts_file: opt.PinnedExpertsFile = opt.CLI_DEFAULTS["--pinned-experts-file"],
    pinned_out: Optional[Path] = typer.Option(None, "--pinned-out", metavar="<file>",
                                              help="Write the plan's pinned experts per layer to this file."),
    as_json: bool = typer.Option(False, "--json", help="Print the plan as JSON (bytes)."),
) -> None:
    """The memory plan: every resident on the device and the host, totals and headroom."""
    from moetier import presets
    from moetier.checkpoint.loader import resolve_dtype
    from moetier.plan.expert_plan import plan_for, refusal
    from moetier.plan.preflight import request_for
    from moetier.plan.render import table, to_json

    try:
        if (model is None) == (preset is None):
            raise MoetierError("give --model DIR or --preset NAME (one of them)")
        if layers is not None and preset is None:
            raise MoetierError("--layers cuts a --preset; a --model is planned as it is")
        for value, name in ((max_num_seqs, "--max-num-seqs"), (max_num_tokens, "--max-num-tokens"),
                            (decode_tokens, "--decode-tokens")):
            if value is not None:  # --max-num-tokens unset: chosen by the plan (plan/chunk.py)
                opt.at_least(value, 1, name)
        if max_model_len is not None:
            opt.at_least(max_model_len, 2, "--max-model-len")
        if device not in ("auto", "cuda", "cpu"):
            raise MoetierError(f"--device {device!r}: choose auto, cuda or cpu")
        if model is not None:
            from moetier.models.registry import config_from_dir
            from moetier.engine.llm import model_dir_of

            from moetier.plan.preflight import check_shards

            cfg = config_from_dir(model_dir_of(model))
            check_shards(model_dir_of(model), cfg)  # plan what generate would load: a truncated shard is refused
        else:
            cfg = presets.preset(preset, layers)
        cfg, dtype = quantized_preset(cfg, dtype, model is not None)
        tdtype = resolve_dtype(dtype, cfg)
        loaded = None
        if trace is not None:
            from moetier.traces.format import read_trace

            loaded = read_trace(opt.input_file(trace, "--trace"))
            loaded.meta.setdefault("path", str(trace))
        if device == "auto":
            import torch

            device = "cuda" if torch.cuda.is_available() or gpu_memory is not None else "none"
            if device == "none":
                raise MoetierError("no CUDA device is visible here: give --gpu-memory (e.g. 139GiB) to plan for a "
                                   "card, or --device cpu to plan a CPU run")
        experts = expert_request(cfg, expert_backend, expert_slots, expert_slots_file, expert_budget, loaded, policy)
        if pinned_experts_file is not None:
            from dataclasses import replace

            experts = replace(experts, pinned=opt.pinned_experts(pinned_experts_file, experts.backend))
        # the pool: max_num_seqs requests of full length, as generate configures the engine
        config = opt.engine_config_for(cfg.max_position_embeddings, max_model_len, max_num_seqs,
                                       max_num_tokens=max_num_tokens, decode_tokens=decode_tokens, dense_weights=dense_weights,
                                       enable_prefix_caching=enable_prefix_caching,
                                       kv_host_bytes=opt.kv_host_memory(kv_host_memory),
                                       speculative_config=opt.speculative_config(speculative_config))
        req = request_for(cfg, tdtype, device, config, gpu_memory, host_memory)
        plan = plan_for(req, experts, loaded)
        if loaded is not None:
            plan.prediction = predict(plan, cfg, loaded, policy)
    except MoetierError as e:
        opt.fail(e)
    refused = None if plan.fits() else refusal(req, plan)
    if pinned_out is not None and refused is None:
        from moetier.experts.cache.split import write_pinned_file

        try:
            write_pinned_file(pinned_out, plan.pinned_experts, {"model": cfg.model_type, "layers": cfg.num_layers},
                              plan.slots_per_layer)
        except OSError as e:
            opt.fail(MoetierError(f"--pinned-out {pinned_out}: cannot write it ({e.strerror})"))
    if as_json:
        typer.echo(to_json(plan))
        if refused is not None:
            typer.echo(f"error: {str(refused).splitlines()[0]}", err=True)
    elif refused is not None:
        typer.echo(f"error: {refused}", err=True)  # the summary, the table, what would fit instead
    else:
        typer.echo(table(plan))
    if refused is not None:
        raise typer.Exit(2)
