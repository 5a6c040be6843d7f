"""`moetier bench decode`: decode tokens per second through the whole engine, ours against the
peers, on the same weights in one run.

One random-weight model (made in memory: the full Qwen3-30B-A3B is 61 GB, more than the disk
holds as a file) or a given checkpoint; its routed experts sit once in the pinned host store and
every backend is built over that store in turn: resident (a device copy), slots at each expert
budget, uva, and the peer users try first, transformers with accelerate offloading the same share
of expert bytes (bench/peer_hf.py). Routing is replayed from a trace, so every backend computes the
same experts. Each row carries its roofline: HBM bytes per step over the measured HBM bandwidth plus
link bytes per step over the measured host-to-GPU bandwidth, and achieved over roofline.

Steps are timed through `LLM.step()` (scheduler, graph replay, sampling, detokenizing), after warm-up
steps that also fill the slot cache; graph capture and kernel compilation happen before any timing.
"""

from __future__ import annotations

import copy
import statistics
import sys
import time

import torch

from moetier.bench import decode_spec
from moetier.bench.common import links, trace_info
from moetier.bench.decode_report import check_tokens, plot, ratios, row_name, table  # noqa: F401 -- cli's names
from moetier.bench.hybrid_rows import host_options, hybrid_rates  # noqa: F401 -- scripts/profile_hybrid.py's
from moetier.bench.decode_steps import (decode_once, distinct_per_step, graph_mode, hit_rate,  # noqa: F401
                                        replay_kernels, roofline, warm_all)
from moetier.bench.outputs import References, strip
from moetier.checkpoint.random_bed import Bed, loaded_bed, random_bed, use_backend
from moetier.config import ModelConfig
from moetier.engine.config import EngineConfig
from moetier.engine.llm import LLM
from moetier.experts.hybrid.phases import model_phases
from moetier.experts.placement import ExpertOptions
from moetier.experts.registry import Hybrid, Resident, Slots, Uva, backend_kind
from moetier.spec.config import SpeculativeConfig
from moetier.traces.format import Trace

# hybrid rows' decode modes (--hybrid-graphs), in the order their rows run: eager first, as a capture
# that fails on a machine may leave the CUDA context unusable. eager: no CUDA graphs (EngineConfig.cuda_graphs
# off); auto: the engine's default, its host path's graph and the whole slots-step graph switched per step
# (engine/switch.py; a row says which it made: nodes-auto or pieces-auto)
HYBRID_GRAPH_MODES = ("eager", "auto")


