"""The plan of one set of expert options (experts/placement.ExpertOptions): counted as given, or
chosen (`--expert-backend auto`, or slots without a count: sizing.auto_plan); the options that carry a
plan out; and the refusal, with what would fit instead, of a plan that does not fit.

    plan = plan_for(req, experts)          # req: memory.PlanRequest
    if not plan.fits(): raise refusal(req, plan)
    experts = options_for(plan, experts)   # the chosen backend and per-layer slots and pins
"""

from __future__ import annotations

from dataclasses import replace

from moetier.errors import MoetierError
from moetier.experts.registry import AUTO, backend_kind
from moetier.plan.memory import Plan, PlanRequest, count
from moetier.plan.render import table
from moetier.plan.sizing import auto_plan, suggestions


class PlanRefused(MoetierError):
    """The run does not fit; the message is the table and the alternatives."""


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
