"""Times the expert kernels at decode on the GPU: the per-pair GEMV (pair_gemv.py) against the grouped GEMM
(grouped_gemm.py) over a sweep of block sizes, T = 1, 8, 32, 64 tokens of a Qwen3-30B-shaped layer,
resident rows, random routing, CUDA-graph replayed (20 calls on different ids per replay, so the
50 MB L2 holds little). Prints ms per call and GB/s of distinct rows read; writes JSON to argv[1]."""

from __future__ import annotations

import json
import sys

import torch

from moetier.bench.common import GB, record, time_graph
from moetier.experts import pair_gemv
from moetier.experts.gemm_config import SWEEP, GemmConfig
from moetier.experts.grouped_gemm import GemmScratch, grouped_expert_mlp
from moetier.experts.shape import RowLayout
from moetier.presets import moe_shape

CALLS = 20


def main(out: str) -> None:
    s = moe_shape("qwen3-30b-a3b")
    h, i, e, k = s.hidden, s.inter, s.num_experts, s.top_k
    layout = RowLayout(h, i)
    rows = (torch.randn(e, layout.numel, device="cuda") * 0.02).to(torch.bfloat16)
    row_bytes = layout.numel * 2
    g = torch.Generator(device="cuda").manual_seed(0)
    results = []
    for t in (1, 8, 32, 64):
        ids = torch.stack([torch.rand(t, e, device="cuda", generator=g).argsort(-1)[:, :k] for _ in range(CALLS)])
        distinct = sum(int(c.unique().numel()) for c in ids) / CALLS
        x = torch.randn(t, h, device="cuda").to(torch.bfloat16)
        w = torch.rand(t, k, device="cuda").to(torch.bfloat16)
        out_t = torch.empty(t, h, dtype=torch.bfloat16, device="cuda")
        scratch = GemmScratch.make(t * k, h, i, torch.device("cuda"))
        ids32 = ids.int()
        variants = [("gemv", None)] + [("grouped", c) for c in SWEEP]
        for name, cfg in variants:
            if name == "gemv":
                def call(c=None):
                    for n in range(CALLS):
                        pair_gemv.expert_mlp(x, ids32[n], ids[n], w, rows, rows, h, i, scratch.h, out_t)
            else:
                def call(c=cfg):
                    for n in range(CALLS):
                        grouped_expert_mlp(x, ids32[n], ids[n], w, rows, rows, h, i, scratch, out_t,
                                           GemmConfig(c, c))
            try:
                ms = time_graph(call) / CALLS
            except Exception as exc:  # a config Triton cannot compile
                print(f"T={t} {name} {cfg}: {type(exc).__name__}: {str(exc)[:120]}")
                continue
            gbs = distinct * row_bytes / GB / (ms / 1e3)
            results.append({"tokens": t, "kernel": name, "config": cfg, "ms": ms, "distinct_rows": distinct,
                            "GBps_distinct": gbs})
            print(f"T={t:3d} {name:8s} {str(cfg):16s} {ms * 1e3:8.1f} us  {gbs:7.0f} GB/s of distinct rows",
                  flush=True)
    with open(out, "w") as f:
        json.dump(record("tune-experts", {"shape": s, "results": results}), f, indent=2)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "tune-experts.json")
