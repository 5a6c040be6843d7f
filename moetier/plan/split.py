"""The split of every MoE layer's experts into pinned on the GPU and cached on the host, from the two
budgets (experts/cache/split.py is the split; traces/split_plan.py the per-layer choice on a trace):

    GPU  = dense + KV + state + workspaces + pinned + slots     <= budget - margin (sizing.margin)
    host = cached experts + staging + the process              <= available - margin (memory.HOST_MARGIN_*)

Order: the host's room sets the experts it can hold; the rest must be pinned (spread evenly over the
layers). Every GPU row left after dense weights, KV and workspaces goes to the experts, evenly per
layer (or as the trace's slot plan spreads them); each layer's rows are then pinned experts or slots:
  - with a trace covering these layers, the per-layer choice that predicts the most hits held out
    (pinning wins where the hot set is stable), at least the pinned count the host forces;
  - without one, only what the host forces is pinned (DEFAULT_NOTE says why) and the rest are slots.
The plan is counted again and trimmed (a slot less, or a slot made a pinned expert when the host is
over) until both budgets hold.
"""

from __future__ import annotations

from dataclasses import replace

from moetier.errors import MoetierError
from moetier.experts.registry import Slots
from moetier.plan.memory import Plan, PlanRequest, count
from moetier.plan.units import gib

DEFAULT_NOTE = ("no trace: pinned only the {p} experts the host cannot hold ({per} per layer, the lowest ids: "
                "without routing to go by no set is better), every other GPU row a slot, since slots follow the "
                "routing and a pinned set cannot; give --trace to pin a stable hot set")


class SplitRefused(MoetierError):
    """The two budgets cannot hold the experts at this request (plan/chunk.py tries a smaller chunk)."""


def even(total: int, layers: list[int], cap: int) -> dict[int, int]:
    base, extra = divmod(total, len(layers))
    return {layer: min(cap, base + (i < extra)) for i, layer in enumerate(layers)}


def _store(plan: Plan) -> int:
    return next(i.bytes for i in plan.host if i.name.startswith("expert store"))


