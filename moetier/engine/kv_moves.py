"""The runner's half of the prefix cache: the bytes that the bookkeeping (prefix_cache.py,
kv_host_tier.py) only plans. Two kinds of moves, both inside one step and none with a host sync:

- Host KV tier: pinned host memory of `capacity` page slots, one block per page tensor of the device
  pool (GQA K and V; MLA latent and the DSA indexer keys), laid out as the pool is,
  [rows, capacity, page_size, ...]. A step's plan runs layer by layer, and per layer in the order the
  plan requires: every GPU -> host copy (a page the cache evicted, possibly reused by this very step),
  then every host -> GPU copy (a hit on the host tier), then the step's own KV writes.
  On CUDA each page tensor row moves all of its pages in one Triton launch each way
  (layers/page_copy_triton.py: the pages a churned pool and tier hand out are scattered, and a copy per
  run of consecutive pages was tens of thousands of small copies per admission), on a side stream that
  first waits for the work already queued (the pages were written by earlier steps). On the CPU the
  copies go along runs of consecutive pages (runs()): the kernel's oracle. In an eager step the
  compute stream waits, before each model layer (a forward pre-hook on model.layers[l]), for that
  layer's copies only: layer l+1's copies overlap layer l's compute. A graph-replayed step, or a model without per-layer modules,
  waits for the whole plan first. After the forward the compute stream joins the copy stream, so no
  copy is still reading a page the next step writes. Plans come with admissions only, so decode
  steps have none.
- State checkpoints (linear-attention models): extra slots of the recurrent-state pool
  (layers/state_cache.py) past the running sequences' slots. Before the forward a hit's checkpoint is
  copied into the sequence's slot; after it, the slot's state is saved into the checkpoint the
  scheduler chose (a chunk that ended on a page boundary).

- State backups (speculative decoding on linear-attention models): before a step verifies drafts,
  each verifying sequence's state is copied to its backup slot; where a draft is rejected the state
  (which took in every draft) is copied back, and the scheduler recomputes the kept tokens.

The pool's layout: state slots 0..max_num_seqs-1 belong to running sequences, slot max_num_seqs is
spare, slots max_num_seqs+1 .. max_num_seqs+checkpoints are checkpoints 0..checkpoints-1, and the
max_num_seqs slots after them are the backups of running slots 0..max_num_seqs-1.
"""

from __future__ import annotations

import torch

from moetier.engine.step import SeqStep, StepInput
from moetier.experts.cache.store import _aligned_empty, _Registration  # exact-size pinned host memory
from moetier.layers.kv_cache import KVCache


def runs(pairs: list[tuple[int, int]]) -> list[tuple[int, int, int]]:
    """(a, b) copy pairs -> (a0, b0, n) runs along which both a and b step by one, in order."""
    out: list[tuple[int, int, int]] = []
    for a, b in pairs:
        if out and (a, b) == (out[-1][0] + out[-1][2], out[-1][1] + out[-1][2]):
            out[-1] = (out[-1][0], out[-1][1], out[-1][2] + 1)
        else:
            out.append((a, b, 1))
    return out


