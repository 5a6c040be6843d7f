"""Where the time of a prefill goes: a preset cut to a few layers, random weights, resident experts
(or slots), replayed routing, one prompt of N tokens through the engine's steps under torch.profiler.

Each model part is a profiler range (forward hooks on the part's modules), so the kernels it launches
are summed under its name:

    attention     GQA / MLA attention (the DSA or kpool indexer inside it), KDA linear attention
    indexer       the DSA / kpool indexer alone (also inside attention)
    MoE           router, routed experts, shared experts (MoEBlock)
    MLP           SwiGLU MLPs: the dense layers' and the shared experts (also inside MoE)
    mHC           the hyper-connections' weights and expands (glm5_next)

Prints the wall time of the prefill (all its chunks), each part's GPU (or, on the CPU, wall) time,
the kernels by GPU time with their launches, and writes it all as JSON (--out).

    python scripts/profile_prefill.py [--preset qwen3-30b-a3b] [--layers 8] [--prompt-len 512]
        [--chunk 2048] [--backend resident|slots] [--budget 0.5] [--trace FILE] [--out FILE]

Without --trace: data/traces/qwen3-30b-like.mtrace for qwen3-30b-a3b, else a synthetic trace for the
preset's experts (the glm-5.3-like parameters, as scripts/profile_glm5_next.py makes).
"""

from __future__ import annotations

import argparse
import bisect
import json
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from moetier.checkpoint.random_bed import random_bed, use_backend
from moetier.engine import EngineConfig, LLM
from moetier.presets import preset
from moetier.sampling_params import SamplingParams

sys.path.insert(0, str(Path(__file__).parent))
from profile_glm5_next import synthetic_trace  # noqa: E402

# module class name -> part (nested parts count in both)
PARTS = {"KdaAttention": "attention", "MlaAttention": "attention", "GqaAttention": "attention",
         "KpoolIndexer": "indexer", "DsaIndexer": "indexer", "MoEBlock": "MoE", "SwigluMLP": "MLP"}


def kernels_by_part(kernels: list[tuple[float, float]], ranges: dict[str, list[tuple[float, float]]]
                    ) -> dict[str, float]:
    """kernels: (start, end) on the GPU's clock; ranges: part -> its (start, end) intervals on the same
    clock (the parts' record_function ranges as the profiler places them on the GPU timeline) -> part
    -> the summed time of the kernels that lie inside one of its intervals (nested parts count in
    both, as the ranges nest). Every kernel on the timeline counts, Triton's too: the CPU ranges'
    device time missed most Triton launches (bench/results/h100-glm-prefill-af8d882: 4 us for mHC,
    whose three kernels took 7.6 ms). Without GPU-side ranges the script falls back to the CPU
    ranges and says so."""
    out: dict[str, float] = {}
    for part, spans in ranges.items():
        merged: list[list[float]] = []  # the part's intervals as a union: nested or touching ones joined
        for a, b in sorted(spans):
            if merged and a <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], b)
            else:
                merged.append([a, b])
        starts = [a for a, _ in merged]
        total = 0.0
        for a, b in kernels:
            i = bisect.bisect_right(starts, a) - 1  # the last interval that starts at or before the kernel
            if i >= 0 and b <= merged[i][1]:
                total += b - a
        out[part] = total
    return out


def ranged(fn, part: str):
    def call(*args, **kwargs):
        with record_function(f"part: {part}"):
            return fn(*args, **kwargs)
    return call


def annotate(model: torch.nn.Module) -> list:
    """A profiler range around every module whose class is in PARTS, and around mHC's weights and
    expand (methods and a function, not modules' forwards) -> undo callables."""
    undo = []
    glm5_next = sys.modules.get("moetier.models.glm5_next")
    if glm5_next is not None and hasattr(glm5_next, "expand"):
        inner = glm5_next.expand
        glm5_next.expand = ranged(inner, "mHC")
        undo.append(lambda: setattr(glm5_next, "expand", inner))
    for mod in model.modules():
        if type(mod).__name__ == "HyperConnection":
            mod.weights = ranged(mod.weights, "mHC")
            undo.append(lambda mod=mod: delattr(mod, "weights"))
        part = PARTS.get(type(mod).__name__)
        if part is None:
            continue
        ranges: list = []

        def enter(m, args, part=part, ranges=ranges):
            r = record_function(f"part: {part}")
            r.__enter__()
            ranges.append(r)

        def leave(m, args, out, ranges=ranges):
            ranges.pop().__exit__(None, None, None)

        undo += [mod.register_forward_pre_hook(enter).remove, mod.register_forward_hook(leave).remove]
    return undo


