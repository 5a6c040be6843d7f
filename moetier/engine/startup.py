"""Plan, then load: the one start of an engine from a checkpoint, shared by `generate`, `serve` and
`bench batch`. The memory plan is made (and refused, PlanRefused, before anything is allocated) first;
the engine is then loaded with the expert options the plan chose (config.experts) and audited against it.

    llm, plan = plan_then_load(model_dir, dtype, device, config, gpu_memory, host_memory,
                               on_plan=print_table, on_audit=print)
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from moetier.engine.config import EngineConfig
from moetier.engine.llm import LLM
from moetier.plan.memory import Plan
from moetier.progress import ByteBar


def plan_then_load(model_dir: Path, dtype: str, device: str, config: EngineConfig,
                   gpu_memory: str | None = None, host_memory: str | None = None,
                   on_plan: Callable[[Plan, object], None] | None = None,
                   on_audit: Callable[[str], None] | None = None) -> tuple[LLM, Plan]:
    """-> (the loaded LLM, its plan). on_plan(plan, rank_plans) is called before loading (rank_plans:
    every rank's share under --tp/--ep, None for one process); on_audit gets the audit's text."""
    from moetier.plan.preflight import preflight

    # several ranks: one rank's plan, every node checked once the ranks have started (plan/nodes.py)
    plan, config, rank_plans = preflight(model_dir, dtype, device, config, gpu_memory, host_memory)
    if on_plan is not None:
        on_plan(plan, rank_plans)
    with ByteBar("loading") as bar:
        llm = LLM(model_dir, dtype=dtype, device=device, config=config, plan=plan, progress=bar,
                  on_audit=on_audit, rank_plans=rank_plans)
    return llm, plan
