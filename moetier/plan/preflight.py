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
from moetier.experts.registry import AUTO, Slots, Uva, backend_kind
from moetier.plan import machine
from moetier.plan.memory import Plan, PlanRequest, count
from moetier.plan.render import table
from moetier.plan.sizing import auto_plan, suggestions


class PlanRefused(MoetierError):
    """The run does not fit; the message is the table and the alternatives."""


def request_for(cfg: ModelConfig, dtype: torch.dtype, device: str, config, gpu_memory: str | None = None,
                host_memory: str | None = None) -> PlanRequest:
    """A PlanRequest for an EngineConfig (engine/config.py) on this machine (or the given sizes)."""
    from moetier.checkpoint.fp8_weights import with_dense
    from moetier.models.mtp import with_mtp

    gpu, gpu_src, with_context = machine.gpu_budget(gpu_memory, device)
    host, host_src = machine.host_budget(host_memory)
    cfg = with_dense(cfg, config.fp8_dense)  # the dense weights as they will be held
    # speculative method mtp loads the MTP layers: their experts, dense weights and KV rows are counted
    cfg = with_mtp(cfg, config.drafts_with_mtp)
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
                       kv_host_bytes=config.kv_host_bytes, speculative=config.speculative_config is not None)


def plan_for(req: PlanRequest, experts, trace=None) -> Plan:
    """The plan of these ExpertOptions: as given, or chosen (backend auto; slots without a count); the
    prefill chunk too when req.max_num_tokens is None (plan/chunk.py: plan.chunk says why)."""
    if req.max_num_tokens is None:
        from moetier.plan.chunk import plan_with_chunk

        return plan_with_chunk(req, lambda r: _placed(r, experts, trace))
    return _placed(req, experts, trace)


def _placed(req: PlanRequest, experts, trace=None) -> Plan:
    layers, e = req.cfg.moe_layers, req.cfg.num_experts
    req = replace(req, ring=(getattr(experts, "ring_group", req.ring[0]),  # the ring mode's staging ring
                             getattr(experts, "ring_depth", req.ring[1])))
    if experts.backend == AUTO:
        return auto_plan(req, trace, experts.policy)
    problems = experts.problems(req.cfg.moe_shape, layers)
    if problems:
        raise MoetierError("; ".join(problems))
    if backend_kind(experts.backend).cached:  # hybrid: the slots' plan, then counted as hybrid
        b = experts.backend
        if experts.slots is None and not experts.slots_per_layer and not experts.pinned:
            plan = auto_plan(req, trace, experts.policy)
            if backend_kind(plan.backend).cached:
                if b == plan.backend:
                    return plan
                other = count(replace(req, backend=b, slots_per_layer=plan.slots_per_layer,
                                      pinned_per_layer=plan.pinned_per_layer))
                other.pinned_experts, other.notes = plan.pinned_experts, plan.notes
                return other
            return count(replace(req, backend=b, slots_per_layer=dict.fromkeys(layers, e)))
        pins = {layer: len(experts.pinned.get(layer, ())) for layer in layers}  # an explicit split (a file)
        slots = {layer: experts.slots_for(layer, e, pins[layer]) for layer in layers}
        plan = count(replace(req, backend=b, slots_per_layer=slots, pinned_per_layer=pins))
        plan.pinned_experts = {layer: list(ids) for layer, ids in experts.pinned.items() if ids}
        return plan
    return count(replace(req, backend=experts.backend))


def options_for(plan: Plan, experts):
    """ExpertOptions that carry the plan out (the chosen backend and per-layer slots)."""
    cached = backend_kind(plan.backend).cached
    return replace(experts, backend=plan.backend, slots=None,
                   slots_per_layer=dict(plan.slots_per_layer) if cached else {},
                   pinned={layer: tuple(ids) for layer, ids in plan.pinned_experts.items()} if cached else {})


def refusal(req: PlanRequest, plan: Plan) -> PlanRefused:
    if req.max_num_tokens is None:  # what would fit is searched at the chunk the plan chose
        req = replace(req, max_num_tokens=plan.request["max_num_tokens"])
    lines = [f"the plan does not fit: {'; '.join(plan.problems())}", table(plan)]
    alt = suggestions(req, plan)
    if alt:
        lines.append("what would fit instead:")
        lines += [f"  {a}" for a in alt]
    return PlanRefused("\n".join(lines))


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
    """-> (plan, the EngineConfig to load with: config.experts as the plan chose them). Raises PlanRefused
    or another MoetierError."""
    from moetier.checkpoint.loader import resolve_dtype
    from moetier.models.registry import config_from_dir

    cfg = config_from_dir(model_dir)
    check_shards(model_dir, cfg)
    req = request_for(cfg, resolve_dtype(dtype, cfg), device, config, gpu_memory, host_memory)
    plan = plan_for(req, config.experts)
    if not plan.fits():
        raise refusal(req, plan)
    return plan, replace(config, experts=options_for(plan, config.experts))


def bench_preflight(cfg: ModelConfig, rows: list[tuple[str, float]], config, gpu_memory: str | None = None,
                    host_memory: str | None = None, dtype: torch.dtype = torch.bfloat16,
                    ring: tuple[int, int] | None = None, pinned: dict[int, tuple[int, ...]] | None = None) -> None:
    """The memory plan of each (backend, expert budget) row of a random-weight benchmark, checked before
    its weights are made: the first row that cannot run is refused (PlanRefused, exit code 2) with its
    table and what would fit. NOTE: the random bed pins every expert on the host whatever the rows, so
    the host is checked with the whole store (the uva plan: store on the host, none on the device).
    ring: the staging ring's (G, D) when config.experts.prefill_stream is ring (default: ExpertOptions').
    pinned: the bed's pinned experts (experts/cache/split.py): its store holds only the cached rows, so
    every row is planned with them, and none with the whole store."""
    from moetier.experts.placement import ExpertOptions

    req = request_for(cfg, dtype, "cuda", config, gpu_memory, host_memory)
    checks = [] if pinned else [("the random weights' host store", Uva.name, None)]
    most = max((len(v) for v in (pinned or {}).values()), default=0)
    for backend, budget in rows:
        kind = backend_kind(backend)
        slots = max(cfg.top_k, round(cfg.num_experts * budget)) if kind.cached else None
        slots = min(slots, cfg.num_experts - most) if slots else slots
        # a hybrid row is checked as slots of its size (the bed builds it from the slots' rows)
        checks.append((f"the {backend} row" + (f" at {budget:.0%}" if slots else ""),
                       Slots.name if kind.cached else backend, slots))
    for what, backend, slots in checks:
        geometry = {} if ring is None else {"ring_group": ring[0], "ring_depth": ring[1]}
        held = {"pinned": pinned} if pinned and backend_kind(backend).cached else {}
        plan = plan_for(req, ExpertOptions(backend, slots=slots, **geometry, **held))
        if not plan.fits():
            r = refusal(req, plan)
            raise PlanRefused(f"{what} does not fit: {r}")
