"""Preflight: the plan of a run, checked before anything is allocated. Every `generate` and
`bench batch` start runs it, and a server calls `preflight()` the same way and logs `render.table()`.

It refuses (PlanRefused, a MoetierError: the CLI prints it and exits with code 2) with the plan's
table and what would fit instead, when
  - checkpoint shards are missing or unreadable (checkpoint/index.py, validate.py say which),
  - the device cannot hold the plan,
  - the host would drop under its safety margin (memory.HOST_MARGIN_*),
  - pinned memory would pass the locked-memory limit (ulimit -l).
With `--expert-backend auto` (the default) or `slots` without a count, it also chooses the placement
(sizing.auto_plan) and hands back the ExpertOptions that carry it out.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import torch

from moetier.config import ModelConfig
from moetier.errors import MoetierError
from moetier.experts.registry import Slots, Uva, backend_kind
from moetier.plan import machine
from moetier.plan.expert_plan import PlanRefused, options_for, plan_for, refusal
from moetier.plan.memory import PlanRequest


def request_for(cfg: ModelConfig, dtype: torch.dtype, device: str, config, gpu_memory: str | None = None,
                host_memory: str | None = None) -> PlanRequest:
    """A PlanRequest for an EngineConfig (engine/config.py) on this machine (or the given sizes)."""
    from moetier.config import with_dense
    from moetier.models.mtp import with_mtp

    gpu, gpu_src, with_context = machine.gpu_budget(gpu_memory, device)
    host, host_src = machine.host_budget(host_memory)
    cfg = with_dense(cfg, config.dense_weights)  # the dense weights as they will be held
    # speculative method mtp loads the MTP layers: their experts, dense weights and KV rows are counted
    cfg = with_mtp(cfg, config.drafts_with_mtp)
    spec = config.speculative_config
    return PlanRequest(cfg, dtype, device, max_model_len=config.model_len(cfg.max_position_embeddings),
                       max_num_seqs=config.max_num_seqs, kv_tokens=config.kv_tokens, page_size=config.page_size,
                       max_num_tokens=config.max_num_tokens, decode_tokens=config.decode_tokens,
                       # an engine drafting with MTP runs every step eagerly: no decode graphs
                       cuda_graphs=config.cuda_graphs and config.record_trace is None and not config.drafts_with_mtp,
                       gpu_budget=gpu,
                       gpu_source=gpu_src, context_in_budget=with_context, host_available=host,
                       host_source=host_src, memlock=machine.memlock_limit(),
                       prefill_stream=config.experts.prefill_stream,
                       prefix_caching=config.enable_prefix_caching,
                       kv_host_bytes=config.kv_host_bytes,
                       draft_tokens=spec.num_speculative_tokens if spec is not None else 0,
                       draft_distributions=config.drafts_with_mtp)


def check_shards(model_dir: Path, cfg: ModelConfig) -> None:
    """Missing or unreadable shards, named, before any allocation (the loader's own checks, run early)."""
    from moetier.checkpoint.index import Checkpoint
    from moetier.checkpoint.validate import model_weights, validate

    ckpt = Checkpoint(model_dir)
    validate(cfg, ckpt, model_weights(cfg, ckpt))
    for f in sorted({t.file for t in ckpt.tensors.values()}):
        try:
            with open(ckpt.path / f, "rb") as fh:
                fh.read(8)
        except OSError as e:
            raise MoetierError(f"checkpoint shard {ckpt.path / f} is not readable ({e.strerror or e}); "
                               "fix its permissions or copy it again") from None


def preflight(model_dir: Path, dtype: str, device: str, config, gpu_memory: str | None = None,
              host_memory: str | None = None):
    """-> (plan, the EngineConfig to load with: config.experts as the plan chose them, every rank's
    share or None for one process): place() for a checkpoint, its shards checked first. Raises
    PlanRefused or another MoetierError."""
    from moetier.checkpoint.loader import resolve_dtype
    from moetier.models.registry import config_from_dir

    cfg = config_from_dir(model_dir)
    check_shards(model_dir, cfg)
    req = request_for(cfg, resolve_dtype(dtype, cfg), device, config, gpu_memory, host_memory)
    return place(req, config, gpu_memory, host_memory)


def place(req: PlanRequest, config, gpu_memory: str | None = None, host_memory: str | None = None):
    """The plan of config.experts for any number of ranks -> (plan, config with the experts the plan
    chose, every rank's share or None). One process: refused here (PlanRefused) when it does not fit.
    Several ranks (--tp/--ep): one rank's plan (plan/nodes.rank_plans: the placement sized for a
    rank's share), whose budgets every node checks once the ranks have started (plan/nodes.node_check)."""
    if config.world_size > 1:
        from moetier.plan.nodes import rank_plans

        plan, experts, shares = rank_plans(req, config.experts, config.layout(), gpu_memory, host_memory)
        return plan, replace(config, experts=experts), shares
    plan = plan_for(req, config.experts)
    if not plan.fits():
        raise refusal(req, plan)
    return plan, replace(config, experts=options_for(plan, config.experts)), None


def bench_preflight(cfg: ModelConfig, rows: list[tuple[str, float]], config, gpu_memory: str | None = None,
                    host_memory: str | None = None, dtype: torch.dtype = torch.bfloat16,
                    ring: tuple[int, int] | None = None, pinned: dict[int, tuple[int, ...]] | None = None,
                    slots_per_layer: dict[int, int] | None = None) -> None:
    """The memory plan of each (backend, expert budget) row of a random-weight benchmark, checked before
    its weights are made: the first row that cannot run is refused (PlanRefused, exit code 2) with its
    table and what would fit. NOTE: the random bed pins every expert on the host whatever the rows, so
    the host is checked with the whole store (the uva plan: store on the host, none on the device).
    ring: the staging ring's (G, D) when config.experts.prefill_stream is ring (default: ExpertOptions').
    pinned: the bed's pinned experts (experts/cache/split.py): its store holds only the cached rows, so
    every row is planned with them, and none with the whole store. slots_per_layer: a slots file's
    counts, one more row (slots of those sizes) planned after the others."""
    from moetier.experts.placement import ExpertOptions

    req = request_for(cfg, dtype, "cuda", config, gpu_memory, host_memory)
    checks = [] if pinned else [("the random weights' host store", Uva.name, None, {})]
    most = max((len(v) for v in (pinned or {}).values()), default=0)
    for backend, budget in rows:
        kind = backend_kind(backend)
        slots = max(cfg.top_k, round(cfg.num_experts * budget)) if kind.cached else None
        slots = min(slots, cfg.num_experts - most) if slots else slots
        # a hybrid row is checked as slots of its size (the bed builds it from the slots' rows)
        checks.append((f"the {backend} row" + (f" at {budget:.0%}" if slots else ""),
                       Slots.name if kind.cached else backend, slots, {}))
    if slots_per_layer:
        checks.append(("the slots row of the slots file", Slots.name, None, dict(slots_per_layer)))
    for what, backend, slots, per_layer in checks:
        geometry = {} if ring is None else {"ring_group": ring[0], "ring_depth": ring[1]}
        held = {"pinned": pinned} if pinned and backend_kind(backend).cached else {}
        plan = plan_for(req, ExpertOptions(backend, slots=slots, slots_per_layer=per_layer, **geometry, **held))
        if not plan.fits():
            r = refusal(req, plan)
            raise PlanRefused(f"{what} does not fit: {r}")
