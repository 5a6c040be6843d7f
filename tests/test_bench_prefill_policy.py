"""`moetier bench prefill` rows per prefill cache policy, on the CPU (tiny random model; the timings
that matter come from the H200): each slots row runs from the same warm cache, reports the decode
after its prefill (tok/s, hit rate), and a refresh row fills rows the bypass row does not. Also the
options, and `bench chunk --prefill-cache`."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from moetier.bench import chunk, prefill
from moetier.checkpoint.random_bed import random_bed, use_backend
from moetier.cli.app import app
from moetier.engine.config import EngineConfig
from moetier.engine.llm import LLM
from moetier.presets import preset
from moetier.sampling_params import SamplingParams


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
