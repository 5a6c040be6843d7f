"""`moetier bench decode --parallel 1,tp2,ep2`: the decode benchmark's rows over several ranks,
beside the one-GPU rows of the same run (issue 18: is TP or EP on two GPUs worth it, and what do
the collectives cost per step).

Row syntax (each row says its world size): `1` one GPU (the ordinary rows), `tpN` tensor
parallelism over N GPUs, `epN` expert parallelism over N GPUs, `tpNepN` both over the same N.
Every parallel row is an engine of its own: random weights of the preset made by every rank for its
share (checkpoint/random_bed.RandomModel; EP ranks together hold exactly the one-GPU experts, so
their outputs are checked against the one-GPU reference row of the run; TP ranks draw their own dense
shards, so theirs are checked against the first row of their own layout: bench/outputs.py), the same
replayed trace on every rank, the same prompts. The expert budget is per GPU: a
rank's slots hold that share of the *model's* experts, capped at the experts it owns, so `ep2` at
50% holds every expert it owns in HBM and `tp2` at 50% the same slots as one GPU.

Per row: tok/s and step time through LLM.step() (rank 0's scheduler, the step broadcast, every
rank's forward, sampling), every rank's expert statistics and hit rate over the timed window
(`expert_stats_per_rank`, `hit_rate_per_rank`: gathered between steps, LLM.expert_stats_per_rank;
`expert_stats` stays rank 0's), rank 0's roofline (one rank's bytes: the ranks run side by side; the
collectives are not in it), and the all-reduce time per step measured on rank 0
(dist/timing.CollectiveTimer: CUDA events around each all-reduce, no host sync; a parallel engine
decodes eagerly, so every all-reduce is seen). NOTE: rank 0's slot cache is warmed like one GPU's;
the workers' fill in the warm-up steps.
"""

from __future__ import annotations

import re

import torch

from moetier.bench.decode_steps import decode_once, distinct_per_step, graph_mode, roofline, warm_all
from moetier.checkpoint.random_bed import RandomModel, slots_for
from moetier.config import ModelConfig
from moetier.engine.config import EngineConfig
from moetier.engine.llm import LLM
from moetier.errors import MoetierError
from moetier.experts.registry import Resident, Slots, Uva, backend_kind
from moetier.parallel import layout_problems
from moetier.traces.format import Trace

BACKENDS = (Resident.name, Uva.name, Slots.name)  # hybrid is refused under EP; the transformers peer is one GPU


def parse_layouts(text: str) -> list[tuple[int, int]]:
    """'1,tp2,ep2' -> [(1, 1), (2, 1), (1, 2)]: (tp, ep) per row kind, in the order given."""
    out: list[tuple[int, int]] = []
    for item in (t.strip().lower() for t in text.split(",")):
        m = re.fullmatch(r"(?:tp(\d+))?(?:ep(\d+))?", item)
        if item == "1":
            lay = (1, 1)
        elif item and m and (m.group(1) or m.group(2)):
            lay = (int(m.group(1) or 1), int(m.group(2) or 1))
            problems = layout_problems(max(lay), *lay)
            if problems or max(lay) < 2:
                raise MoetierError(f"--parallel {item!r}: " + ("; ".join(problems) or "a parallel row needs 2 or "
                                                               "more ranks"))
        else:
            raise MoetierError(f"--parallel {text!r}: give comma-separated rows like 1,tp2,ep2 (1: one GPU, tpN / "
                               "epN / tpNepN: N GPUs)")
        if lay not in out:
            out.append(lay)
    return out


def label(tp: int, ep: int) -> str:
    return "1" if tp == ep == 1 else (f"tp{tp}" if tp > 1 else "") + (f"ep{ep}" if ep > 1 else "")


def parallel_rows(cfg: ModelConfig, trace: Trace, trace_path: str, tp: int, ep: int, budgets: list[float],
                  batches: list[int], backends: list[str], args: dict, bw: dict, dtype: str = "bf16") -> list[dict]:
    """The (tp, ep) rows of every backend this layout runs (resident, uva, slots at each budget)."""
    plan = [(Resident.name, 1.0)] * (Resident.name in backends) + [(Uva.name, 0.0)] * (Uva.name in backends)
    plan += [(Slots.name, b) for b in budgets if Slots.name in backends]
    rows: list[dict] = []
    for backend, budget in plan:
        rows += bench_layout(cfg, trace, trace_path, tp, ep, backend, budget, batches, args, bw, dtype)
        print(f"{label(tp, ep)} {backend} done: "
              + ", ".join(f"b{r['batch']} {r['tok_s']:.1f} tok/s" for r in rows[-len(batches):]), flush=True)
    return rows


