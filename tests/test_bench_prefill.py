"""`moetier bench prefill` on the CPU: the link-row count from logged routing, the table and the plot
(the timed rows need CUDA: tests/test_gpu.py and the H200 runs in bench/results/); the rows per
prefill cache policy on a tiny random model (each slots row from the same warm cache, with the decode
after its prefill: tok/s, hit rate), the options, and `bench chunk --prefill-cache`."""

from __future__ import annotations

import numpy as np
import pytest
from typer.testing import CliRunner

from moetier.bench import chunk, prefill
from moetier.checkpoint.random_bed import random_bed, use_backend
from moetier.cli.app import app
from moetier.engine.config import EngineConfig
from moetier.experts.kernels.gemm_config import GemmConfig
from moetier.engine.llm import LLM
from moetier.presets import preset
from moetier.sampling_params import SamplingParams


class Log:
    def __init__(self, steps):
        self.ids = steps


def test_link_rows_count_a_chunk_per_block_of_pairs_of_each_expert_not_in_hbm():
    # one step, one layer: expert 0 has 130 pairs (3 chunks of 64), expert 1 has 2, expert 2 has 64
    ids = np.array([0] * 130 + [1] * 2 + [2] * 64).reshape(-1, 2)
    in_hbm = {5: np.array([False, True, False, True])}
    link, hbm = prefill.step_rows(Log([{5: ids}]), in_hbm, GemmConfig(large_block_m=64))
    assert (link, hbm) == (3 + 1, 1)
    # a step dense in pairs reads in its own chunks: 130 pairs are 2 chunks of 128
    dense = GemmConfig(large_block_m=64, large_dense_pairs=ids.size, large_dense_block_m=128)
    assert prefill.step_rows(Log([{5: ids}]), in_hbm, dense) == (2 + 1, 1)


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


@pytest.fixture(scope="module")
def bed_and_trace(tmp_path_factory):
    bed = random_bed(preset("tiny"), seed=0, device="cpu")
    trace = tmp_path_factory.mktemp("trace") / "t.mtrace"
    use_backend(bed, "resident")
    rec = LLM.from_model(bed.model, bed.tokenizer, EngineConfig(record_trace=trace))
    rec.generate([list(range(40))], SamplingParams(max_tokens=20, ignore_eos=True))  # replays wrap around
    rec.close()
    return bed, str(trace)


def test_rows_per_policy_with_the_decode_after_the_prefill(bed_and_trace):
    bed, trace = bed_and_trace
    args = {"chunk": 128, "reps": 1, "policy": "lfru", "decode_tokens": 16, "seed": 0, "decode_steps": 6,
            "prefill_cache": ["bypass", "refresh"]}
    bw = {"hbm_GBps": 100.0, "link_GBps": 10.0, "tflops": 1.0}
    rows = {}
    for policy in ("bypass", "refresh"):
        rows[policy] = prefill.bench_backend(bed, trace, "slots", 0.25, [96], [1], args, bw, policy)[0]
    uva = prefill.bench_backend(bed, trace, "uva", 0.0, [96], [1], args, bw)[0]
    for policy, r in rows.items():
        assert r["prefill_cache"] == policy and r["steps"] == 1 and r["decode_steps"] == 6
        assert r["decode_tok_s"] > 0 and 0 <= r["decode_hit_rate"] <= 1
        assert r["link_bytes"] > 0
    assert uva["prefill_cache"] is None and uva["decode_hit_rate"] is None
    text = prefill.table([*rows.values(), uva])
    assert "refresh" in text and "then decode" in text
    # the refreshed row reads what it filled once, and the chunk's most used experts from HBM after
    assert rows["refresh"]["link_bytes"] != rows["bypass"]["link_bytes"]


def test_bench_prefill_checks_the_policy_option():
    r = CliRunner().invoke(app, ["bench", "prefill", "--prefill-cache", "bypass,sometimes"])
    assert r.exit_code == 2 and "--prefill-cache 'sometimes'" in r.stderr
    r = CliRunner().invoke(app, ["bench", "prefill", "--decode-steps", "-1"])
    assert r.exit_code == 2 and "--decode-steps" in r.stderr