def main(argv: list[str]) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="qwen3-30b-a3b")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--chunk", type=int, default=2048, help="tokens a prefill step takes (max_num_tokens)")
    ap.add_argument("--backend", default="resident", choices=("resident", "slots"))
    ap.add_argument("--budget", type=float, default=0.5)
    ap.add_argument("--trace", type=Path)
    ap.add_argument("--out", type=Path)
    a = ap.parse_args(argv)
    for name, value in (("--layers", a.layers), ("--prompt-len", a.prompt_len), ("--chunk", a.chunk)):
        if value < 1:
            ap.error(f"{name} {value}: must be at least 1")
    if not 0 < a.budget <= 1:  # also refuses nan
        ap.error(f"--budget {a.budget}: a fraction of the expert bytes, above 0 and at most 1")
    if a.trace is not None and not a.trace.is_file():
        ap.error(f"--trace {a.trace}: no such trace file")
    if a.out is not None and not a.out.parent.is_dir():
        ap.error(f"--out {a.out}: not a file path in an existing directory")
    cuda = torch.cuda.is_available()
    try:
        cfg = preset(a.preset, a.layers, "bfloat16" if cuda else "float32")
    except Exception as exc:  # an unknown preset or a layer count it cannot take: its own message
        ap.error(f"--preset {a.preset} --layers {a.layers}: {exc}")
    trace = a.trace or (Path("data/traces/qwen3-30b-like.mtrace") if a.preset == "qwen3-30b-a3b"
                        else synthetic_trace(cfg, Path(tempfile.mkdtemp()) / "routing.mtrace"))
    bed = random_bed(cfg, device="cuda" if cuda else "cpu", dtype=torch.bfloat16 if cuda else torch.float32)
    use_backend(bed, a.backend, a.budget if a.backend == "slots" else 1.0)
    # prefix caching off: every run below prefills the same prompt, which would otherwise hit the pages
    # (and KDA state checkpoints) the run before left, and profile only the tail after them
    llm = LLM.from_model(bed.model, bed.tokenizer, EngineConfig(
        replay_trace=trace, max_num_tokens=a.chunk, cuda_graphs=False, kv_tokens=a.prompt_len + 64,
        enable_prefix_caching=False))
    prompt = torch.randint(0, 400, (a.prompt_len,)).tolist()

    steps = 0  # engine steps of the last run: the prompt's chunks

    def once() -> float:  # ms: the prompt's prefill steps and the step sampling its first token
        nonlocal steps
        llm.add_request(prompt, SamplingParams(max_tokens=1, ignore_eos=True))
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        steps = 0
        while llm.has_unfinished():
            llm.step()
            steps += 1
        if cuda:
            torch.cuda.synchronize()
        return (time.perf_counter() - t0) * 1e3

    warm = [round(once(), 2) for _ in range(3)]
    undo = annotate(bed.model)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=acts) as prof:
        ms = once()
    profiled_steps = steps
    for u in undo:
        u()
    timed = sorted(once() for _ in range(3))  # without the profiler and its ranges
    cpu, gpu = torch.autograd.DeviceType.CPU, torch.autograd.DeviceType.CUDA
    parts: dict[str, float] = {}  # ms: the kernels inside each part's ranges (CPU: the ranges' wall)
    kernels_by_name: dict[str, list] = {}
    gpu_ranges: dict[str, list] = {}  # part -> its ranges on the GPU timeline (us)
    spans: list[tuple[float, float]] = []  # every kernel and copy on the GPU timeline (us)
    for e in prof.events():
        if e.name.startswith("part: "):
            part = e.name.removeprefix("part: ")
            if e.device_type == cpu:
                parts[part] = parts.get(part, 0.0) + (e.device_time_total if cuda else e.cpu_time_total) / 1e3
            elif e.device_type == gpu:
                gpu_ranges.setdefault(part, []).append((e.time_range.start, e.time_range.end))
        elif e.device_type == gpu:  # kernels and copies, not the ranges
            k = kernels_by_name.setdefault(e.name, [e.name, 0, 0.0])
            k[1], k[2] = k[1] + 1, k[2] + e.device_time
            spans.append((e.time_range.start, e.time_range.end))
    attribution = "CPU ranges' wall" if not cuda else "CPU ranges' device time (misses most Triton launches)"
    if gpu_ranges:  # the ranges on the GPU timeline: every kernel inside them, Triton's too
        parts = {p: us / 1e3 for p, us in kernels_by_part(spans, gpu_ranges).items()}
        attribution = "kernels inside the parts' ranges on the GPU timeline"
    kernels = sorted(kernels_by_name.values(), key=lambda k: -k[2])  # [name, launches, us]
    mode = "CUDA, eager steps" if cuda else "eager on the CPU (a dry run: not a measurement of the GPU)"
    print(f"{a.preset} cut to {a.layers} layers, {a.backend}, one prompt of {a.prompt_len} tokens in chunks of "
          f"{a.chunk} ({profiled_steps} steps), {mode}: {timed[1]:.2f} ms (median of 3 after warm-up {warm}; "
          f"{ms:.2f} ms profiled)")
    print(f"parts ({attribution}):")
    for p, t in sorted(parts.items(), key=lambda x: -x[1]):
        print(f"  {p:<10} {t:9.3f} ms {'GPU' if cuda else 'wall'}")
    if cuda:
        total = sum(k[2] for k in kernels) / 1e3
        print(f"kernels: {sum(k[1] for k in kernels)} launches, {total:.3f} ms of GPU time")
        for name, n, us in kernels[:30]:
            print(f"  {us / 1e3:8.3f} ms {n:5d}x  {name[:100]}")
    else:
        print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=25, max_name_column_width=60))
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps({
            "command": " ".join(["python", "scripts/profile_prefill.py", *argv]), "mode": mode,
            "preset": a.preset, "layers": a.layers, "prompt_len": a.prompt_len, "chunk": a.chunk,
            "backend": a.backend, "budget": a.budget if a.backend == "slots" else None, "trace": str(trace),
            "steps": profiled_steps, "ms": timed[1], "ms_runs": timed, "warmup_ms": warm, "profiled_ms": ms,
            "parts_ms": parts, "parts_attribution": attribution,
            "kernels": kernels}, indent=1) + "\n")


if __name__ == "__main__":
    main(sys.argv[1:])
