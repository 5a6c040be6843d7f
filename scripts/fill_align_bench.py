"""The slot fill's copy kernel (experts/cache/slot_kernels.copy_rows) by host row size: the same
expert's bytes in rows padded to 16, 128, 512 and 4,096 bytes, so a row's start in pinned memory
(row i at i x row bytes) is aligned to that much; the other formats' rows as they are built. The
question it answers: whether NVFP4's rows, which end 16 bytes past a multiple of 128 at every
published shape (the three float32 tensor scales at the row's end),
fill slower for it than 128-aligned rows would. Each size goes through `moetier bench layer`'s fill
measurement (bench/layer.bench_fills: 1, 8 and 32 missed experts, the copy kernel graph-replayed and
its slots checked against the rows, and the copy engine beside it). CUDA only; it measures the
package it imports (PYTHONPATH first, for a script).

    python scripts/fill_align_bench.py OUT.json [--preset qwen3-30b-a3b] [--experts 48]
"""

from __future__ import annotations

import argparse
import json
import os

import torch

from moetier.bench.common import record
from moetier.bench.layer import bench_fills
from moetier.experts.shape import RowLayout
from moetier.presets import moe_shape

ALIGNS = (16, 128, 512, 4096)
MOST_MISSES = 32  # the largest fill bench_fills times: that many distinct experts


def fill_rates(row_bytes: int, experts: int, top_k: int) -> list[dict]:
    """bench_fills on `experts` random pinned host rows of row_bytes (and their copy on the device, the
    check's reference)."""
    g = torch.Generator().manual_seed(row_bytes)
    host = torch.randint(0, 256, (experts, row_bytes), dtype=torch.uint8, generator=g).pin_memory()
    return bench_fills(host, host.cuda(), row_bytes, experts, top_k)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--preset", default="qwen3-30b-a3b")
    ap.add_argument("--experts", type=int, default=48)
    args = ap.parse_args()
    if args.experts < MOST_MISSES:
        ap.error(f"--experts {args.experts}: the largest fill moves {MOST_MISSES} distinct experts; give at least that")
    if os.path.isdir(args.out) or not os.path.isdir(os.path.dirname(os.path.abspath(args.out))):
        ap.error(f"OUT {args.out}: give a file path in an existing directory")
    try:
        shape = moe_shape(args.preset)
    except Exception as exc:  # an unknown preset: the presets' own message
        ap.error(f"--preset {args.preset}: {exc}")
    if not torch.cuda.is_available():
        ap.error("this benchmark times a CUDA kernel; no CUDA device is visible")
    rows = []
    for fmt in ("bf16", "fp8", "nvfp4", "int4"):
        lay = RowLayout(shape.hidden, shape.inter, None if fmt == "bf16" else fmt)
        exact = lay.row_bytes(torch.bfloat16)
        sizes = {"as built": exact}
        if fmt == "nvfp4":  # the same bytes padded to each alignment
            sizes = {f"align {a}": -(-exact // a) * a for a in ALIGNS}
        for name, size in sizes.items():
            for r in fill_rates(size, args.experts, shape.top_k):
                if not r["rows"]:
                    continue  # the no-miss launch: no bytes move
                r |= {"format": fmt, "variant": name, "row_bytes": size, "start_alignment": size & -size}
                rows.append(r)
                print(f"{fmt:6} {name:10} row {size:>10,} B (starts aligned to {r['start_alignment']:>5} B) "
                      f"{r['rows']:3} rows: kernel {r['kernel_GBps']:6.1f} GB/s, copy engine "
                      f"{r['copy_engine_GBps']:6.1f} GB/s", flush=True)
    with open(args.out, "w") as f:
        json.dump(record("fill-align", {"preset": args.preset, "rows": rows}), f, indent=1)


if __name__ == "__main__":
    main()