def aligned_indices(both: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """[2, n] int32 (sources, destinations) on the host -> its two rows on the device (pinned,
    non_blocking: no host sync), each row starting 16-byte aligned: Triton compiles a kernel per
    alignment of its pointers, so an unaligned second row (n not a multiple of 4) was a second compile."""
    n = both.shape[1]
    both = torch.nn.functional.pad(both, (0, -n % 4)).contiguous().pin_memory().to(device, non_blocking=True)
    return both[0, :n], both[1, :n]


class KVMoves:
    """The page copies and state checkpoints of each step (see the module's docstring)."""

    def __init__(self, kv: KVCache, host_slots: int = 0, checkpoint_base: int = -1, backup_base: int = -1):
        self.kv, self.host_slots, self.checkpoint_base = kv, host_slots, checkpoint_base
        self.backup_base = backup_base  # -1: no state backups (no speculation, or no recurrent state)
        self.device_tensors = kv.page_tensors()
        self.rows = kv.layer_rows()  # model layer -> [(tensor, row)], in layer order
        self.host: list[torch.Tensor] = []
        self.host_bytes = 0
        self._registration = self.stream = None
        self._events: dict[int, torch.cuda.Event] = {}
        self._waiting: set[int] = set()  # layers whose copies the compute stream has yet to wait for
        self._hooked = False
        self._word_rows: dict[int, list[tuple]] = {}  # CUDA: per layer (device row, host pointer, words)
        if host_slots:
            dev = self.device_tensors[0].device
            sizes = [host_slots * t[:, 0].numel() * t.element_size() for t in self.device_tensors]
            self.host_bytes = sum(sizes)
            base, _ = _aligned_empty(self.host_bytes)
            if dev.type == "cuda":  # pinned at exact size, as the expert store is
                self._registration = _Registration(base)
                self.stream = torch.cuda.Stream(dev)
                self._events = {layer: torch.cuda.Event() for layer in self.rows}
            at = 0
            for t, n in zip(self.device_tensors, sizes):
                shape = (t.shape[0], host_slots, *t.shape[2:])
                self.host.append(base[at:at + n].view(t.dtype).view(shape))
                at += n
            if dev.type == "cuda":  # the kernel reads and writes the host rows by their device address
                from moetier.experts.cache.store import DevicePointer
                from moetier.layers.page_copy_triton import word_rows

                self._word_rows = {layer: [(d, DevicePointer(h), w) for d, h, w in rows] for layer, rows in
                                   word_rows(self.device_tensors, self.host, self.rows).items()}
                self._compile()

    def _compile(self) -> None:
        """The copy kernel compiled now, not at the first admission that hits the host tier: page 0
        of each row onto itself (nothing changes), one launch per word type and page size."""
        from moetier.layers.page_copy_triton import copy_pages

        src, dst = aligned_indices(torch.zeros((2, 1), dtype=torch.int32), self.stream.device)
        seen = set()
        for rows in self._word_rows.values():
            for d, _, words in rows:
                if (d.dtype, words) not in seen:
                    seen.add((d.dtype, words))
                    copy_pages(d, d, src, dst, words)

    def attach(self, model: torch.nn.Module) -> None:
        """Per-layer waits: a forward pre-hook on each model.layers[l] that holds pages (CUDA host tier
        only; without such modules every step waits for its whole plan first)."""
        layers = getattr(model, "layers", None)
        if (self.stream is None or not self.rows or not isinstance(layers, torch.nn.ModuleList)
                or max(self.rows) >= len(layers)):
            return
        for layer in self.rows:
            layers[layer].register_forward_pre_hook(self._wait_hook(layer))
        self._hooked = True

    def _wait_hook(self, layer: int):
        def wait(module, args):
            if layer in self._waiting:
                torch.cuda.current_stream(self.stream.device).wait_event(self._events[layer])
                self._waiting.discard(layer)
        return wait

    def before(self, step: StepInput, layered: bool = False) -> None:
        """The host tier's copies of the step, then the checkpoints its hits resume from. layered: the
        step runs eagerly through the model's layer modules (each waits for its own copies)."""
        if step.copies_to_host or step.copies_to_gpu:
            if not self.host:
                raise RuntimeError("the step carries host-tier copies but this runner has no host tier")
            if self.stream is None:
                self._copy(step)
            else:
                compute = torch.cuda.current_stream(self.stream.device)
                self.stream.wait_stream(compute)  # the pages it reads were written by earlier steps
                with torch.cuda.stream(self.stream):
                    self._copy_cuda(step, record=layered and self._hooked)
                if layered and self._hooked:
                    self._waiting = set(self.rows)
                else:
                    compute.wait_stream(self.stream)  # before this step writes (or reads) any of them
        for s in step.seqs:
            if s.restore_checkpoint >= 0:
                self._state_copy(self._slot(s.restore_checkpoint), s.state_slot)

    def after(self, seqs: list[SeqStep]) -> None:
        """Join the copy stream (a layer whose hook did not run has not waited); save the states the
        scheduler asked for (chunks that ended on a page boundary)."""
        if self._waiting:
            torch.cuda.current_stream(self.stream.device).wait_stream(self.stream)
            self._waiting.clear()
        for s in seqs:
            if s.save_checkpoint >= 0:
                self._state_copy(s.state_slot, self._slot(s.save_checkpoint))

    def back_up(self, seqs: list[SeqStep]) -> None:
        """Before a verify step: the state of each sequence that carries drafts, to its backup slot."""
        if self.backup_base >= 0:
            for s in seqs:
                if s.num_draft:
                    self._state_copy(s.state_slot, self.backup_base + s.state_slot)

    def roll_back(self, seqs: list[SeqStep], emitted: dict[str, list[int]]) -> None:
        """After verifying: the state before the step back where a draft was rejected (the scheduler
        then recomputes the kept tokens, speculation.py)."""
        if self.backup_base >= 0:
            for s in seqs:
                if s.num_draft and len(emitted[s.request_id]) - 1 < s.num_draft:
                    self._state_copy(self.backup_base + s.state_slot, s.state_slot)

    def _copy(self, step: StepInput) -> None:
        """Along runs of consecutive pages, with torch, in order (the CPU's path; the kernel's oracle)."""
        up, down = runs(step.copies_to_host), runs(step.copies_to_gpu)  # (page, slot, n), (slot, page, n)
        for rows in self.rows.values():
            for t, r in rows:
                d, h = self.device_tensors[t][r], self.host[t][r]
                for p, s, n in up:
                    h[s:s + n].copy_(d[p:p + n])
                for s, p, n in down:
                    d[p:p + n].copy_(h[s:s + n])

    def _copy_cuda(self, step: StepInput, record: bool) -> None:
        """On the copy stream: the pairs' indices to the device (pinned, non_blocking: no host sync),
        then per page tensor row one kernel to the host and one back, layer by layer."""
        from moetier.layers.page_copy_triton import copy_pages

        dev = self.stream.device

        def indices(pairs: list[tuple[int, int]]) -> tuple[torch.Tensor, torch.Tensor]:
            return aligned_indices(torch.tensor(pairs, dtype=torch.int32).reshape(-1, 2).t(), dev)

        up = indices(step.copies_to_host) if step.copies_to_host else None  # device page -> host slot
        down = indices(step.copies_to_gpu) if step.copies_to_gpu else None  # host slot -> device page
        for layer, rows in self._word_rows.items():
            for d, h, words in rows:
                if up is not None:
                    copy_pages(d, h, up[0], up[1], words)
                if down is not None:
                    copy_pages(h, d, down[0], down[1], words)
            if record:
                self._events[layer].record(self.stream)

    def _slot(self, checkpoint: int) -> int:
        if self.checkpoint_base < 0:
            raise RuntimeError("the step carries a state checkpoint but this runner keeps none")
        return self.checkpoint_base + checkpoint

    def _state_copy(self, src: int, dst: int) -> None:
        state = self.kv.state  # layers/state_cache.HybridKVCache
        for t in (state.conv, state.recurrent):
            t[:, dst].copy_(t[:, src])
