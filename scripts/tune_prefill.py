"""Times the large-step grouped expert GEMM (grouped_gemm.grouped_expert_mlp_large) on the GPU over a
sweep of block sizes, for T = 512 and 2048 tokens of a Qwen3-30B-shaped layer (128 experts top-8,
bf16, resident rows; routing from the qwen3-30b-like trace), against the FLOP and byte floors.

    python scripts/tune_prefill.py [OUT.json]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from moetier.bench.common import GB, record, time_eager
from moetier.experts.kernels.gemm_config import GemmConfig
from moetier.experts.kernels.grouped_gemm_large import grouped_expert_mlp_large
from moetier.experts.shape import RowLayout
from moetier.presets import moe_shape
from moetier.traces.format import read_trace

# (large_block_m, BLOCK_N, BLOCK_K, warps) for both kernels
SWEEP = [(64, 64, 64, 4), (64, 128, 64, 4), (64, 64, 128, 4), (64, 128, 64, 8), (128, 64, 64, 8),
         (128, 128, 64, 8), (32, 64, 64, 4), (128, 64, 32, 4)]


def main(out: str | None = None) -> None:
    s = moe_shape("qwen3-30b-a3b")
    h, i, e, k = s.hidden, s.inter, s.num_experts, s.top_k
    layout = RowLayout(h, i)
    rows = (torch.randn(e, layout.numel, device="cuda") * 0.02).to(torch.bfloat16)
    trace = read_trace(Path(__file__).parents[1] / "data" / "traces" / "qwen3-30b-like.mtrace")
    results = []
    for t in (512, 2048):
        ids = torch.as_tensor(trace.ids[:t, 0].astype("int64")).cuda()
        x = torch.randn(t, h, device="cuda").to(torch.bfloat16)
        w = torch.rand(t, k, device="cuda").to(torch.bfloat16)
        distinct = int(ids.unique().numel())
        flops = 2 * t * k * 3 * h * i
        for bm, bn, bk, nw in SWEEP:
            cfg = GemmConfig(large_block_m=bm, large_gate_up=(bn, bk, nw), large_down=(bn, bk, nw))
            try:
                ms = time_eager(lambda: grouped_expert_mlp_large(x, ids.int(), ids, w, rows, rows, h, i, e, cfg),
                                reps=10)
            except Exception as exc:  # a config Triton cannot compile
                print(f"T={t} {cfg}: {type(exc).__name__}: {str(exc)[:100]}")
                continue
            r = {"tokens": t, "block_m": bm, "block_n": bn, "block_k": bk, "warps": nw, "ms": ms,
                 "tflops": flops / (ms / 1e3) / 1e12, "weights_GBps": distinct * layout.numel * 2 / GB / (ms / 1e3),
                 "distinct_experts": distinct}
            results.append(r)
            print(f"T={t:5d} bm={bm:3d} bn={bn:3d} bk={bk:3d} w={nw}: {ms:7.3f} ms  {r['tflops']:6.1f} TFLOP/s  "
                  f"{r['weights_GBps']:7.1f} GB/s of weights", flush=True)
    best = {t: min((r for r in results if r["tokens"] == t), key=lambda r: r["ms"]) for t in (512, 2048)}
    print("best:", {t: (b["block_m"], b["block_n"], b["block_k"], b["warps"], round(b["ms"], 3)) for t, b in best.items()})
    if out:
        Path(out).write_text(json.dumps(record("tune-prefill", {"results": results}), indent=1) + "\n")


if __name__ == "__main__":
    main(*sys.argv[1:])
