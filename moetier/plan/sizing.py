"""Automatic sizing: the expert placement that fits the device budget, and what would fit instead
when a plan does not.

Order (issue 14): KV pages for the requested length and batch first, then the workspaces and graphs,
then every remaining byte less a stated margin (MARGIN_SHARE of the budget, at least MARGIN_MIN) goes
to expert slots, split over the MoE layers evenly or as a routing trace says (traces/slot_plan.py).
If every expert fits, the plan is `resident`. The result is checked against the budget by counting
the whole plan again and taking slots away until it fits, so it never exceeds the budget.
"""

from __future__ import annotations

from dataclasses import replace

from moetier.errors import MoetierError
from moetier.experts.registry import Resident, Slots, backend_kind
from moetier.plan.memory import Plan, PlanRequest, count
from moetier.plan.units import GiB, gib

MARGIN_SHARE, MARGIN_MIN = 0.02, 1 * GiB  # of the device budget, kept free by automatic sizing


def margin(budget: int) -> int:
    return max(MARGIN_MIN, int(MARGIN_SHARE * budget))


def even_split(total: int, layers: list[int], num_experts: int) -> dict[int, int]:
    """`total` slots over the layers as evenly as they go (the first layers take the remainder)."""
    base, extra = divmod(total, len(layers))
    return {layer: min(num_experts, base + (i < extra)) for i, layer in enumerate(layers)}


def split_slots(total: int, layers: list[int], num_experts: int, trace=None, policy: str = "lfru") -> dict[int, int]:
    """Per-layer slots summing to at most `total`: the trace's plan (traces/slot_plan.py) where the trace
    covers exactly these layers, else the even split."""
    if trace is not None and list(trace.layers) == list(layers) and trace.num_experts == num_experts:
        from moetier.traces.slot_plan import plan as trace_plan

        per = total // len(layers)
        if 1 <= per <= num_experts:
            got = trace_plan(trace, per * len(layers), policy)
            return {int(k): v for k, v in got["slots"].items()}
    return even_split(total, layers, num_experts)


def with_slots(req: PlanRequest, slots: dict[int, int]) -> Plan:
    return count(replace(req, backend=Slots.name, slots_per_layer=slots))


def auto_plan(req: PlanRequest, trace=None, policy: str = "lfru") -> Plan:
    """Resident when every expert fits the budget less the margin, else the most slots that do.
    Raises MoetierError (with the numbers) when not even one slot per layer fits."""
    layers, e = req.cfg.moe_layers, req.cfg.num_experts
    if req.gpu_budget is None or req.device != "cuda":
        plan = count(replace(req, backend=Resident.name))
        plan.notes.append("no device budget: every expert resident")
        return plan
    keep = margin(req.gpu_budget)
    limit = req.gpu_budget - keep
    resident = count(replace(req, backend=Resident.name))
    if resident.device_total <= limit or not layers:
        resident.notes.append(f"every expert fits: resident ({gib(limit - resident.device_total)} to spare "
                              f"after the {gib(keep)} margin)")
        return resident
    from moetier.plan.split import covers, host_short, split_plan

    traced = covers(trace, layers, e)
    if traced or host_short(req):  # pinned experts where the host is short or the trace says they pay
        return split_plan(req, keep, trace if traced else None, policy)
    base = with_slots(req, dict.fromkeys(layers, 0))
    room = limit - base.device_total
    # one slot: its row plus its share of the cache state (a few int32/int64 entries) and rounding
    total = min(room // (base.row_bytes + 64), len(layers) * e) if room > 0 else 0
    if total < len(layers):
        raise MoetierError(
            f"the device budget {gib(req.gpu_budget)} less the {gib(keep)} margin leaves {gib(max(room, 0))} "
            f"for expert slots after dense weights, KV and workspaces ({gib(base.device_total)}); one slot per "
            f"layer needs {gib(len(layers) * base.row_bytes)}. Shorten --max-model-len, lower --max-num-seqs, "
            "or use --expert-backend uva")
    slots = split_slots(total, layers, e, trace, policy)
    plan = with_slots(req, slots)
    while plan.device_total > limit:  # the per-slot estimate was short: take from the largest layer
        big = max(slots, key=lambda k: slots[k])
        if slots[big] <= 1:
            break
        slots[big] -= 1
        plan = with_slots(req, slots)
    plan.notes.append(f"automatic: {sum(slots.values())} slots of {len(layers) * e} experts "
                      f"({sum(slots.values()) / (len(layers) * e):.0%}), "
                      f"{'split by the trace' if trace is not None else 'split evenly'}; "
                      f"{gib(keep)} margin kept free")
    return plan


def _largest(lo: int, hi: int, fits) -> int | None:
    """The largest n in [lo, hi] with fits(n) (fits is monotone), or None."""
    if hi < lo or not fits(lo):
        return None
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
    return lo


def suggestions(req: PlanRequest, plan: Plan) -> list[str]:
    """What would fit instead of a plan that does not: slots, length, batch (device); each a flag."""
    out = []
    if plan.gpu_budget is not None and plan.device_total > plan.gpu_budget:
        try:
            auto = auto_plan(req)
            if backend_kind(auto.backend).cached:
                s = sorted(auto.slots_per_layer.values())
                out.append(f"--expert-backend slots --expert-slots {s[0]} (of {req.cfg.num_experts} experts per "
                           f"layer; the automatic plan gives {s[0]}..{s[-1]}) at this length and batch")
            elif backend_kind(plan.backend).host_store:
                out.append("--expert-backend resident: every expert fits")
        except MoetierError:
            pass
        cap = plan.gpu_budget

        def fits_len(n: int) -> bool:
            return count(replace(req, max_model_len=n, kv_tokens=None)).device_total <= cap

        def fits_seqs(n: int) -> bool:
            return count(replace(req, max_num_seqs=n, kv_tokens=None)).device_total <= cap

        n = _largest(req.page_size, req.model_len - 1, fits_len)
        if n is not None:
            out.append(f"--max-model-len {n // req.page_size * req.page_size or n} with the same experts and batch")
        if req.max_num_seqs > 1:
            b = _largest(1, req.max_num_seqs - 1, fits_seqs)
            if b is not None:
                out.append(f"--max-num-seqs {b} with the same experts and length")
    if plan.host_available is not None and plan.host_total > plan.host_available - plan.host_margin:
        if backend_kind(plan.backend).host_store:
            out.append("--expert-backend resident, if the device can hold every expert (no host store)")
        short = gib(plan.host_total + plan.host_margin - plan.host_available)
        if req.host_source.startswith("--host-memory"):  # the limit is the user's own flag, not the machine
            out.append(f"raise --host-memory by at least {short} (or leave it out to use what the host has)")
        else:
            out.append(f"free {short} of host memory (other processes, page cache held by tmpfs) or run on a "
                       "larger host")
    return out
