"""Where a hybrid decode step's time goes on the GPU's clock: the engine's real steps (a replayed trace,
so every step routes anew and misses) under torch.profiler, one row per variant, in one process:

    slots     the slot cache alone (whole-step graph)
    nodes     hybrid, the whole step one graph, the host's share a host-function node
    pieces    hybrid, piecewise graphs split at the MoE layers (a host sync per layer)

Per variant it prints the step's wall time, the GPU's busy time (the union of kernel and copy intervals
on every stream), the fill kernels' busy time, the kernels
by total time, and, per MoE layer of the first profiled step (from its first expert kernel to the
next layer's), when its fills, GEMMs, copies and combine ran and how much of it the GPU was busy. It writes each variant's
chrome trace (`OUT/trace-VARIANT.json`) and a JSON summary (`OUT/profile-hybrid.json`).

    python scripts/profile_hybrid.py --trace uniform.mtrace [--batch 1] [--budget 0.5] [--layers 8]
        [--variants slots,nodes,pieces] [--steps 6] [--host-profile FILE] [--out DIR]

CUDA only. The profiler adds its own host overhead per launch (pieces and eager launches pay it, graph
replays hardly): read wall times from `moetier bench decode`, and this for the GPU's timeline.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

from moetier.bench.common import record
from moetier.bench.decode import host_options, warm_all
from moetier.checkpoint.random_bed import random_bed, use_backend
from moetier.engine import LLM, EngineConfig
from moetier.errors import MoetierError
from moetier.presets import preset
from moetier.sampling_params import SamplingParams

VARIANTS = ("slots", "nodes", "pieces")


def gpu_events(trace_path: str) -> list[dict]:
    """Kernel and memcpy/memset events of a chrome trace: name, cat, ts (us), dur (us), stream, bytes."""
    with open(trace_path) as f:
        events = json.load(f)["traceEvents"]
    out = []
    for e in events:
        if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset"):
            a = e.get("args", {})
            out.append({"name": e["name"], "cat": e["cat"], "ts": float(e["ts"]), "dur": float(e["dur"]),
                        "stream": a.get("stream"), "bytes": a.get("bytes", 0)})
    return sorted(out, key=lambda e: e["ts"])


def busy_us(events: list[dict]) -> float:
    """The union of the events' intervals (us): the time the GPU was doing anything."""
    total, end = 0.0, -1.0
    for e in events:
        s, t = e["ts"], e["ts"] + e["dur"]
        if t > end:
            total += t - max(s, end)
            end = t
    return total


FILL_KERNELS = ("_copy_rows", "_copy_chunks")  # the slot fills: kernels reading pinned rows over the link
LAYER_START = ("_hybrid_plan", "_bookkeeping", "_step_regs")  # the first kernel of a MoE layer's expert step


def is_fill(e: dict) -> bool:
    return e["cat"] == "kernel" and any(k in e["name"] for k in FILL_KERNELS)


def summary(events: list[dict], steps: int, wall_s: float) -> dict:
    fills = [e for e in events if is_fill(e)]
    fill_us = busy_us(fills)
    kernels: dict[str, float] = {}
    for e in events:
        if e["cat"] == "kernel":
            kernels[e["name"][:60]] = kernels.get(e["name"][:60], 0.0) + e["dur"] / steps
    span = (events[-1]["ts"] + events[-1]["dur"] - events[0]["ts"]) if events else 0.0
    return {"steps": steps, "wall_ms_per_step": wall_s / steps * 1e3, "gpu_span_ms_per_step": span / steps / 1e3,
            "gpu_busy_ms_per_step": busy_us(events) / steps / 1e3,
            "fill_kernels_per_step": len(fills) / steps, "fill_busy_ms_per_step": fill_us / steps / 1e3,
            "memcpy_per_step": sum(e["cat"] == "gpu_memcpy" for e in events) / steps,
            "streams": sorted({str(e["stream"]) for e in events}),
            "kernels_us_per_step": dict(sorted(kernels.items(), key=lambda kv: -kv[1])[:20])}


def layer_marks(events: list[dict], layers: int) -> list[dict]:
    """The first profiled layers' expert steps, each from its first kernel (the plan or the bookkeeping)
    to the next one's: offsets (us from the segment's start) of the fills, the GEMMs, the copies, and the
    GPU's busy time in it (the rest is idle: the host's syncs, launches, or a host node's wait)."""
    starts = [e["ts"] for e in events if e["cat"] == "kernel" and any(k in e["name"] for k in LAYER_START)]
    out = []
    for i, s in enumerate(starts[:layers]):
        end = starts[i + 1] if i + 1 < len(starts) else s + 1e4
        inside = [e for e in events if s <= e["ts"] < end]

        def span(pick) -> list[float] | None:
            sel = [e for e in inside if pick(e)]
            return [round(sel[0]["ts"] - s), round(max(e["ts"] + e["dur"] for e in sel) - s)] if sel else None
        out.append({"layer": i, "len_us": round(end - s), "busy_us": round(busy_us(inside)),
                    "fills": sum(map(is_fill, inside)), "fills_us": span(is_fill),
                    "gemm_us": span(lambda e: e["cat"] == "kernel" and ("_gate_up" in e["name"] or "_down" in e["name"])),
                    "dtoh_us": span(lambda e: e["cat"] == "gpu_memcpy" and "DtoH" in e["name"]),
                    "htod_us": span(lambda e: e["cat"] == "gpu_memcpy" and "HtoD" in e["name"]),
                    "combine_us": span(lambda e: e["cat"] == "kernel" and "_combine" in e["name"])})
    return out


