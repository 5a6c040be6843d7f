"""How a large step (prefill) of the slots backend brings in the experts that are not in slots: the
prefill stream mode, SlotExperts(prefill_stream=...).

    uva   one large-step grouped GEMM (grouped_gemm_large.py): hits read their slot rows
          from HBM, misses read their rows from pinned host memory across the link inside the kernel,
          once per chunk of GemmConfig.large_block_m pairs of a row. No host sync.
    ring  (the default: the faster, docs/bench-prefill.md) the distinct missing experts are copied G at a time by the copy engine, on a side stream,
          from the pinned host rows into a staging ring of D device buffers of G exact rows each,
          while the compute stream runs the GEMM over the hits and then over each group as its copy
          lands: the link and the tensor cores work at once, and each needed row crosses the link
          exactly once per step (per layer).

One layer of a ring step (ring_forward):
    1. slot_ids = the cache's expert -> slot map gathered on the device (the cache is not touched)
    2. per expert, its hit pairs and its miss pairs counted on the device ([2, E]), then ONE
       device -> host copy of those counts: the copy engine is driven from the host, so it needs
       the list of missing experts (see the NOTE below)
    3. groups: the missing experts in id order, G per group; group g is staged in buffer g % D
    4. side stream: waits the compute stream (the buffers may still be read by the previous layer),
       then copies groups 0..D-1, each followed by a 'filled' event
    5. compute stream: the GEMM over the hit pairs (the other pairs masked to id -1: no work), pair
       outputs to y, unweighted; skipped when no pair hits
    6. per group g: wait filled[g % D], the GEMM over g's pairs only (a pair's row index is its
       expert's place in the buffer), record free[g % D]; the side stream then copies group g + D
       into that buffer after waiting free[g % D]
    7. the combine, once, over all pairs in the fixed order over k (grouped_gemm.combine_pairs)

Bit-exact against uva and resident: a pass computes whole experts (every pair of an expert is in the
same pass), the large-step plan sorts stably by (row key, pair id) and chunks each row's run from its
start, so every expert's run has the same pairs in the same chunks as in the one-GEMM step whatever
its key (slot, host, or buffer place); a pair's output depends only on its token, its row's bytes and
its chunk; y is written once per pair and combined in the same order. The CPU path runs the same
driver with the torch reference (expert_pairs) as its pass (tests/test_prefill_ring.py).

NOTE: step 2 is a host synchronisation per MoE layer, accepted in this mode only: prefill steps are
eager (never captured in a CUDA graph), and decode steps never take this path. The uva mode keeps
its no-host-sync property (tests/test_gpu_prefill.py checks it).
"""

from __future__ import annotations

from typing import Callable

import torch

PREFILL_STREAMS = ("uva", "ring")
RING_GROUP = 4  # G: expert rows per ring buffer (a group, one copy-engine batch)
RING_DEPTH = 2  # D: buffers in the ring (2: double buffering, 3: triple)

# run_pass(row_ids [T, k] int32, ids [T, k] (-1 outside the pass), rows [N, R], max_rows): the
# unweighted pair outputs of the pass's pairs (ids >= 0), row of a pair = rows[row_ids]
Pass = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, int], None]


def check_stream(mode: str) -> str:
    if mode not in PREFILL_STREAMS:
        raise ValueError(f"prefill stream {mode!r}: choose uva or ring")
    return mode


def check_geometry(group: int, depth: int) -> list[str]:
    out = []
    if group < 1:
        out.append(f"ring group must be at least 1 expert row, got {group}")
    if depth < 2:
        out.append(f"ring depth must be at least 2 buffers (double buffering), got {depth}")
    return out


