"""Where a prefix-cached serving level's time goes, step by step: the workloads of
scripts/prefix_cache_h200.sh (bench serve's shared-prefix and multi-turn prompts, bench/serve.chains)
run through the engine directly, without a server, each step's wall time recorded with what it
carried (tokens, sequences, cached tokens, host-tier copies each way).

    python scripts/profile_prefix_steps.py OUT.json [--dataset shared-prefix|multi-turn]
        [--concurrency 16] [--kv-tokens 262144] [--kv-host-memory-gib 0] [--repeat 2] [--layers 8]

Qwen3-30B-A3B cut to --layers layers, random weights, slots at 50% of the expert bytes, the qwen3-30b-like
routing trace, the server's engine defaults. --concurrency requests (chains: multi-turn's conversations)
run at once, each chain's next request entering when the one before it ends, as bench serve's client
does. The level runs --repeat times in one engine (the first after a warm-up of one request per prefix),
and the last repeat once more under torch.profiler: the kernels by GPU time and the host functions
by their own time go into the JSON. Prints per repeat the level's wall time and its steps by kind,
and every Triton compile (kernel, the step it fell in, its milliseconds: a first use of a
specialization on this machine or process).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from moetier.bench.common import command, provenance
from moetier.bench.serve import Prefixes, chains
from moetier.checkpoint.random_bed import random_bed, use_backend
from moetier.engine import EngineConfig, LLM
from moetier.presets import preset
from moetier.sampling_params import SamplingParams

SHAPES = {"shared-prefix": dict(n=16, input_len=4160, output_len=32, shape=Prefixes(4096, 4, 1)),
          "multi-turn": dict(n=128, input_len=4608, output_len=64, shape=Prefixes(4096, 4, 2))}


COMPILES: list[dict] = []  # every Triton compile: kernel, where (level, step), ms
WHERE = {"at": "startup"}
PROBE: dict = {}  # what the step now running carried (main's wrapper of runner.execute writes it)


def log_compiles() -> None:
    """Time JITFunction._do_compile (the compile of a specialization not yet in this process)."""
    import triton.runtime.jit as jit

    inner = getattr(jit.JITFunction, "_do_compile", None)
    if inner is None:
        print("this Triton has no JITFunction._do_compile: compiles are not logged")
        return

    def timed(self, key, signature, device, constexprs, options, attrs, warmup):
        t = time.perf_counter()
        out = inner(self, key, signature, device, constexprs, options, attrs, warmup)
        COMPILES.append(dict(kernel=getattr(self, "__name__", "?"), at=WHERE["at"],
                             ms=round((time.perf_counter() - t) * 1e3, 1), key=str(key)[:300]))
        return out

    jit.JITFunction._do_compile = timed


def run_level(llm: LLM, level: list[list[tuple[list[int], int]]], concurrency: int, steps: list[dict],
              label: str = "") -> float:
    """Every chain's requests in order, `concurrency` chains at once; appends a record per step."""
    pending, active = list(level), {}  # active: request id -> the rest of its chain
    t0 = time.perf_counter()

    def start(chain):
        (prompt, out), rest = chain[0], chain[1:]
        active[llm.add_request(prompt, SamplingParams(max_tokens=out, ignore_eos=True, temperature=0))] = rest

    while pending and len(active) < concurrency:
        start(pending.pop(0))
    while active:
        WHERE["at"] = f"{label} step {len(steps)}"
        t = time.perf_counter()
        outs = llm.step()
        rec = dict(PROBE, ms=(time.perf_counter() - t) * 1e3)
        steps.append(rec)
        for o in outs:
            if o.finished:
                rest = active.pop(o.request_id)
                if rest:
                    start(rest)
                elif pending:
                    start(pending.pop(0))
    return time.perf_counter() - t0


