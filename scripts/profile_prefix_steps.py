"""Where a prefix-cached serving level's time goes, step by step: the workloads of
scripts/prefix_cache_h200.sh (bench serve's shared-prefix and multi-turn prompts, bench/serve.chains)
run through the engine directly, without a server, each step's wall time recorded with what it
carried (tokens, sequences, cached tokens, host-tier copies each way).

    python scripts/profile_prefix_steps.py OUT.json [--dataset shared-prefix|multi-turn]
        [--concurrency 16] [--kv-tokens 262144] [--kv-host-memory-gib 0] [--repeat 2] [--layers 8]
        [--prefix-len 4096] [--preset qwen3-30b-a3b] [--backend slots] [--budget 0.5] [--trace data/traces/qwen3-30b-like.mtrace]

The preset cut to --layers layers, random weights, the expert backend (slots at --budget of the expert
bytes by default), the routing trace (--trace none: the random router's own), the server's engine
defaults. --concurrency requests (chains: multi-turn's conversations)
run at once, each chain's next request entering when the one before it ends, as bench serve's client
does. The level runs --repeat times in one engine (the first after a warm-up of one request per prefix),
and the last repeat once more under torch.profiler: the kernels by GPU time and the host functions
by their own time go into the JSON. Last, one more request over the first prefix with a fresh tail (a
hit, as the level's requests are) has its first step (the uncached tail: the hit's TTFT) timed alone,
profiled (kernels, host functions), run under CUDA's sync debug mode (the step's host syncs by call
site) and under cProfile (its Python functions by own time). Prints per repeat the level's wall time and its steps by kind,
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
from moetier.experts import registry
from moetier.presets import names, preset
from moetier.sampling_params import SamplingParams

def shapes(prefix_len: int) -> dict[str, dict]:
    """prefix_cache_h200.sh's workloads at its --prefix-len of 4096 (a smaller one for small models)."""
    return {"shared-prefix": dict(n=16, input_len=prefix_len + 64, output_len=32, shape=Prefixes(prefix_len, 4, 1)),
            "multi-turn": dict(n=128, input_len=prefix_len + 512, output_len=64, shape=Prefixes(prefix_len, 4, 2))}


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


def hit_step(llm: LLM, prefix: list[int], input_len: int, vocab: range, acts) -> dict:
    """Four requests, each prefix plus a fresh tail to input_len; each one's first step (the tail after
    the hit) run alone: timed, then under the profiler (kernels and host functions), under CUDA's sync
    debug mode (where the step waits for the GPU, by call site), under cProfile (Python functions by
    own time); the rest of each run out."""
    rec: dict = {}
    for n, mode in enumerate(("alone", "profiled", "syncs", "python")):
        tail = random.Random(100 + n).choices(vocab, k=input_len - len(prefix))
        llm.add_request(prefix + tail, SamplingParams(max_tokens=2, ignore_eos=True, temperature=0))
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        t = time.perf_counter()
        if mode == "profiled":
            with profile(activities=acts) as prof:
                llm.step()
        elif mode == "syncs":
            rec["sync_sites"] = sync_sites(llm.step)
        elif mode == "python":
            rec["python"] = python_profile(llm.step)
        else:
            llm.step()
        rec[f"ms_{mode}"] = round((time.perf_counter() - t) * 1e3, 2)
        rec.update(PROBE)
        while llm.has_unfinished():
            llm.step()
    rec.update(by_time(prof, 30, 20))
    print(f"hit step: {rec['ms_alone']} ms alone, {rec['ms_profiled']} ms profiled, {rec.get('tokens')} tokens; "
          f"GPU {rec['kernel_ms']} ms in {rec['kernel_launches']} kernel launches:", *lines(rec["kernels"][:20]),
          "host functions by own ms:", *lines(rec["host_ops"][:12]),
          f"syncs ({rec['ms_syncs']} ms under sync debug mode), by call site:",
          *(f"  {c:4d} {site}" for site, c in rec["sync_sites"].items()),
          f"Python functions by own ms ({rec['ms_python']} ms under cProfile):", *lines(rec["python"][:20]), sep="\n")
    return rec


def by_time(prof, kernels: int, host: int) -> dict:
    """A torch.profiler run's kernels by GPU time and host functions by own time, [name, calls, ms] each,
    with the kernels' total time and launches."""
    avg = prof.key_averages()
    evs = [e for e in avg if e.device_time_total > 0]
    return dict(kernels=[[e.key, e.count, round(e.device_time_total / 1e3, 3)]
                         for e in sorted(evs, key=lambda e: -e.device_time_total)[:kernels]],
                kernel_ms=round(sum(e.self_device_time_total for e in evs) / 1e3, 2),
                kernel_launches=sum(e.count for e in evs if e.self_device_time_total > 0),
                host_ops=[[e.key, e.count, round(e.self_cpu_time_total / 1e3, 3)]
                          for e in sorted(avg, key=lambda e: -e.self_cpu_time_total)[:host]])


def lines(rows: list[list]) -> list[str]:
    return [f"  {ms:9.3f} {calls:6d} {name[:100]}" for name, calls, ms in rows]


def short(path: str) -> str:
    """The last folder and the file of a path."""
    return "/".join(path.rsplit("/", 2)[-2:])