def run_variant(variant: str, a, cfg) -> dict:
    bed = random_bed(cfg)
    opts = {}
    backend = "slots" if variant == "slots" else "hybrid"
    if backend == "hybrid":
        opts = host_options({"host_profile": a.host_profile}, {"link_GBps": a.link_GBps})
        opts["host_kernel"] = "compiled"
        opts["hybrid_nodes"] = variant == "nodes"
    use_backend(bed, backend, a.budget, **opts)
    config = EngineConfig(replay_trace=a.trace, max_num_seqs=a.batch, kv_tokens=a.batch * 512)
    llm = LLM.from_model(bed.model, bed.tokenizer, config)
    if llm.runner.graphs is not None:
        llm.runner.graphs.switch = None  # the variant's own graph on every step, never the whole slots step
    warm_all(bed.model)
    try:
        g = torch.Generator().manual_seed(0)
        for p in torch.randint(0, 400, (a.batch, 32), generator=g).tolist():
            llm.add_request(p, SamplingParams(max_tokens=a.warmup + a.steps + 4, ignore_eos=True))
        for _ in range(a.warmup):
            llm.step()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            t0 = time.perf_counter()
            for _ in range(a.steps):
                llm.step()
            torch.cuda.synchronize()
            wall = time.perf_counter() - t0
        path = os.path.join(a.out, f"trace-{variant}.json")
        prof.export_chrome_trace(path)
        events = gpu_events(path)
        return {"variant": variant, **summary(events, a.steps, wall), "layers": layer_marks(events, a.layers),
                "stats": llm.metrics().get("expert_stats")}
    finally:
        llm.close()
        del bed
        torch.cuda.empty_cache()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--trace", required=True)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--budget", type=float, default=0.5)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--preset", default="qwen3-30b-a3b")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=24)
    ap.add_argument("--host-profile", default="bench/results/h200-cpu-experts-4b7b6ff.json")
    ap.add_argument("--link-GBps", type=float, default=55.0, help="the link rate the cost model prices (GB/s)")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    a = ap.parse_args()
    variants = [v for v in a.variants.split(",") if v]
    if not variants or set(variants) - set(VARIANTS):
        ap.error(f"--variants {a.variants!r}: choose from {', '.join(VARIANTS)}")
    if min(a.batch, a.steps, a.layers) < 1 or a.warmup < 0 or not 0 < a.budget <= 1:
        ap.error("--batch, --steps and --layers must be >= 1, --warmup >= 0 and --budget in (0, 1]")
    if not 0 < a.link_GBps < math.inf:
        ap.error(f"--link-GBps {a.link_GBps}: give a rate in GB/s above 0")
    for path, name in ((a.trace, "--trace"), (a.host_profile, "--host-profile")):
        if not os.path.isfile(path):
            ap.error(f"{name} {path}: no such file")
    if os.path.exists(a.out) and not os.path.isdir(a.out):
        ap.error(f"--out {a.out}: a file, not a folder")
    try:
        cfg = preset(a.preset, a.layers, "bfloat16")
    except MoetierError as e:
        ap.error(f"--preset {a.preset}: {e}")
    if not torch.cuda.is_available():
        sys.exit("profile_hybrid.py needs CUDA")
    os.makedirs(a.out, exist_ok=True)
    rows = [run_variant(v, a, cfg) for v in variants]
    with open(os.path.join(a.out, "profile-hybrid.json"), "w") as f:
        json.dump(record("profile-hybrid", {"args": vars(a), "rows": rows}), f, indent=1)
    for r in rows:
        print(f"\n== {r['variant']}: wall {r['wall_ms_per_step']:.2f} ms/step, GPU span {r['gpu_span_ms_per_step']:.2f}"
              f", busy {r['gpu_busy_ms_per_step']:.2f} ms/step; fill kernels {r['fill_kernels_per_step']:.1f}/step "
              f"busy {r['fill_busy_ms_per_step']:.2f} ms; memcpys {r['memcpy_per_step']:.1f}/step; streams {r['streams']}")
        for name, us in list(r["kernels_us_per_step"].items())[:10]:
            print(f"   {us:8.1f} us/step  {name}")
        for m in r["layers"]:
            print(f"   layer {m['layer']}: {m['len_us']} us, busy {m['busy_us']}; fills {m['fills']} {m['fills_us']}, "
                  f"gemm {m['gemm_us']}, DtoH {m['dtoh_us']}, HtoD {m['htod_us']}, combine {m['combine_us']}")


if __name__ == "__main__":
    main()
