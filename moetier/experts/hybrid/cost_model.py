"""Which misses of a step the hybrid backend fills over the link and which the host cores compute.
Pure CPU arithmetic on a few numbers per layer; no torch.

A missed expert can be served two ways, and both ways run at the same time:
    link   its row (row_bytes) crosses host -> device, then the GPU computes it with the hits:
           link_s(n) = queued_link_s + n * row_bytes / link_bandwidth
    host   the host cores compute its tokens from the host store; a hidden state goes down and an
           output comes back (kilobytes). One call per layer pays a fixed overhead:
           host_s(S) = queued_host_s + overhead_s + sum over e in S of (row_bytes / host_bandwidth
                                                                      + (tokens_e - 1) * token_s)
The layer waits for the slower path, so the choice minimizes max(link_s, host_s) (the GPU's own work
on the hits overlaps both and is the same whichever way a miss goes). The two paths are concurrent,
never summed: the layer's time is max(link_s, host_s) plus what both pay alike (the layer's sync, the
choice, the combine), which changes no choice; a cost only one path pays (e.g. work already queued on
the link or the host cores) is its queued_* argument.

Every link miss costs the same and a host miss costs more the more tokens use it, so an optimal
host set is always some n misses with the fewest tokens: the model sorts the misses by (tokens, order
of first appearance), tries every n and keeps the best, the smallest n on ties (a link miss also
warms the cache for the next step). O(m log m) for m misses (m <= T * k); deterministic.

Bandwidths are measured (the link at start-up, the host kernel by scripts/bench_cpu_experts.py or a
short calibration), never hard-coded. GB is 10^9 bytes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Sequence

GB = 1e9


@dataclass(frozen=True)
class PathRates:
    link_GBps: float  # host -> device bytes per second / 1e9 (pinned, copy engine or SM copy)
    host_GBps: dict[str, float] = field(default_factory=dict)  # weight bytes the host kernel streams, by dtype
    host_overhead_s: float = 0.0  # per host call: thread hand-off, hidden down, output back
    host_token_s: float = 0.0  # extra host seconds per extra token of one expert (M > 1 adds compute)

    def __post_init__(self):
        problems = []
        if not (math.isfinite(self.link_GBps) and self.link_GBps > 0):
            problems.append(f"link bandwidth must be a positive number of GB/s, got {self.link_GBps}")
        for dtype, v in self.host_GBps.items():
            if not (math.isfinite(v) and v >= 0):
                problems.append(f"host bandwidth for {dtype} must be >= 0 GB/s (0: never use the host), got {v}")
        for name in ("host_overhead_s", "host_token_s"):
            v = getattr(self, name)
            if not (math.isfinite(v) and v >= 0):
                problems.append(f"{name} must be >= 0 seconds, got {v}")
        if problems:
            raise ValueError("; ".join(problems))

    def host_rate(self, dtype: str) -> float:
        if dtype not in self.host_GBps:
            raise ValueError(f"no measured host expert throughput for {dtype} rows (have: "
                             f"{', '.join(self.host_GBps) or 'none'}); run scripts/bench_cpu_experts.py or "
                             "let the backend calibrate")
        return self.host_GBps[dtype]


@dataclass(frozen=True)
class Split:
    host: tuple[bool, ...]  # per miss, in the order given: computed on the host
    link_s: float  # predicted seconds of the link path (queued work included)
    host_s: float  # predicted seconds of the host path (queued work included)

    @property
    def seconds(self) -> float:
        return max(self.link_s, self.host_s)

    @property
    def num_host(self) -> int:
        return sum(self.host)


class CostModel:
    def __init__(self, rates: PathRates, row_bytes: int, dtype: str):
        if row_bytes <= 0:
            raise ValueError(f"row_bytes must be positive, got {row_bytes}")
        self.rates, self.row_bytes, self.dtype = rates, row_bytes, dtype
        self.link_row_s = row_bytes / (rates.link_GBps * GB)
        host = rates.host_rate(dtype)
        self.host_row_s = row_bytes / (host * GB) if host > 0 else math.inf

    def host_cost(self, tokens: int) -> float:
        """Seconds the host spends on one expert used by `tokens` tokens (overhead excluded)."""
        return self.host_row_s + (tokens - 1) * self.rates.host_token_s

    def split(self, tokens: Sequence[int], queued_link_s: float = 0.0, queued_host_s: float = 0.0) -> Split:
        """tokens[i]: how many of the step's tokens use miss i (misses in order of first appearance)."""
        if any(t < 1 for t in tokens):
            raise ValueError(f"every miss is used by at least one token, got {list(tokens)}")
        if queued_link_s < 0 or queued_host_s < 0:
            raise ValueError("queued work must be >= 0 seconds")
        m = len(tokens)
        order = sorted(range(m), key=lambda i: (tokens[i], i))
        best_n, best = 0, (queued_link_s + m * self.link_row_s, queued_host_s)
        if math.isfinite(self.host_row_s):
            host = queued_host_s + self.rates.host_overhead_s
            for n in range(1, m + 1):
                host += self.host_cost(tokens[order[n - 1]])
                link = queued_link_s + (m - n) * self.link_row_s
                if max(link, host) < max(best):  # strict: ties keep the smaller n
                    best_n, best = n, (link, host)
        chosen = set(order[:best_n])
        return Split(tuple(i in chosen for i in range(m)), *best)

    def all_link_s(self, m: int, queued_link_s: float = 0.0) -> float:
        return queued_link_s + m * self.link_row_s


