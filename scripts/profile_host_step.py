"""Host work of one decode step: the preset (Qwen3-30B-A3B) cut to a few layers, resident experts,
replayed routing, CUDA graphs; after warm steps, 64 steps timed and 64 under cProfile. Prints the
step median, the Python calls a step and the functions by their own time, and writes them as JSON.
Only the engine API that c19cd98 already had is used, so one copy of this script measures an older
tree too (run it from that tree's root with that tree on PYTHONPATH; issue 28's alternation).

    python scripts/profile_host_step.py LABEL BATCH OUT.json [LAYERS]

On a machine without CUDA it runs one layer on the CPU (its forward, not the graph, dominates there).
"""

from __future__ import annotations

import cProfile
import json
import pstats
import statistics
import sys
import time

import torch

from moetier.checkpoint.random_bed import random_bed, use_backend
from moetier.engine import LLM, EngineConfig
from moetier.presets import preset
from moetier.sampling_params import SamplingParams

STEPS = 64


def main(label: str, batch: int, out: str, layers: int = 8) -> None:
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    bed = random_bed(preset("qwen3-30b-a3b", layers if dev == "cuda" else 1, "bfloat16"), device=dev)
    use_backend(bed, "resident")
    llm = LLM.from_model(bed.model, bed.tokenizer,
                         EngineConfig(replay_trace="data/traces/qwen3-30b-like.mtrace", kv_tokens=8192))
    g = torch.Generator().manual_seed(0)
    for p in torch.randint(0, 400, (batch, 128), generator=g).tolist():
        llm.add_request(p, SamplingParams(max_tokens=400, ignore_eos=True))
    for _ in range(20):  # the prefills and the first decode steps: every request is decoding after them
        llm.step()
    if dev == "cuda":
        torch.cuda.synchronize()

    def steps(n: int) -> list[float]:
        walls = []
        for _ in range(n):
            t0 = time.perf_counter()
            llm.step()  # its sampled tokens were read back: the step is complete
            walls.append((time.perf_counter() - t0) * 1e3)
        return walls

    walls = steps(STEPS)
    prof = cProfile.Profile()
    prof.enable()
    steps(STEPS)
    prof.disable()
    stats = pstats.Stats(prof).stats
    calls = sum(v[1] for v in stats.values()) / STEPS
    # per function, summed over same-named entries: [calls, own ms, cumulative ms] per step
    fns: dict[str, list[float]] = {}
    for (path, _, name), (_, ncalls, tt, ct, _) in stats.items():
        key = (path.split("moetier/")[-1] if "moetier/" in path else path.split("/")[-1]) + ":" + name
        f = fns.setdefault(key, [0.0, 0.0, 0.0])
        f[0] += ncalls / STEPS
        f[1] += tt / STEPS * 1e3
        f[2] += ct / STEPS * 1e3
    print(f"{label} b{batch}: step median {statistics.median(walls):.3f} ms; {calls:.0f} Python calls a step")
    for key, (c, tt, ct) in sorted(fns.items(), key=lambda x: -x[1][1])[:18]:
        print(f"   {tt:7.3f} ms own {ct:7.3f} ms cum {c:6.1f} calls  {key}")
    with open(out, "w") as fh:
        json.dump({"label": label, "batch": batch, "layers": layers, "device": dev, "walls_ms": walls,
                   "calls_per_step": calls, "functions": fns}, fh)


if __name__ == "__main__":
    if len(sys.argv) not in (4, 5):
        sys.exit(__doc__)
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3], *(int(a) for a in sys.argv[4:]))
