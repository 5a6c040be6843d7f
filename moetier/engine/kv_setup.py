"""The engine's KV, sized and wired together: the device pool (pages, state slots, state checkpoints),
the host KV tier, the prefix cache over the pages, and the scheduler that holds them (and, without a
memory plan, its prefill chunk: auto_chunk). Every rank of a
parallel engine builds the same device pool and the same moves (dist/worker.py); rank 0 alone
schedules."""

from __future__ import annotations

import torch

from moetier.engine.config import EngineConfig
from moetier.engine.kv_host_tier import KVHostTier
from moetier.engine.kv_moves import KVMoves
from moetier.engine.pages import PagePool
from moetier.engine.prefix_cache import PrefixCache
from moetier.engine.scheduler import Scheduler
from moetier.engine.speculation import Speculation
from moetier.errors import MoetierError
from moetier.experts.backends import UvaExperts
from moetier.layers.kv_cache import KVCache, KVSpec


def num_checkpoints(config: EngineConfig, spec: KVSpec, dtype: torch.dtype) -> int:
    """State checkpoints the engine keeps: one per sequence it runs at once (a stated choice: every
    running prompt can leave its latest boundary), none without recurrent state or prefix caching."""
    return config.max_num_seqs if config.enable_prefix_caching and spec.state_bytes_per_seq(dtype) else 0


def num_backups(config: EngineConfig, spec: KVSpec, dtype: torch.dtype) -> int:
    """State backups of speculative decoding: one per sequence it runs at once (a verify step saves the
    state before it and restores it when a draft is rejected), none without recurrent state."""
    return config.max_num_seqs if config.speculative_config is not None and spec.state_bytes_per_seq(dtype) else 0


def page_bytes(kv: KVCache) -> int:
    """Bytes of one page over all layers and page tensors: one host-tier slot."""
    return sum(t[:, 0].numel() * t.element_size() for t in kv.page_tensors())


def host_capacity(config: EngineConfig, kv: KVCache) -> int:
    """Host-tier slots that config.kv_host_bytes holds (0: no host tier); one clear error if not one."""
    if not config.kv_host_bytes:
        return 0
    per = page_bytes(kv)
    if config.kv_host_bytes < per:
        raise MoetierError(f"--kv-host-memory of {config.kv_host_bytes:,} B holds no KV page ({per:,} B per page "
                           f"over all layers); give at least {per:,} B or 0 for no host tier")
    return config.kv_host_bytes // per


def engine_kv(spec: KVSpec, config: EngineConfig, dtype: torch.dtype, device: torch.device | str) -> KVCache:
    """The device KV pool of an engine (every rank allocates the same): the scheduler's pages plus one
    scratch page (padding rows of graph-replayed steps write there), the state slots of max_num_seqs
    sequences plus a spare one plus the state checkpoints plus speculative decoding's state backups."""
    slots = config.max_num_seqs + 1 + num_checkpoints(config, spec, dtype) + num_backups(config, spec, dtype)
    return spec.allocate(config.num_pages + 1, config.page_size, dtype, device, state_slots=slots)


def engine_moves(kv: KVCache, config: EngineConfig, spec: KVSpec, dtype: torch.dtype) -> KVMoves:
    """The runner's host-tier copies and state checkpoints for this pool (none when both are off)."""
    ckpts = num_checkpoints(config, spec, dtype)
    base = config.max_num_seqs + 1 if ckpts else -1
    backups = config.max_num_seqs + 1 + ckpts if num_backups(config, spec, dtype) else -1
    return KVMoves(kv, host_capacity(config, kv), base, backups)


def engine_scheduler(config: EngineConfig, spec: KVSpec, dtype: torch.dtype, moves: KVMoves, max_len: int,
                     extra_key: str) -> Scheduler:
    """The scheduler over config.num_pages pages, with the prefix cache (on or off), its host tier
    (moves.host_slots slots) and, for models with recurrent state, the state slots and checkpoints.
    extra_key: salt of the page hashes (the model)."""
    pages = PagePool(config.num_pages)
    states = PagePool(config.max_num_seqs) if spec.state_bytes_per_seq(dtype) else None
    cache = PrefixCache(pages, config.page_size, extra_key=extra_key, enabled=config.enable_prefix_caching,
                        host=KVHostTier(moves.host_slots) if moves.host_slots else None)
    ckpts = num_checkpoints(config, spec, dtype)
    spec = None if config.speculative_config is None else Speculation(config.speculative_config)
    return Scheduler(pages, config.page_size, config.max_num_tokens, config.max_num_seqs, max_len, states, cache,
                     PagePool(ckpts) if ckpts else None, spec)


def auto_chunk(model) -> tuple[int, str]:
    """The prefill chunk for an engine without a memory plan: experts off the GPU (uva, or a slot
    cache short of every expert) or not, the budget being the device's memory. -> (tokens, reason)."""
    from moetier.plan.chunk import engine_chunk

    offloaded = False
    for block in model.moe_blocks():
        ex = getattr(block.experts, "inner", block.experts)  # experts/parallel/ep.ShardedExperts
        cache = getattr(ex, "cache", None)
        offloaded |= isinstance(ex, UvaExperts) or (cache is not None and cache.num_slots < cache.num_experts)
    dev = model.device
    total = torch.cuda.get_device_properties(dev).total_memory if dev.type == "cuda" else None
    return engine_chunk(model.cfg, model.dtype, dev.type, offloaded, total)
