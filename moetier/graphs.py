"""CUDA graphs of the decode step: every layer, from token ids to logits, for batch sizes 1, 2, 4
and 8 (a step of another size pads up to the next one). Sampling stays outside the graph.

The graph reads its inputs from static buffers (token ids, positions, KV slots, context lengths,
page tables) that each step overwrites in place; padding rows write their keys into a scratch page
that no request owns and attend to that page only. The slot cache's state lives in device tensors,
so replays advance it exactly as eager steps would.
"""

from __future__ import annotations

import torch

from moetier.attention import AttnBatch
from moetier.kv import KVCache
from moetier.scheduler import ScheduledSeq

SIZES = (1, 2, 4, 8)


class DecodeGraphs:
    def __init__(self, model, kv: KVCache, scratch_page: int, max_pages_per_seq: int, sizes=SIZES):
        self.model, self.kv, self.scratch = model, kv, scratch_page
        self.sizes = tuple(sorted(sizes))
        self.max_batch = self.sizes[-1]
        dev = model.device
        b = self.max_batch
        width = max_pages_per_seq
        # The static inputs are views of two device blocks (int64: ids, positions, slots; int32:
        # context lengths, page table) with pinned host twins, so a step fills them with two copies.
        self._dev64 = torch.zeros(3 * b, dtype=torch.int64, device=dev)
        self._dev32 = torch.zeros(b * (1 + width), dtype=torch.int32, device=dev)
        self._host64 = torch.zeros(3 * b, dtype=torch.int64, pin_memory=True)
        self._host32 = torch.zeros(b * (1 + width), dtype=torch.int32, pin_memory=True)
        self.ids, self.positions, self.slots = self._dev64.view(3, b)
        self.seq_lens = self._dev32[:b]
        self.page_table = self._dev32[b:].view(b, width)
        self.query_start = torch.arange(b + 1, dtype=torch.int32, device=dev)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}
        self._capture()

    def _batch(self, n: int, max_ctx: int) -> AttnBatch:
        return AttnBatch(self.positions[:n], self.slots[:n], self.query_start[:n + 1], self.seq_lens[:n],
                         self.page_table[:n], list(range(n + 1)), [max_ctx] * n, 1)

    def _pad(self) -> None:
        self.ids.zero_()
        self.positions.zero_()
        self.slots.fill_(self.scratch * self.kv.page_size)
        self.seq_lens.fill_(1)
        self.page_table.fill_(self.scratch)

    @torch.inference_mode()
    def _capture(self) -> None:
        # The attention kernel sizes its key splits from the host lengths: capture for the longest
        # context a sequence can have, so every replay is covered.
        max_ctx = self.page_table.shape[1] * self.kv.page_size
        pool = torch.cuda.graph_pool_handle()
        for n in reversed(self.sizes):  # largest first: the smaller graphs reuse its pool
            batch = self._batch(n, max_ctx)
            self._pad()
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):  # warm-up: compile kernels, size workspaces
                self.model.logits(self.model.forward(self.ids[:n], batch, self.kv))
            torch.cuda.current_stream().wait_stream(side)
            self._reset_experts()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.logits[n] = self.model.logits(self.model.forward(self.ids[:n], batch, self.kv))
            self.graphs[n] = graph
        self._reset_experts()

    def _reset_experts(self) -> None:
        # Warm-up and capture ran the cache on padding; start serving from an empty cache.
        for moe in self.model.moe_blocks():
            cache = getattr(moe.experts, "cache", None)
            if cache is not None:
                cache.reset()

    def fits(self, seqs: list[ScheduledSeq]) -> bool:
        return 0 < len(seqs) <= self.max_batch and all(s.num_tokens == 1 and s.sample for s in seqs)

    @torch.inference_mode()
    def run(self, seqs: list[ScheduledSeq]) -> torch.Tensor:
        """Replay the decode graph for these one-token steps -> logits [len(seqs), V] float32."""
        n = len(seqs)
        size = next(s for s in self.sizes if s >= n)
        b, page, width = self.max_batch, self.kv.page_size, self.page_table.shape[1]
        # NOTE: the host blocks are rewritten each step; the previous step's copy has finished,
        # because its sampling read the logits back to the host.
        ids, pos, slot = self._host64.view(3, b)
        lens, table = self._host32[:b], self._host32[b:].view(b, width)
        ids.zero_()
        pos.zero_()
        slot.fill_(self.scratch * page)
        lens.fill_(1)
        table.fill_(self.scratch)
        for i, s in enumerate(seqs):
            r, p = s.request, s.start
            ids[i] = r.token(p)
            pos[i] = p
            slot[i] = r.pages[p // page] * page + p % page
            lens[i] = p + 1
            table[i, : len(r.pages)] = torch.tensor(r.pages, dtype=torch.int32)
        self._dev64.copy_(self._host64, non_blocking=True)
        self._dev32.copy_(self._host32, non_blocking=True)
        self.graphs[size].replay()
        return self.logits[size][:n]
