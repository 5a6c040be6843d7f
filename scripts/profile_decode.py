"""Where the GPU time of one decode step goes: a preset (Qwen3-30B by default) cut to a few layers, resident
experts, replayed routing, the engine's decode step run eagerly under torch.profiler. Prints the
kernels by total time and the sum of kernel time against the graph replay time of the same step."""

from __future__ import annotations

import sys

import torch
from torch.profiler import ProfilerActivity, profile

from moetier.bench import decode
from moetier.checkpoint.random_bed import random_bed, use_backend
from moetier.engine import EngineConfig, LLM
from moetier.presets import preset
from moetier.sampling_params import SamplingParams


def main(layers: int = 8, batch: int = 1, name: str = "qwen3-30b-a3b",
         trace: str = "data/traces/qwen3-30b-like.mtrace") -> None:
    cfg = preset(name, layers, "bfloat16")
    bed = random_bed(cfg)
    use_backend(bed, "resident")
    llm = LLM.from_model(bed.model, bed.tokenizer, EngineConfig(replay_trace=trace, max_num_seqs=8, kv_tokens=4096))
    for p in torch.randint(0, 400, (batch, 32)).tolist():
        llm.add_request(p, SamplingParams(max_tokens=40, ignore_eos=True))
    for _ in range(10):
        llm.step()
    graphs = llm.runner.graphs
    torch.cuda.synchronize()
    graph_ms = decode.replay_ms(llm, batch)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            graphs.graphs[batch].replay()
        torch.cuda.synchronize()
    events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    total_us = sum(e.device_time for e in events) / 5
    print(f"{layers} layers, batch {batch}: graph replay {graph_ms:.3f} ms per step; kernels inside sum to "
          f"{total_us / 1e3:.3f} ms; {len(events) / 5:.0f} kernels per step")
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=70))


if __name__ == "__main__":
    # python scripts/profile_decode.py [LAYERS [BATCH [PRESET [TRACE]]]]
    a = sys.argv[1:]
    main(*(int(x) for x in a[:2]), *a[2:4])
