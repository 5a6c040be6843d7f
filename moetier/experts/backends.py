"""The ExpertBackend interface (one per MoE layer) and its implementations.

    forward(hidden [T, H], topk_ids [T, k], topk_weights [T, k]) -> [T, H]

    resident   every expert in device memory. The ceiling and the reference.
    slots      an HBM slot cache (slots.py) over the host store (store.py). The product.
    uva        every expert in pinned host memory, read across the link on every use: what vLLM's
               --cpu-offload-gb does. The baseline to beat.

An expert's weights are one row [gate_up (2I x H) | down (H x I)] (store.RowLayout). Every backend
computes each (token, expert) pair with the same ops and sums the k outputs in slot order, so the
backends differ only in where a row's bytes are read from: slots and uva are bit-exact against
resident with the same kernels. On the CPU those are torch ops; on CUDA, decode steps (T up to
`decode_tokens`) run the Triton kernels with no host sync and fixed buffers (CUDA-graph safe): the
bookkeeping and fill of slots, then the grouped GEMM (grouped.py, each distinct row read once).
Larger steps (prefill) take an eager per-expert path that bypasses the cache.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Callable

import torch
import torch.nn.functional as F

from moetier.experts.slots import SlotCache, policy_for
from moetier.experts.store import DevicePointer, RowLayout
from moetier.models.layers import silu_mul

Fetch = Callable[[int], tuple[torch.Tensor, torch.Tensor]]  # row key -> (w13 [2I, H], w2 [H, I])


def expert_pairs(hidden: torch.Tensor, keys: torch.Tensor, fetch: Fetch) -> torch.Tensor:
    """Outputs of every (token, slot) pair, before weighting: [T, k, H].

    `keys` [T, k] names the row each pair reads; fetch(key) gives that row's weights. Rows are visited
    one at a time over the pairs that use them, pairs in flat order; a pair's result depends only on
    its token and its row's bytes, so which rows hold which expert never changes a bit.
    NOTE: host-side loop over used rows (syncs); the CUDA decode path is gemm.expert_mlp.
    """
    t, k = keys.shape
    flat = keys.reshape(-1)
    tok = torch.arange(t, device=hidden.device).repeat_interleave(k)
    out = hidden.new_empty(t * k, hidden.shape[-1])
    order = torch.argsort(flat, stable=True)
    uniq, counts = torch.unique_consecutive(flat[order], return_counts=True)
    begin = 0
    for key, n in zip(uniq.tolist(), counts.tolist()):
        pairs = order[begin:begin + n]
        begin += n
        w13, w2 = fetch(key)
        out[pairs] = F.linear(silu_mul(F.linear(hidden[tok[pairs]], w13)), w2)
    return out.view(t, k, -1)


def combine(pair_out: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
    # pair_out: [T, k, H], topk_weights: [T, k] -> [T, H]; a fixed reduction order over k.
    return (pair_out * topk_weights[..., None].to(pair_out.dtype)).sum(dim=1)


def row_fetch(rows: torch.Tensor, layout: RowLayout, device: torch.device | None = None) -> Fetch:
    """Fetch from a rows tensor [N, R]; with `device`, rows are copied there first (prefill over the link)."""
    def fetch(key: int) -> tuple[torch.Tensor, torch.Tensor]:
        row = rows[key:key + 1]
        if device is not None and row.device != device:
            row = row.to(device, non_blocking=True)
        return layout.w13(row)[0], layout.w2(row)[0]
    return fetch


class ExpertBackend(ABC):
    """Computes one MoE layer's routed experts for the tokens of a step."""

    name: str

    def __init__(self, layout: RowLayout, top_k: int, decode_tokens: int, device: torch.device):
        self.layout, self.top_k, self.device = layout, top_k, torch.device(device)
        self.decode_tokens = decode_tokens  # steps up to this many tokens take the decode path
        self.bypassed = 0  # steps that took the prefill path (host-side count, prefill is eager)
        self.cuda = self.device.type == "cuda"
        if self.cuda:
            from moetier.experts import grouped

            # shared by every backend of this shape (see grouped.Scratch)
            self._work = grouped.Scratch.shared(decode_tokens * top_k, layout.hidden, layout.inter, self.device)
            self._out: torch.Tensor | None = None

    @abstractmethod
    def forward(self, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        ...

    @abstractmethod
    def nbytes(self) -> dict[str, int]:
        """Bytes this backend holds, by tier ('device', 'host')."""

    def _decode_out(self, hidden: torch.Tensor) -> torch.Tensor:
        if self._out is None or self._out.dtype != hidden.dtype:
            self._out = torch.empty(self.decode_tokens, self.layout.hidden, dtype=hidden.dtype, device=self.device)
        return self._out[: hidden.shape[0]]

    def _kernel(self, hidden, slot_ids, topk_ids, topk_weights, dev_rows, host_rows) -> torch.Tensor:
        from moetier.experts import grouped

        # One kernel for every T and every backend: the backends stay bit-exact against each other,
        # and a pair's result never depends on the other tokens of its step (a token gets the same
        # bits alone or in a batch). At one token it is as fast as the per-pair GEMV (gemm.py: 31.0
        # vs 31.1 us per Qwen3-30B layer on the H200), 2.3x faster at 64 (scripts/tune_experts.py,
        # bench/results/h200-tune-experts.json).
        return grouped.grouped_expert_mlp(hidden, slot_ids, topk_ids, topk_weights, dev_rows, host_rows,
                                          self.layout.hidden, self.layout.inter, self._work,
                                          self._decode_out(hidden))


class ResidentExperts(ExpertBackend):
    """Every expert in the compute device's memory."""

    name = "resident"

    def __init__(self, rows: torch.Tensor, layout: RowLayout, top_k: int, decode_tokens: int = 64):
        super().__init__(layout, top_k, decode_tokens, rows.device)
        self.rows = rows  # [E, R]

    def forward(self, hidden, topk_ids, topk_weights):
        if self.cuda and hidden.shape[0] <= self.decode_tokens:
            return self._kernel(hidden, topk_ids.int(), topk_ids, topk_weights, self.rows, self.rows)
        return combine(expert_pairs(hidden, topk_ids, row_fetch(self.rows, self.layout)), topk_weights)

    def nbytes(self):
        return {"device": self.rows.numel() * self.rows.element_size(), "host": 0}


class UvaExperts(ExpertBackend):
    """Every expert in pinned host memory, read across the link each time it is used."""

    name = "uva"

    def __init__(self, host_rows: torch.Tensor, layout: RowLayout, top_k: int, decode_tokens: int = 64,
                 device: torch.device | str = "cpu"):
        super().__init__(layout, top_k, decode_tokens, device)
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
            self.bypassed += 1
        fetch = row_fetch(self.host, self.layout, self.device if self.cuda else None)
        return combine(expert_pairs(hidden, topk_ids, fetch), topk_weights)

    def nbytes(self):
        return {"device": 0, "host": self.host.numel() * self.host.element_size()}


class SlotExperts(ExpertBackend):
    """S slots in device memory caching the experts of the host store (see slots.py for one step)."""

    name = "slots"

    def __init__(self, host_rows: torch.Tensor, layout: RowLayout, top_k: int, num_slots: int,
                 decode_tokens: int = 64, device: torch.device | str = "cpu", fill: str = "kernel",
                 policy: str = "lfru"):
        super().__init__(layout, top_k, decode_tokens, device)
        if fill not in ("kernel", "copy"):
            raise ValueError(f"fill must be 'kernel' or 'copy', got {fill!r}")
        num_experts = host_rows.shape[0]
        self.host = host_rows
        self.fill = fill
        self.cache = SlotCache(num_experts, num_slots, self.device, policy_for(policy, num_slots, top_k))
        self.slots = torch.empty(num_slots, layout.numel, dtype=host_rows.dtype, device=self.device)
        if self.cuda:
            from moetier.experts import kernels

            self._host_dev = DevicePointer(host_rows)
            self._scratch = kernels.Scratch(num_experts, num_slots, decode_tokens * top_k, self.device)
            sms = torch.cuda.get_device_properties(self.device).multi_processor_count
            self._copy_programs = 2 * sms
            self._copy_stream = torch.cuda.Stream(self.device)

    def forward(self, hidden, topk_ids, topk_weights):
        t = hidden.shape[0]
        if t > self.decode_tokens:
            return self._bypass(hidden, topk_ids, topk_weights)
        if not self.cuda:
            slot_ids, miss = self.cache.step_reference(topk_ids)
            n = int(miss.count)
            self.slots[miss.slot[:n].long()] = self.host[miss.expert[:n].long()]
            keys = torch.where(slot_ids >= 0, slot_ids.long(), self.cache.num_slots + topk_ids)
            return combine(expert_pairs(hidden, keys, self._fetch), topk_weights)
        from moetier.experts import kernels

        slot_ids = kernels.bookkeeping(self.cache, self._scratch, topk_ids)
        if self.fill == "kernel":
            kernels.copy_rows(self._host_dev, self.slots, self._scratch, self._copy_programs)
        else:
            self._fill_by_copy_engine()
        return self._kernel(hidden, slot_ids, topk_ids, topk_weights, self.slots, self._host_dev)

    def _fetch(self, key: int) -> tuple[torch.Tensor, torch.Tensor]:
        s = self.cache.num_slots
        rows = self.slots[key:key + 1] if key < s else self.host[key - s:key - s + 1]
        return self.layout.w13(rows)[0], self.layout.w2(rows)[0]

    def _fill_by_copy_engine(self) -> None:
        """Fill misses with cudaMemcpyAsync on a side stream. Reads the miss list on the host (a sync):
        for eager steps and prefetching, not for graph-captured decode."""
        sc = self._scratch
        n = int(sc.miss_count)
        if n == 0:
            return
        experts, slots = sc.miss_expert[:n].tolist(), sc.miss_slot[:n].tolist()
        main = torch.cuda.current_stream(self.device)
        self._copy_stream.wait_stream(main)
        with torch.cuda.stream(self._copy_stream):
            for e, s in zip(experts, slots):
                self.slots[s].copy_(self.host[e], non_blocking=True)
        main.wait_stream(self._copy_stream)

    def _bypass(self, hidden, topk_ids, topk_weights) -> torch.Tensor:
        """Prefill: leave the cache alone; read resident experts from their slots, stream the rest."""
        self.bypassed += 1
        slot_of = self.cache.expert_slot.tolist()
        host = row_fetch(self.host, self.layout, self.device if self.cuda else None)

        def fetch(expert: int) -> tuple[torch.Tensor, torch.Tensor]:
            s = slot_of[expert]
            return self._fetch(s) if s >= 0 else host(expert)
        return combine(expert_pairs(hidden, topk_ids, fetch), topk_weights)

    def nbytes(self):
        return {"device": self.slots.numel() * self.slots.element_size(),
                "host": self.host.numel() * self.host.element_size()}


BACKENDS = ("resident", "slots", "uva")
