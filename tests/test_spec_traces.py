"""Routing traces while speculating (traces/hooks.py, docs/speculative.md "Traces"): a replayed trace
routes each position of a sequence once, as a plain replay does, and a recording writes each verified
position once (the target layers' columns equal a plain recording's; the MTP layer's column is its
catch-up). The engine helpers are tests/test_spec_engine.py's."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from moetier.checkpoint.writer import make_checkpoint
from moetier.engine.llm import LLM
from tests.test_spec_engine import CODE, MTP, NGRAM, greedy, mtp_ckpt, oracle, tokens, workload  # noqa: F401


def test_a_replayed_trace_routes_each_position_once_while_speculating():
    """Replaying a trace, the rows of rejected drafts are routed again by the steps that make their
    positions valid: each position takes the trace row a run without speculation gives it, so the
    greedy tokens and the cursor's end equal the plain replay's (one sequence; a spoiled draft forces
    rejections)."""
    trace = Path(__file__).parents[1] / "data" / "traces" / "tiny-stdlib-heldout.mtrace"
    plain = LLM(None, device="cpu", dtype="float32", replay_trace=trace)
    p = plain.encode(CODE[0])
    want = tokens(plain.generate([p], greedy(24)))
    llm = LLM(None, device="cpu", dtype="float32", replay_trace=trace, speculative_config=NGRAM)
    seen = oracle(llm, {tuple(p): want[0]}, {tuple(p): 2})
    assert tokens(llm.generate([p], greedy(24))) == want
    assert int(llm.replayer.cursor) == int(plain.replayer.cursor) == len(p) + 23
    assert any(0 < a < 3 for a in seen) and 3 in seen  # a partial rejection, and runs kept whole


def _stream_rows(path, layers: int) -> dict[int, np.ndarray]:
    """A recorded trace's ids [n, layers, k] per stream, in its token order."""
    from moetier.traces.format import read_trace

    t = read_trace(path)
    return {int(s): t.ids[t.seq == s, :layers] for s in np.unique(t.seq)}


@pytest.mark.parametrize("ckpt, method", [("dsv3", "ngram"), ("dsv3", "mtp"), ("glm5-next", "ngram")])
def test_a_recorded_trace_writes_each_verified_position_once(mtp_ckpt, tmp_path, ckpt, method):
    """Recording while speculating: rejected drafts' rows are left out (and, with recurrent state, the
    rows a rollback recomputes are written once), so the target layers' columns equal a plain
    recording's; the MTP layer's column is its catch-up at the same positions, whatever was accepted."""
    path = mtp_ckpt if ckpt == "dsv3" else make_checkpoint(tmp_path / "ckpt", "tiny-glm5-next", seed=2,
                                                           dtype="float32")
    plain = LLM(path, device="cpu", dtype="float32", record_trace=tmp_path / "plain.mtrace")
    prompts, params = workload(plain.cfg.vocab_size, n=4, seed=5)
    want = tokens(plain.generate(prompts, params))
    plain.close()
    layers = len(plain.cfg.moe_layers)
    base = _stream_rows(tmp_path / "plain.mtrace", layers)
    keys = [tuple(p) for p in prompts]
    mtp_cols = []
    for spoil in (1, 2):
        llm = LLM(path, device="cpu", dtype="float32", speculative_config=MTP if method == "mtp" else NGRAM,
                  record_trace=tmp_path / f"spec{spoil}.mtrace")
        seen = oracle(llm, dict(zip(keys, want)), {k: spoil + 3 * i for i, k in enumerate(keys)})
        assert tokens(llm.generate(prompts, params)) == want and 0 < max(seen)
        llm.close()
        got = _stream_rows(tmp_path / f"spec{spoil}.mtrace", layers + 1)
        assert got.keys() == base.keys()
        for s, rows in base.items():
            assert np.array_equal(got[s][:, :layers], rows), f"stream {s}"
        if method == "mtp":
            mtp_cols.append({s: rows[:, layers] for s, rows in got.items()})
        else:
            assert all(rows.shape[1] == layers for rows in got.values())  # no MTP layer loaded, none traced
    if method == "mtp":
        assert all(np.array_equal(mtp_cols[0][s], mtp_cols[1][s]) for s in base)