BENCH_DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32", "fp8": "fp8"}  # the bench's names -> keys


def rate_key(quant: str | None, dtype: object) -> str:
    """The key of PathRates.host_GBps for rows of this quantization and dtype: "fp8" for FP8 rows (their
    bytes are uint8), else the dtype's name without "torch." ("bfloat16")."""
    return quant if quant is not None else str(dtype).removeprefix("torch.")  # 4-bit rows: "nvfp4", "int4"


def rates_from_bench(data: dict, link_GBps: float, threads: int | None = None) -> PathRates:
    """PathRates from scripts/bench_cpu_experts.py's JSON (its winner's fit; with `winners`, one
    GB/s per row dtype it measured, e.g. bf16 and fp8) and a measured link. threads: the host threads
    the kernel will run with; where the JSON has the winner kernel's rows at that count (1 token at 1
    and 8 experts), the rates are fitted to those rows as the script fits its winner's, else the
    winner's own fit stands."""
    w = data["winner"]
    main = data["shape"]["dtype"]  # rows without a dtype come from older JSON: one dtype
    dtype = BENCH_DTYPES.get(main, main)
    use = threads if threads is not None else w["threads"]

    def rows_at(name: str, kernel: str, n: int) -> dict:
        return {(r["tokens"], r["experts"]): r for r in data["results"]
                if r["kernel"] == kernel and r["threads"] == n and r.get("dtype", main) == name}

    def refit(by: dict, row_bytes: int) -> tuple[float, float] | None:  # (GB/s, overhead s), the script's fit
        if (1, 1) not in by or (1, 8) not in by:
            return None
        t1, t8 = by[1, 1]["ms"] / 1e3, by[1, 8]["ms"] / 1e3
        per = max((t8 - t1) / 7, t8 / 8 / 2)
        return row_bytes / GB / per, max(t1 - per, 0.0)

    rb = data["shape"].get("row_bytes", {})
    by = rows_at(main, w["kernel"], use)
    got = refit(by, rb[main]) if use != w["threads"] and isinstance(rb, dict) and main in rb else None
    if got is None:
        use, by = w["threads"], rows_at(main, w["kernel"], w["threads"])
        got = (w["GBps"], w["overhead_s"])
    host = {dtype: got[0]}
    for name, win in data.get("winners", {}).items():  # the other dtypes' winners: their rates only
        other = refit(rows_at(name, win["kernel"], use), rb[name]) if use != win.get("threads", use) and \
            isinstance(rb, dict) and name in rb else None
        host.setdefault(BENCH_DTYPES.get(name, name), other[0] if other else win["GBps"])
    token_s = 0.0
    if (1, 8) in by and (8, 8) in by:  # 7 more tokens on each of 8 experts
        token_s = max(0.0, (by[8, 8]["ms"] - by[1, 8]["ms"]) / 1e3 / (8 * 7))
    return PathRates(link_GBps, host, got[1], token_s)
