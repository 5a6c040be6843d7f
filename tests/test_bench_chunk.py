"""`moetier bench chunk` on the CPU: the rows' logic end to end on a tiny random model (the timings
that matter need CUDA: bench/results/ holds the H200 runs), and its option checks."""

from __future__ import annotations

from typer.testing import CliRunner

from moetier.bench import chunk
from moetier.checkpoint.random_bed import random_bed, use_backend
from moetier.cli.app import app
from moetier.engine.config import EngineConfig
from moetier.engine.llm import LLM
from moetier.presets import preset
from moetier.sampling_params import SamplingParams


def test_rows_report_ttft_and_the_decodes_latency_per_chunk(tmp_path):
    bed = random_bed(preset("tiny"), seed=0, device="cpu")
    trace = tmp_path / "t.mtrace"
    use_backend(bed, "resident")
    rec = LLM.from_model(bed.model, bed.tokenizer, EngineConfig(record_trace=trace))
    rec.generate([list(range(40))], SamplingParams(max_tokens=30, ignore_eos=True))
    rec.close()
    args = {"policy": "lfru", "decode_tokens": 64, "seed": 0, "before": 3}
    data = chunk.run(bed, str(trace), [("resident", 1.0), ("slots", 0.5)], [96, 200], 300, 2, args)
    rows = data["rows"]
    assert [(r["backend"], r["chunk"]) for r in rows] == [("resident", 96), ("resident", 200), ("slots", 96),
                                                           ("slots", 200)]
    for r in rows:
        # the decodes take 2 of each step's tokens: 300 prompt tokens need ceil(300 / (chunk - 2)) steps
        assert r["steps"] == -(-300 // (r["chunk"] - 2)), r
        assert r["ttft_ms"] > 0 and r["itl_alone_ms"] > 0 and r["itl_during_max_ms"] >= r["itl_during_median_ms"]
        assert r["stalled_ms"] <= r["ttft_ms"] + 1e-6
    assert "chunk   200" in chunk.table(rows)


def test_bench_chunk_checks_options_first():
    r = CliRunner().invoke(app, ["bench", "chunk", "--chunks", "512,x"])
    assert r.exit_code == 2 and "--chunks" in r.stderr
    r = CliRunner().invoke(app, ["bench", "chunk", "--chunks", "32"])
    assert r.exit_code == 2 and "--chunks" in r.stderr
    r = CliRunner().invoke(app, ["bench", "chunk", "--backends", "uva"])
    assert r.exit_code == 2 and "resident, slots" in r.stderr