def rooms(req: PlanRequest, margin: int) -> tuple[int, int, Plan]:
    """(GPU rows for experts, host rows for cached experts, the plan with no expert rows at all)."""
    layers = req.cfg.moe_layers
    base = count(replace(req, backend=Slots.name, slots_per_layer=dict.fromkeys(layers, 0), pinned_per_layer={}))
    row = base.row_bytes
    dev = (req.gpu_budget - margin - base.device_total) // (row + 64)  # a row, its share of the cache state
    if req.host_available is None:
        return dev, len(layers) * req.cfg.num_experts, base
    host_free = req.host_available - base.host_margin - (base.host_total - _store(base))
    return dev, max(0, host_free // (row + 2 * req.page)), base


def split_plan(req: PlanRequest, margin: int, trace=None, policy: str = "lfru") -> Plan:
    """The slots plan with pinned experts that fits both budgets; MoetierError (with the numbers) when
    the GPU cannot take what the host leaves over plus a slot per layer."""
    layers, e, k = req.cfg.moe_layers, req.cfg.num_experts, req.cfg.top_k
    dev_rows, host_rows, base = rooms(req, margin)
    total = len(layers) * e
    must = max(0, total - host_rows)
    if dev_rows < must + len(layers):
        raise SplitRefused(
            f"the experts do not fit the two budgets: {total:,} rows of {base.row_bytes:,} B; the host holds "
            f"{min(host_rows, total):,} after the process and its margin, so {must:,} must be pinned on the GPU, "
            f"which has room for {max(dev_rows, 0):,} expert rows after dense weights, KV and workspaces "
            f"({gib(base.device_total)}) and the {gib(margin)} margin, one slot per layer included. Shorten "
            "--max-model-len, lower --max-num-seqs, or run on a larger host")
    per = even(min(dev_rows, total - len(layers)), layers, e)  # device rows a layer: pinned + slots
    low = even(must, layers, e - 1)
    for layer in layers:  # a layer whose even share of the forced pins passes its rows: move them on
        low[layer] = min(low[layer], per[layer] - 1)
    short = must - sum(low.values())
    for layer in layers:
        take = min(short, per[layer] - 1 - low[layer])
        low[layer] += take
        short -= take
    pinned, slots, chosen, notes = {}, {}, {}, []
    traced = covers(trace, layers, e)
    if traced:
        from moetier.traces.split_plan import choose

        for i, layer in enumerate(layers):
            got = choose(trace.layer_ids(i), e, per[layer], low[layer], k, policy)
            chosen[layer], slots[layer] = got, got.slots
            pinned[layer] = list(got.pinned)
        p = sum(len(v) for v in pinned.values())
        stable = sum(c.stability for c in chosen.values()) / len(chosen)
        notes.append(f"trace: {p} experts pinned where the held-out half hits more with them than with slots "
                     f"(at least the {must} the host cannot hold); the first half's hot sets cover {stable:.0%} "
                     "of what the second half's own would")
    else:
        for layer in layers:
            pinned[layer] = list(range(low[layer]))
            slots[layer] = per[layer] - low[layer]
        notes.append(DEFAULT_NOTE.format(p=must, per=f"{min(low.values())}..{max(low.values())}"))
    plan = _count(req, slots, pinned)
    limit = req.gpu_budget - margin
    while plan.device_total > limit or not _host_fits(plan):
        big = max(slots, key=lambda la: slots[la])
        if slots[big] <= 1:
            break
        slots[big] -= 1
        if not _host_fits(plan):  # the slot's row becomes a pinned expert: one row less on the host
            pinned[big] = sorted(set(pinned[big]) | {min(set(range(e)) - set(pinned[big]))})
        plan = _count(req, slots, pinned)
    plan.pinned_experts = {layer: ids for layer, ids in pinned.items() if ids}
    plan.notes += notes
    plan.notes.append(f"split: {sum(len(v) for v in pinned.values()):,} experts pinned on the GPU "
                      f"({gib(sum(len(v) for v in pinned.values()) * plan.row_bytes)}), {sum(slots.values()):,} slots, "
                      f"{total - sum(len(v) for v in pinned.values()):,} cached on the host; {gib(margin)} GPU margin")
    return plan


def covers(trace, layers: list[int], num_experts: int) -> bool:
    """Whether a trace can choose these layers' splits: its i-th traced layer stands for the i-th MoE
    layer (a synthetic trace numbers its layers 0..L-1; a recorded one has the model's ids)."""
    return trace is not None and len(trace.layers) == len(layers) and trace.num_experts == num_experts


def _count(req: PlanRequest, slots: dict[int, int], pinned: dict[int, list[int]]) -> Plan:
    return count(replace(req, backend=Slots.name, slots_per_layer=dict(slots),
                         pinned_per_layer={la: len(v) for la, v in pinned.items()}))


def _host_fits(plan: Plan) -> bool:
    return plan.host_available is None or plan.host_total <= plan.host_available - plan.host_margin


def host_short(req: PlanRequest) -> bool:
    """Whether the host cannot hold every expert beside the process (so some must be pinned)."""
    _, host_rows, _ = rooms(replace(req, gpu_budget=req.gpu_budget or 0), 0)
    return host_rows < len(req.cfg.moe_layers) * req.cfg.num_experts


def predict_split(plan: Plan, trace, policy: str, phys) -> dict:
    """Hit rate (and its pinned share) and ms per token the trace predicts for the plan's split, each
    traced layer through its MoE layer's slots and pinned set (global ids: one process); the model's
    other layers take the mean traced layer's rate through phys (traces/simulate.Physics)."""
    from moetier.traces.split_plan import predict

    e, k = trace.num_experts, trace.top_k
    slots = plan.slots_per_layer
    layers = sorted(slots)  # the i-th traced layer stands for layers[i] (as in covers; cycled if fewer)
    got = []
    for i in range(len(trace.layers)):
        layer = layers[i % len(layers)]
        got.append(predict(trace.layer_ids(i), e, slots[layer], tuple(plan.pinned_experts.get(layer, ())), policy, k))
    looked = sum(c.lookups for c in got) or 1
    tokens = sum(c.steps for c in got) or 1
    misses, over = sum(c.misses for c in got) / tokens, sum(c.overflow for c in got) / tokens
    return {"hit_rate": sum(c.hits for c in got) / looked, "pinned_rate": sum(c.pinned for c in got) / looked,
            "ms_per_token": phys.ms_per_token(k, misses, over)}
