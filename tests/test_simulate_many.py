"""simulate_many (all the caches of a table or a plot in one numpy pass) against simulate (one cache in
plain Python, held to the engine's slot cache by test_traces.py): equal counts, job by job."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from moetier.traces.simulate import POLICIES, simulate, simulate_many
from moetier.traces.synth import SynthParams, synthesize

ROOT = Path(__file__).parents[1]


@pytest.mark.parametrize("experts,top_k,layers,tokens,skew", [
    (40, 4, 2, 700, 1.1),  # LFRU epochs every 16 lifetimes: rebuilds mid-run
    (16, 8, 1, 400, 0.5),  # slots below top_k: overflow
    (64, 1, 2, 300, 1.5),  # one expert a token
    (128, 8, 1, 600, 1.47),  # the qwen3-30b-like shape
])
def test_every_job_equals_simulate(experts, top_k, layers, tokens, skew):
    ids = synthesize(SynthParams(experts, top_k, layers, tokens=tokens, skew=skew, reuse=0.3, seed=experts))
    sizes = sorted({1, 2, top_k - 1, top_k, top_k + 1, experts // 4, experts // 2, experts - 1, experts} - {0})
    jobs = [(i, s, pol) for pol in POLICIES for s in sizes for i in range(layers)]
    got = simulate_many(ids, jobs, experts, top_k)
    for (i, s, pol), c in zip(jobs, got):
        want = simulate(ids[:, i], experts, s, pol, top_k)
        assert (c.hits, c.misses, c.overflow, c.steps) == (want.hits, want.misses, want.overflow, want.steps), \
            (pol, i, s)


def test_repeated_ids_take_the_reference():
    ids = np.array([[[1, 1]], [[2, 3]], [[1, 2]]])  # token 0 names expert 1 twice
    got = simulate_many(ids, [(0, 2, "lru"), (0, 2, "belady")], 4, 2)
    assert [(c.hits, c.misses) for c in got] == [(simulate(ids[:, 0], 4, 2, p, 2).hits,
                                                   simulate(ids[:, 0], 4, 2, p, 2).misses) for p in ("lru", "belady")]


def test_curves_reproduce_the_committed_report():
    """docs/traces.md's curves (data/traces/report.json, made by the per-cache loop) come out bit-equal."""
    from moetier.traces.format import read_trace
    from moetier.traces.report import curves

    want = json.loads((ROOT / "data/traces/report.json").read_text())["tiny-stdlib-heldout"]
    t = read_trace(ROOT / "data/traces/tiny-stdlib-heldout.mtrace")
    t.ids = t.ids[: want["tokens"]]
    seen = []
    grid, hit = curves(t, list(POLICIES), progress=seen.append)
    assert grid == want["grid"] and hit == want["curves"]
    assert seen[-1] == want["tokens"] and seen == sorted(seen)
