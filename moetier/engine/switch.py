"""Per decode step, which graph of a hybrid engine to replay: the host path's (the pieces of
engine/piecewise.py, a sync per hybrid layer; or, in the nodes mode, one graph whose host share runs as
host-function nodes, experts/hybrid/nodes.py) or the whole step with every hybrid backend on its slots
step alone. Below, "pieces" names the first, whichever mode made it.

Two judges, per window of `window` steps:
  - the cost model: one host read of the counters gives
        m = (link fills + overflow + host experts) / layer-steps over the window,
    the misses a layer-step could hand to the host; pieces are worth trying when the backends'
    expected saving at m, summed over the hybrid layers, exceeds the measured extra cost of a pieces
    replay over a whole one at no misses (`overhead_s`, per captured size);
  - the clock: the wall time from one choose() to the next is the step just run (replay, sampling,
    the token read, the scheduler: the same for both variants). Per captured size, the median step of
    the last window on each variant. When the model says pieces but the pieces' last median is slower
    than the whole graph's, the step stays whole; one window in `probe` tries the pieces again, so a
    change of routing (or of the cache) is seen.
Why both: the cost model prices the host kernel and the link, not the layer's Python launches and
syncs, which decide at batch 1 (H200, uniform routing, 50%: the model sent 1.77 experts a layer-step
to the host and the pieces ran 110.8 tok/s against the whole graph's 141.2, c26e1ef); the clock alone
would have to try the pieces on every trace to learn that a realistic one gains nothing.

It starts on the whole graph: its link fills warm the cache as `slots` would, and host-served misses
are never filled, so starting on pieces left a realistic trace's cache colder than slots' for as long
as the whole graph ran after (96cd92a: 88.8% hits against 91.0% at b1). The first window's counters
then decide.

backends: objects with cache.stats [5] (hits, misses, overflow, steps, pinned hits), host_count() (the experts served
on the host so far: an int, or a device tensor of one element), host_only_steps and host_saving_s(m)
(experts/hybrid/backend.HybridExperts, experts/hybrid/nodes.HybridNodesExperts).
"""

from __future__ import annotations

import statistics
import time
from typing import Callable

import torch

GAP_S = 1.0  # a longer interval between two decode steps is idle time or a prefill, not a step


class Switch:
    def __init__(self, backends: list, window: int = 16, probe: int = 16,
                 clock: Callable[[], float] = time.perf_counter):
        if window < 1 or probe < 2:
            raise ValueError(f"window must be >= 1 and probe >= 2, got {window} and {probe}")
        self.backends, self.window, self.probe, self.clock = backends, window, probe, clock
        self.pieces = False
        self.steps = 0
        self.counts = {"pieces": 0, "whole": 0}
        self.last_misses_per_layer_step: float | None = None
        self.median_s: dict[tuple[int, bool], float] = {}  # (size, pieces) -> last window's median step
        self._spans: list[float] = []  # this window's step times (its variant and size: self._at)
        self._at: tuple[int, bool] | None = None
        self._prev: float | None = None
        self._last = self._read()

    def _read(self) -> tuple[int, int]:
        host = [b.host_count() for b in self.backends]  # nodes: a device counter; eager or pieces: an int
        dev = [h.view(1) for h in host if isinstance(h, torch.Tensor)]
        got = torch.cat([torch.stack([b.cache.stats for b in self.backends]).sum(0), *dev]).tolist()  # one read
        _hits, misses, overflow, steps = got[:4]
        host_total = sum(got[self.backends[0].cache.stats.numel():])  # after [hits, misses, overflow, steps, pinned] + sum(h for h in host if not isinstance(h, torch.Tensor))
        return misses + overflow + host_total, steps + sum(b.host_only_steps for b in self.backends)

    def _time(self) -> None:
        """The step since the last call ran on self._at: keep its time (not a gap)."""
        now = self.clock()
        if self._prev is not None and self._at is not None and now - self._prev < GAP_S:
            self._spans.append(now - self._prev)
        self._prev = now

    def choose(self, overhead_s: float, size: int = 0) -> bool:
        """-> True: replay the pieces for this step (of captured size `size`)."""
        self._time()
        self.steps += 1
        if self.steps % self.window == 0:
            if self._spans and self._at is not None:
                self.median_s[self._at] = statistics.median(self._spans)
            self._spans = []
            now = self._read()
            dm, ds = now[0] - self._last[0], now[1] - self._last[1]
            self._last = now
            if ds > 0 and dm >= 0:  # a reset in between: skip this window
                m = dm / ds
                self.last_misses_per_layer_step = m
                self.pieces = sum(b.host_saving_s(m) for b in self.backends) > overhead_s and self._pieces_pay(size)
        at = (size, self.pieces)
        if at != self._at:  # a window's times are of one variant and size
            self._spans = []
            self._at = at
        self.counts["pieces" if self.pieces else "whole"] += 1
        return self.pieces

    def _pieces_pay(self, size: int) -> bool:
        """The clock's word, once the model says pieces: pieces unless measured slower than the whole
        graph at this size; then whole, but for one window in `probe` (a new measurement)."""
        pieces, whole = self.median_s.get((size, True)), self.median_s.get((size, False))
        if pieces is None or whole is None or pieces <= whole:
            return True
        return (self.steps // self.window) % self.probe == 0  # the windows ended so far