def python_profile(fn, top: int = 40) -> list[list]:
    """Run fn under cProfile: its functions by own time, [file:line name, calls, own ms] (the host's
    share of an eager step that torch.profiler leaves unnamed: our Python, fla's, Triton's launchers)."""
    import cProfile
    import pstats

    prof = cProfile.Profile()
    prof.runcall(fn)
    stats = pstats.Stats(prof).stats  # (file, line, name) -> (calls, primitive calls, own s, cumulative s, callers)
    rows = sorted(stats.items(), key=lambda kv: -kv[1][2])[:top]
    return [[f"{short(f)}:{line} {name}", calls, round(own * 1e3, 3)]
            for (f, line, name), (calls, _, own, _, _) in rows]


def sync_sites(fn) -> dict[str, int]:
    """Run fn under CUDA's sync debug mode; count each synchronizing call by its innermost frames in
    moetier (and fla). On the CPU: nothing to count."""
    import traceback
    import warnings

    sites: dict[str, int] = {}
    if not torch.cuda.is_available():
        fn()
        return sites

    def seen(message, category, filename, lineno, file=None, line=None):
        if "synchroniz" not in str(message):  # only the sync debug mode's own warnings
            return
        frames = [f"{short(f.filename)}:{f.lineno} {f.name}"
                  for f in traceback.extract_stack()[:-1] if "moetier" in f.filename or "/fla/" in f.filename]
        key = " < ".join(reversed(frames[-3:]))
        sites[key] = sites.get(key, 0) + 1

    with warnings.catch_warnings():  # restores showwarning and the filters on the way out
        warnings.simplefilter("always")
        warnings.showwarning = seen
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sites


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--dataset", choices=("shared-prefix", "multi-turn"), default="shared-prefix")
    ap.add_argument("--prefix-len", type=int, default=4096)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--kv-tokens", type=int, default=262144)
    ap.add_argument("--kv-host-memory-gib", type=float, default=0.0)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--preset", default="qwen3-30b-a3b")
    ap.add_argument("--backend", default="slots")
    ap.add_argument("--budget", type=float, default=0.5)
    ap.add_argument("--trace", default="data/traces/qwen3-30b-like.mtrace")
    a = ap.parse_args()
    if min(a.concurrency, a.kv_tokens, a.repeat, a.layers, a.prefix_len) < 1 or not a.kv_host_memory_gib >= 0:
        ap.error("--concurrency, --kv-tokens, --repeat, --layers, --prefix-len take positive integers; "
                 "--kv-host-memory-gib a size of at least 0")
    if not a.out.parent.is_dir():
        ap.error(f"{a.out}: not a file path in an existing directory")
    if a.preset not in names():
        ap.error(f"--preset {a.preset}: not a preset ({', '.join(names())})")
    if a.backend not in registry.NAMES:
        ap.error(f"--backend {a.backend}: not an expert backend ({', '.join(registry.NAMES)})")
    if not 0 < a.budget <= 1:  # nan fails too
        ap.error(f"--budget {a.budget}: a share of the expert bytes in (0, 1]")
    if a.trace != "none" and not Path(a.trace).is_file():
        ap.error(f"--trace {a.trace}: not a file (a .mtrace, or none for the model's own router)")
    cuda = torch.cuda.is_available()
    bed = random_bed(preset(a.preset, a.layers, "bfloat16" if cuda else "float32"),
                     device="cuda" if cuda else "cpu", dtype=torch.bfloat16 if cuda else torch.float32)
    use_backend(bed, a.backend, a.budget)
    config = EngineConfig(replay_trace=None if a.trace == "none" else a.trace, kv_tokens=a.kv_tokens,
                          kv_host_bytes=int(a.kv_host_memory_gib * 2**30), cuda_graphs=cuda)
    log_compiles()
    llm = LLM.from_model(bed.model, bed.tokenizer, config)
    execute = llm.runner.execute

    def probed(step):  # what the step carried, read before it runs
        PROBE.update(tokens=step.num_tokens, seqs=len(step.seqs), up=len(step.copies_to_host),
                     down=len(step.copies_to_gpu))
        return execute(step)

    llm.runner.execute = probed
    s = shapes(a.prefix_len)[a.dataset]
    vocab = range(min(1000, bed.cfg.vocab_size // 2), min(30000, bed.cfg.vocab_size))
    ids = random.Random(1).choices(vocab, k=4 * (s["input_len"] + s["output_len"]))
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
    record.update(by_time(prof, 25, 25))
    print("kernels by GPU ms:", *lines(record["kernels"][:15]), "host ops by own ms:", *lines(record["host_ops"][:15]),
          sep="\n")
    record["hit_step"] = hit_step(llm, level[0][0][0][:s["shape"].prefix_len], s["input_len"], vocab, acts)
    record["compiles"] = COMPILES
    late = [c for c in COMPILES if c["at"] != "startup"]
    early = sum(c["ms"] for c in COMPILES if c["at"] == "startup")
    print(f"Triton compiles: {len(COMPILES) - len(late)} at startup ({early:.0f} ms), {len(late)} after it:",
          *(f"  {c['ms']:8.1f} ms {c['kernel']:24s} {c['at']}" for c in late), sep="\n")
    a.out.write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
