"""Measures the host expert kernels (moetier/experts/hybrid/host_kernels.py) at the Qwen3-30B-A3B expert
shape (hidden 2048, inter 768; one row is 9.44 MB in bf16, 4.72 MB in FP8), for the hybrid backend's
cost model.

Cases (tokens x distinct experts, each token using k of them):
    1 x 1, 1 x 8 (batch 1, one token's top-8), 8 x 8 (every token every expert), 8 x 29 (batch 8 of
    top-8 over 29 distinct experts, 2 to 3 tokens each: the misses of a uniform step), 32 x 8
Each call reads experts rotated over a pool of 64 (604 MB in bf16), so every weight comes from DRAM,
as a cold miss does. Rows:
    bf16  both kernels (compiled, grouped) at every thread count
    fp8   compiled at every thread count; grouped (which dequantizes each expert into bf16 scratch)
          at grouped's best bf16 thread count
    nvfp4, int4, int4-g32 (4-bit rows, 2.65 / 2.43 / 2.65 MB): as fp8
It prints, per row, the median us per call and GB/s of weights (distinct experts x row bytes / time;
GB = 1e9 B); then per dtype and kernel the best thread count (least time for 1 x 8 plus 8 x 8) with
the cost-model fit from 1 x 1 and 1 x 8,
    t(n experts) = overhead + n * row_bytes / GBps,
the winner per dtype, a read ceiling (torch int64 sum of 8 contiguous rows), and with CUDA the bf16 and fp8
winners while the copy engine streams pinned memory to the GPU (they share the host memory bus).
The compiled kernel is also run with other work-item sizes (--blocks) at its best thread count. Last,
a short table of the 1 x 8 and 8 x 29 rows of the compiled and grouped kernels and of those sizes.

    python scripts/bench_cpu_experts.py [--out FILE] [--small] [--threads 1,4,8,16] [--dtypes bf16,fp8,nvfp4,int4]
                                        [--kernels compiled,grouped] [--blocks 16,256] [--reps 7]
--small: a tiny shape for a CPU smoke run (not a measurement). The JSON's `winner` is the bf16 winner
(--host-profile reads it), `winners` has one per dtype (cost_model.rates_from_bench takes each GB/s).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import threading
import time

import torch

from moetier.bench.common import GB, record
from moetier.experts.hybrid import host_ext
from moetier.experts.hybrid.host_kernels import KERNELS, host_kernel
from moetier.experts.shape import RowLayout
from moetier.quant import fp8_block as fp8
from moetier.quant.registry import PACKED4 as FOUR_BIT

CASES = ((1, 1, 1), (1, 8, 8), (8, 8, 8), (8, 29, 8), (32, 8, 8))  # tokens, distinct experts, k per token
POOL = 64


def timed(fn, reps: int) -> float:
    """Median seconds of fn() after one untimed call."""
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


class Rotation:
    """Hands out `n` distinct experts per call, moving through the pool so rows come from DRAM."""

    def __init__(self, n: int, pool: int):
        self.n, self.pool, self.next = n, pool, 0

    def __call__(self) -> torch.Tensor:
        ids = (torch.arange(self.n) + self.next) % self.pool
        self.next = (self.next + self.n) % self.pool
        return ids


def case_inputs(tokens: int, n: int, k: int, hidden: int):
    """x [T, H] bf16, pairs t * k + j, weights, and which of the n experts pair (t, j) uses: token t
    takes experts (t * k + j) % n, so all n are used (n <= T * k) and each token's k are distinct."""
    x = torch.randn(tokens, hidden).to(torch.bfloat16)
    pairs = torch.arange(tokens * k)
    which = torch.tensor([(t * k + j) % n for t in range(tokens) for j in range(k)])
    return x, pairs, torch.full((tokens * k,), 1.0 / k), which


def run_kernel(name: str, threads: int, layout: RowLayout, rows: torch.Tensor, reps: int, dtype: str,
               block_kb: int = 0, cases=CASES) -> list[dict]:
    kernel = host_kernel(name, layout, threads)
    if block_kb:
        kernel.block_bytes = block_kb * 1024  # compiled only
    row_bytes = rows.shape[1] * rows.element_size()
    out = []
    for tokens, n, k in cases:
        x, pairs, weights, which = case_inputs(tokens, n, k, layout.hidden)
        rot = Rotation(n, rows.shape[0])

        def call() -> None:
            kernel(x, pairs, rot()[which], weights, rows, k)
        s = timed(call, reps)
        out.append({"kernel": name, "dtype": dtype, "threads": threads, "tokens": tokens, "experts": n, "k": k,
                    "ms": s * 1e3, "us": s * 1e6, "GBps": n * row_bytes / GB / s,
                    **({"block_kb": block_kb} if block_kb else {})})
    return out


