"""`moetier bench prefill` on the CPU: the link-row count from logged routing, the table and the plot
(the timed rows need CUDA: tests/test_gpu.py and the H200 runs in bench/results/)."""

from __future__ import annotations

import numpy as np
import pytest

from moetier.bench import prefill


class Log:
    def __init__(self, steps):
        self.ids = steps


def test_link_rows_count_a_chunk_per_block_of_pairs_of_each_expert_not_in_hbm():
    # one step, one layer: expert 0 has 130 pairs (3 chunks of 64), expert 1 has 2, expert 2 has 64
    ids = np.array([0] * 130 + [1] * 2 + [2] * 64).reshape(-1, 2)
    in_hbm = {5: np.array([False, True, False, True])}
    link, hbm = prefill.step_rows(Log([{5: ids}]), in_hbm, block_m=64)
    assert (link, hbm) == (3 + 1, 1)


def row(backend, budget, n, b, tok_s):
    return {"backend": backend, "budget": budget, "prompt_len": n, "batch": b, "tok_s": tok_s, "ms": 1e3 * n * b / tok_s,
            "link_bytes": 1e9 if backend != "resident" else 0.0, "link_bound_tok_s": None if backend == "resident"
            else 2 * tok_s, "of_link_bound": None if backend == "resident" else 0.5, "work_bound_tok_s": 1e6}


def test_table_and_plot(tmp_path):
    rows = [row(bk, bu, n, b, t * n) for bk, bu, t in (("resident", None, 50.0), ("slots", 0.5, 5.0), ("uva", None, 1.0))
            for n in (128, 512) for b in (1, 4)]
    text = prefill.table(rows)
    assert "pp512" in text and "50.0% of it" in text and "link bound - tok/s" in text
    pytest.importorskip("matplotlib")
    cfg = {"layers": 2, "hidden": 64, "experts": 32, "top_k": 4}
    prefill.plot({"rows": rows, "config": cfg}, str(tmp_path / "p.png"))
    assert (tmp_path / "p.png").stat().st_size > 10_000
