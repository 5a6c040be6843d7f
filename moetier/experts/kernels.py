"""Triton kernels of the expert tiers (GPU). Each has a plain-torch twin that tests hold it to:

    bookkeeping   one fused step of the slot cache      <-> SlotCache.step_reference (slots.py)
    copy_rows     miss list -> slots, reading host rows   <-> index_copy on the rows
    expert_mlp    SwiGLU experts by row id, T x k pairs  <-> backends.expert_pairs + combine

Rows are addressed by id: a pair whose slot id is >= 0 reads slot row `slot`, a pair whose slot id
is -1 reads host row `expert` across the link (pinned memory seen through unified addressing). The
resident backend passes expert ids as slot ids, the uva backend passes -1 everywhere; one kernel
serves all three, so the backends are bit-exact against each other.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BIG32 = 2**31 - 1
REGS_LIMIT = 16384  # largest [BLOCK_N, BLOCK_S] the register bookkeeping takes


@triton.jit
def _bookkeeping(ids_ptr, n, expert_slot_ptr, slot_expert_ptr, stamp_ptr, clock_ptr, stats_ptr,
                 first_ptr, used_ptr, victim_ptr, slots_out_ptr, miss_expert_ptr, miss_slot_ptr, miss_count_ptr,
                 num_slots, BLOCK_N: tl.constexpr, BLOCK_S: tl.constexpr):
    # One program does the whole step; see slots.py for the semantics. Scratch between steps:
    # first[E] == BIG32 and used[S] == 0 (restored before the program ends).
    # NOTE: loads of state written earlier in this program use .cg (L2) and follow a barrier.
    pos = tl.arange(0, BLOCK_N)
    pmask = pos < n
    ids = tl.load(ids_ptr + pos, mask=pmask, other=0).to(tl.int32)
    clock = tl.load(clock_ptr)

    # 1. first appearance of each expert
    tl.atomic_min(first_ptr + ids, pos, mask=pmask)
    tl.debug_barrier()
    first = tl.load(first_ptr + ids, mask=pmask, other=-1, cache_modifier=".cg")
    is_first = pmask & (first == pos)

    # 2. hits mark their slots as used
    slot0 = tl.load(expert_slot_ptr + ids, mask=pmask, other=-1, cache_modifier=".cg")
    hit = is_first & (slot0 >= 0)
    miss = is_first & (slot0 < 0)
    tl.store(used_ptr + slot0, 1, mask=hit)
    tl.debug_barrier()

    # 3. victims: unused slots by (stamp, slot); stamps start at -1 so key >= 0
    s = tl.arange(0, BLOCK_S)
    smask = s < num_slots
    used = tl.load(used_ptr + s, mask=smask, other=1, cache_modifier=".cg")
    stamp = tl.load(stamp_ptr + s, mask=smask, other=0, cache_modifier=".cg")
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
    tl.store(expert_slot_ptr + old, -1, mask=fill & (old >= 0))
    tl.debug_barrier()
    tl.store(expert_slot_ptr + ids, victim, mask=fill)
    tl.store(slot_expert_ptr + victim, ids, mask=fill)
    tl.store(miss_expert_ptr + rank, ids, mask=fill)
    tl.store(miss_slot_ptr + rank, victim, mask=fill)
    n_fill = tl.minimum(n_miss, n_free)
    tl.store(miss_count_ptr, n_fill)
    tl.debug_barrier()

    # 5. slot ids out, stamps, clock, stats; restore scratch
    slot = tl.load(expert_slot_ptr + ids, mask=pmask, other=-1, cache_modifier=".cg")
    tl.store(slots_out_ptr + pos, slot, mask=pmask)
    tl.store(stamp_ptr + slot, clock, mask=pmask & (slot >= 0))
    tl.store(first_ptr + ids, 2147483647, mask=pmask)
    tl.store(used_ptr + s, 0, mask=smask)
    tl.store(clock_ptr, clock + 1)
    tl.store(stats_ptr + 0, tl.load(stats_ptr + 0) + tl.sum(hit.to(tl.int64), axis=0))
    tl.store(stats_ptr + 1, tl.load(stats_ptr + 1) + n_fill.to(tl.int64))
    tl.store(stats_ptr + 2, tl.load(stats_ptr + 2) + (n_miss - n_fill).to(tl.int64))
    tl.store(stats_ptr + 3, tl.load(stats_ptr + 3) + 1)


@triton.jit
def _bookkeeping_regs(ids_ptr, n, expert_slot_ptr, slot_expert_ptr, stamp_ptr, clock_ptr, stats_ptr,
                      slots_out_ptr, miss_expert_ptr, miss_slot_ptr, miss_count_ptr, num_slots,
                      BLOCK_N: tl.constexpr, BLOCK_S: tl.constexpr):
    # The same step as _bookkeeping, for small steps (a decode batch of a few tokens): every set
    # operation is a [BLOCK_N, BLOCK_N] or [BLOCK_N, BLOCK_S] comparison in registers, so the step
    # costs two dependent rounds of loads and one of stores, with no barrier.
    pos = tl.arange(0, BLOCK_N)
    pmask = pos < n
    s = tl.arange(0, BLOCK_S)
    smask = s < num_slots
    # Everything independent is loaded up front, so the step waits on two rounds of loads only.
    ids = tl.load(ids_ptr + pos, mask=pmask, other=-1).to(tl.int32)
    clock = tl.load(clock_ptr)
    stats = tl.load(stats_ptr + tl.arange(0, 4))
    stamp = tl.load(stamp_ptr + s, mask=smask, other=0)
    held = tl.load(slot_expert_ptr + s, mask=smask, other=-1)
    slot0 = tl.load(expert_slot_ptr + ids, mask=pmask, other=-1)

    # 1. first appearance: the lowest position holding the same id
    same = (ids[:, None] == ids[None, :]) & pmask[None, :]
    first = tl.min(tl.where(same, pos[None, :], BLOCK_N), axis=1)
    is_first = pmask & (first == pos)
    # 2. hits and the slots they use
    hit = is_first & (slot0 >= 0)
    miss = is_first & (slot0 < 0)
    used = tl.max((hit[:, None] & (slot0[:, None] == s[None, :])).to(tl.int32), axis=0)
    # 3. victims by (stamp, slot)
    big = 9223372036854775807
    key = tl.sort(tl.where(smask & (used == 0), (stamp + 1) * num_slots + s, big))
    n_free = tl.sum((key != big).to(tl.int32), axis=0)
    ordered = (key % num_slots).to(tl.int32)
    # 4. miss r takes victim r (a one-hot gather), evicting the expert it held
    miss_i = miss.to(tl.int32)
    rank = tl.cumsum(miss_i, axis=0) - 1
    n_miss = tl.sum(miss_i, axis=0)
    fill = miss & (rank < n_free)
    victim = tl.sum(tl.where(rank[:, None] == s[None, :], ordered[None, :], 0), axis=1)
    old = tl.sum(tl.where(victim[:, None] == s[None, :], held[None, :], 0), axis=1)
    # NOTE: evicted experts are never needed this step, so these stores touch disjoint addresses.
    tl.store(expert_slot_ptr + old, -1, mask=fill & (old >= 0))
    tl.store(expert_slot_ptr + ids, victim, mask=fill)
    tl.store(slot_expert_ptr + victim, ids, mask=fill)
    tl.store(miss_expert_ptr + rank, ids, mask=fill)
    tl.store(miss_slot_ptr + rank, victim, mask=fill)
    n_fill = tl.minimum(n_miss, n_free)
    tl.store(miss_count_ptr, n_fill)
    # 5. every position takes the slot of its first appearance (-1: overflow)
    at_first = tl.where(fill, victim, tl.where(hit, slot0, -1))
    slot = tl.sum(tl.where(first[:, None] == pos[None, :], at_first[None, :], 0), axis=1)
    tl.store(slots_out_ptr + pos, slot, mask=pmask)
    tl.store(stamp_ptr + slot, clock, mask=pmask & (slot >= 0))
    tl.store(clock_ptr, clock + 1)
    four = tl.arange(0, 4)
    step = tl.where(four == 0, tl.sum(hit.to(tl.int64), axis=0),
                    tl.where(four == 1, n_fill.to(tl.int64), tl.where(four == 2, (n_miss - n_fill).to(tl.int64), 1)))
    tl.store(stats_ptr + four, stats + step)


class Scratch:
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


def bookkeeping(cache, scratch: Scratch, topk_ids: torch.Tensor) -> torch.Tensor:
    """One fused step of `cache` (a SlotCache on the GPU). -> slot ids [T, k] int32 (a scratch view)."""
    n = topk_ids.numel()
    if n > scratch.max_pairs:
        raise ValueError(f"{n} (token, expert) pairs exceed the {scratch.max_pairs} this cache was sized for")
    block_n = max(16, triton.next_power_of_2(n))
    block_s = max(16, triton.next_power_of_2(cache.num_slots))
    if block_n <= 64 and block_n * block_s <= REGS_LIMIT:
        _bookkeeping_regs[(1,)](
            topk_ids, n, cache.expert_slot, cache.slot_expert, cache.stamp, cache.clock, cache.stats,
            scratch.slots_out, scratch.miss_expert, scratch.miss_slot, scratch.miss_count, cache.num_slots,
            BLOCK_N=block_n, BLOCK_S=block_s, num_warps=1)  # one warp: reductions stay in shuffles
    else:
        _bookkeeping[(1,)](
            topk_ids, n, cache.expert_slot, cache.slot_expert, cache.stamp, cache.clock, cache.stats,
            scratch.first, scratch.used, scratch.victim, scratch.slots_out, scratch.miss_expert,
            scratch.miss_slot, scratch.miss_count, cache.num_slots, BLOCK_N=block_n, BLOCK_S=block_s, num_warps=4)
    return scratch.slots_out[:n].view(topk_ids.shape)


@triton.jit
def _copy_rows(src_ptr, dst_ptr, miss_expert_ptr, miss_slot_ptr, miss_count_ptr, row, chunks,
               BLOCK: tl.constexpr):
    # Persistent grid: program p copies chunks p, p + P, ... of the miss list; with no misses every
    # program reads one counter and leaves.
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    total = tl.load(miss_count_ptr) * chunks
    offs = tl.arange(0, BLOCK)
    for w in tl.range(pid, total, nprog):
        r = w // chunks
        c = (w % chunks).to(tl.int64) * BLOCK + offs
        e = tl.load(miss_expert_ptr + r).to(tl.int64)
        s = tl.load(miss_slot_ptr + r).to(tl.int64)
        m = c < row
        v = tl.load(src_ptr + e * row + c, mask=m)
        tl.store(dst_ptr + s * row + c, v, mask=m)


def copy_rows(src, dst: torch.Tensor, scratch: Scratch, programs: int, block: int = 8192) -> None:
    """Copy host rows into slots for the first miss_count entries of the miss list.

    src: [E, R] host rows (a DevicePointer to pinned memory); dst: [S, R] slots on the device.
    """
    row = dst.shape[1]
    _copy_rows[(programs,)](src, dst, scratch.miss_expert, scratch.miss_slot, scratch.miss_count, row,
                            triton.cdiv(row, block), BLOCK=block, num_warps=8)


@triton.jit
def _gate_up(x_ptr, dev_ptr, host_ptr, slot_ptr, expert_ptr, h_ptr, top_k: tl.constexpr, hidden: tl.constexpr,
             inter: tl.constexpr, row: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    # program (p, nb): pair p = t * top_k + j, intermediate rows [nb * BLOCK_N, +BLOCK_N)
    p = tl.program_id(0)
    nb = tl.program_id(1)
    t = p // top_k
    slot = tl.load(slot_ptr + p)
    on_host = slot < 0
    r = tl.where(on_host, tl.load(expert_ptr + p).to(tl.int64), slot.to(tl.int64))
    base = tl.where(on_host, host_ptr, dev_ptr) + r * row
    n = nb * BLOCK_N + tl.arange(0, BLOCK_N)
    nm = n < inter
    acc_g = tl.zeros([BLOCK_N], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_N], dtype=tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        km = kk < hidden
        x = tl.load(x_ptr + t * hidden + kk, mask=km, other=0.0).to(tl.float32)
        wm = nm[:, None] & km[None, :]
        wg = tl.load(base + n[:, None] * hidden + kk[None, :], mask=wm, other=0.0)
        wu = tl.load(base + (n[:, None] + inter) * hidden + kk[None, :], mask=wm, other=0.0)
        acc_g += tl.sum(wg.to(tl.float32) * x[None, :], axis=1)
        acc_u += tl.sum(wu.to(tl.float32) * x[None, :], axis=1)
    h = acc_g / (1.0 + tl.exp(-acc_g)) * acc_u
    tl.store(h_ptr + p * inter + n, h, mask=nm)


@triton.jit
def _down(h_ptr, weight_ptr, dev_ptr, host_ptr, slot_ptr, expert_ptr, out_ptr, top_k: tl.constexpr,
          hidden: tl.constexpr, inter: tl.constexpr, row: tl.constexpr, w13: tl.constexpr,
          BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    # program (t, nb): output rows [nb * BLOCK_N, +BLOCK_N) of token t, summing its k experts in order
    t = tl.program_id(0)
    nb = tl.program_id(1)
    n = nb * BLOCK_N + tl.arange(0, BLOCK_N)
    nm = n < hidden
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for j in range(0, top_k):
        p = t * top_k + j
        slot = tl.load(slot_ptr + p)
        on_host = slot < 0
        r = tl.where(on_host, tl.load(expert_ptr + p).to(tl.int64), slot.to(tl.int64))
        base = tl.where(on_host, host_ptr, dev_ptr) + r * row + w13
        part = tl.zeros([BLOCK_N], dtype=tl.float32)
        for k0 in range(0, inter, BLOCK_K):
            kk = k0 + tl.arange(0, BLOCK_K)
            km = kk < inter
            hk = tl.load(h_ptr + p * inter + kk, mask=km, other=0.0)
            w = tl.load(base + n[:, None] * inter + kk[None, :], mask=nm[:, None] & km[None, :], other=0.0)
            part += tl.sum(w.to(tl.float32) * hk[None, :], axis=1)
        acc += tl.load(weight_ptr + p).to(tl.float32) * part
    tl.store(out_ptr + t * hidden + n, acc.to(out_ptr.dtype.element_ty), mask=nm)


# (BLOCK_N, BLOCK_K, num_warps) per kernel; chosen by `moetier bench layer` on the H200.
GATE_UP_CONFIG = (16, 256, 4)
DOWN_CONFIG = (16, 256, 4)


def expert_mlp(x: torch.Tensor, slot_ids: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
               dev_rows: torch.Tensor, host_rows, hidden: int, inter: int, h: torch.Tensor, out: torch.Tensor,
               gate_up_config: tuple[int, int, int] = None, down_config: tuple[int, int, int] = None) -> torch.Tensor:
    """SwiGLU experts for T tokens x k pairs, rows by id. x [T, H]; slot_ids, topk_ids, topk_weights [T, k];
    dev_rows [S, R]; host_rows [E, R] (DevicePointer) or dev_rows again; h [T*k, I] float32 scratch;
    out [T, H] in x.dtype. Deterministic: each output sums its k experts in slot order."""
    t, k = topk_ids.shape
    row = dev_rows.shape[1]
    bn, bk, nw = gate_up_config or GATE_UP_CONFIG
    _gate_up[(t * k, triton.cdiv(inter, bn))](x, dev_rows, host_rows, slot_ids, topk_ids, h, k, hidden, inter, row,
                                             BLOCK_N=bn, BLOCK_K=bk, num_warps=nw)
    bn, bk, nw = down_config or DOWN_CONFIG
    _down[(t, triton.cdiv(hidden, bn))](h, topk_weights, dev_rows, host_rows, slot_ids, topk_ids, out, k, hidden,
                                        inter, row, 2 * inter * hidden, BLOCK_N=bn, BLOCK_K=bk, num_warps=nw)
    return out
