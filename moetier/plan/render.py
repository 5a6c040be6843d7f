"""The plan as one screen of text (a rich table) and as JSON (bytes, with the unit named)."""

from __future__ import annotations

import io
import json

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from moetier.experts.registry import backend_kind
from moetier.plan.memory import Plan
from moetier.plan.units import gb, gib

WIDTH = 116


def _rows(t: Table, items, total: int, budget: int | None, budget_name: str, margin: int | None = None) -> None:
    for i in items:
        t.add_row(escape(i.name), gib(i.bytes), gb(i.bytes), escape(i.note))
    t.add_section()
    t.add_row("total", gib(total), gb(total), "", style="bold")
    if budget is not None:
        t.add_row(budget_name, gib(budget), gb(budget), "")
        head = budget - total
        note = "" if margin is None else f"{gib(margin)} must stay free"
        t.add_row("headroom", gib(head), gb(head), note, style="green" if head - (margin or 0) >= 0 else "red bold")


def table(plan: Plan) -> str:
    """Both tables and the notes, rendered to plain text of at most WIDTH columns."""
    buf = io.StringIO()
    con = Console(file=buf, width=WIDTH, force_terminal=False, color_system=None)
    q = plan.request
    slots = plan.slots_per_layer
    placement = plan.backend if not backend_kind(plan.backend).cached else (
        f"{plan.backend} {min(slots.values())}..{max(slots.values())} per layer" if slots else plan.backend)
    pins = plan.pinned_per_layer
    if pins:
        placement += f" + pinned {min(pins.get(la, 0) for la in slots)}..{max(pins.values())} per layer"
    con.print(f"memory plan: {q['model_type']}, {q['layers']} layers ({q['moe_layers']} MoE), {q['dtype']}, "
              f"experts {'FP8 ' if q.get('experts_quant') == 'fp8' else ''}{placement}; KV of {q['kv_tokens']:,} tokens "
              f"({q['max_num_seqs']} requests, each up to {q['max_model_len']:,}), "
              f"steps of {q['max_num_tokens']} tokens on {q['device']}", markup=False)
    if plan.device:
        t = Table(title=f"device ({q['gpu_budget_source'] or 'no budget given'})", title_justify="left",
                  expand=False)
        for c in ("resident", "GiB", "GB", "how counted"):
            t.add_column(c, justify="right" if c in ("GiB", "GB") else "left", overflow="fold")
        _rows(t, plan.device, plan.device_total, plan.gpu_budget, "budget")
        con.print(t)
    t = Table(title=f"host ({q['host_source'] or 'no budget given'})", title_justify="left")
    for c in ("resident", "GiB", "GB", "how counted"):
        t.add_column(c, justify="right" if c in ("GiB", "GB") else "left", overflow="fold")
    _rows(t, plan.host, plan.host_total, plan.host_available, "available", plan.host_margin
          if plan.host_available is not None else None)
    con.print(t)
    lock = "unlimited" if plan.memlock is None else gib(plan.memlock)
    con.print(f"pinned host memory: {gib(plan.pinned)} ({gb(plan.pinned)}), locked-memory limit {lock}")
    if plan.prediction:
        p = plan.prediction
        kinds = (f" (pinned {p['pinned_rate']:.1%}, slots {p['hit_rate'] - p['pinned_rate']:.1%})"
                 if p.get("pinned_rate") is not None else "")
        con.print(f"trace {p['trace']}: predicted hit rate {p['hit_rate']:.1%}{kinds}, {p['tok_per_s']:.1f} tok/s at "
                  f"batch 1 ({p['physics']})")
    for n in plan.notes:
        con.print(n, markup=False)
    return buf.getvalue().rstrip()


def to_json(plan: Plan) -> str:
    return json.dumps(plan.as_dict(), indent=1)
