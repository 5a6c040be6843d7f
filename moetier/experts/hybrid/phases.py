"""Where the time of a hybrid MoE layer goes, on the host's clock (experts/hybrid/backend.py; off by default).

With `HybridExperts.phases` set to a PhaseClock, every decode call of the layer takes time.perf_counter()
marks (a few per call: cheap, but not free, hence off unless asked) and adds them, as offsets from the
call's entry, to running sums. `means_us()` gives mean microseconds per mark over the calls that had a
host share ("layers") and, separately, over those that took the plain slots step after the sync
("slots_layers": no host set), plus what the device said:

    sync        the ids, their slots and the hidden state are on the host (the layer's one host sync)
    choose      the cost model chose the host set and the pair lists are built
    host_args   the host call's inputs are built (tokens, experts, output buffer), just before the hand-over
    host_start  the host call was handed over (to the compiled kernel's native thread or the worker),
                before the device launches
    launched    the device path's launches (bookkeeping, fills, grouped GEMM) have returned
    host_begin  the host kernel began computing (the native thread's or worker's clock)
    host_end    the host kernel ended
    joined      the main thread has the host outputs
    done        the combine is launched; forward returns
    device_gpu  (a duration, not an offset) GPU time from the first device launch of the path to the end
                of its GEMM, by CUDA events, read one call later (when they are surely complete)
    device_first  the share of calls whose device path had finished on the GPU when the host joined:
                near 1 the host share is the long pole, near 0 the link share is

Reading it: host_begin well after launched means the host kernel did not start until the launches
were done (the serialization of issue 17); host_end - host_begin against device_gpu says which path is
longer; joined - host_end is the hand-back latency.
"""

from __future__ import annotations

MARKS = ("sync", "choose", "host_args", "host_start", "launched", "host_begin", "host_end", "joined", "done")


class PhaseClock:
    def __init__(self):
        self.calls = 0
        self.sums = dict.fromkeys(MARKS, 0.0)
        self.slots_calls = 0
        self.slots_sums = dict.fromkeys(("sync", "choose", "done"), 0.0)
        self.device_gpu_s = 0.0
        self.device_gpu_calls = 0
        self.device_first = 0
        self.device_polled = 0

    def add(self, t0: float, marks: dict[str, float]) -> None:
        """One call with a host share: absolute perf_counter times by mark (all of MARKS)."""
        self.calls += 1
        for k in MARKS:
            self.sums[k] += marks[k] - t0

    def add_slots(self, t0: float, marks: dict[str, float]) -> None:
        """One call that took the slots step after its sync (no host set)."""
        self.slots_calls += 1
        for k in self.slots_sums:
            self.slots_sums[k] += marks[k] - t0

    def device(self, gpu_s: float | None = None, finished_first: bool | None = None) -> None:
        if gpu_s is not None:
            self.device_gpu_s += gpu_s
            self.device_gpu_calls += 1
        if finished_first is not None:
            self.device_first += finished_first
            self.device_polled += 1

    def merge(self, other: PhaseClock) -> None:
        self.calls += other.calls
        self.slots_calls += other.slots_calls
        for k in MARKS:
            self.sums[k] += other.sums[k]
        for k in self.slots_sums:
            self.slots_sums[k] += other.slots_sums[k]
        self.device_gpu_s += other.device_gpu_s
        self.device_gpu_calls += other.device_gpu_calls
        self.device_first += other.device_first
        self.device_polled += other.device_polled

    def means_us(self) -> dict:
        def mean(sums, n):
            return {k: round(v / n * 1e6, 1) for k, v in sums.items()} if n else {}
        out = {"layers": self.calls, **mean(self.sums, self.calls), "slots_layers": self.slots_calls,
               "slots": mean(self.slots_sums, self.slots_calls)}
        if self.device_gpu_calls:
            out["device_gpu"] = round(self.device_gpu_s / self.device_gpu_calls * 1e6, 1)
        if self.device_polled:
            out["device_first"] = round(self.device_first / self.device_polled, 3)
        return out


def model_phases(blocks) -> dict | None:
    """The phases of every hybrid layer of a model merged (blocks: its MoE blocks), or None when off."""
    total, any_on = PhaseClock(), False
    for b in blocks:
        clock = getattr(b.experts, "phases", None)
        if clock is not None:
            total.merge(clock)
            any_on = True
    return total.means_us() if any_on else None
