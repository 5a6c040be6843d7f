"""Triton kernels of the slot cache (GPU), held by tests to their torch twins:

    bookkeeping   one step of the cache (slot ids, map updates, miss list)  <-> SlotCache.step_reference
    copy_rows     miss list -> slots, reading host rows across the link      <-> index_copy on the rows

No host sync anywhere: counts and lists stay on the device, grids are fixed, and a step without
misses costs a masked early exit, so a CUDA graph can replay the whole MoE layer.

A negative id (experts/parallel/ep.NOT_MINE: another rank's expert) is no expert of the cache, as in
SlotCache.step_reference: every load and store indexed by it is masked off (no hit, no miss, no fill,
no stamp, no use counted, no scratch touched), and its slot id out is -1.

A pinned expert (slots.py) maps to a row >= num_slots for good: a hit that marks no slot used, takes
no stamp, and counts in stats[4] as well as in the hits.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moetier.experts.cache.store import DevicePointer

BIG32 = 2**31 - 1
REGS_LIMIT = 16384  # largest [BLOCK_N, BLOCK_S] the register bookkeeping takes
# 4 warps: within a tenth of a microsecond of the fastest at a hit and a miss step (`moetier bench
# layer`; docs/measured-defaults.md)
BOOKKEEPING_WARPS = 4
COPY_BLOCK = 8192  # elements per copy work item


@triton.jit
def _epoch(clock, half_life):
    return tl.where(half_life > 0, clock // tl.maximum(half_life, 1), 0)


@triton.jit
def _freq_now(freq_ptr, fepoch_ptr, experts, mask, epoch):
    # An expert's use count as of `epoch`: halved once per half-life since it was last brought up to date.
    f = tl.load(freq_ptr + experts, mask=mask, other=0)
    age = tl.minimum(epoch - tl.load(fepoch_ptr + experts, mask=mask, other=0), 31).to(tl.int32)
    return (f >> age).to(tl.int64)


@triton.jit
def _count_uses(freq_ptr, fepoch_ptr, ids, is_first, epoch):
    # One more use of every needed expert (its first position in the step stores it).
    now = _freq_now(freq_ptr, fepoch_ptr, ids, is_first, epoch)
    tl.store(freq_ptr + ids, (now + 1).to(tl.int32), mask=is_first)
    tl.store(fepoch_ptr + ids, epoch.to(tl.int32), mask=is_first)


@triton.jit
def _write_fills(expert_slot_ptr, slot_expert_ptr, miss_expert_ptr, miss_slot_ptr, miss_count_ptr,
                 ids, victim, old, rank, fill, n_miss, n_free):
    # Miss `rank` moves into `victim`, evicting `old`; the miss list records it for the fill.
    # NOTE: evicted experts are never needed this step, so these stores touch disjoint addresses.
    tl.store(expert_slot_ptr + old, -1, mask=fill & (old >= 0))
    tl.store(expert_slot_ptr + ids, victim, mask=fill)
    tl.store(slot_expert_ptr + victim, ids, mask=fill)
    tl.store(miss_expert_ptr + rank, ids, mask=fill)
    tl.store(miss_slot_ptr + rank, victim, mask=fill)
    n_fill = tl.minimum(n_miss, n_free)
    tl.store(miss_count_ptr, n_fill)
    return n_fill


@triton.jit
def _stats_step(i, hit, pin, n_miss, n_fill):
    # What one step adds to [hits, misses, overflow, steps, pinned hits] (i: 0..7, the store masks i < 5).
    return tl.where(i == 0, tl.sum(hit.to(tl.int64), axis=0),
                    tl.where(i == 1, n_fill.to(tl.int64),
                             tl.where(i == 2, (n_miss - n_fill).to(tl.int64),
                                      tl.where(i == 3, 1, tl.sum(pin.to(tl.int64), axis=0)))))


# n, the pair count, changes every step: unspecialized (docs/prefix-cache.md, "Compiles before serving")
@triton.jit(do_not_specialize=["n"])
def _bookkeeping(ids_ptr, n, expert_slot_ptr, slot_expert_ptr, stamp_ptr, clock_ptr, stats_ptr,
                 first_ptr, used_ptr, victim_ptr, slots_out_ptr, miss_expert_ptr, miss_slot_ptr, miss_count_ptr,
                 num_slots, freq_ptr, fepoch_ptr, weight, half_life,
                 BLOCK_N: tl.constexpr, BLOCK_S: tl.constexpr, USE_FREQ: tl.constexpr):
    # One program does the whole step; see slots.py for the semantics. Scratch between steps:
    # first[E] == BIG32 and used[S] == 0 (restored before the program ends).
    # NOTE: loads of state written earlier in this program use .cg (L2) and follow a barrier.
    pos = tl.arange(0, BLOCK_N)
    pmask = pos < n
    ids = tl.load(ids_ptr + pos, mask=pmask, other=-1).to(tl.int32)
    valid = pmask & (ids >= 0)  # negative ids: no expert of this cache (module docstring)
    clock = tl.load(clock_ptr)

    # 1. first appearance of each expert
    tl.atomic_min(first_ptr + ids, pos, mask=valid)
    tl.debug_barrier()
    first = tl.load(first_ptr + ids, mask=valid, other=-1, cache_modifier=".cg")
    is_first = valid & (first == pos)

    # 2. hits mark their slots as used
    slot0 = tl.load(expert_slot_ptr + ids, mask=valid, other=-1, cache_modifier=".cg")
    hit = is_first & (slot0 >= 0)
    pin = hit & (slot0 >= num_slots)  # a pinned expert: its row is after the slots
    miss = is_first & (slot0 < 0)
    tl.store(used_ptr + slot0, 1, mask=hit & (slot0 < num_slots))
    tl.debug_barrier()

    # 3. victims: unused slots by (stamp, slot); stamps start at -1 so key >= 0
    s = tl.arange(0, BLOCK_S)
    smask = s < num_slots
    used = tl.load(used_ptr + s, mask=smask, other=1, cache_modifier=".cg")
    stamp = tl.load(stamp_ptr + s, mask=smask, other=0, cache_modifier=".cg")
    if USE_FREQ:
        epoch = _epoch(clock, half_life)
        held = tl.load(slot_expert_ptr + s, mask=smask, other=-1, cache_modifier=".cg")
        stamp = stamp + weight * _freq_now(freq_ptr, fepoch_ptr, held, smask & (held >= 0), epoch)
    big = 9223372036854775807
    key = tl.where(smask & (used == 0), (stamp + 1) * num_slots + s, big)
    key = tl.sort(key)
    n_free = tl.sum((key != big).to(tl.int32), axis=0)
    tl.store(victim_ptr + s, (key % num_slots).to(tl.int32), mask=smask)
    tl.debug_barrier()

    # 4. miss r takes victim r while victims last; the rest overflow
    miss_i = miss.to(tl.int32)
    rank = tl.cumsum(miss_i, axis=0) - 1
    n_miss = tl.sum(miss_i, axis=0)
    fill = miss & (rank < n_free)
    victim = tl.load(victim_ptr + rank, mask=fill, other=0, cache_modifier=".cg")
    old = tl.load(slot_expert_ptr + victim, mask=fill, other=-1, cache_modifier=".cg")
    n_fill = _write_fills(expert_slot_ptr, slot_expert_ptr, miss_expert_ptr, miss_slot_ptr, miss_count_ptr,
                          ids, victim, old, rank, fill, n_miss, n_free)
    tl.debug_barrier()

    # 5. slot ids out, stamps, clock, stats; restore scratch
    slot = tl.load(expert_slot_ptr + ids, mask=valid, other=-1, cache_modifier=".cg")
    tl.store(slots_out_ptr + pos, slot, mask=pmask)
    tl.store(stamp_ptr + slot, clock, mask=pmask & (slot >= 0) & (slot < num_slots))
    tl.store(first_ptr + ids, 2147483647, mask=valid)
    tl.store(used_ptr + s, 0, mask=smask)
    if USE_FREQ:
        _count_uses(freq_ptr, fepoch_ptr, ids, is_first, _epoch(clock, half_life))
    tl.store(clock_ptr, clock + 1)
    five = tl.arange(0, 8)
    m5 = five < 5
    tl.store(stats_ptr + five, tl.load(stats_ptr + five, mask=m5, other=0) + _stats_step(five, hit, pin, n_miss, n_fill),
             mask=m5)


@triton.jit
def _step_regs(ids_ptr, n, expert_slot_ptr, slot_expert_ptr, stamp_ptr, clock_ptr, stats_ptr,
               slots_out_ptr, miss_expert_ptr, miss_slot_ptr, miss_count_ptr, num_slots,
               freq_ptr, fepoch_ptr, weight, half_life,
               BLOCK_N: tl.constexpr, BLOCK_S: tl.constexpr, USE_FREQ: tl.constexpr):
    # The same step as _bookkeeping, for small steps (a decode batch of a few tokens): every set
    # operation is a [BLOCK_N, BLOCK_N] or [BLOCK_N, BLOCK_S] comparison in registers, so the step
    # waits on two rounds of loads and no barrier. Everything independent is loaded up front.
    pos = tl.arange(0, BLOCK_N)
    pmask = pos < n
    five = tl.arange(0, 8)
    m5 = five < 5
    ids = tl.load(ids_ptr + pos, mask=pmask, other=-1).to(tl.int32)
    valid = pmask & (ids >= 0)  # negative ids: no expert of this cache (module docstring)
    clock = tl.load(clock_ptr)
    stats = tl.load(stats_ptr + five, mask=m5, other=0)
    slot0 = tl.load(expert_slot_ptr + ids, mask=valid, other=-1)

    # 1. first appearance: the lowest position holding the same id (a negative id's is never first,
    # and its slot, taken from a negative id's position, is -1)
    same = (ids[:, None] == ids[None, :]) & pmask[None, :]
    first = tl.min(tl.where(same, pos[None, :], BLOCK_N), axis=1)
    is_first = valid & (first == pos)
    hit = is_first & (slot0 >= 0)
    pin = hit & (slot0 >= num_slots)  # a pinned expert: its row is after the slots
    miss = is_first & (slot0 < 0)
    miss_i = miss.to(tl.int32)
    n_miss = tl.sum(miss_i, axis=0)
    n_fill = n_miss
    if n_miss == 0:
        # The hit path: every id is resident; only stamps, the counters and the slot ids change.
        tl.store(miss_count_ptr, 0)
        tl.store(slots_out_ptr + pos, slot0, mask=pmask)
        tl.store(stamp_ptr + slot0, clock, mask=valid & (slot0 < num_slots))
    else:
        s = tl.arange(0, BLOCK_S)
        smask = s < num_slots
        stamp = tl.load(stamp_ptr + s, mask=smask, other=0)
        held = tl.load(slot_expert_ptr + s, mask=smask, other=-1)
        if USE_FREQ:  # held experts are not needed this step: their counts are not being updated
            stamp = stamp + weight * _freq_now(freq_ptr, fepoch_ptr, held, smask & (held >= 0),
                                               _epoch(clock, half_life))
        # 2. slots the hits use; 3. victims by (stamp, slot) among the rest
        used = tl.max((hit[:, None] & (slot0[:, None] == s[None, :])).to(tl.int32), axis=0)
        big = 9223372036854775807
        key = tl.sort(tl.where(smask & (used == 0), (stamp + 1) * num_slots + s, big))
        n_free = tl.sum((key != big).to(tl.int32), axis=0)
        ordered = (key % num_slots).to(tl.int32)
        # 4. miss r takes victim r (a one-hot gather), evicting the expert it held
        rank = tl.cumsum(miss_i, axis=0) - 1
        fill = miss & (rank < n_free)
        victim = tl.sum(tl.where(rank[:, None] == s[None, :], ordered[None, :], 0), axis=1)
        old = tl.sum(tl.where(victim[:, None] == s[None, :], held[None, :], 0), axis=1)
        n_fill = _write_fills(expert_slot_ptr, slot_expert_ptr, miss_expert_ptr, miss_slot_ptr, miss_count_ptr,
                              ids, victim, old, rank, fill, n_miss, n_free)
        # 5. every position takes the slot of its first appearance (-1: overflow)
        at_first = tl.where(fill, victim, tl.where(hit, slot0, -1))
        slot = tl.sum(tl.where(first[:, None] == pos[None, :], at_first[None, :], 0), axis=1)
        tl.store(slots_out_ptr + pos, slot, mask=pmask)
        tl.store(stamp_ptr + slot, clock, mask=pmask & (slot >= 0) & (slot < num_slots))
    if USE_FREQ:
        _count_uses(freq_ptr, fepoch_ptr, ids, is_first, _epoch(clock, half_life))
    tl.store(clock_ptr, clock + 1)
    tl.store(stats_ptr + five, stats + _stats_step(five, hit, pin, n_miss, n_fill), mask=m5)


# n, the pair count, changes every step: unspecialized (docs/prefix-cache.md, "Compiles before serving")
@triton.jit(do_not_specialize=["n"])
def _bookkeeping_regs(ids_ptr, n, expert_slot_ptr, slot_expert_ptr, stamp_ptr, clock_ptr, stats_ptr,
                      slots_out_ptr, miss_expert_ptr, miss_slot_ptr, miss_count_ptr, num_slots,
                      freq_ptr, fepoch_ptr, weight, half_life,
                      BLOCK_N: tl.constexpr, BLOCK_S: tl.constexpr, USE_FREQ: tl.constexpr):
    _step_regs(ids_ptr, n, expert_slot_ptr, slot_expert_ptr, stamp_ptr, clock_ptr, stats_ptr, slots_out_ptr,
               miss_expert_ptr, miss_slot_ptr, miss_count_ptr, num_slots, freq_ptr, fepoch_ptr, weight,
               half_life, BLOCK_N, BLOCK_S, USE_FREQ)


@triton.jit
def _copy_chunks(src_ptr, dst_ptr, miss_expert_ptr, miss_slot_ptr, total, row, chunks, pid, nprog,
                 BLOCK: tl.constexpr):
    # Work item w = (miss r, chunk c); program p takes items p, p + P, ...
    offs = tl.arange(0, BLOCK)
    for w in tl.range(pid, total, nprog):
        r = w // chunks
        c = (w % chunks).to(tl.int64) * BLOCK + offs
        e = tl.load(miss_expert_ptr + r, cache_modifier=".cg").to(tl.int64)
        s = tl.load(miss_slot_ptr + r, cache_modifier=".cg").to(tl.int64)
        m = c < row
        v = tl.load(src_ptr + e * row + c, mask=m)
        tl.store(dst_ptr + s * row + c, v, mask=m)


class BookkeepingScratch:
    """Per-cache scratch of the bookkeeping kernel, sized once (fixed addresses for graphs)."""

    def __init__(self, num_experts: int, num_slots: int, max_pairs: int, device: torch.device):
        self.first = torch.full((num_experts,), BIG32, dtype=torch.int32, device=device)
        self.used = torch.zeros(num_slots, dtype=torch.int32, device=device)
        self.victim = torch.zeros(triton.next_power_of_2(num_slots), dtype=torch.int32, device=device)
        self.max_pairs = max_pairs
        self.slots_out = torch.empty(max_pairs, dtype=torch.int32, device=device)
        self.miss_expert = torch.full((max_pairs,), -1, dtype=torch.int32, device=device)
        self.miss_slot = torch.full((max_pairs,), -1, dtype=torch.int32, device=device)
        self.miss_count = torch.zeros(1, dtype=torch.int32, device=device)


def bookkeeping(cache, scratch: BookkeepingScratch, topk_ids: torch.Tensor, warps: int = BOOKKEEPING_WARPS,
                stats: torch.Tensor | None = None) -> torch.Tensor:
    """One fused step of `cache` (a SlotCache on the GPU). -> slot ids [T, k] int32 (a scratch view).
    warps: of the register kernel (small steps); the bench sweeps it. stats: the [5] counters the step
    adds to (default the cache's; a prefetch step keeps its own, experts/prefetch.py)."""
    stats = cache.stats if stats is None else stats
    n = topk_ids.numel()
    if n > scratch.max_pairs:
        raise ValueError(f"{n} (token, expert) pairs exceed the {scratch.max_pairs} this cache was sized for")
    block_n = max(16, triton.next_power_of_2(n))
    block_s = max(16, triton.next_power_of_2(cache.num_slots))
    pol = cache.policy
    freq = (cache.freq, cache.fepoch, pol.weight, pol.half_life)
    if fits_registers(n, cache.num_slots):
        _bookkeeping_regs[(1,)](
            topk_ids, n, cache.expert_slot, cache.slot_expert, cache.stamp, cache.clock, stats,
            scratch.slots_out, scratch.miss_expert, scratch.miss_slot, scratch.miss_count, cache.num_slots, *freq,
            BLOCK_N=block_n, BLOCK_S=block_s, USE_FREQ=pol.uses_freq, num_warps=warps)
    else:
        _bookkeeping[(1,)](
            topk_ids, n, cache.expert_slot, cache.slot_expert, cache.stamp, cache.clock, stats,
            scratch.first, scratch.used, scratch.victim, scratch.slots_out, scratch.miss_expert,
            scratch.miss_slot, scratch.miss_count, cache.num_slots, *freq,
            BLOCK_N=block_n, BLOCK_S=block_s, USE_FREQ=pol.uses_freq, num_warps=4)
    return scratch.slots_out[:n].view(topk_ids.shape)


@triton.jit
def _copy_rows(src_ptr, dst_ptr, miss_expert_ptr, miss_slot_ptr, miss_count_ptr, row, chunks,
               BLOCK: tl.constexpr):
    # Persistent grid; with no misses every program reads one counter and leaves.
    total = tl.load(miss_count_ptr) * chunks
    _copy_chunks(src_ptr, dst_ptr, miss_expert_ptr, miss_slot_ptr, total, row, chunks, tl.program_id(0),
                 tl.num_programs(0), BLOCK)


def copy_rows(src, dst: torch.Tensor, scratch: BookkeepingScratch, programs: int, block: int = COPY_BLOCK) -> None:
    """Copy host rows into slots for the first miss_count entries of the miss list.

    src: [E, R] host rows (a DevicePointer to pinned memory); dst: [S, R] slots on the device.
    FP8 rows (uint8, a multiple of 16 bytes) move as 2-byte words: the element width the copy was
    tuned on (bf16 rows), not one byte per element.
    """
    if dst.dtype == torch.uint8 and dst.shape[1] % 2 == 0:
        dst = dst.view(torch.int16)
        src = DevicePointer(src.tensor.view(torch.int16)) if isinstance(src, DevicePointer) else src.view(torch.int16)
    row = dst.shape[1]
    _copy_rows[(programs,)](src, dst, scratch.miss_expert, scratch.miss_slot, scratch.miss_count, row,
                            triton.cdiv(row, block), BLOCK=block, num_warps=8)


def fits_registers(n: int, num_slots: int) -> bool:
    block_n = max(16, triton.next_power_of_2(n))
    return block_n <= 64 and block_n * max(16, triton.next_power_of_2(num_slots)) <= REGS_LIMIT