class StagingRing:
    """D device buffers of G expert rows ([D, G, R], exact row bytes as the slots), a side stream
    for the copy engine and per buffer a 'filled' and a 'free' event. On the CPU the copies are
    plain and the events none (the same driver runs: tests). One ring serves every layer of a shape
    (shared()): layers run one after another and each waits the previous one's reads (begin)."""

    def __init__(self, group: int, depth: int, row_numel: int, dtype: torch.dtype, device: torch.device):
        problems = check_geometry(group, depth)
        if problems:
            raise ValueError("; ".join(problems))
        self.group, self.depth = group, depth
        self.buffers = torch.empty(depth, group, row_numel, dtype=dtype, device=device)
        self.cuda = self.buffers.device.type == "cuda"
        if self.cuda:
            self.stream = torch.cuda.Stream(self.buffers.device)
            self.filled = [torch.cuda.Event() for _ in range(depth)]
            self.free = [torch.cuda.Event() for _ in range(depth)]
        self.copies = 0  # copy-engine transfers issued (host count)

    @classmethod
    def shared(cls, group: int, depth: int, row_numel: int, dtype: torch.dtype, device) -> StagingRing:
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        key = (device, group, depth, row_numel, dtype)
        if key not in _SHARED:
            # NOTE: a normal tensor even when the first caller is an engine step (inference mode): an
            # inference tensor could not be written by a later caller outside it (tests, benchmarks)
            with torch.inference_mode(False):
                _SHARED[key] = cls(group, depth, row_numel, dtype, device)
        return _SHARED[key]

    def nbytes(self) -> int:
        return self.buffers.numel() * self.buffers.element_size()

    def begin(self) -> None:
        """Before a layer's first copy: the buffers may still be read by work queued on the compute stream."""
        if self.cuda:
            self.stream.wait_stream(torch.cuda.current_stream(self.buffers.device))

    def load(self, g: int, experts: list[int], host: torch.Tensor) -> None:
        """Copy group g (expert ids, ascending) into buffer g % D: one copy per run of consecutive ids."""
        b = g % self.depth
        buf = self.buffers[b]
        if not self.cuda:
            for place, first, n in runs(experts):
                buf[place:place + n].copy_(host[first:first + n])
            return
        with torch.cuda.stream(self.stream):
            if g >= self.depth:  # the group g - D's pass still reads this buffer
                self.stream.wait_event(self.free[b])
            for place, first, n in runs(experts):
                buf[place:place + n].copy_(host[first:first + n], non_blocking=True)
                self.copies += 1
            self.filled[b].record(self.stream)

    def acquire(self, g: int) -> torch.Tensor:
        """The compute stream waits group g's copy; -> its buffer [G, R]."""
        b = g % self.depth
        if self.cuda:
            torch.cuda.current_stream(self.buffers.device).wait_event(self.filled[b])
        return self.buffers[b]

    def release(self, g: int) -> None:
        """Group g's pass is queued: its buffer is free once the compute stream gets past here."""
        if self.cuda:
            self.free[g % self.depth].record(torch.cuda.current_stream(self.buffers.device))


_SHARED: dict[tuple, StagingRing] = {}


def runs(experts: list[int]) -> list[tuple[int, int, int]]:
    """Ascending expert ids -> (place in the group, first id, length) per run of consecutive ids."""
    out: list[tuple[int, int, int]] = []
    for place, e in enumerate(experts):
        if out and out[-1][1] + out[-1][2] == e:
            out[-1] = (out[-1][0], out[-1][1], out[-1][2] + 1)
        else:
            out.append((place, e, 1))
    return out


def split_hits(slot_ids: torch.Tensor, topk_ids: torch.Tensor, num_experts: int) -> tuple[bool, list[int]]:
    """-> (whether any pair hits a slot, the distinct missing experts ascending). Device counts of
    fixed shape, then one device -> host copy: the host sync of the ring mode (module NOTE).
    Negative ids (experts/parallel/ep.NOT_MINE) are neither."""
    ids = topk_ids.reshape(-1).long()
    mine = ids >= 0
    hit = mine & (slot_ids.reshape(-1) >= 0)
    counts = torch.zeros(2, num_experts + 1, dtype=torch.int32, device=ids.device)
    one = torch.ones_like(ids, dtype=torch.int32)
    counts[0].scatter_add_(0, torch.where(hit, ids, num_experts), one)
    counts[1].scatter_add_(0, torch.where(mine & ~hit, ids, num_experts), one)
    c = counts[:, :num_experts].cpu()
    return bool(c[0].any()), c[1].nonzero().flatten().tolist()


