"""The device plan of the hybrid backend's `nodes` mode (hybrid_nodes.py): which misses of a step the
host cores compute, decided on the device, so that no host sync is needed and the step can be captured.

    rates = plan_rates(model, max_tokens, device)         # fp64 [3 + max_tokens]: the cost model's numbers
    plan = PlanBuffers(num_experts, max_pairs, device)     # fixed addresses: a graph reads them
    plan_step(ids, expert_slot, rates, plan)               # one Triton launch (CUDA) or the torch reference
    plan.dev_ids[:P]   ids with the host set's pairs set to -1 (experts/parallel/ep.NOT_MINE: skipped by the cache
                       step, the grouped GEMM and their plan), the others unchanged
    plan.job           int64 [1 + 2 * max_pairs]: [n host pairs, tokens [max_pairs], experts [max_pairs]]
                       (the first n of each list valid, host pairs in pair order): what the host node reads
    plan.pos           int64 [max_pairs]: the host pairs' positions p (0..P-1, p = token * k + j), then P
                       (a scratch row of the pair outputs) up to P
    plan.counters      int64 [2]: host experts, host pairs, summed over steps (read by stats(), never in a step)

The choice is CostModel.split's, exactly: the misses (distinct experts, id >= 0, not in a slot: the
cache's expert_slot read BEFORE the step's bookkeeping) ordered by (tokens, first appearance), the host
set the n first of them minimizing max(link_s(n), host_s(n)), ties to the smaller n; the sums in fp64,
in the same order as the Python loop (a sequential loop over n, not a parallel scan), so the same
rounding. NOTE: the rates come as a small fp64 tensor, not as kernel scalars: Triton passes Python
floats as fp32, and a fused multiply-add would round differently from Python; so the table holds
link_row_s, the host call's overhead and host_cost(t) for every token count t, each computed in Python
as CostModel computes it, and the kernel only adds, multiplies by an integer count and compares.
A token lists an expert once (top-k), so an expert's pairs are its tokens (<= T).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from moetier.experts.hybrid.cost_model import CostModel

BIG32 = tl.constexpr(2**31 - 1)  # constexpr: a compiled kernel may read no other global
BIG_KEY = tl.constexpr(2**30)  # above any (tokens * BLOCK + first) key: tokens <= 64, BLOCK <= 2^14


def plan_rates(model: CostModel, max_tokens: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """fp64 [3 + max_tokens]: link_row_s, overhead_s, then host_cost(t) for t = 0..max_tokens (t = 0 unused;
    inf everywhere when the host rate is 0: never the host, as CostModel.split)."""
    inf = not math.isfinite(model.host_row_s)
    cost = [math.inf if inf else model.host_cost(t) for t in range(max_tokens + 1)]
    return torch.tensor([model.link_row_s, model.rates.host_overhead_s, *cost], dtype=torch.float64, device=device)


class PlanBuffers:
    """The plan's outputs and scratch, one set per model (layers run one after another; a graph reads
    these addresses). first / count: per-expert scratch, BIG32 / 0 between steps (the kernel restores them)."""

    def __init__(self, num_experts: int, max_pairs: int, device: torch.device | str):
        dev = torch.device(device)
        self.max_pairs = max_pairs
        self.dev_ids = torch.full((max_pairs,), -1, dtype=torch.int64, device=dev)
        self.job = torch.zeros(1 + 2 * max_pairs, dtype=torch.int64, device=dev)
        self.pos = torch.zeros(max_pairs, dtype=torch.int64, device=dev)
        self.first = torch.full((num_experts,), BIG32.value, dtype=torch.int32, device=dev)
        self.count = torch.zeros(num_experts, dtype=torch.int32, device=dev)


@triton.jit
def _hybrid_plan(ids_ptr, P, K, slot_ptr, first_ptr, count_ptr, rates_ptr, dev_ids_ptr, job_ptr, pos_ptr,
                 counters_ptr, MAX_PAIRS, BLOCK: tl.constexpr):
    # One program. ids [P] (the flat [T, K] topk ids), slot [E] int32 (expert_slot), first / count [E]
    # int32 scratch, rates fp64 [3 + T]; out dev_ids [P], job [1 + 2 MAX_PAIRS], pos [P], counters [2].
    offs = tl.arange(0, BLOCK)
    valid = offs < P
    e = tl.load(ids_ptr + offs, mask=valid, other=-1).to(tl.int64)
    ec = tl.maximum(e, 0)
    s = tl.load(slot_ptr + ec, mask=valid & (e >= 0), other=0)
    miss = valid & (e >= 0) & (s < 0)
    tl.atomic_min(first_ptr + ec, offs, mask=miss)  # the expert's first pair
    tl.atomic_add(count_ptr + ec, 1, mask=miss)  # its tokens
    tl.debug_barrier()
    f = tl.load(first_ptr + ec, mask=miss, other=0, cache_modifier=".cg")
    t = tl.load(count_ptr + ec, mask=miss, other=0, cache_modifier=".cg")
    key = t.to(tl.int64) * BLOCK + f  # the split's order (tokens, first appearance); one per expert
    is_first = miss & (f == offs)
    m = tl.sum(is_first.to(tl.int32), axis=0)
    skey = tl.sort(tl.where(is_first, key, BIG_KEY))  # the m misses, in order, then BIG_KEY
    cost = tl.load(rates_ptr + 2 + skey // BLOCK, mask=offs < m, other=0.0)  # host_cost(tokens), fp64
    link_row = tl.load(rates_ptr)
    host = tl.load(rates_ptr + 1)  # the call's overhead
    best = m.to(tl.float64) * link_row
    best_n = m * 0
    for n in range(1, m + 1):  # CostModel.split's loop, its order of additions
        host += tl.sum(tl.where(offs == n - 1, cost, 0.0), axis=0)  # one lane: exact
        cur = tl.maximum((m - n).to(tl.float64) * link_row, host)
        better = cur < best  # strict: ties keep the smaller n
        best_n = tl.where(better, n, best_n)
        best = tl.where(better, cur, best)
    thresh = tl.sum(tl.where(offs == best_n - 1, skey, 0), axis=0)  # 0 when best_n == 0: below every key
    host_pair = miss & (key <= thresh)
    tl.store(dev_ids_ptr + offs, tl.where(host_pair, -1, e), mask=valid)
    hp = host_pair.to(tl.int32)
    idx = tl.cumsum(hp, axis=0) - 1  # host pairs compacted in pair order
    nh = tl.sum(hp, axis=0)
    tl.store(job_ptr + 1 + idx, offs // K, mask=host_pair)
    tl.store(job_ptr + 1 + MAX_PAIRS + idx, e, mask=host_pair)
    tl.store(pos_ptr + idx, offs, mask=host_pair)
    tl.store(pos_ptr + offs, P, mask=valid & (offs >= nh))  # disjoint from the stores above
    tl.store(job_ptr, nh.to(tl.int64))
    tl.store(counters_ptr, tl.load(counters_ptr) + best_n)
    tl.store(counters_ptr + 1, tl.load(counters_ptr + 1) + nh)
    tl.debug_barrier()  # every lane has read first / count: restore them for the next step
    tl.store(first_ptr + ec, BIG32, mask=miss)
    tl.store(count_ptr + ec, 0, mask=miss)


def plan_kernel(ids: torch.Tensor, expert_slot: torch.Tensor, rates: torch.Tensor, plan: PlanBuffers,
                counters: torch.Tensor) -> None:
    """The Triton plan: ids [T, k] (any int dtype), expert_slot [E] int32; fills plan and adds to
    counters [2] int64. One launch, one program, one warp (the loop's reductions stay in the warp)."""
    t, k = ids.shape
    p = t * k
    if p > plan.max_pairs or rates.numel() < 3 + t:
        raise ValueError(f"plan of {p} pairs: buffers hold {plan.max_pairs}, rates {rates.numel() - 3} tokens")
    block = max(16, triton.next_power_of_2(p))
    _hybrid_plan[(1,)](ids, p, k, expert_slot, plan.first, plan.count, rates, plan.dev_ids, plan.job, plan.pos,
                       counters, plan.max_pairs, BLOCK=block, num_warps=1)


def plan_reference(ids: torch.Tensor, expert_slot: torch.Tensor, rates: torch.Tensor, plan: PlanBuffers,
                   counters: torch.Tensor) -> None:
    """The torch (and Python) twin of plan_kernel, the tests' oracle and the CPU path: the same outputs.
    Reads its inputs on the host (not for a captured step)."""
    t, k = ids.shape
    p = t * k
    flat = ids.reshape(-1).tolist()
    slot_now = expert_slot[ids.reshape(-1).clamp(min=0)].tolist()
    tokens: dict[int, int] = {}  # misses in order of first appearance -> tokens
    first: dict[int, int] = {}
    for q, (e, s) in enumerate(zip(flat, slot_now)):
        if e >= 0 and s < 0:
            tokens[e] = tokens.get(e, 0) + 1
            first.setdefault(e, q)
    order = sorted(tokens, key=lambda e: (tokens[e], first[e]))
    r = rates.tolist()
    m = len(order)
    best_n, best, host = 0, m * r[0], r[1]
    for n in range(1, m + 1):
        host += r[2 + tokens[order[n - 1]]]
        cur = max((m - n) * r[0], host)
        if cur < best:
            best_n, best = n, cur
    chosen = set(order[:best_n])
    hpos = [q for q, e in enumerate(flat) if e in chosen]
    dev = [-1 if e in chosen else e for e in flat]
    mp = plan.max_pairs
    plan.dev_ids[:p] = torch.tensor(dev, dtype=torch.int64)
    job = plan.job
    job[0] = len(hpos)
    job[1:1 + len(hpos)] = torch.tensor([q // k for q in hpos], dtype=torch.int64)
    job[1 + mp:1 + mp + len(hpos)] = torch.tensor([flat[q] for q in hpos], dtype=torch.int64)
    plan.pos[:p] = torch.tensor(hpos + [p] * (p - len(hpos)), dtype=torch.int64)
    counters[0] += best_n
    counters[1] += len(hpos)
