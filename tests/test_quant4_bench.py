"""4-bit experts in the plan and the benchmarks (issue 30): `moetier plan --preset ... --dtype nvfp4`
counts the 4-bit rows exactly, random beds take nvfp4 and int4, and the decode benchmark runs their
rows beside bf16 and FP8 in one record (on the CPU: tiny shape, float32 compute)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from moetier import presets
from moetier.quant.quant_config import example


@pytest.mark.parametrize("quant,row", [("nvfp4", 2_654_336), ("int4", 2_433_024), ("int4-g32", 2_654_208)])
def test_memory_plan_counts_4bit_rows_exactly(quant, row):
    from moetier.plan import residents
    from moetier.cli.plan import quantized_preset
    from moetier.plan.memory import PlanRequest, count

    bf = presets.preset("qwen3-30b-a3b", dtype="bfloat16")
    q, dtype = quantized_preset(bf, quant, False)
    assert dtype == "bfloat16" and q == dataclasses.replace(bf, quant=quant, quant_config=example(quant))
    assert residents.row_bytes(q.moe_shape, torch.bfloat16) == row
    plan = count(PlanRequest(q, torch.bfloat16, "cuda", backend="slots",
                             slots_per_layer={layer: 64 for layer in q.moe_layers}))
    host = next(i for i in plan.host if i.name.startswith("expert store"))
    assert f"{48 * 128 * row:,} B" in host.note


def test_bench_decode_runs_4bit_rows_beside_fp8_on_cpu(tmp_path):
    from moetier.bench import decode
    from moetier.cli.bench_common import parse_dtypes
    from moetier.checkpoint.random_bed import random_bed
    from moetier.traces.format import write_trace
    from moetier.traces.synth import SynthParams, meta_of, synthesize

    assert parse_dtypes("bf16,fp8,nvfp4,int4") == ["bf16", "fp8", "nvfp4", "int4"]
    cfg = presets.preset("tiny")
    trace = tmp_path / "t.mtrace"
    p = SynthParams(experts=cfg.num_experts, top_k=cfg.top_k, layers=cfg.num_layers, tokens=256, skew=1.2, seed=3)
    write_trace(trace, synthesize(p), meta_of(p))
    dtypes = ("fp8", "nvfp4", "int4")
    beds = {d: random_bed(cfg, seed=1, device="cpu", dtype=torch.float32, quant=d) for d in dtypes}
    args = {"tokens": 4, "warmup": 2, "prompt_len": 5, "hf_tokens": 2, "policy": "lfru", "decode_tokens": 16, "seed": 0}
    data = decode.run(cfg, str(trace), [0.5], [1], ["resident", "uva", "slots"], args,
                      bw={"hbm_GBps": 100.0, "link_GBps": 10.0}, dtypes=dtypes, beds=beds)
    rows = data["rows"]
    assert [(r["dtype"], r["backend"]) for r in rows] == [(d, b) for d in dtypes for b in ("resident", "uva", "slots")]
    eq = data["greedy_tokens_equal_to_resident"]
    assert {"uva/b1/nvfp4", "slots@0.5/b1/int4"} <= set(eq) and all(eq.values())
    lay = beds["nvfp4"].cfg.moe_shape.layout
    assert data["config"]["by_dtype"]["nvfp4"]["row_bytes"] == lay.numel == get_row("nvfp4", lay)
    uva = {r["dtype"]: r for r in rows if r["backend"] == "uva"}
    assert uva["nvfp4"]["link_bytes_per_step"] < 0.6 * uva["fp8"]["link_bytes_per_step"]
    assert uva["int4"]["link_bytes_per_step"] < 0.6 * uva["fp8"]["link_bytes_per_step"]
    rows4 = next(iter(beds["int4"].host.values()))
    assert rows4.dtype == torch.uint8 and beds["int4"].cfg.moe_shape.layout.part(rows4, "down_scale").ne(0).any()


def get_row(quant, lay) -> int:
    from moetier.quant.registry import get

    return get(quant).row_bytes(lay.hidden, lay.inter)


def test_h200_summary_judges_the_targets_from_the_records(tmp_path):
    """scripts/quant4_summary.py on records shaped as bench decode / prefill write them: ratios taken
    side by side, a missing record said so, a differing row's check a failure."""
    import json

    from scripts.quant4_summary import main

    rows = [{"backend": b, "budget": bu, "batch": n, "dtype": d, "tok_s": t} for b, bu, n, d, t in (
        ("slots", 0.5, 1, "bf16", 400.0), ("slots", 0.5, 1, "fp8", 700.0), ("slots", 0.5, 1, "nvfp4", 1000.0),
        ("slots", 0.5, 8, "fp8", 1000.0), ("slots", 0.5, 8, "nvfp4", 1400.0),
        ("resident", None, 1, "fp8", 900.0), ("resident", None, 1, "nvfp4", 950.0))]
    (tmp_path / "decode-qwen3-q4.json").write_text(json.dumps({
        "rows": rows, "greedy_tokens_equal_to_resident": {"slots@0.5/b1/nvfp4": True},
        "output_checks": {"slots@0.5/b8/nvfp4": "MISMATCH (rel err 1e-1)"}}))
    (tmp_path / "prefill-q4.json").write_text(json.dumps({"rows": [
        {"backend": "resident", "prompt_len": 2048, "dtype": d, "tok_s": t} for d, t in (("bf16", 1e4), ("nvfp4", 9e3))]}))
    assert main([str(tmp_path)]) == 0
    got = json.loads((tmp_path / "quant4-summary.json").read_text())
    v = {t["target"]: (t["measured"], t["verdict"]) for t in got["targets"]}
    assert v["qwen3-30b-a3b slots@50% b1 nvfp4/fp8"] == (1000 / 700, "pass")
    assert v["qwen3-30b-a3b slots@50% b1 nvfp4/bf16"] == (2.5, "pass")
    assert v["qwen3-30b-a3b slots@50% b8 nvfp4/fp8"] == (1.4, "FAIL")
    assert v["qwen3-30b-a3b resident b1 nvfp4/fp8"][1] == "pass"
    assert v["prefill resident pp2048 nvfp4/bf16"] == (0.9, "pass") and v["prefill resident pp2048 int4/bf16"][1] == "missing"
    assert v["glm-5.3-flash slots@50% b1 nvfp4/fp8"] == (None, "missing")
    checks = {c["target"]: c["verdict"] for c in got["checks"]}
    assert checks["decode qwen3 slots@0.5/b8/nvfp4 output check"] == "FAIL"
    assert checks["decode glm-5.3-flash record"] == "missing"
