"""What an engine reports about itself: the scheduler's queues and KV pages, the prefix cache and its
host tier, step counts and times, every rank's expert statistics, and the speculation counters.
LLM.metrics() returns it; the server's /metrics (server/metrics.py) and `moetier generate --json`
read it.

Expert statistics come per rank, rank 0's first, and are never summed: under EP each (token, expert)
pair is counted on its owner only, so the sum would be the model's lookups, but under TP every rank
looks up every pair (over its columns of it under the columns split) and a sum would count each pair
once per rank.
"""

from __future__ import annotations

from moetier.engine.step import RankQuery
from moetier.errors import MoetierError

STEP_COUNTERS = ("steps", "large_steps", "large_step_tokens", "step_seconds", "large_step_seconds")


def last_stats(llm) -> list[dict] | None:
    """Every rank's expert statistics as a parallel engine closes, for metrics() after close(); None
    when a worker is already dead: close() never raises."""
    if llm._workers.dead():
        return None
    try:
        return llm.runner.ask(RankQuery("expert_stats"))
    except MoetierError:
        return None


def expert_stats_per_rank(llm) -> list[dict]:
    """Each rank's expert statistics (CausalLM.expert_stats over its own MoE layers), in rank order: one
    process gives a list of one. A parallel engine asks its workers between steps (a query on the step
    records' channel: engine/step.RankQuery); a dead worker raises MoetierError naming it. After
    close(), the ranks' statistics taken at close."""
    if llm._workers is not None and llm._workers.stopped:
        closed = getattr(llm, "_closed_stats", None)
        if closed is None:
            raise MoetierError("this parallel engine failed before it closed: its workers' expert statistics "
                               "are gone; start a new LLM")
        return closed
    return llm.runner.ask(RankQuery("expert_stats"))


def engine_metrics(llm) -> dict:
    """expert_stats: rank 0's (compatibility); expert_stats_per_rank: every rank's, rank 0's first."""
    s = llm.scheduler
    per_rank = expert_stats_per_rank(llm)
    stats = per_rank[0]
    looked = stats["hits"] + stats["misses"] + stats["overflow"] + stats.get("host", 0)
    return {
        "running": len(s.running),
        "waiting": len(s.waiting),
        # pages held by requests; cached pages no request holds are free to take (as vLLM counts)
        "kv_pages_used": s.cache.num_in_use,
        "kv_pages_cached": s.cache.num_evictable,
        "kv_pages_total": s.pages.num_pages,
        "kv_usage": s.cache.num_in_use / s.pages.num_pages,
        **s.cache.metrics_dict(llm.kv_page_bytes),
        **{k: getattr(llm, k) for k in STEP_COUNTERS},
        "expert_hit_rate": stats["hits"] / looked if looked else None,
        "expert_stats": stats,
        "expert_stats_per_rank": per_rank,
        # overlapped scheduling (engine/overlap.py): steps launched before the previous step's tokens were
        # read back; absent without it
        **({} if llm.overlap is None else {"steps_launched_ahead": llm.overlap.launched_ahead}),
        # speculative decoding, vLLM's names (engine/speculation.py); absent without it
        **({} if s.spec is None else s.spec.counters.as_dict()),
    }