def summary(steps: list[dict], decode_tokens: int) -> dict:
    kinds: dict[str, list[float]] = {}
    for s in steps:
        kind = ("large" if s["tokens"] > decode_tokens else "small") + (" +copies" if s["up"] or s["down"] else "")
        kinds.setdefault(kind, []).append(s["ms"])
    return {k: dict(steps=len(v), ms=round(sum(v), 1), median_ms=round(statistics.median(v), 2),
                    max_ms=round(max(v), 1)) for k, v in sorted(kinds.items())} | dict(
        pages_up=sum(s["up"] for s in steps), pages_down=sum(s["down"] for s in steps))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--dataset", choices=tuple(SHAPES), default="shared-prefix")
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--kv-tokens", type=int, default=262144)
    ap.add_argument("--kv-host-memory-gib", type=float, default=0.0)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--layers", type=int, default=8)
    a = ap.parse_args()
    if min(a.concurrency, a.kv_tokens, a.repeat, a.layers) < 1 or not a.kv_host_memory_gib >= 0:
        ap.error("--concurrency, --kv-tokens, --repeat, --layers take positive integers; "
                 "--kv-host-memory-gib a size of at least 0")
    if not a.out.parent.is_dir():
        ap.error(f"{a.out}: not a file path in an existing directory")
    cuda = torch.cuda.is_available()
    bed = random_bed(preset("qwen3-30b-a3b", a.layers, "bfloat16" if cuda else "float32"),
                     device="cuda" if cuda else "cpu", dtype=torch.bfloat16 if cuda else torch.float32)
    use_backend(bed, "slots", 0.5)
    config = EngineConfig(replay_trace="data/traces/qwen3-30b-like.mtrace", kv_tokens=a.kv_tokens,
                          kv_host_bytes=int(a.kv_host_memory_gib * 2**30), cuda_graphs=cuda)
    log_compiles()
    llm = LLM.from_model(bed.model, bed.tokenizer, config)
    execute = llm.runner.execute

    def probed(step):  # what the step carried, read before it runs
        PROBE.update(tokens=step.num_tokens, seqs=len(step.seqs), up=len(step.copies_to_host),
                     down=len(step.copies_to_gpu))
        return execute(step)

    llm.runner.execute = probed
    s = SHAPES[a.dataset]
    ids = random.Random(1).choices(range(1000, 30000), k=4 * (s["input_len"] + s["output_len"]))
    level = chains(a.dataset, s["n"], s["input_len"], s["output_len"], ids, 0, s["shape"])
    warm = [[c[0]] for c in level[:s["shape"].num_prefixes]]
    run_level(llm, warm, 1, [], "warm-up")
    line, _ = command()
    record = dict(command=line, provenance=provenance(), args=vars(a) | dict(out=str(a.out)), repeats=[])
    for r in range(a.repeat):
        steps: list[dict] = []
        wall = run_level(llm, level, a.concurrency, steps, f"repeat {r}")
        rep = dict(wall_s=round(wall, 3), summary=summary(steps, llm.config.decode_tokens), steps=steps)
        record["repeats"].append(rep)
        print(f"repeat {r}: {wall * 1e3:.1f} ms, {len(steps)} steps; " + "; ".join(
            f"{k}: {v}" for k, v in rep["summary"].items()))
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=acts) as prof:
        run_level(llm, level, a.concurrency, [], "profiled")
    avg = prof.key_averages()
    gpu = sorted((e for e in avg if e.device_time_total > 0), key=lambda e: -e.device_time_total)[:25]
    host = sorted(avg, key=lambda e: -e.self_cpu_time_total)[:25]
    record["kernels"] = [[e.key, e.count, round(e.device_time_total / 1e3, 2)] for e in gpu]
    record["host_ops"] = [[e.key, e.count, round(e.self_cpu_time_total / 1e3, 2)] for e in host]
    print("kernels by GPU ms:", *(f"  {k[2]:9.2f} {k[1]:6d} {k[0][:90]}" for k in record["kernels"][:15]), sep="\n")
    print("host ops by own ms:", *(f"  {k[2]:9.2f} {k[1]:6d} {k[0][:90]}" for k in record["host_ops"][:15]), sep="\n")
    record["compiles"] = COMPILES
    late = [c for c in COMPILES if c["at"] != "startup"]
    early = sum(c["ms"] for c in COMPILES if c["at"] == "startup")
    print(f"Triton compiles: {len(COMPILES) - len(late)} at startup ({early:.0f} ms), {len(late)} after it:",
          *(f"  {c['ms']:8.1f} ms {c['kernel']:24s} {c['at']}" for c in late), sep="\n")
    a.out.write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
