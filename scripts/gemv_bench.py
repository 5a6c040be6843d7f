"""Dense linears at decode sizes: cuBLAS (F.linear) against layers/dense_linear_triton.dense_mm and its
block variants, on the decode-step weights of Qwen3-30B-A3B and GLM-5.3-Flash, M = 1 to 32 rows.

Each row is a CUDA-graph replay (the mode decode ships in) of the op over enough copies of the weight
to pass 256 MB, so no copy is still in L2 when it is read again (a decode step reads each weight once,
between other layers' weights); time per call = replay / copies. Beside it the weight's bytes at the
device-to-device copy rate of the same run, and each variant's largest difference from F.linear
(relative to F.linear's largest value: summation order only, so about bf16's epsilon at most).

    python scripts/gemv_bench.py OUT.json [--m 1,4,8,16,32]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

import torch
import torch.nn.functional as F

from moetier.bench.common import links, time_graph
from moetier.layers.dense_linear_triton import dense_mm

# (model, weight, N, K): the 16-bit dense linears a decode step reads, from the presets' shapes
SHAPES = [
    ("qwen3-30b-a3b", "qkv", 5120, 2048), ("qwen3-30b-a3b", "o_proj", 2048, 4096),
    ("glm-5.3-flash", "kda in_proj", 24896, 4096), ("glm-5.3-flash", "kda o_proj", 4096, 8192),
    ("glm-5.3-flash", "mlp w13", 24576, 4096), ("glm-5.3-flash", "mlp w2", 4096, 12288),
    ("glm-5.3-flash", "shared w13", 4096, 4096), ("glm-5.3-flash", "shared w2", 4096, 2048),
    ("glm-5.3-flash", "mla q_a", 1536, 4096), ("glm-5.3-flash", "mla q_b", 16384, 1536),
    ("glm-5.3-flash", "mla kv_a", 512, 4096), ("glm-5.3-flash", "mla o", 4096, 16384),
    ("glm-5.3-flash", "indexer wq_b", 4096, 1536), ("glm-5.3-flash", "indexer wk+gate", 128, 4096),
]
# (label, dense_mm keywords): the shipped default first
VARIANTS = [
    ("gemv", {}),
    ("gemv bn16", {"block_n": 16}), ("gemv bn64", {"block_n": 64}), ("gemv bk128", {"block_k": 128}),
    ("gemv p8x", {"programs": 8 * 132}), ("gemv s6", {"num_stages": 6}),
]


def timed(op, copies: list[torch.Tensor], x: torch.Tensor) -> float:
    def build():
        for w in copies:
            op(x, w)
    return time_graph(build, reps=9) * 1e3 / len(copies)  # us per call


def main(argv: list[str]) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out")
    ap.add_argument("--m", default="1,4,8,16,32")
    a = ap.parse_args(argv)
    torch.manual_seed(0)
    hbm = links(256 * 2**20)["d2d_GBps"]
    rows = []
    for model, name, n, k in SHAPES:
        nbytes = n * k * 2
        copies = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * k ** -0.5
                  for _ in range(max(1, -(-256 * 10**6 // nbytes)))]
        for m in (int(v) for v in a.m.split(",")):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            ref = F.linear(x, copies[0]).float()
            scale = ref.abs().max().item()
            row = {"model": model, "weight": name, "N": n, "K": k, "M": m, "MB": nbytes / 1e6,
                   "at_hbm_us": nbytes / 1e3 / hbm, "cublas_us": timed(F.linear, copies, x)}
            for label, kw in VARIANTS:
                row[f"{label}_us"] = timed(lambda x, w, kw=kw: dense_mm(x, w, **kw), copies, x)
                row[f"{label}_maxrel"] = (dense_mm(x, copies[0], **kw).float() - ref).abs().max().item() / scale
            rows.append(row)
            best = min(VARIANTS, key=lambda v: row[f"{v[0]}_us"])[0]
            print(f"{model:14} {name:16} {n:6}x{k:<6} M={m:<3} hbm {row['at_hbm_us']:7.1f} us  cuBLAS "
                  f"{row['cublas_us']:7.1f}  gemv {row['gemv_us']:7.1f} ({row['gemv_maxrel']:.1e})  best {best} "
                  f"{row[f'{best}_us']:7.1f}", flush=True)
        del copies
    # per M: the step's sum over the shapes (each weight once), cuBLAS against each variant
    summary = {}
    for m in sorted({r["M"] for r in rows}):
        rs = [r for r in rows if r["M"] == m]
        summary[m] = {"at_hbm_us": sum(r["at_hbm_us"] for r in rs), "cublas_us": sum(r["cublas_us"] for r in rs),
                      **{f"{lb}_us": sum(r[f"{lb}_us"] for r in rs) for lb, _ in VARIANTS}}
        s = summary[m]
        print(f"M={m:<3} sum over shapes: hbm {s['at_hbm_us']:.1f} us, cuBLAS {s['cublas_us']:.1f}, "
              + ", ".join(f"{lb} {s[f'{lb}_us']:.1f}" for lb, _ in VARIANTS))
    with open(a.out, "w") as f:
        json.dump({"command": " ".join(["python", "scripts/gemv_bench.py", *argv]), "hbm_GBps": hbm,
                   "device": torch.cuda.get_device_name(), "rows": rows, "sum_by_m": summary,
                   "median_gemv_over_cublas": statistics.median(r["gemv_us"] / r["cublas_us"] for r in rows)},
                  f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1:])
