"""The ExpertBackend interface (one per MoE layer) and its implementations.

    forward(hidden [T, H], topk_ids [T, k], topk_weights [T, k]) -> [T, H]

    resident   every expert in device memory. The ceiling and the reference.
    slots      an HBM slot cache (slots.py) over the host store (store.py). The product.
    uva        every expert in pinned host memory, read across the link on every use: what vLLM's
               --cpu-offload-gb does. The baseline to beat.

An expert's weights are one row [gate_up (2I x H) | down (H x I)] (quant/rows.RowLayout; FP8 rows append
the block scales, and the CPU path dequantizes a row before the same torch ops). Every backend
computes each (token, expert) pair with the same ops and sums the k outputs in slot order, so the
backends differ only in where a row's bytes are read from: slots and uva are bit-exact against
resident with the same kernels. On the CPU those are torch ops; on CUDA, decode steps (T up to
`decode_tokens`) run the Triton kernels with no host sync and fixed buffers (CUDA-graph safe): the
bookkeeping and fill of slots, then the grouped GEMM (grouped_gemm.py, each distinct row read once).
Larger steps (prefill) take the large-step grouped GEMM on CUDA (a device sort for its plan, chunks
of up to 64 pairs of a row, host rows read across the link in the kernel, no host sync); on the CPU
the per-expert torch path (reference.py). The slot cache's part in them is a policy
(prefill_cache.py): bypass leaves it alone, refresh first moves the chunk's most used experts in.
Under bypass, how the misses of a large step reach the GEMM is the prefill stream mode
(prefill_ring.py): uva (read over the link in the kernel) or ring (staged by the copy engine).

A negative topk id (experts/parallel/ep.NOT_MINE: another rank's expert) is no pair of this backend on every
path: it reads no row, takes no slot, counts nowhere and contributes exactly zero to the k-sum.

Every backend counts what it did (stats(): hits, misses, overflow, steps, bypassed) and can be put
back to its empty state (reset()), so nobody reaches into a backend's cache.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from moetier.experts.kernels.gemm_config import GemmConfig
from moetier.experts.prefill.cache_policy import check_policy, refresh_device, refresh_reference
from moetier.experts.prefill.ring import (RING_DEPTH, RING_GROUP, StagingRing, check_geometry, check_stream,
                                          ring_forward, ring_large)
from moetier.experts.reference import combine, expert_pairs, row_fetch
from moetier.experts.cache.slots import SlotCache, policy_for
from moetier.experts.cache.store import DevicePointer
from moetier.quant.rows import RowLayout

class ExpertBackend(ABC):
    """Computes one MoE layer's routed experts for the tokens of a step."""

    name: str
    # False: forward() reads device values on the host (a sync), so a decode step cannot be captured
    # in a CUDA graph; the engine then runs decode steps eagerly.
    graph_safe = True
    # True: prefetch() takes in predicted experts ahead of the layer's step (experts/prefetch.py)
    prefetches = False

    def __init__(self, layout: RowLayout, top_k: int, decode_tokens: int, device: torch.device,
                 gemm: GemmConfig = GemmConfig()):
        self.layout, self.top_k, self.device, self.gemm = layout, top_k, torch.device(device), gemm
        self.decode_tokens = decode_tokens  # steps up to this many tokens take the decode path
        self.bypassed = 0  # steps that took the prefill path (host-side count, prefill is eager)
        self.cuda = self.device.type == "cuda"
        if self.cuda:
            from moetier.experts.kernels.grouped_gemm import GemmScratch

            # shared by every backend of this shape (see GemmScratch)
            self._work = GemmScratch.shared(decode_tokens * top_k, layout.hidden, layout.inter, self.device)
            self._out: torch.Tensor | None = None

    @abstractmethod
    def forward(self, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        ...

    @abstractmethod
    def nbytes(self) -> dict[str, int]:
        """Bytes this backend holds, by tier ('device', 'host')."""

    def stats(self) -> dict[str, int]:
        """Counters since the last reset: cache hits, misses (filled), overflow (read over the link),
        decode steps of the cache, and steps that bypassed it (prefill). One host read; call between
        steps, never inside one."""
        return {"hits": 0, "misses": 0, "overflow": 0, "steps": 0, "bypassed": self.bypassed}

    def reset(self) -> None:
        """Back to the state after building: counters zero, an empty cache."""
        self.bypassed = 0

    def _decode_out(self, hidden: torch.Tensor) -> torch.Tensor:
        if self._out is None or self._out.dtype != hidden.dtype:
            self._out = torch.empty(self.decode_tokens, self.layout.hidden, dtype=hidden.dtype, device=self.device)
        return self._out[: hidden.shape[0]]

    def _large(self, hidden, slot_ids, topk_ids, topk_weights, dev_rows, host_rows, max_rows) -> torch.Tensor:
        """A step above the decode limit on CUDA (prefill): the same SwiGLU by the large-step grouped
        GEMM, a device sort for its plan, no host sync; host rows read across the link in the kernel."""
        from moetier.experts.kernels.grouped_gemm_large import grouped_expert_mlp_large

        self.bypassed += 1
        return grouped_expert_mlp_large(hidden, slot_ids, topk_ids, topk_weights, dev_rows, host_rows,
                                        self.layout.hidden, self.layout.inter, max_rows, self.gemm, self.layout.quant,
                                        limit=self.layout.swiglu_limit)

    def _kernel(self, hidden, slot_ids, topk_ids, topk_weights, dev_rows, host_rows) -> torch.Tensor:
        from moetier.experts.kernels.grouped_gemm import grouped_expert_mlp

        # One kernel for every backend at a given T: the backends stay bit-exact against each other,
        # and on the GPU a pair's result never depends on the other tokens of its step (see the NOTE in
        # grouped_gemm._gate_up). bf16 rows take the grouped GEMM at every T (at one token as fast as a
        # per-pair GEMV, faster with more: docs/bench-decode.md), so a token gets the same bits alone or
        # in a batch; FP8 and 4-bit rows take a GEMV at one token (fp8_gemv.py, q4_gemv.py), whose bits
        # differ from the grouped GEMM's: for them batch == alone holds for greedy tokens.
        return grouped_expert_mlp(hidden, slot_ids, topk_ids, topk_weights, dev_rows, host_rows, self.layout.hidden,
                                  self.layout.inter, self._work, self._decode_out(hidden), self.gemm, self.layout.quant,
                                  self.layout.swiglu_limit)


class ResidentExperts(ExpertBackend):
    """Every expert in the compute device's memory."""

    name = "resident"

    def __init__(self, rows: torch.Tensor, layout: RowLayout, top_k: int, decode_tokens: int = 64,
                 gemm: GemmConfig = GemmConfig()):
        super().__init__(layout, top_k, decode_tokens, rows.device, gemm)
        self.rows = rows  # [E, R]

    def forward(self, hidden, topk_ids, topk_weights):
        if self.cuda and hidden.shape[0] <= self.decode_tokens:
            return self._kernel(hidden, topk_ids.int(), topk_ids, topk_weights, self.rows, self.rows)
        if self.cuda:
            return self._large(hidden, topk_ids.int(), topk_ids, topk_weights, self.rows, self.rows,
                               self.rows.shape[0])
        return combine(expert_pairs(hidden, topk_ids, row_fetch(self.rows, self.layout, hidden.dtype),
                                    self.layout.swiglu_limit),
                       topk_weights)

    def nbytes(self):
        return {"device": self.rows.numel() * self.rows.element_size(), "host": 0}


class UvaExperts(ExpertBackend):
    """Every expert in pinned host memory, read across the link each time it is used."""

    name = "uva"

    def __init__(self, host_rows: torch.Tensor, layout: RowLayout, top_k: int, decode_tokens: int = 64,
                 device: torch.device | str = "cpu", gemm: GemmConfig = GemmConfig()):
        super().__init__(layout, top_k, decode_tokens, device, gemm)
        self.host = host_rows  # [E, R] on the CPU
        if self.cuda:
            self._host_dev = DevicePointer(host_rows)
            self._none = torch.full((decode_tokens * top_k,), -1, dtype=torch.int32, device=self.device)
            # the kernel reads host rows only; it still needs a device tensor for the slot-row argument
            self._no_rows = torch.empty(1, layout.numel, dtype=host_rows.dtype, device=self.device)

    def forward(self, hidden, topk_ids, topk_weights):
        t = hidden.shape[0]
        if self.cuda and t <= self.decode_tokens:
            none = self._none[: topk_ids.numel()].view(topk_ids.shape)
            return self._kernel(hidden, none, topk_ids, topk_weights, self._no_rows, self._host_dev)
        if self.cuda:
            none = torch.full(topk_ids.shape, -1, dtype=torch.int32, device=self.device)
            return self._large(hidden, none, topk_ids, topk_weights, self._no_rows, self._host_dev,
                               self.host.shape[0])
        return combine(expert_pairs(hidden, topk_ids, row_fetch(self.host, self.layout, hidden.dtype),
                                    self.layout.swiglu_limit),
                       topk_weights)

    def nbytes(self):
        return {"device": 0, "host": self.host.numel() * self.host.element_size()}


class SlotExperts(ExpertBackend):
    """S slots in device memory caching the experts of the host store (see slots.py for one step)."""

    name = "slots"
    prefetches = True

    def __init__(self, host_rows: torch.Tensor, layout: RowLayout, top_k: int, num_slots: int,
                 decode_tokens: int = 64, device: torch.device | str = "cpu", policy: str = "lfru", gemm: GemmConfig = GemmConfig(), prefill: str = "bypass",
                 prefill_stream: str = "ring", ring: tuple[int, int] = (RING_GROUP, RING_DEPTH),
                 pinned: tuple[int, ...] = (), device_rows: torch.Tensor | None = None):
        """pinned: experts (local ids) that live on the GPU for good (experts/cache/split.py); device_rows:
        the [S + P, R] device block, pinned[j]'s row filled at S + j (made here, slots only, when None).
        host_rows [E, R]: only the cached experts' rows are read (a split store backs no others)."""
        super().__init__(layout, top_k, decode_tokens, device, gemm)
        num_experts = host_rows.shape[0]
        self.host = host_rows
        self.prefill = check_policy(prefill)  # what a large step does to the cache (prefill_cache.py)
        # how a bypass step's misses reach the GEMM: uva (in the kernel) or ring (prefill_ring.py)
        self.prefill_stream = check_stream(prefill_stream)
        problems = check_geometry(*ring)
        if problems:
            raise ValueError("; ".join(problems))
        self.ring_shape = ring  # (G rows per buffer, D buffers): the ring is made at the first ring step
        self.ring_rows = 0  # rows the ring copied over the link (host count)
        self.cache = SlotCache(num_experts, num_slots, self.device, policy_for(policy, num_slots, top_k), pinned)
        rows = self.cache.num_rows
        if device_rows is None:
            if pinned:
                raise ValueError("pinned experts need their device rows (device_rows [S + P, R], filled)")
            device_rows = torch.empty(rows, layout.numel, dtype=host_rows.dtype, device=self.device)
        if tuple(device_rows.shape) != (rows, layout.numel) or device_rows.dtype != host_rows.dtype:
            raise ValueError(f"device_rows must be [{rows}, {layout.numel}] {host_rows.dtype}, "
                             f"got {list(device_rows.shape)} {device_rows.dtype}")
        self.slots = device_rows  # [S + P, R]: the slots, then the pinned experts (slot ids index both)
        # rows the prefill refreshes filled (a device counter: the CUDA path adds the miss count unread)
        self._refreshed = torch.zeros(1, dtype=torch.int64, device=self.device)
        # prefetch steps' counters (slots.py's five), apart from the real steps' (experts/prefetch.py)
        self._prefetch_stats = torch.zeros(5, dtype=torch.int64, device=self.device)
        self._prefetched = False  # a prefetch is in flight on the side stream: forward joins it first
        self._guess_in: torch.Tensor | None = None  # [decode_tokens, H]: the predictor's input, fixed address
        if self.cuda:
            from moetier.experts.cache.slot_kernels import BookkeepingScratch

            self._host_dev = DevicePointer(host_rows)
            # NOTE: at least S pairs: a refresh step asks for S ids (experts/registry.slot_cache_state)
            self._scratch = BookkeepingScratch(num_experts, num_slots, max(decode_tokens * top_k, num_slots),
                                               self.device)
            sms = torch.cuda.get_device_properties(self.device).multi_processor_count
            self._copy_programs = 2 * sms

    def prefetch(self, predict, x: torch.Tensor) -> None:
        """Take in the experts predict(x) names (x: the previous MoE layer's input [T, H]) before this
        layer's step: one cache step with its own counters, and its fills; on CUDA on the side stream
        (experts/prefetch.py), which this layer's forward joins. Decode steps only."""
        t = x.shape[0]
        if t > self.decode_tokens:
            return
        if not self.cuda:
            self._fill_reference(self.cache.step_reference(predict(x), stats=self._prefetch_stats)[1])
            return
        from moetier.experts.cache.slot_kernels import bookkeeping, copy_rows
        from moetier.experts.prefetch import side_stream

        if self._guess_in is None or self._guess_in.dtype != x.dtype:
            self._guess_in = torch.empty(self.decode_tokens, x.shape[1], dtype=x.dtype, device=self.device)
        guess_in = self._guess_in[:t]
        guess_in.copy_(x)  # NOTE: x's memory may be reused once this layer returns; the side stream reads this copy
        main, side = torch.cuda.current_stream(self.device), side_stream(self.device)
        side.wait_stream(main)
        with torch.cuda.stream(side):
            bookkeeping(self.cache, self._scratch, predict(guess_in), stats=self._prefetch_stats)
            copy_rows(self._host_dev, self.slots, self._scratch, self._copy_programs)
        self._prefetched = True

    def _join_prefetch(self) -> None:
        if self._prefetched:  # the cache's state and its scratch are the side stream's until here
            from moetier.experts.prefetch import side_stream

            torch.cuda.current_stream(self.device).wait_stream(side_stream(self.device))
            self._prefetched = False

    def forward(self, hidden, topk_ids, topk_weights):
        t = hidden.shape[0]
        self._join_prefetch()
        if t > self.decode_tokens:
            return self._bypass(hidden, topk_ids, topk_weights)
        if not self.cuda:
            slot_ids, miss = self.cache.step_reference(topk_ids)
            self._fill_reference(miss)
            keys = torch.where(slot_ids >= 0, slot_ids.long(), self.cache.num_rows + topk_ids)
            keys = torch.where(topk_ids < 0, topk_ids, keys)  # another rank's expert (experts/parallel/ep.py)
            return combine(expert_pairs(hidden, keys, self._fetcher(hidden.dtype), self.layout.swiglu_limit),
                           topk_weights)
        from moetier.experts.cache.slot_kernels import bookkeeping, copy_rows

        slot_ids = bookkeeping(self.cache, self._scratch, topk_ids)
        copy_rows(self._host_dev, self.slots, self._scratch, self._copy_programs)
        return self._kernel(hidden, slot_ids, topk_ids, topk_weights, self.slots, self._host_dev)

    def _fill_reference(self, miss) -> int:
        """The torch path's fill: the miss list's host rows into their slots. -> rows copied."""
        n = int(miss.count)
        self.slots[miss.slot[:n].long()] = self.host[miss.expert[:n].long()]
        return n

    def _fetcher(self, dtype: torch.dtype):
        """key -> weights: keys below S + P read device row `key`, the others host row `key - S - P`."""
        s = self.cache.num_rows
        slot, host = row_fetch(self.slots, self.layout, dtype), row_fetch(self.host, self.layout, dtype)
        return lambda key: slot(key) if key < s else host(key - s)

    def _bypass(self, hidden, topk_ids, topk_weights) -> torch.Tensor:
        """Prefill: experts in slots are read from their slots, the rest from the host store across the
        link (each row once per chunk of its tokens). Under the refresh policy the cache first takes
        one step over the chunk's experts ranked by use and fills its misses (prefill_cache.py), so
        the slot ids below are the refreshed ones; under bypass the cache is left alone, and in the ring
        prefill stream mode the misses are staged by the copy engine instead (_ring, prefill_ring.py)."""
        if self.prefill_stream == "ring" and self.prefill == "bypass":
            # a device gather: -1 where not in a slot (a negative id's slot id is moot: no pass reads it)
            return self._ring(hidden, self.cache.expert_slot[topk_ids.clamp(min=0)], topk_ids, topk_weights)
        if self.cuda:
            if self.prefill == "refresh":
                from moetier.experts.cache.slot_kernels import copy_rows

                refresh_device(self.cache, self._scratch, topk_ids)
                copy_rows(self._host_dev, self.slots, self._scratch, self._copy_programs)  # NOTE: before the GEMM
                self._refreshed += self._scratch.miss_count  # on the device: no read back
            # a device gather: -1 where not in a slot (a negative id's slot id is moot: the GEMM skips it)
            slot_ids = self.cache.expert_slot[topk_ids.clamp(min=0)]
            return self._large(hidden, slot_ids, topk_ids, topk_weights, self.slots, self._host_dev,
                               self.cache.num_rows + self.cache.num_experts)
        self.bypassed += 1
        if self.prefill == "refresh":
            self._refreshed += self._fill_reference(refresh_reference(self.cache, topk_ids))
        slot_of = self.cache.expert_slot.tolist()
        host = row_fetch(self.host, self.layout, hidden.dtype)
        slot = row_fetch(self.slots, self.layout, hidden.dtype)

        def fetch(expert: int) -> tuple[torch.Tensor, torch.Tensor]:
            s = slot_of[expert]
            return slot(s) if s >= 0 else host(expert)
        return combine(expert_pairs(hidden, topk_ids, fetch, self.layout.swiglu_limit), topk_weights)

    def _ring(self, hidden, slot_ids, topk_ids, topk_weights) -> torch.Tensor:
        """A bypass step in the ring mode (prefill_ring.py): the hits' pass, then the missing experts'
        groups as the copy engine stages them, pair outputs unweighted into one buffer, one combine.
        NOTE: one host read per layer (the miss list); prefill is eager."""
        self.bypassed += 1
        t, k = topk_ids.shape
        lay = self.layout
        ring = StagingRing.shared(*self.ring_shape, lay.numel, self.host.dtype, self.device)
        if self.cuda:
            out, copied = ring_large(ring, hidden, slot_ids, topk_ids, topk_weights, self.host, self.slots,
                                     lay.hidden, lay.inter, self.gemm, lay.quant, lay.swiglu_limit)
            self.ring_rows += copied
            return out
        pair_out = hidden.new_zeros(t, k, lay.hidden)

        def cpu_pass(row_ids, ids, rows, max_rows):  # the torch reference over the pass's experts
            row_of = dict(zip(ids.reshape(-1).tolist(), row_ids.reshape(-1).tolist()))
            fetch = row_fetch(rows, lay, hidden.dtype)
            part = expert_pairs(hidden, ids, lambda e: fetch(row_of[e]), lay.swiglu_limit)
            pair_out.copy_(torch.where((ids >= 0)[..., None], part, pair_out))
        self.ring_rows += ring_forward(ring, slot_ids, topk_ids, self.host, self.slots, cpu_pass)
        return combine(pair_out, topk_weights)

    def nbytes(self):
        # the host holds the cached experts' rows only (a split store backs no pinned row)
        cached = self.cache.num_experts - self.cache.num_pinned
        return {"device": self.slots.numel() * self.slots.element_size(),
                "host": cached * self.host.shape[1] * self.host.element_size()}

    def stats(self):
        # refreshed: rows prefill refreshes filled (not in misses: those count decode's fills);
        # prefetch_*: the prefetch steps' lookups (experts/prefetch.py), never in the step counters
        h, m, o, s, _ = self._prefetch_stats.tolist()
        return {**self.cache.read_stats(), "bypassed": self.bypassed, "refreshed": int(self._refreshed),
                "prefetch_hits": h, "prefetch_fills": m, "prefetch_overflow": o, "prefetch_steps": s}

    def reset(self):
        super().reset()
        self.ring_rows = 0
        self.cache.reset()
        self._refreshed.zero_()
        self._prefetch_stats.zero_()


def set_prefill_policy(backend: ExpertBackend, policy: str) -> None:
    """Set the prefill cache policy of a backend with a slot cache (slots, hybrid; through an
    expert-parallel wrapper); backends without one have nothing to refresh."""
    check_policy(policy)
    if (inner := _slot_backend(backend)) is not None:
        inner.prefill = policy


def set_prefill_stream(backend: ExpertBackend, mode: str) -> None:
    """Set the prefill stream mode (uva or ring, prefill_ring.py) of a backend with a slot cache
    (through an expert-parallel wrapper); the others have no misses to stream."""
    check_stream(mode)
    if (inner := _slot_backend(backend)) is not None:
        inner.prefill_stream = mode


def _slot_backend(backend: ExpertBackend) -> SlotExperts | None:
    """The backend's slot cache owner, through a parallel wrapper (ep.ShardedExperts, columns.ColumnExperts)."""
    inner = getattr(backend, "inner", backend)
    return inner if isinstance(inner, SlotExperts) else None

