"""The runner's half of the prefix cache: the bytes that the bookkeeping (prefix_cache.py,
kv_host_tier.py) only plans. Two kinds of moves, both inside one step and none with a host sync:

- Host KV tier: pinned host memory of `capacity` page slots, one block per page tensor of the device
  pool (GQA K and V; MLA latent and the DSA indexer keys), block [capacity, layers, page_size, ...]
  so that one slot is contiguous. A step's plan runs before its forward, in the order the plan
  requires: every GPU -> host copy (a page the cache evicted, possibly reused by this very step),
  then every host -> GPU copy (a hit on the host tier), then the step's own KV writes. On CUDA the
  copies run non_blocking on a side stream that first waits for the work already queued (the pages
  were written by earlier steps) and that the compute stream then waits for. NOTE: the compute waits
  for the whole plan, not layer by layer; plans come with admissions only, so decode steps have none.
- State checkpoints (linear-attention models): extra slots of the recurrent-state pool
  (layers/state_cache.py) past the running sequences' slots. Before the forward a hit's checkpoint is
  copied into the sequence's slot; after it, the slot's state is saved into the checkpoint the
  scheduler chose (a chunk that ended on a page boundary).

The pool's layout: state slots 0..max_num_seqs-1 belong to running sequences, slot max_num_seqs is
spare, slots max_num_seqs+1 .. max_num_seqs+checkpoints are checkpoints 0..checkpoints-1.
"""

from __future__ import annotations

import torch

from moetier.engine.step import SeqStep, StepInput
from moetier.experts.cache.store import _aligned_empty, _Registration  # exact-size pinned host memory
from moetier.layers.kv_cache import KVCache


class KVMoves:
    """The page copies and state checkpoints of each step (see the module's docstring)."""

    def __init__(self, kv: KVCache, host_slots: int = 0, checkpoint_base: int = -1):
        self.kv, self.host_slots, self.checkpoint_base = kv, host_slots, checkpoint_base
        self.device_tensors = [t for t in kv.page_tensors() if t.numel()]
        self.host: list[torch.Tensor] = []
        self.host_bytes = 0
        self._registration = self.stream = None
        if host_slots:
            dev = self.device_tensors[0].device
            shapes = [(host_slots, t.shape[0], *t.shape[2:]) for t in self.device_tensors]
            sizes = [host_slots * t[:, 0].numel() * t.element_size() for t in self.device_tensors]
            self.host_bytes = sum(sizes)
            base, _ = _aligned_empty(self.host_bytes)
            if dev.type == "cuda":  # pinned at exact size, as the expert store is
                self._registration = _Registration(base)
                self.stream = torch.cuda.Stream(dev)
            at = 0
            for t, shape, n in zip(self.device_tensors, shapes, sizes):
                self.host.append(base[at:at + n].view(t.dtype).view(shape))
                at += n

    def before(self, step: StepInput) -> None:
        """The host tier's copies of the step, then the checkpoints its hits resume from."""
        if step.copies_to_host or step.copies_to_gpu:
            if not self.host:
                raise RuntimeError("the step carries host-tier copies but this runner has no host tier")
            if self.stream is None:
                self._copy(step)
            else:
                compute = torch.cuda.current_stream(self.stream.device)
                self.stream.wait_stream(compute)  # the pages it reads were written by earlier steps
                with torch.cuda.stream(self.stream):
                    self._copy(step)
                compute.wait_stream(self.stream)  # before this step writes (or reads) any of them
        for s in step.seqs:
            if s.restore_checkpoint >= 0:
                self._state_copy(self._slot(s.restore_checkpoint), s.state_slot)

    def after(self, seqs: list[SeqStep]) -> None:
        """Save the states the scheduler asked for (chunks that ended on a page boundary)."""
        for s in seqs:
            if s.save_checkpoint >= 0:
                self._state_copy(s.state_slot, self._slot(s.save_checkpoint))

    def _copy(self, step: StepInput) -> None:
        blocking = self.stream is None
        for page, slot in step.copies_to_host:
            for d, h in zip(self.device_tensors, self.host):
                h[slot].copy_(d[:, page], non_blocking=not blocking)
        for slot, page in step.copies_to_gpu:
            for d, h in zip(self.device_tensors, self.host):
                d[:, page].copy_(h[slot], non_blocking=not blocking)

    def _slot(self, checkpoint: int) -> int:
        if self.checkpoint_base < 0:
            raise RuntimeError("the step carries a state checkpoint but this runner keeps none")
        return self.checkpoint_base + checkpoint

    def _state_copy(self, src: int, dst: int) -> None:
        state = self.kv.state  # layers/state_cache.HybridKVCache
        for t in (state.conv, state.recurrent):
            t[:, dst].copy_(t[:, src])
