"""Time spent in the collectives of one rank (Parallel.all_reduce), for the benchmarks' "all-reduce
per step" figures. Off by default: Parallel.all_reduce then pays one attribute check.

    timer = llm.parallel.timer      # every rank's Parallel carries one (dist/group.init_rank)
    timer.start()                   # on, counters cleared (at the start of a timed window)
    ... steps ...
    timer.take() -> {"tp": {"calls": n, "ms": total, "bytes": total}, "ep": {...}}   # and clears

On CUDA each collective is bracketed by two CUDA events on the current stream: recording them adds
no host synchronisation, and the stream waits for the NCCL work before the second event, so the
span is the collective's wall time on the stream, waiting for the slowest rank included. The events
are read only in take(), after the steps' tokens were read back (so they are complete). While a
CUDA graph is being captured nothing is recorded (NOTE: a graphed decode step would need a separate
micro-benchmark of the all-reduce at its message size; the parallel engine runs decode eagerly).
On the CPU (gloo) all_reduce returns when done, so perf_counter brackets it.
"""

from __future__ import annotations

import time
from contextlib import contextmanager

import torch


class CollectiveTimer:
    def __init__(self):
        self.on = False
        self._spans: list[tuple[str, object, object, int]] = []  # (group, start, end, bytes)

    def start(self) -> None:
        self.on = True
        self._spans.clear()

    def stop(self) -> None:
        self.on = False
        self._spans.clear()

    @contextmanager
    def span(self, over: str, x: torch.Tensor):
        nbytes = x.numel() * x.element_size()
        if x.is_cuda:
            if torch.cuda.is_current_stream_capturing():
                yield
                return
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            yield
            b.record()
            self._spans.append((over, a, b, nbytes))
        else:
            t0 = time.perf_counter()
            yield
            self._spans.append((over, t0, time.perf_counter(), nbytes))

    def take(self) -> dict[str, dict[str, float]]:
        """Totals by group since start() (or the last take()), and clear them."""
        out: dict[str, dict[str, float]] = {}
        for over, a, b, nbytes in self._spans:
            if isinstance(a, float):
                ms = (b - a) * 1e3
            else:
                b.synchronize()
                ms = a.elapsed_time(b)
            d = out.setdefault(over, {"calls": 0, "ms": 0.0, "bytes": 0})
            d["calls"] += 1
            d["ms"] += ms
            d["bytes"] += nbytes
        self._spans.clear()
        return out