def read_ceiling(rows: torch.Tensor, threads: int, reps: int) -> dict:
    """GB/s of a torch sum over 8 contiguous rows read as int64 (read once, nothing written; a bf16 sum
    is compute-bound in torch), torch at `threads`."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    start = [0]

    def call() -> None:
        a = start[0]
        start[0] = (a + 8) % (rows.shape[0] - 8)
        rows[a:a + 8].view(torch.int64).sum()  # the value is meaningless (wraps): only the reads count
    s = timed(call, reps)
    torch.set_num_threads(before)
    return {"threads": threads, "read_GBps": 8 * rows.shape[1] * rows.element_size() / GB / s}


def fit(by_case: dict, row_bytes: int) -> dict:
    """overhead (s) and GB/s from t(1 expert) and t(8 experts) at one token."""
    t1, t8 = by_case[(1, 1)]["ms"] / 1e3, by_case[(1, 8)]["ms"] / 1e3
    # noise can make t8 - t1 tiny: never claim more than twice the average rate of the 8-expert call
    per = max((t8 - t1) / 7, t8 / 8 / 2)
    return {"overhead_s": max(t1 - per, 0.0), "GBps": row_bytes / GB / per}


def contended(best: dict, layout: RowLayout, rows: torch.Tensor, reps: int) -> dict | None:
    """A config's 1 x 8 row while another thread keeps the copy engine streaming 256 MiB host->GPU.
    NOTE: that thread must not hold the GIL while a copy runs: a wait in cudaStreamSynchronize keeps it
    (torch does not release it there), and the timing thread, back from the kernel's ctypes call (which
    releases it), then waits for the copy, 5 ms at 55 GB/s. (The 4b7b6ff and a786368 runs did so: their
    3.1 and 6.3 GB/s at 8 to 16 threads were that wait.) So it keeps two copies queued and polls the
    older one's event, sleeping 0.2 ms between polls."""
    if not torch.cuda.is_available():
        return None
    src = torch.empty(256 * 2**20, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty_like(src, device="cuda")
    stop, moved = threading.Event(), [0, 0.0]

    def stream() -> None:
        s = torch.cuda.Stream()
        queued: list[torch.cuda.Event] = []
        t0 = time.perf_counter()
        with torch.cuda.stream(s):
            while not stop.is_set():
                while len(queued) < 2:
                    dst.copy_(src, non_blocking=True)
                    queued.append(torch.cuda.Event())
                    queued[-1].record(s)
                if queued[0].query():
                    queued.pop(0)
                    moved[0] += src.numel()
                else:
                    time.sleep(2e-4)
            s.synchronize()
        moved[1] = time.perf_counter() - t0
    th = threading.Thread(target=stream)
    th.start()
    time.sleep(0.05)
    r = run_kernel(best["kernel"], best["threads"], layout, rows, reps, best["dtype"])
    stop.set()
    th.join()
    one = next(x for x in r if (x["tokens"], x["experts"]) == (1, 8))
    return {**one, "h2d_GBps_meanwhile": moved[0] / GB / moved[1]}


def make_rows(dtype: str, hidden: int, inter: int) -> tuple[RowLayout, torch.Tensor]:
    """A pool of POOL expert rows: random bf16 weights, FP8 bytes with plausible block scales, or 4-bit
    rows of random codes with plausible group (and NVFP4 tensor) scales."""
    if dtype == "bf16":
        lay = RowLayout(hidden, inter)
        return lay, (torch.randn(POOL, lay.numel) * 0.02).to(torch.bfloat16)
    if dtype in FOUR_BIT:
        lay = RowLayout(hidden, inter, dtype)
        rows = torch.zeros(POOL, lay.numel, dtype=torch.uint8)
        rows[:, :lay.w13_numel + lay.w2_numel] = torch.randint(0, 256, (POOL, lay.w13_numel + lay.w2_numel),
                                                               dtype=torch.uint8)
        for part in ("gate_up", "down"):  # weights about N(0, 0.02): codes up to 6 (NVFP4) or 8 (INT4) steps
            lay.part(rows, part + "_scale").fill_(0.02 / 3 if dtype != "nvfp4" else 1.0)
            if dtype == "nvfp4":
                lay.part(rows, part + "_scale_2").fill_(0.02 / 3)
        return lay, rows
    lay = RowLayout(hidden, inter, "fp8")
    rows = torch.zeros(POOL, lay.numel, dtype=torch.uint8)
    w = (torch.randn(POOL, lay.w13_numel + lay.w2_numel) * 64).clamp(-fp8.FP8_MAX, fp8.FP8_MAX)
    rows[:, :w.shape[1]] = w.to(fp8.FP8).view(torch.uint8)
    lay.s13(rows).fill_(0.02 / 64)
    lay.s2(rows).fill_(0.02 / 64)
    return lay, rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--small", action="store_true")
    ap.add_argument("--threads", default=None,
                    help="comma-separated thread counts (default 1,2,4,8,12 and all cores, less 2, less 1: the "
                         "hybrid backend's main thread also needs a core)")
    ap.add_argument("--dtypes", default="bf16,fp8", help="row dtypes to measure: bf16, fp8, nvfp4, int4, int4-g32 "
                                                          "(comma-separated)")
    ap.add_argument("--kernels", default=",".join(KERNELS), help="kernels to measure (default: all)")
    ap.add_argument("--blocks", default="16,256",
                    help="compiled kernel: also these work-item sizes (KB of weights; its default is 64) at its "
                         "best thread count, 1 x 8 and 8 x 29 (empty: none)")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--contended-threads", default="",
                    help="comma-separated thread counts: the winner kernel also at these, while the copy engine "
                         "streams (CUDA only; e.g. 12,14,15,16 shows what one more busy thread costs)")
    a = ap.parse_args()
    cores = os.cpu_count() or 1
    hidden, inter = (256, 96) if a.small else (2048, 768)
    dtypes = [d for d in a.dtypes.split(",") if d]
    if set(dtypes) - {"bf16", "fp8", *FOUR_BIT} or not dtypes:
        raise SystemExit(f"--dtypes {a.dtypes!r}: choose from bf16, fp8, {', '.join(FOUR_BIT)} (comma-separated)")
    try:
        busy_counts = sorted({int(c) for c in a.contended_threads.split(",") if c.strip()})
    except ValueError:
        busy_counts = [0]
    if any(c < 1 for c in busy_counts):
        ap.error(f"--contended-threads {a.contended_threads!r}: give thread counts >= 1, e.g. 14,15,16")
    counts = sorted({int(c) for c in a.threads.split(",")} if a.threads else
                    {c for c in (1, 2, 4, 8, 12, cores - 2, cores - 1, cores) if 1 <= c <= cores})
    t0 = time.perf_counter()
    ok, why = host_ext.available()  # the first call builds (or loads the cached build)
    build_s = time.perf_counter() - t0
    print(f"compiled kernel: {'built/loaded in %.1f s' % build_s if ok else 'unavailable: ' + why}", flush=True)
    unknown = sorted(set(k for k in a.kernels.split(",") if k) - set(KERNELS))
    if unknown:
        ap.error(f"--kernels {a.kernels!r}: {', '.join(unknown)} unknown; choose from {', '.join(KERNELS)}")
    kernels = [k for k in a.kernels.split(",") if k in KERNELS and (ok or k != "compiled")]
    if not kernels:
        raise SystemExit(f"--kernels {a.kernels!r}: none of {', '.join(KERNELS)} (that can run here)")
    results, ceilings, best, fits, winners, busy, blocks, sweep = [], [], {}, {}, {}, {}, [], []
    for dtype in dtypes:
        layout, rows = make_rows(dtype, hidden, inter)
        row_bytes = rows.shape[1] * rows.element_size()
        names = kernels
        for name in names:
            tc = counts if dtype == "bf16" or name == "compiled" else [best.get(("bf16", name), {}).get("threads",
                                                                                                      counts[-1])]
            for threads in tc:
                for r in run_kernel(name, threads, layout, rows, a.reps, dtype):
                    results.append(r)
                    print(f"{dtype:>4} {r['kernel']:>8} threads {threads:>3}  {r['tokens']:>2} tok x {r['experts']:>2} exp"
                          f"  {r['us']:9.0f} us  {r['GBps']:6.1f} GB/s", flush=True)

            # best thread count: least time for 1 x 8 and 8 x 8 together (batch 1 and 8 of top-8), so a
            # kernel that is fine at one token but reads a row per pair cannot win
            def score(c: int) -> float:
                return sum(r["ms"] for r in results if (r["dtype"], r["kernel"], r["threads"]) == (dtype, name, c)
                           and (r["tokens"], r["experts"]) in ((1, 8), (8, 8)))
            threads = min(tc, key=score)
            by_case = {(r["tokens"], r["experts"]): r for r in results
                       if (r["dtype"], r["kernel"], r["threads"]) == (dtype, name, threads)}
            best[dtype, name] = {**by_case[1, 8], "score_ms": score(threads)}
            fits[dtype, name] = fit(by_case, row_bytes)
        if "compiled" in names:
            for kb in [int(b) for b in a.blocks.split(",") if b]:
                for r in run_kernel("compiled", best[dtype, "compiled"]["threads"], layout, rows, a.reps, dtype, kb,
                                    ((1, 8, 8), (8, 29, 8))):
                    blocks.append(r)
                    print(f"{dtype:>4} compiled threads {r['threads']:>3}  {r['tokens']:>2} tok x {r['experts']:>2} exp"
                          f"  {r['us']:9.0f} us  {r['GBps']:6.1f} GB/s  ({kb} KB items)", flush=True)
        win = min(names, key=lambda n: best[dtype, n]["score_ms"])
        winners[dtype] = {"kernel": win, "threads": best[dtype, win]["threads"], **fits[dtype, win]}
        if dtype == "bf16":
            ceilings = [read_ceiling(rows, c, a.reps) for c in counts]
        busy[dtype] = contended(best[dtype, win], layout, rows, a.reps)
        for c in busy_counts:
            got = contended({**best[dtype, win], "threads": c}, layout, rows, a.reps)
            if got is not None:
                sweep.append(got)
                print(f"{dtype:>4} {win:>8} threads {c:>3}  1 tok x  8 exp while streaming  {got['us']:9.0f} us"
                      f"  {got['GBps']:6.1f} GB/s  (host-to-GPU {got['h2d_GBps_meanwhile']:.1f} GB/s)", flush=True)
        del rows
    print()
    if ceilings:
        print("read ceiling (torch int64 sum of 8 contiguous bf16 rows, GB/s):",
              ", ".join(f"{c['threads']}t {c['read_GBps']:.1f}" for c in ceilings))
    for (dtype, name), f in fits.items():
        print(f"best {dtype:>4} {name:>8}: {best[dtype, name]['threads']} threads, 1 x 8 at "
              f"{best[dtype, name]['GBps']:.1f} GB/s; fit overhead {f['overhead_s'] * 1e6:.0f} us + {f['GBps']:.1f} GB/s")
    for dtype, w in winners.items():
        print(f"winner {dtype}: {w['kernel']} at {w['threads']} threads")
        if busy.get(dtype):
            print(f"  while the copy engine streams: {busy[dtype]['GBps']:.1f} GB/s host kernel, "
                  f"{busy[dtype]['h2d_GBps_meanwhile']:.1f} GB/s host-to-GPU")
    table = [r for r in results if r["kernel"] in ("compiled", "grouped") and (r["tokens"], r["experts"]) in
             ((1, 8), (8, 29)) and (r["threads"] in (8, 12, 16) or r["threads"] == best[r["dtype"], r["kernel"]]["threads"])]
    print(f"\n{'dtype':<6} {'kernel':<14} {'thr':>3}  {'case':<6} {'us/call':>9}  {'GB/s':>6}")
    for r in table + blocks:
        kernel = r["kernel"] + (f" {r['block_kb']}KB" if "block_kb" in r else "")
        print(f"{r['dtype']:<6} {kernel:<14} {r['threads']:>3}  {r['tokens']}x{r['experts']:<5} {r['us']:>9.0f}"
              f"  {r['GBps']:>6.1f}")
    main_dtype = "bf16" if "bf16" in winners else dtypes[0]
    data = record("cpu-experts", {
        "shape": {"hidden": hidden, "inter": inter, "dtype": main_dtype,
                  "row_bytes": {d: RowLayout(hidden, inter, None if d == "bf16" else d).row_bytes(torch.bfloat16)
                                for d in dtypes}},
        "cores": cores, "compiled": {"available": ok, "reason": why, "build_s": build_s}, "results": results,
        "ceilings": ceilings, "best": {f"{d}/{n}": b for (d, n), b in best.items()},
        "fit": {f"{d}/{n}": f for (d, n), f in fits.items()}, "winner": winners[main_dtype], "winners": winners,
        "contended": busy.get(main_dtype), "contended_by_dtype": busy, "contended_sweep": sweep,
        "blocks": blocks, "table": table})
    if a.out:
        with open(a.out, "w") as f:
            json.dump(data, f, indent=2)
        print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
