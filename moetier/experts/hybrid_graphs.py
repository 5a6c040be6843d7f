"""CUDA graphs of the hybrid layer's device path (experts/hybrid.py, step 3: the device share).

After the choice, a step's device pairs (n of 1..P, P = decode tokens x top-k) always take the same
launches: the positions upload, gathers of their ids, weights and hidden rows, the cache bookkeeping,
the fills (copy_rows), the grouped GEMM and the scatter of their outputs into the pair-output buffer
y. Launched one by one from Python they took about 550 us of host time per layer on the H200 (15 host
threads busy on the other cores; docs/hybrid-graphs.md), more than their GPU time, and they were the layer's
critical path. Here they are one graph replay per layer, after three small input copies and the
positions upload.

    sizes(P)                                the captured device-pair counts: powers of two below P, and P
    pad_size(n, P)                          the captured size that a step of n device pairs replays
    padded_plan(gpu, host, size, sentinel)  the one positions upload: device pairs, padding, host pairs

Padding: a padded pair has position `sentinel` (= P), where the static flat ids hold -1
(experts/ep.NOT_MINE: no hit, miss, fill, stamp or GEMM work, see slot_kernels.py and grouped_gemm.py),
the flat weights 0; it gathers the static hidden state's extra row T (never written: harmless) and
scatters into y's extra row P (never read: the combine reads rows < T*k). The real pairs keep their
chunks, tile rows and k order, and the bookkeeping's BLOCK_N (the next power of two of the count, at
least 16) and one-token plan (n == 1) are the same padded or not, so a replay gives the eager path's
bits for the same choice (gpu-marked tests: tests/test_hybrid_graphs.py).

Static buffers (fixed addresses; one set per model and dtype pair, on the HostPath the layers share,
which run one after another on one stream): flat ids [P+1] int64, weights [P+1], hidden [T+1, H], the
positions [2P] int64, y [P+1, H] fp32 and the GEMM's own output [P, H] fp32. forward()'s tensors are
copied in (they need not have fixed addresses: eager decode, tests). Graphs: per layer backend (they
capture its cache, slots and scratch) and per (size, hidden dtype, weight dtype), all in one memory pool
per model (HostPath.graph_pool: their intermediates, the gathered rows, are dead when a replay ends and
layers replay one at a time, so they can share it). Captured at build for the model's dtypes (hidden
and weights in the rows' compute dtype, as the routers give them); NOTE: a step with any other dtype
pair (a test's fp32 weights) takes the eager device path: nothing is captured while serving (a capture
in the middle of a forward failed on the H200, and it would synchronize the device).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def sizes(max_pairs: int) -> list[int]:
    """The captured device-pair counts: 1, 2, 4, ... below max_pairs, then max_pairs."""
    out, n = [], 1
    while n < max_pairs:
        out.append(n)
        n *= 2
    return out + [max_pairs]


def pad_size(n: int, max_pairs: int) -> int:
    """The captured size a step of n (1..max_pairs) device pairs replays: the next power of two, at most
    max_pairs."""
    if not 1 <= n <= max_pairs:
        raise ValueError(f"{n} device pairs: a graph takes 1..{max_pairs}")
    return min(1 << (n - 1).bit_length(), max_pairs)


def padded_plan(gpu_pos: list[int], host_pos: list[int], size: int, sentinel: int) -> list[int]:
    """The positions upload of a replay: the device pairs' positions, padded with `sentinel` up to
    `size`, then the host pairs' (read eagerly by the combine's scatter)."""
    return gpu_pos + [sentinel] * (size - len(gpu_pos)) + host_pos


@dataclass
class Statics:
    """A model's static buffers of one (hidden dtype, weight dtype) pair (module docstring)."""

    ids: torch.Tensor   # [P+1] int64; [P] = -1
    w: torch.Tensor     # [P+1] weight dtype; [P] = 0
    hid: torch.Tensor   # [T+1, H] hidden dtype; row T zeros
    perm: torch.Tensor  # [2P] int64: padded device positions, then host positions
    y: torch.Tensor     # [P+1, H] fp32 pair outputs; row P scratch
    out: torch.Tensor   # [P, H] fp32: grouped_expert_mlp's weighted output (unused, written)

    @classmethod
    def make(cls, tokens: int, top_k: int, hidden: int, xdt: torch.dtype, wdt: torch.dtype, device) -> Statics:
        p = tokens * top_k
        ids = torch.empty(p + 1, dtype=torch.int64, device=device)
        ids[p] = -1
        w = torch.zeros(p + 1, dtype=wdt, device=device)
        return cls(ids, w, torch.zeros(tokens + 1, hidden, dtype=xdt, device=device),
                   torch.full((2 * p,), p, dtype=torch.int64, device=device),
                   torch.zeros(p + 1, hidden, dtype=torch.float32, device=device),
                   torch.empty(p, hidden, dtype=torch.float32, device=device))

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.ids, self.w, self.hid, self.perm, self.y, self.out))