def ring_forward(ring: StagingRing, slot_ids: torch.Tensor, topk_ids: torch.Tensor, host: torch.Tensor,
                 slots: torch.Tensor, run_pass: Pass) -> int:
    """Steps 2-6 of a ring step (module docstring): every pair with id >= 0 gets its output from
    exactly one pass (hits from `slots` [S, R], misses from the ring). The caller combines.
    -> the rows copied over the link (each missing expert once)."""
    e = host.shape[0]
    any_hit, missing = split_hits(slot_ids, topk_ids, e)
    g_size, depth = ring.group, ring.depth
    groups = [missing[i:i + g_size] for i in range(0, len(missing), g_size)]
    ids = topk_ids.long()
    if groups:
        # NOTE: the missing list goes to the device before any pass is queued: a copy from pageable
        # memory waits for its stream to drain, which right after split_hits' read costs nothing
        dev, n = topk_ids.device, len(missing)
        where = torch.tensor(missing, dtype=torch.long, device=dev)
        group_of = torch.full((e,), -1, dtype=torch.int32, device=dev)
        place_of = torch.full((e,), -1, dtype=torch.int32, device=dev)
        group_of[where] = torch.arange(n, dtype=torch.int32, device=dev) // g_size
        place_of[where] = torch.arange(n, dtype=torch.int32, device=dev) % g_size
        ring.begin()
        for g in range(min(depth, len(groups))):
            ring.load(g, groups[g], host)
    if any_hit:
        hit = (ids >= 0) & (slot_ids >= 0)
        run_pass(slot_ids, topk_ids.masked_fill(~hit, -1), slots, slots.shape[0])
    if not groups:
        return 0
    safe = ids.clamp(min=0)
    mine, pair_group, pair_place = ids >= 0, group_of[safe], place_of[safe]
    for g in range(len(groups)):
        rows = ring.acquire(g)
        sel = mine & (pair_group == g)
        run_pass(torch.where(sel, pair_place, -1), topk_ids.masked_fill(~sel, -1), rows, g_size)
        ring.release(g)
        if g + depth < len(groups):
            ring.load(g + depth, groups[g + depth], host)
    return n


def ring_large(ring: StagingRing, x: torch.Tensor, slot_ids: torch.Tensor, topk_ids: torch.Tensor,
               topk_weights: torch.Tensor, host: torch.Tensor, slots: torch.Tensor, hidden: int, inter: int,
               config, quant: str | None = None, limit: float | None = None) -> tuple[torch.Tensor, int]:
    """A ring step on the large-step kernels (grouped_gemm_large.py): each pass writes its pairs'
    unweighted outputs into one y, then one combine (grouped_gemm.combine_pairs). CUDA; on CPU tensors
    in Triton's interpreter (tests/prefill_ring_interpreter.py). -> (out [T, H] in x.dtype, rows copied)."""
    from moetier.experts.kernels.grouped_gemm import combine_pairs
    from moetier.experts.kernels.gemm_config import compute_dtype, h_dtype
    from moetier.experts.kernels.grouped_gemm_large import grouped_expert_mlp_large

    t, k = topk_ids.shape
    h = torch.empty(t * k, inter, dtype=h_dtype(compute_dtype(x.dtype, slots.dtype, quant)), device=x.device)
    y = torch.empty(t * k, hidden, dtype=torch.float32, device=x.device)

    def run_pass(row_ids, ids, rows, max_rows):  # rows twice: no pair of a pass reads a host row
        grouped_expert_mlp_large(x, row_ids, ids, topk_weights, rows, rows, hidden, inter, max_rows, config, quant,
                                 h=h, y=y, limit=limit)
    copied = ring_forward(ring, slot_ids, topk_ids, host, slots, run_pass)
    out = torch.empty(t, hidden, dtype=x.dtype, device=x.device)
    return combine_pairs(y, topk_weights, topk_ids, out), copied