def test_bench_chunk_rows_carry_the_policy(bed_and_trace):
    bed, trace = bed_and_trace
    args = {"policy": "lfru", "decode_tokens": 16, "seed": 0, "before": 2, "prefill_cache": "refresh"}
    data = chunk.run(bed, trace, [("slots", 0.5)], [64], 150, 1, args)
    (row,) = data["rows"]
    assert row["prefill_cache"] == "refresh" and row["steps"] == -(-150 // 63)
    assert "refresh chunk    64" in chunk.table([row])
    r = CliRunner().invoke(app, ["bench", "chunk", "--prefill-cache", "stream"])
    assert r.exit_code == 2 and "bypass or refresh" in r.stderr


def test_rows_per_stream_mode_count_each_missing_row_once_in_the_ring(bed_and_trace):
    bed, trace = bed_and_trace
    args = {"chunk": 128, "reps": 1, "policy": "lfru", "decode_tokens": 16, "seed": 0, "decode_steps": 0,
            "prefill_cache": ["bypass"], "prefill_stream": ["uva", "ring"], "ring_group": 3, "ring_depth": 2}
    bw = {"hbm_GBps": 100.0, "link_GBps": 10.0, "tflops": 1.0}
    rows = {s: prefill.bench_backend(bed, trace, "slots", 0.25, [96], [1], args, bw, "bypass", s)[0]
            for s in ("uva", "ring")}
    assert rows["ring"]["prefill_stream"] == "ring" and rows["ring"]["ring"] == [3, 2]
    assert rows["uva"]["prefill_stream"] == "uva" and "ring" not in rows["uva"]
    # the ring copies each missing row once per step; uva reads it once per chunk of its pairs (>= once)
    assert 0 < rows["ring"]["link_bytes"] <= rows["uva"]["link_bytes"]
    assert rows["ring"]["link_bound_tok_s"] >= rows["uva"]["link_bound_tok_s"]
    assert "ring3x2" in prefill.table(list(rows.values()))
    r = CliRunner().invoke(app, ["bench", "prefill", "--prefill-stream", "uva,pipe"])
    assert r.exit_code == 2 and "--prefill-stream 'pipe'" in r.stderr
    # the ring's geometry is a tuning constant (experts/prefill/ring.py), no user option
    r = CliRunner().invoke(app, ["bench", "prefill", "--ring-depth", "3"])
    assert r.exit_code == 2 and "No such option" in r.stderr and "--ring-depth" in r.stderr


def test_rows_are_checked_against_the_first_slots_row_without_resident(bed_and_trace, monkeypatch):
    bed, trace = bed_and_trace
    args = {"chunk": 128, "reps": 2, "policy": "lfru", "decode_tokens": 16, "seed": 0, "decode_steps": 0,
            "prefill_cache": ["bypass", "refresh"], "prefill_stream": ["uva"]}
    bw = {"hbm_GBps": 100.0, "link_GBps": 10.0, "tflops": 1.0}
    real = prefill.prefill_checked

    def broken(llm, prompts):  # the uva rows' first prompt reads a wrong logit
        tokens, logits = real(llm, prompts)
        if llm.model.moe_blocks()[0].experts.__class__.__name__ == "UvaExperts":
            logits[0][0, 3] += 1e3
            tokens[0] = [3]
        return tokens, logits

    monkeypatch.setattr(prefill, "prefill_checked", broken)
    data = prefill.run(bed, trace, [0.25], [96], [1, 2], ["slots", "uva"], args, {}, bw=bw)
    checks = data["output_checks"]
    assert checks["slots@0.25/bypass/uva/pp96x1"] == "reference"
    assert data["output_references"]["bf16/96/2"] == "slots@0.25/bypass/uva/pp96x2"
    assert checks["slots@0.25/refresh/uva/pp96x2"] == "exact"
    assert checks["uva/pp96x1"].startswith("MISMATCH") and checks["uva/pp96x2"].startswith("MISMATCH")
    text = prefill.table(data["rows"])
    assert text.count("<<< OUTPUTS DIFFER") == 2
    for r in data["rows"]:  # the median run, and the spread of the runs
        assert r["runs"] == len(r["runs_s"]) >= 1 and r["tok_s_min"] <= r["tok_s"] <= r["tok_s_max"]
        assert "tokens" not in r and "logits" not in r
    assert f"over {data['rows'][0]['runs']})" in text


def test_median_of_runs_is_the_headline_with_its_spread(tmp_path, capsys):
    import json
    import sys

    sys.path.insert(0, str(__import__("pathlib").Path(__file__).parents[1] / "scripts"))
    import median_of_runs

    for i, t in enumerate((50.0, 70.0, 60.0)):
        rec = {"benchmark": "prefill", "rows": [{**row("resident", None, 512, 1, t), "check": {"verdict": "reference"}}]}
        (tmp_path / f"run{i}.json").write_text(json.dumps(rec))
    assert median_of_runs.main([str(p) for p in sorted(tmp_path.glob("run*.json"))]) == 0
    out = capsys.readouterr().out
    assert "resident/pp512x1: median 60.0 tok/s (50.0 to 70.0 over 3 runs" in out and "checks: reference" in out
    assert median_of_runs.main([str(tmp_path / "run0.json"), "--row", "uva/pp1x1"]) == 2
