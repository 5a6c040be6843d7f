"""Where the time of one prefill step goes: the Qwen3-30B shape cut to a few layers, resident experts,
replayed routing, one prompt of N tokens through the engine's step under torch.profiler (CPU and CUDA).
Prints the wall time of the step, the ops by CPU time and by CUDA time.

    python scripts/profile_prefill.py [layers] [prompt_len]
"""

from __future__ import annotations

import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

from moetier.checkpoint.random_bed import random_bed, use_backend
from moetier.engine import EngineConfig, LLM
from moetier.presets import preset
from moetier.sampling_params import SamplingParams


def main(layers: int = 8, n: int = 512) -> None:
    cfg = preset("qwen3-30b-a3b", layers, "bfloat16")
    bed = random_bed(cfg)
    use_backend(bed, "resident")
    llm = LLM.from_model(bed.model, bed.tokenizer, EngineConfig(replay_trace="data/traces/qwen3-30b-like.mtrace",
                                                                max_num_tokens=2048, cuda_graphs=False,
                                                                kv_tokens=4096))
    prompt = torch.randint(0, 400, (n,)).tolist()

    def once() -> float:
        llm.add_request(prompt, SamplingParams(max_tokens=1, ignore_eos=True))
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        while llm.has_unfinished():
            llm.step()
        return (time.perf_counter() - t0) * 1e3

    print("warm-up steps (ms):", [round(once(), 2) for _ in range(3)])
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        ms = once()
    print(f"{layers} layers, one prompt of {n} tokens: {ms:.2f} ms wall")
    print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=30, max_name_column_width=60))
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=20, max_name_column_width=60))


if __name__ == "__main__":
    main(*(int(a) for a in sys.argv[1:]))
