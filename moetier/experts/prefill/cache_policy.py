"""What a large step (prefill) does to a layer's slot cache: the policy of SlotExperts(prefill=...).

    bypass   the cache is left alone: experts in slots are read from them, the others from the host
             store across the link inside the large-step GEMM (each row once per chunk of its pairs).
    refresh  before the GEMM, the cache takes one ordinary step over the chunk's experts ranked by
             how many of its (token, expert) pairs each has, most first; the step's misses are
             filled into their victims, then the GEMM reads every expert now in a slot from HBM.
             So the experts the prompt used most are in slots for the decode that follows, and each
             filled row crosses the link once (the fill) instead of once per chunk of its pairs.

The refresh step is the cache's normal bookkeeping (SlotCache.step_reference on the CPU, the fused
kernel of slot_kernels.py on CUDA) over a list of S ids (S = slots), so its semantics are the
cache's: hits keep their slots; misses, in ranking order, take the victims the policy (lru / lfru)
orders (empty slots first); the slots of the ranked experts are never victims. When the chunk uses
at least S experts the S most used end up resident whatever the policy; when it uses fewer, the
policy chooses which old experts stay. Entries past the chunk's used experts repeat the first id: a
repeat is no first appearance, so it neither hits nor misses.

Invariants (tests/test_prefill_cache.py, tests/test_gpu_prefill_cache.py):
  - the cache's maps stay inverse (SlotCache.check) and every occupied slot holds its expert's row;
  - the hit / miss / overflow / step counters are not touched (they describe decode): the refresh's
    fills are counted apart (`refreshed`); the clock advances by one (a step of recency);
  - the prefill's outputs are bit-exact against bypass: a pair reads the same row bytes from a slot
    or from the host, and the large-step plan groups each row's pairs in the same order whatever
    the row's key (grouped_gemm_large.plan_large sorts stably), so the same chunks run the same math;
  - on CUDA no host sync: the ranking is device ops of fixed shape ([E] counts, a stable sort, the
    first S), the bookkeeping kernel and the fill read the miss count on the device.

NOTE: the refresh's fill uses the kernel copy (copy_rows) for both fill modes: the copy-engine fill
reads the miss list on the host (a sync). Under expert parallelism another rank's pairs come in as
id -1 (experts/parallel/ep.NOT_MINE) on the CPU and CUDA alike: the ranking counts them for nothing.
"""

from __future__ import annotations

import torch

from moetier.experts.cache.slots import MissList, SlotCache

PREFILL_POLICIES = ("bypass", "refresh")


def check_policy(policy: str) -> str:
    if policy not in PREFILL_POLICIES:
        raise ValueError(f"prefill cache policy {policy!r}: choose bypass or refresh")
    return policy


def ranking(topk_ids: torch.Tensor, num_experts: int, num_slots: int) -> torch.Tensor:
    """The ids the refresh step asks for: [min(S, E)] int64, the step's experts by pair count, most
    first, ties by lower id; entries past the used experts repeat the first. Negative ids (another
    rank's expert, experts/parallel/ep.NOT_MINE) count for nothing. Device ops of fixed shape: no host sync."""
    ids = topk_ids.reshape(-1).long()
    valid = ids >= 0
    counts = torch.zeros(num_experts, dtype=torch.int32, device=ids.device)
    counts.scatter_add_(0, ids.clamp(min=0), valid.int())
    order = torch.argsort(-counts, stable=True)[:num_slots]  # [S] expert ids, most pairs first
    used = counts[order] > 0
    return torch.where(used, order, order[:1])


def pair_counts(topk_ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """[E] pairs of the step per expert (tests and benchmarks; the ranking counts the same way)."""
    ids = topk_ids.reshape(-1).long()
    return torch.bincount(ids[ids >= 0], minlength=num_experts)


def cached_only(cache: SlotCache, topk_ids: torch.Tensor) -> torch.Tensor:
    """topk_ids with the pinned experts (rows after the slots, experts/cache/split.py) as -1: a refresh
    ranks the cached experts only, so its S asks are all ones a slot can take. Device ops, no sync."""
    if not cache.num_pinned:
        return topk_ids
    at = cache.expert_slot[topk_ids.clamp(min=0).long()]
    return torch.where(at >= cache.num_slots, -1, topk_ids)


def refresh_reference(cache: SlotCache, topk_ids: torch.Tensor) -> MissList:
    """The refresh step on the torch reference (CPU, or any device with syncs): the cache's step over
    the ranking, counters restored. -> the miss list (expert -> slot) the caller fills."""
    ids = ranking(cached_only(cache, topk_ids), cache.num_experts, cache.num_slots)
    saved = cache.stats.clone()
    _, miss = cache.step_reference(ids[None])
    cache.stats.copy_(saved)
    return miss


def refresh_device(cache: SlotCache, scratch, topk_ids: torch.Tensor) -> None:
    """The refresh step by the fused bookkeeping kernel (slot_kernels.bookkeeping): the miss list
    lands in scratch (miss_expert, miss_slot, miss_count) for copy_rows. No host sync; scratch must
    hold at least S pairs (SlotExperts sizes it so). Runs in Triton's interpreter on CPU tensors too."""
    from moetier.experts.cache.slot_kernels import bookkeeping

    ids = ranking(cached_only(cache, topk_ids), cache.num_experts, cache.num_slots)
    saved = cache.stats.clone()
    bookkeeping(cache, scratch, ids.view(1, -1))
    cache.stats.copy_(saved)


def rows_consistent(cache: SlotCache, slots: torch.Tensor, host: torch.Tensor) -> bool:
    """Every occupied slot holds its expert's host row, byte for byte (tests; syncs)."""
    held = cache.slot_expert.cpu().long()
    occupied = (held >= 0).nonzero().flatten()
    return bool(torch.equal(slots[occupied.to(slots.device)].cpu(), host[held[occupied]].cpu()))
