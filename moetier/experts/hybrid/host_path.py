"""The host side of the `hybrid` backend (hybrid.py), shared by the layers of a model: the host kernel,
the worker thread, pinned staging buffers and the measured rates (measure_rates).

A layer hands the host its pairs before it launches its device path: the call is prepared on the
layer's thread and started on the compiled kernel's own native thread (host_ext.start: no GIL needed
to begin; a torch kernel runs on the worker thread), then the device work is launched while it runs.
Threads default to the usable cores less one (default_host_threads): the launching thread keeps a core.
"""

from __future__ import annotations

import math
import os
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from moetier.experts.hybrid.cost_model import PathRates, rate_key
from moetier.experts.hybrid.host_kernels import HostKernel, compute_dtype, host_kernel
from moetier.experts.shape import RowLayout


class HostPath:
    """What the layers of one model share: the host kernel, the one worker thread that runs it (layers
    run one after another), pinned staging buffers, and the measured rates. The kernel is built here,
    at model build: "auto" (the default) and "compiled" take the compiled kernel where it builds and
    else grouped with a one-line warning (cpu_experts.host_kernel), never an error at serve time."""

    def __init__(self, layout: RowLayout, kernel: str = "auto", threads: int | None = None,
                 rates: PathRates | None = None):
        self.kernel: HostKernel = host_kernel(kernel, layout, threads or default_host_threads(), fallback=True)
        self.worker = ThreadPoolExecutor(1, thread_name_prefix="moetier-hybrid")
        self.rates = rates
        self._bufs: dict[tuple, torch.Tensor] = {}
        self._views: dict[tuple, torch.Tensor] = {}  # by (name, dtype, pin, device, shape)

    def buffer(self, name: str, shape: tuple[int, ...], dtype: torch.dtype, pin: bool = False,
               device: torch.device | None = None) -> torch.Tensor:
        # NOTE: shared by every layer. A layer's host->device copies out of pinned ones are ordered before
        # the next layer's device->host copies into them, and the next layer waits for those (its sync);
        # a device one is used within one layer's stream order.
        view = self._views.get((name, dtype, pin, device, shape))  # a view made before: one lookup
        if view is not None:
            return view
        key = (name, dtype, pin, device)
        b = self._bufs.get(key)
        if b is None or b.numel() < math.prod(shape):
            b = self._bufs[key] = torch.empty(math.prod(shape), dtype=dtype, pin_memory=pin, device=device)
            self._views = {k: v for k, v in self._views.items() if k[:4] != key}  # views of the old one
        view = self._views[key + (shape,)] = b[:math.prod(shape)].view(shape)
        return view

    def calibrate(self, host_rows: torch.Tensor, slots: torch.Tensor) -> PathRates:
        """Measure once: the link (host rows into slots, which are empty at build) and the host kernel
        (1 and 4 experts at one token, 4 experts at 8 tokens; medians of 3)."""
        if self.rates is None:  # on the worker: the kernel sets the thread count of the thread it runs on
            self.rates = self.worker.submit(measure_rates, self.kernel, host_rows, slots).result()
        return self.rates


def default_host_threads() -> int:
    """The host kernel's threads when none are given: the cores this process may use, less one, which
    stays free for the thread that launches the device work meanwhile (at least 1)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    return max(1, cores - 1)


class _Job:
    """A host call in flight: a native one (host_ext.Started) or a future of the worker thread (of
    _timed's (out, (start, end)))."""

    def __init__(self, inner):
        self.inner, self.done = inner, None
        self.times: tuple[float, float] = (0.0, 0.0)

    def result(self) -> torch.Tensor:
        if self.done is None:
            got = self.inner.result()
            self.done = (got, self.inner.times) if hasattr(self.inner, "times") else got
        out, self.times = self.done
        return out


def _timed(fn, *args):
    with torch.inference_mode():  # per thread: the worker's ops write buffers made under it
        t0 = time.perf_counter()
        out = fn(*args)
        return out, (t0, time.perf_counter())


def measure_rates(kernel: HostKernel, host_rows: torch.Tensor, slots: torch.Tensor, reps: int = 3) -> PathRates:
    lay = kernel.layout
    n = min(4, host_rows.shape[0], slots.shape[0])
    row_bytes = host_rows.shape[1] * host_rows.element_size()
    cuda = slots.device.type == "cuda"
    dtype = compute_dtype(host_rows, torch.bfloat16)  # FP8 rows: timed with bf16 hidden states

    def seconds(fn) -> float:
        fn()
        times = []
        for _ in range(reps):
            if cuda:
                torch.cuda.synchronize(slots.device)
            t0 = time.perf_counter()
            fn()
            if cuda:
                torch.cuda.synchronize(slots.device)
            times.append(time.perf_counter() - t0)
        return sorted(times)[reps // 2]

    link = seconds(lambda: slots[:n].copy_(host_rows[:n], non_blocking=True))
    x1 = torch.randn(8, lay.hidden, generator=torch.Generator().manual_seed(0)).to(dtype)

    e, turn = host_rows.shape[0], [0]

    def host(tokens: int, experts: int):
        toks = torch.arange(tokens).repeat_interleave(experts)

        def call():
            # each call takes the next experts, so that rows come from DRAM as misses do, not from L3
            ids = (torch.arange(experts) + turn[0]) % e
            turn[0] += experts
            return kernel.pair_outputs(x1[:tokens], toks, ids.repeat(tokens), host_rows)
        return call
    t1, tn, tm = seconds(host(1, 1)), seconds(host(1, n)), seconds(host(8, n))
    # seconds per more expert; noise can make tn - t1 tiny: never more than twice the average rate
    per = max((tn - t1) / max(n - 1, 1), tn / n / 2)
    return PathRates(link_GBps=n * row_bytes / 1e9 / link,
                     host_GBps={rate_key(lay.quant, host_rows.dtype): row_bytes / 1e9 / per},
                     host_overhead_s=max(t1 - per, 0.0), host_token_s=max((tm - tn) / (7 * n), 0.0))
