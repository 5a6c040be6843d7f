"""Where the GPU time of one decode step goes: a preset (Qwen3-30B by default) cut to a few layers, resident
experts, replayed routing, the engine's decode graph replayed under torch.profiler. Prints the
kernels by total time and the sum of kernel time against the graph replay time of the same step."""

from __future__ import annotations

import sys

import torch

from moetier.bench.decode_steps import replay_kernels, replay_ms
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
    torch.cuda.synchronize()
    graph_ms = replay_ms(llm, batch)
    k = replay_kernels(llm, batch)
    print(f"{layers} layers, batch {batch}: graph replay {graph_ms:.3f} ms per step; kernels inside sum to "
          f"{k['kernel_ms_per_step']:.3f} ms; {k['kernels_per_step']:.0f} kernels per step")
    print(k["table"])


if __name__ == "__main__":
    # python scripts/profile_decode.py [LAYERS [BATCH [PRESET [TRACE]]]]
    a = sys.argv[1:]
    main(*(int(x) for x in a[:2]), *a[2:4])
