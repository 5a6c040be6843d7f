"""Every rank's expert statistics (LLM.metrics()["expert_stats_per_rank"], a RankQuery between steps:
engine/step.py, dist/executor.py) with 2 gloo ranks on the CPU, 4 slots per layer so that decode steps
miss and overflow.

What holds against one process on the same tokens (the greedy tokens of these layouts equal one
process's, tests/test_tp.py): under EP each (token, expert) pair is looked up on its owning rank only,
so the ranks' lookups (hits + misses + overflow) sum to one process's while each rank's own counts
differ; under TP with the columns split every rank looks up every pair in a cache of the same slot
count, so each rank's counters equal one process's. A worker that answered with rank 0's statistics,
or none, fails both."""

from __future__ import annotations

import os
import signal
import time

import pytest

from moetier.checkpoint.writer import make_checkpoint
from moetier.engine.llm import LLM
from moetier.engine.step import RankQuery
from moetier.errors import MoetierError
from moetier.experts.placement import ExpertOptions
from tests.test_tp import ENGINE, GREEDY, PROMPTS

SLOTS = ExpertOptions(backend="slots", slots=4)


def lookups(stats: dict) -> int:
    return stats["hits"] + stats["misses"] + stats["overflow"]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("rankstats") / "tiny", "tiny", seed=1, dtype="float32")


@pytest.fixture(scope="module")
def one(ckpt):
    """One process's tokens and expert statistics after the prompts."""
    llm = LLM(ckpt, experts=SLOTS, **ENGINE)
    tokens = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]
    m = llm.metrics()
    assert m["expert_stats_per_rank"] == [m["expert_stats"]]  # one process: a list of one
    assert m["expert_stats"]["misses"] > 0 and m["expert_stats"]["overflow"] > 0  # the slots are short
    return tokens, m["expert_stats"]


def run_parallel(ckpt, one, **layout) -> tuple[dict, list[dict]]:
    """Generate the prompts on a 2-rank engine -> (metrics, metrics after close)."""
    llm = LLM(ckpt, experts=SLOTS, **ENGINE, **layout)
    try:
        assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)] == one[0]
        m = llm.metrics()
        assert llm.metrics()["expert_stats_per_rank"] == m["expert_stats_per_rank"]  # asking runs no step
    finally:
        llm.close()
    return m, llm.metrics()["expert_stats_per_rank"]  # after close: the ranks' statistics taken at close


@pytest.mark.parametrize("records", ["world", "gloo", "pipe"])
def test_ep_ranks_count_their_own_experts(ckpt, one, records):
    m, closed = run_parallel(ckpt, one, expert_parallel_size=2, step_record_group=records)
    per = m["expert_stats_per_rank"]
    assert len(per) == 2 and per[0] == m["expert_stats"] and closed == per
    assert per[0] != per[1]  # different experts, different slot caches
    assert lookups(per[0]) > 0 and lookups(per[1]) > 0
    assert lookups(per[0]) + lookups(per[1]) == lookups(one[1])  # each pair on its owner only
    assert per[0]["steps"] == per[1]["steps"] == one[1]["steps"]  # every rank runs every MoE layer-step


def test_tp_columns_ranks_each_see_every_pair(ckpt, one):
    m, _ = run_parallel(ckpt, one, tensor_parallel_size=2)
    per = m["expert_stats_per_rank"]
    assert len(per) == 2 and per[0] == m["expert_stats"]
    assert per[0] == per[1] == one[1]  # the same ids into caches of the same slot count


def test_a_dead_worker_fails_metrics_loudly(ckpt):
    llm = LLM(ckpt, experts=SLOTS, expert_parallel_size=2, **ENGINE)
    try:
        llm.generate([PROMPTS[1]], GREEDY)
        pid = llm._workers.processes[0].pid
        os.kill(pid, signal.SIGKILL)
        llm._workers.processes[0].join(timeout=10.0)  # the kill has taken effect (tests/test_tp.py says why)
        t0 = time.monotonic()
        with pytest.raises(MoetierError, match=rf"rank 1 \(pid {pid}, exit code -9\) died"):
            llm.metrics()
        assert time.monotonic() - t0 < 5.0
        with pytest.raises(MoetierError, match="failed before it closed"):
            llm.metrics()
    finally:
        llm.close()  # the workers are gone: close() still returns


def test_a_query_names_what_it_may_ask():
    with pytest.raises(MoetierError, match="RankQuery\\('traces'\\): choose one of expert_stats"):
        RankQuery("traces")
