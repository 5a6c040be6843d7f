"""mHC's mixing weights on CUDA at prefill sizes: the fused path (layers/mhc_triton.mhc_weights_fused:
up to MAX_ROWS tokens the projection split per token, above it tiled over blocks of tokens, then one
Triton launch)
against the torch ops (HyperConnection.weights_reference, some 150 launches), each called eagerly as
a prefill step calls it (allocations and launches included), at GLM-5.3-Flash's width.

    python scripts/mhc_weights_bench.py OUT.json [--tokens 64,65,256,2048,8192] [--dtype bfloat16]

Per size: microseconds per call of each (triton.testing.do_bench, median), their ratio, and the largest
relative difference of post, comb and the collapse between them (the two projections round apart).
"""

from __future__ import annotations

import argparse
import json
import os

import torch

from moetier.bench.common import provenance
from moetier.layers.mhc import HyperConnection
from moetier.layers.mhc_triton import MAX_ROWS, mhc_weights_fused

HIDDEN, STREAMS, ITERS = 4096, 4, 20  # GLM-5.3-Flash: hidden_size, hc_mult, hc_sinkhorn_iters


def parse_tokens(text: str) -> list[int]:
    """'64,65' -> [64, 65]; argparse reports a ValueError as one line and exit 2."""
    sizes = [int(t) for t in text.split(",")]
    if min(sizes) < 1:
        raise ValueError(text)
    return sizes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", help="the JSON record to write")
    ap.add_argument("--tokens", type=parse_tokens, default="64,65,256,2048,8192",
                    help="step sizes, positive integers, comma separated")
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    args = ap.parse_args()
    sizes = args.tokens
    if os.path.isdir(args.out):
        ap.error(f"{args.out} is a directory; give a file name for the JSON record")
    if not torch.cuda.is_available():
        ap.error("this benchmark times CUDA kernels; no CUDA device is visible")
    import triton.testing

    dtype, dev = getattr(torch, args.dtype), torch.device("cuda")
    g = torch.Generator().manual_seed(0)
    hc = HyperConnection(HIDDEN, STREAMS, ITERS, 1e-6, 1e-5, dtype, "cpu")
    with torch.no_grad():
        hc.fn.copy_(torch.randn(hc.fn.shape, generator=g) * 0.02)
        hc.base.copy_(torch.randn(hc.base.shape, generator=g))
        hc.scale.copy_(torch.tensor([1.0, 1.0, 4.0]))
    hc = hc.to(dev)
    rows = []
    for n in sizes:
        x = torch.randn(n, STREAMS, HIDDEN, generator=g).to(dtype).to(dev)
        fused = lambda: mhc_weights_fused(x, hc.fn, hc.base, hc.scale, ITERS, hc.hc_eps, hc.norm_eps)  # noqa: E731
        ref = lambda: hc.weights_reference(x)  # noqa: E731
        with torch.inference_mode():
            diff = [float((a.float() - b.float()).norm() / b.float().norm()) for a, b in zip(fused(), ref())]
            fused_us = triton.testing.do_bench(fused, rep=200, return_mode="median") * 1e3
            ref_us = triton.testing.do_bench(ref, rep=200, return_mode="median") * 1e3
        row = {"tokens": n, "path": "partials" if n <= MAX_ROWS else "project", "fused_us": fused_us,
               "torch_us": ref_us, "speedup": ref_us / fused_us, "rel_diff_post_comb_collapsed": diff}
        rows.append(row)
        print(f"{n:6d} tokens ({row['path']:8s}): fused {fused_us:9.1f} us, torch {ref_us:9.1f} us, "
              f"{row['speedup']:5.2f}x; rel. diff post {diff[0]:.1e} comb {diff[1]:.1e} collapsed {diff[2]:.1e}")
    with open(args.out, "w") as f:
        json.dump({"provenance": provenance(), "device": torch.cuda.get_device_name(), "args": vars(args),
                   "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