def repeated(run, repeats: int) -> dict:
    """run(first) `repeats` times (first: the run whose outputs are checked, bench/outputs.py) -> the
    median run's record (of an even count, the lower middle) with every run's tok/s, their median and
    their spread (min-max). Each run decodes the same prompts from where the trace cursor stands, so
    every row's n-th run replays the same routing as its reference's."""
    runs = [run(i == 0) for i in range(repeats)]
    rates = [x["tok_s"] for x in runs]
    mid = {**sorted(runs, key=lambda x: x["tok_s"])[(repeats - 1) // 2]}
    mid.update(tokens=runs[0]["tokens"], logits=runs[0].get("logits"), runs=repeats, runs_tok_s=rates,
               tok_s=statistics.median(rates), tok_s_min=min(rates), tok_s_max=max(rates))
    return mid


def progress(line: str) -> None:
    """A line on stderr as each bed and row is done: a run cut short by a time limit still says how far it
    got and what each part took (the tables go to stdout once a backend's batches are done)."""
    print(f"bench decode: {line}", file=sys.stderr, flush=True)


def bench_engine(bed: Bed, trace: Trace, trace_path: str, backend: str, budget: float, batches: list[int],
                 args: dict, bw: dict, mode: str = "auto", per_layer: dict[int, int] | None = None,
                 prefetch: str = "off", spec: SpeculativeConfig | None = None) -> list[dict]:
    """mode (hybrid rows; HYBRID_GRAPH_MODES): eager (no graphs) or auto (the engine's default: the
    row's `graphs` says which it made, nodes-auto or pieces-auto). per_layer: slots per MoE layer (a
    slots file) instead of the budget's count; the row's budget is then their share of the experts.
    prefetch: next-layer expert prefetch of slots rows (experts/prefetch.py MODES). spec: the engine
    speculates (bench/decode_spec.py: the rows' counters, their check by tokens)."""
    kind = backend_kind(backend)
    hybrid = kind.host_compute
    opts = host_options(args, bw) if hybrid else {}
    if per_layer:
        opts["slots_per_layer"] = per_layer
    slots = use_backend(bed, backend, budget, args["policy"], args["decode_tokens"], **opts)
    if hybrid and mode == "auto":  # what the default made of it
        mode = "nodes-auto" if getattr(bed.model.moe_blocks()[0].experts, "graph_safe", False) else "pieces-auto"
    prompt_len = args["prompt_len"]
    drafts = spec.num_speculative_tokens if spec else 0  # a verify step's rows past the last token kept
    config = EngineConfig(replay_trace=trace_path, max_num_seqs=max(batches), decode_tokens=args["decode_tokens"],
                          max_num_tokens=max(512, max(batches) * prompt_len),
                          kv_tokens=max(batches) * (prompt_len + args["warmup"] + args["tokens"] + drafts + 16),
                          cuda_graphs=mode != "eager", experts=ExpertOptions(prefetch=prefetch),
                          speculative_config=spec, async_scheduling=args.get("async_scheduling", False))
    t0 = time.perf_counter()
    llm = LLM.from_model(bed.model, bed.tokenizer, config)
    warm_all(bed.model)
    what = f"{backend} " + ("(slots file)" if per_layer else f"{budget:.0%}") + (
        f" prefetch {prefetch}" if prefetch != "off" else "") + (f" {decode_spec.label(spec)}" if spec else "")
    progress(f"{what}: engine ready in {time.perf_counter() - t0:.1f} s")
    rows = []
    try:
        for b in batches:
            t0 = time.perf_counter()
            switch = getattr(llm.runner.graphs, "switch", None)
            counts0 = dict(switch.counts) if switch else {}
            # hybrid: a fresh phase clock (a few perf_counter calls per layer) as the timed window opens
            timed = (lambda: [blk.experts.profile(True) for blk in bed.model.moe_blocks()]) if hybrid else None
            r = repeated(lambda first: speculating(llm, spec, lambda opened: decode_once(
                llm, b, prompt_len, args["warmup"], args["tokens"], args["seed"], on_timed=opened,
                keep_logits=first and spec is None), timed), args.get("repeats", 1))
            kernels = replay_kernels(llm, b)  # None without graphs (the CPU)
            if kernels:  # the step's graph: its launches beside its replay time (the rest is launch gaps)
                r.update(kernels_per_step=kernels["kernels_per_step"], kernel_ms_per_step=kernels["kernel_ms_per_step"],
                         kernel_table=kernels["table"])
            if switch:  # steps of this run (warm-up included) on each variant, and what they cost
                r["switch"] = {"steps": {k: v - counts0[k] for k, v in switch.counts.items()},
                               "overhead_ms": {n: s * 1e3 for n, s in llm.runner.graphs.overhead_s.items()},
                               "last_misses_per_layer_step": switch.last_misses_per_layer_step}
            st = r["expert_stats"]
            host_experts = None
            prefetched = None
            if kind.cached:
                per = max(1, st["steps"])  # layer-steps: every counter is summed over layers
                hbm_experts = (st["hits"] + st["misses"]) / per
                # the step's own misses: on its critical path (prefetch fills cross the link beside it)
                link_experts = (st["misses"] + st["overflow"]) / per
                if prefetch != "off":
                    prefetched = st.get("prefetch_fills", 0) / per
                if hybrid:
                    host_experts = st.get("host", 0) / per
            else:
                distinct = distinct_per_step(trace, *r["cursor"], b)
                hbm_experts, link_experts = (0.0, distinct) if kind.host_store else (distinct, 0.0)
            roof = roofline(bed, b, hbm_experts, link_experts, bw["hbm_GBps"], bw["link_GBps"])
            if hybrid:
                hp = bed.model.moe_blocks()[0].experts.hostpath
                r["hybrid"] = {"host_experts_per_layer_step": host_experts, "host_pairs": st.get("host_pairs", 0),
                               "host_kernel_ms_per_step": st.get("host_us", 0) / 1e3 / max(1, r["timed_steps"]),
                               "rates": hybrid_rates(bed.model), "host_threads": hp.kernel.threads,
                               "host_kernel": hp.kernel.name, "phases_us": model_phases(bed.model.moe_blocks())}
            rows.append({"backend": backend, "budget": budget if kind.cached else None, "slots": slots,
                         **({"slots_per_layer": {str(la): n for la, n in per_layer.items()}} if per_layer else {}),
                         "graphs": mode if hybrid else graph_mode(llm),
                         **r, **roof, "of_roofline": r["tok_s"] / roof["roofline_tok_s"],
                         "hbm_experts_per_layer_step": hbm_experts, "link_experts_per_layer_step": link_experts,
                         **({"prefetch": prefetch, "prefetch_experts_per_layer_step": prefetched}
                            if prefetch != "off" else {}),
                         **({"spec": decode_spec.label(spec), "speculative_config": vars(spec)} if spec else {})})
            progress(f"{what} batch {b}: {r['tok_s']:.1f} tok/s, {time.perf_counter() - t0:.1f} s" + (
                f"; {kernels['kernels_per_step']:.0f} kernels a step, {kernels['kernel_ms_per_step']:.3f} ms of "
                f"kernel time in the {r['gpu_replay_ms']:.3f} ms replay" if kernels and r.get("gpu_replay_ms") else ""))
    finally:
        llm.close()
    return rows


def speculating(llm: LLM, spec: SpeculativeConfig | None, decode, timed) -> dict:
    """decode(on_timed) -> one run's record; with spec, its speculation counters over the timed window
    added (bench/decode_spec.py). timed: what else opens with the window (hybrid's phase clock) or None."""
    if spec is None:
        return decode(timed)
    counters, before = llm.scheduler.spec.counters, []

    def opened():
        before.append(copy.deepcopy(counters))
        if timed is not None:
            timed()

    r = decode(opened)
    r["spec_decode"] = decode_spec.fields(counters.since(before[0]), r)
    return r


def bench_hf(bed: Bed, trace: Trace, budget: float, batches: list[int], args: dict, bw: dict) -> list[dict]:
    from moetier.bench.peer_hf import build_hf_peer

    use_backend(bed, Uva.name)  # our experts stay in the host store only: the GPU is the peer's
    peer = build_hf_peer(bed.model, budget, host_rows=bed.host)
    peer.replay(trace.ids)
    rows = []
    try:
        for b in batches:
            g = torch.Generator().manual_seed(args["seed"])  # decode_once's prompts: the output check's
            prompts = torch.randint(0, bed.tokenizer.vocab_size, (b, args["prompt_len"]), generator=g).tolist()
            r = peer.decode(prompts, args["hf_tokens"], warmup=2)
            # The peer streams every offloaded layer's experts, all of them, at every forward.
            offloaded = peer.report["offloaded_bytes"] / bed.row_bytes / len(bed.host)
            on_gpu = distinct_per_step(trace, 0, 64 * b, b) * (1 - peer.report["offloaded_layers"] / len(bed.host))
            roof = roofline(bed, b, on_gpu, offloaded, bw["hbm_GBps"], bw["link_GBps"])
            rows.append({"backend": "hf-accelerate", "budget": budget, "batch": b, **r, **roof,
                         "of_roofline": r["tok_s"] / roof["roofline_tok_s"],
                         "peer": {**r.get("peer", {}), **peer.report}})
    finally:
        peer.close()
    return rows


def bed_dtype(bed: Bed) -> str:
    """The row label of a bed's weight format: the experts' format (fp8, nvfp4, ...; dense weights in
    the model dtype), <format>-dense (the dense projections kept in that format too: fp8-dense,
    nvfp4-dense, ...), or the model dtype (bf16, float32)."""
    if bed.cfg.quant is not None:
        return bed.cfg.quant + ("-dense" if bed.cfg.dense_quant else "")
    return {torch.bfloat16: "bf16"}.get(bed.model.dtype, str(bed.model.dtype)[6:])


def make_bed(cfg: ModelConfig, dtype: str, seed: int, pinned: dict | None = None) -> Bed:
    """A random bed of one --dtype format: bf16, an expert format (fp8, nvfp4, int4, ...: the routed
    experts in it, dense weights bf16) or <format>-dense (the dense projections kept in it too,
    layers/quant_linear.py); pinned: experts made on the GPU with no host copy."""
    quant = None if dtype == "bf16" else dtype.removesuffix("-dense")
    return random_bed(cfg, seed, quant=quant, keep_dense=dtype.endswith("-dense"), pinned=pinned)


def run(cfg: ModelConfig, trace_path: str, budgets: list[float], batches: list[int], backends: list[str],
        args: dict, model_path: str | None = None, bed: Bed | None = None, bw: dict | None = None,
        dtypes: tuple[str, ...] = ("bf16",), beds: dict[str, Bed] | None = None,
        layouts: tuple[tuple[int, int], ...] = ((1, 1),)) -> dict:
    """Every backend row for each weight format in `dtypes` ("bf16"; "fp8": random weights with the
    experts in FP8 rows; "fp8-dense": the dense projections in FP8 too), one bed at a time, side by side in one record. bed / beds and bw: models
    already built and bandwidths already measured (tests on the CPU). layouts: (tp, ep) of the rows; (1, 1)
    is one GPU, the others run over several ranks after the one-GPU bed is freed (decode_parallel.py)."""
    from moetier.bench.decode_parallel import parallel_rows

    from moetier.traces.format import read_trace

    if bed is not None and len(dtypes) > 1:
        raise ValueError("one bed runs one expert format; pass beds={dtype: bed} for several")
    trace = read_trace(trace_path)
    link, rows, configs, build_s, errors, refs = {}, [], {}, 0.0, [], References()
    for dtype in dtypes:
        t0 = time.perf_counter()
        if beds is not None:
            b = beds[dtype]
        elif bed is not None:
            b = bed
        else:
            b = loaded_bed(model_path) if model_path else make_bed(cfg, dtype, args["seed"], args.get("pinned"))
        build_s += time.perf_counter() - t0
        progress(f"{dtype} weights ready in {time.perf_counter() - t0:.1f} s")
        if bw is None:  # measured once, with the first bed's rows
            link = links(row_bytes=b.row_bytes)
            bw = {"hbm_GBps": link["d2d_GBps"], "link_GBps": link["h2d_copy_engine_GBps"]}
        label = bed_dtype(b)
        configs[label] = {"row_bytes": b.row_bytes, "dense_bytes": b.dense_bytes,
                          "expert_bytes": b.row_bytes * cfg.num_experts * len(b.host)}
        if (1, 1) in layouts:
            rows += run_bed(b, trace, trace_path, budgets, batches, backends, args, bw, errors, refs)
        for block in b.model.moe_blocks():
            block.experts = None  # let this bed's device rows go before the next is built
        del b
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        for tp, ep in (lay for lay in layouts if lay != (1, 1)):
            par = [{**r, "dtype": label} for r in parallel_rows(cfg, trace, trace_path, tp, ep, budgets, batches,
                                                                backends, args, bw, dtype)]
            for r in par:  # EP: the one-GPU row of the run (else the layout's first); TP: its own first row
                group = (label, r["batch"]) + ((r["parallel"],) if tp > 1 else ())
                refs.check(r, group, row_name(r), exact_by_design=tp > 1 and ep == 1)
            rows += par
    same = check_tokens(rows)
    first = next(iter(configs.values()))
    return {"config": {"layers": cfg.num_layers, "hidden": cfg.hidden_size, "experts": cfg.num_experts,
                       "top_k": cfg.top_k, "moe_inter": cfg.moe_intermediate_size, "vocab": cfg.vocab_size,
                       "dtype": ",".join(configs), **first, "by_dtype": configs},
            "trace": str(trace_path), "trace_file": trace_info(trace_path), "links": link, "bandwidth": bw, "build_s": build_s, "args": args,
            "greedy_tokens_equal_to_resident": same, **refs.summary(rows, row_name), "errors": errors,
            "rows": strip(rows)}


def run_bed(bed: Bed, trace: Trace, trace_path: str, budgets: list[float], batches: list[int],
            backends: list[str], args: dict, bw: dict, errors: list[dict], refs: References | None = None
            ) -> list[dict]:
    """The one-GPU rows of one bed, each checked against the reference (bench/outputs.py): resident, or
    without it the first slots row (which then runs first), else the first row that ran."""
    refs = refs if refs is not None else References()
    label, rows = bed_dtype(bed), []
    plan = [(Resident.name, 1.0)] * (Resident.name in backends)
    plan += [(Slots.name, b) for b in budgets if Slots.name in backends]
    plan[1:1] = [(Uva.name, 0.0)] * (Uva.name in backends)  # after the reference
    modes = sorted(args.get("hybrid_graphs") or ["auto"], key=HYBRID_GRAPH_MODES.index)
    per_layer = args.get("slots_per_layer") or {}
    share = sum(per_layer.values()) / (len(per_layer) * bed.cfg.num_experts) if per_layer else None
    plan = [(b, budget, "auto", None) for b, budget in plan]
    plan += [(Slots.name, share, "auto", per_layer)] * bool(per_layer and Slots.name in backends)
    # every slots row once per prefetch mode, in the order given
    plan = [(*p, pf) for p in plan for pf in ((args.get("prefetch") or ["off"]) if p[0] == Slots.name else ["off"])]
    for mode in modes:
        plan += [(Hybrid.name, b, mode, None, "off") for b in budgets if Hybrid.name in backends]
        plan += [(Hybrid.name, share, mode, per_layer, "off")] * bool(per_layer and Hybrid.name in backends)
    spec = decode_spec.parse(args.get("speculative_config"))  # each row again with it, after it
    for backend, budget, mode, counts, prefetch, sp in ((*p, sp) for p in plan for sp in (None, spec)[:1 + bool(spec)]):
        try:
            rows += bench_engine(bed, trace, trace_path, backend, budget, batches, args, bw, mode, counts, prefetch, sp)
        except Exception as e:  # noqa: BLE001 -- a hybrid mode that fails on a machine is a result to report
            if not backend_kind(backend).host_compute:
                raise
            errors.append({"backend": backend, "budget": budget, "graphs": mode, "dtype": bed_dtype(bed),
                           "error": repr(e), **({"spec": decode_spec.label(sp)} if sp else {})})
            print(f"hybrid {budget:.0%} graphs={mode} failed: {e!r}", flush=True)
            continue
        for r in rows[-len(batches):]:
            r["dtype"] = label
            refs.check(r, (label, r["batch"]), row_name(r), exact_by_design=not backend_kind(backend).host_compute)
            decode_spec.judge(r)
        decode_spec.pair_with_plain(rows)
        print(table(rows[-len(batches):]), flush=True)
    if "hf" in backends and bed.cfg.quant is None:  # the transformers peer runs bf16 experts only
        for budget in budgets:
            got = bench_hf(bed, trace, budget, [b for b in batches if b <= 8], args, bw)
            for r in got:
                r["dtype"] = label
                refs.check(r, (label, r["batch"]), row_name(r), exact_by_design=False)
            rows += got
            print(table(got), flush=True)
    return rows