def statics(hostpath, tokens: int, top_k: int, hidden: int, xdt, wdt, device) -> Statics:
    """The model's Statics for these dtypes, made at first ask (kept on the HostPath)."""
    key = (torch.device(device), tokens, top_k, hidden, xdt, wdt)
    st = hostpath.graph_statics.get(key)
    if st is None:
        st = hostpath.graph_statics[key] = Statics.make(tokens, top_k, hidden, xdt, wdt, device)
    return st


class DeviceGraphs:
    """The device path of one HybridExperts layer as CUDA graphs (module docstring)."""

    def __init__(self, backend):
        self.b = backend
        self.max_pairs = backend.decode_tokens * backend.top_k
        self.graphs: dict[tuple, torch.cuda.CUDAGraph] = {}
        self.replays = 0
        self._statics: dict[tuple, Statics] = {}  # the model's (HostPath's), by dtypes: one lookup a step
        self._ready: set[tuple] = set()  # (hidden dtype, weight dtype) pairs captured at build

    def statics(self, xdt, wdt) -> Statics:
        st = self._statics.get((xdt, wdt))
        if st is None:
            b = self.b
            st = self._statics[xdt, wdt] = statics(b.hostpath, b.decode_tokens, b.top_k, b.layout.hidden, xdt, wdt,
                                                    b.device)
        return st

    def capture_all(self, xdt: torch.dtype, wdt: torch.dtype) -> None:
        """At build: every size for these dtypes (the only ones replayed: ready())."""
        for n in sizes(self.max_pairs):
            self.graphs[n, xdt, wdt] = self._capture(n, self.statics(xdt, wdt))
        self._ready.add((xdt, wdt))

    def ready(self, xdt, wdt) -> bool:
        """Whether steps of these dtypes replay (captured at build); else the eager device path."""
        return (xdt, wdt) in self._ready

    def run(self, hidden, topk_ids, topk_weights, gpu_pos: list[int], host_pos: list[int], timed: bool
            ) -> tuple[torch.Tensor, torch.Tensor]:
        """The device path by one replay: -> (y [T*k, H] fp32 with the device pairs' outputs to come, the
        host pairs' positions on the device). gpu_pos: at least one."""
        b = self.b
        t, k = topk_ids.shape
        ng, nh = len(gpu_pos), len(host_pos)
        n = pad_size(ng, self.max_pairs)
        g = self.graphs[n, hidden.dtype, topk_weights.dtype]
        st = self.statics(hidden.dtype, topk_weights.dtype)
        plan = b.hostpath.buffer("plan", (n + nh,), torch.int64, True)
        plan.numpy()[:] = padded_plan(gpu_pos, host_pos, n, self.max_pairs)  # no tensor built first
        st.perm[:n + nh].copy_(plan, non_blocking=True)
        st.ids[:t * k].copy_(topk_ids.reshape(-1))
        st.w[:t * k].copy_(topk_weights.reshape(-1))
        st.hid[:t].copy_(hidden)
        if timed:
            b._ev_dev[0].record()
        g.replay()
        if timed:
            b._ev_dev[1].record()
            b._dev_pending = True
        self.replays += 1
        return st.y[:t * k], st.perm[n:n + nh]

    def _body(self, st: Statics, n: int) -> None:
        """The captured launches: the eager path's (HybridExperts.device_pairs) over static inputs."""
        gpos = st.perm[:n]
        self.b.device_pairs(st.hid.index_select(0, gpos // self.b.top_k), st.ids.index_select(0, gpos).view(n, 1),
                            st.w.index_select(0, gpos).view(n, 1), gpos, st.out[:n], st.y)

    def _capture(self, n: int, st: Statics) -> torch.cuda.CUDAGraph:
        """One eager run of the body with every pair padding (it compiles whatever is missing; the cache's
        clock and step count, the only state it moves, are put back), then the capture."""
        b = self.b
        cache = b.cache
        st.perm[:n].fill_(self.max_pairs)
        keep = cache.clock.clone(), cache.stats.clone()
        main = torch.cuda.current_stream(b.device)
        side = torch.cuda.Stream(b.device)
        side.wait_stream(main)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.stream(side):
            self._body(st, n)
            side.synchronize()
            # capture_begin, not torch.cuda.graph: that one runs gc.collect() and empty_cache() per graph.
            g.capture_begin(pool=b.hostpath.graph_pool(), capture_error_mode="thread_local")
            try:
                self._body(st, n)
            finally:
                g.capture_end()
        main.wait_stream(side)
        cache.clock.copy_(keep[0])
        cache.stats.copy_(keep[1])
        return g