def bench_layout(cfg: ModelConfig, trace: Trace, trace_path: str, tp: int, ep: int, backend: str, budget: float,
                 batches: list[int], args: dict, bw: dict, dtype: str = "bf16") -> list[dict]:
    from moetier.plan.nodes import rank_plans
    from moetier.plan.preflight import request_for

    device, model_dtype = args.get("device", "cuda"), args.get("model_dtype", "bfloat16")
    random = RandomModel(args["preset"], args.get("layers"), backend, budget, args["policy"], args["seed"],
                         None if dtype == "bf16" else dtype, args.get("expert_split", "auto"))
    prompt_len, most = args["prompt_len"], max(batches)
    config = EngineConfig(replay_trace=trace_path, max_num_seqs=most, decode_tokens=args["decode_tokens"],
                          max_num_tokens=max(512, most * prompt_len),
                          kv_tokens=most * (prompt_len + args["warmup"] + args["tokens"] + 16),
                          tensor_parallel_size=tp, expert_parallel_size=ep,
                          step_record_group=args.get("step_record_group", "world"))
    # every rank's share against its GPU and its node, before any rank makes its weights
    req = request_for(cfg, getattr(torch, model_dtype), device, config, args.get("gpu_memory"),
                      args.get("host_memory"))
    par = config.layout()
    _, _, plans = rank_plans(req, random.options(cfg, par), par, args.get("gpu_memory"), args.get("host_memory"))
    llm = LLM.from_random(random, model_dtype, device, config, rank_plans=plans)
    bed = llm.bed
    slots = slots_for(cfg, backend, budget, ep, tp if bed.split == "columns" else 1)
    warm_all(bed.model)  # rank 0's cache in its steady state, as one GPU's rows
    rows = []
    try:
        for b in batches:  # NOTE: back to back as one GPU's rows, so each starts at the same trace step
            sent = (llm.runner.broadcast_s, llm.runner.broadcasts)
            r = decode_once(llm, b, prompt_len, args["warmup"], args["tokens"], args["seed"], keep_logits=True)
            # rank 0's wall time in the step record's broadcast, per step (dist/executor.DistributedRunner)
            r["record_broadcast_ms_per_step"] = ((llm.runner.broadcast_s - sent[0]) * 1e3
                                                 / max(1, llm.runner.broadcasts - sent[1]))
            r["step_record_group"] = args.get("step_record_group", "world")
            st = r["expert_stats"]  # rank 0's: the roofline is one rank's bytes
            kind = backend_kind(backend)
            if kind.cached:
                per = max(1, st["steps"])
                hbm, link = (st["hits"] + st["misses"]) / per, (st["misses"] + st["overflow"]) / per
            else:  # rank 0 computes the distinct experts of the step that it owns: 1/ep of them
                distinct = distinct_per_step(trace, *r["cursor"], b) / ep
                hbm, link = (0.0, distinct) if kind.host_store else (distinct, 0.0)
            roof = roofline(bed, b, hbm, link, bw["hbm_GBps"], bw["link_GBps"])
            rows.append({"backend": backend, "budget": budget if kind.cached else None, "slots": slots,
                         "graphs": graph_mode(llm), "parallel": label(tp, ep), "world": max(tp, ep), "tp": tp,
                         "expert_split": bed.split,
                         "ep": ep, **r, **roof, "of_roofline": r["tok_s"] / roof["roofline_tok_s"],
                         "hbm_experts_per_layer_step": hbm, "link_experts_per_layer_step": link})
        for r in rows:
            r.update(collective_window(llm, r["batch"], prompt_len, args["seed"] + 1))
    finally:
        llm.close()
    return rows


def collective_window(llm: LLM, batch: int, prompt_len: int, seed: int) -> dict:
    """The all-reduce figures of a row: a short window of eager steps at its batch (every rank eager:
    runner.graphs_on), timed by the collective timer. NOTE: a replayed graph records no spans, so
    these are eager all-reduces (launches and the wait for the slower rank included), not the
    graphed step's."""
    runner, timer = getattr(llm.runner, "inner", llm.runner), llm.parallel.timer
    runner.graphs_on = False
    try:
        eager = decode_once(llm, batch, prompt_len, 4, 8, seed, on_timed=timer.start)
    finally:
        runner.graphs_on = True
    spent = timer.take()
    timer.stop()
    steps = max(1, eager["timed_steps"])
    return {"eager_tok_s": eager["tok_s"], "eager_step_ms_median": eager["step_ms_median"],
            "collectives": {over: {"calls_per_step": d["calls"] / steps, "ms_per_step": d["ms"] / steps,
                                   "bytes_per_step": d["bytes"] / steps} for over, d in spent.items()},
            "all_reduce_ms_per_step": sum(d["ms"] for d in spent.values()) / steps}
