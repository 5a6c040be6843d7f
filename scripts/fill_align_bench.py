"""The slot fill's copy kernel (experts/cache/slot_kernels.copy_rows) by host row size: the same
expert's bytes in rows padded to 16, 128, 512 and 4,096 bytes, so a row's start in pinned memory
(row i at i x row bytes) is aligned to that much; the other formats' rows as they are built. The
question it answers: whether NVFP4's rows, which end 16 bytes past a multiple of 128 at every
published shape (the three float32 tensor scales at the row's end),
fill slower for it than 128-aligned rows would. Each row: m missed experts (distinct, random)
copied into slots in one CUDA-graph replay, median of 7; the slots are checked against the host
rows. CUDA only; it measures the package it imports (PYTHONPATH first, for a script).

    python scripts/fill_align_bench.py OUT.json [--preset qwen3-30b-a3b] [--experts 48]
"""

from __future__ import annotations

import argparse
import json
import os

import torch

from moetier.bench.common import GB, record, time_graph
from moetier.experts.cache.slot_kernels import BookkeepingScratch, copy_rows
from moetier.experts.cache.store import DevicePointer
from moetier.experts.shape import RowLayout
from moetier.presets import moe_shape

ALIGNS = (16, 128, 512, 4096)
MISSES = (8, 32)  # rows a replay fills


def fill_rate(row_bytes: int, experts: int, misses: int) -> dict:
    """GB/s of copy_rows moving `misses` host rows of row_bytes into slots (graph-replayed)."""
    g = torch.Generator().manual_seed(row_bytes)
    host = torch.randint(0, 256, (experts, row_bytes), dtype=torch.uint8, generator=g).pin_memory()
    slots = torch.zeros(misses, row_bytes, dtype=torch.uint8, device="cuda")
    sc = BookkeepingScratch(experts, misses, misses, torch.device("cuda"))
    ids = torch.randperm(experts, generator=g)[:misses]
    sc.miss_expert[:misses] = ids.int().cuda()
    sc.miss_slot[:misses] = torch.arange(misses, dtype=torch.int32, device="cuda")
    sc.miss_count.fill_(misses)
    programs = 2 * torch.cuda.get_device_properties(0).multi_processor_count  # as backends.py
    ms = time_graph(lambda: copy_rows(DevicePointer(host), slots, sc, programs))
    assert torch.equal(slots.cpu(), host[ids]), "copy_rows moved the wrong bytes"
    return {"row_bytes": row_bytes, "misses": misses, "ms": ms, "GBps": misses * row_bytes / GB / (ms / 1e3)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--preset", default="qwen3-30b-a3b")
    ap.add_argument("--experts", type=int, default=48)
    args = ap.parse_args()
    if args.experts < MISSES[-1]:
        ap.error(f"--experts {args.experts}: the largest fill moves {MISSES[-1]} distinct experts; give at least that")
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
            for m in MISSES:
                r = fill_rate(size, args.experts, m) | {"format": fmt, "variant": name,
                                                        "start_alignment": size & -size}
                rows.append(r)
                print(f"{fmt:6} {name:10} row {size:>10,} B (starts aligned to {r['start_alignment']:>5} B) "
                      f"{m:3} rows {r['ms']:8.3f} ms {r['GBps']:6.1f} GB/s", flush=True)
    with open(args.out, "w") as f:
        json.dump(record("fill-align", {"preset": args.preset, "rows": rows}), f, indent=1)


if __name__ == "__main__":
    main()
