"""`moetier bench decode` on the CPU with the tiny preset: every engine row runs, the roofline sums
its bytes, the greedy tokens of slots and uva equal resident's under a replayed trace."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from moetier.bench import decode, decode_spec, decode_steps
from moetier.cli.bench_common import parse_budget
from moetier.checkpoint.random_bed import random_bed, use_backend
from moetier.engine.config import EngineConfig
from moetier.engine.llm import LLM
from moetier.errors import MoetierError
from moetier.presets import preset
from moetier.traces.format import read_trace, write_trace
from moetier.traces.synth import SynthParams, meta_of, synthesize


@pytest.fixture(scope="module")
def tiny_trace(tmp_path_factory):
    cfg = preset("tiny")
    path = tmp_path_factory.mktemp("trace") / "tiny.mtrace"
    p = SynthParams(experts=cfg.num_experts, top_k=cfg.top_k, layers=cfg.num_layers, tokens=512, skew=1.2, seed=3)
    write_trace(path, synthesize(p), meta_of(p))
    return str(path)


def test_budget_parsing():
    assert parse_budget("50%") == 0.5 and parse_budget("0.25") == 0.25 and parse_budget("100%") == 1.0
    for bad in ("0%", "150%", "half"):
        with pytest.raises(MoetierError, match="--expert-budget"):
            parse_budget(bad)


def test_distinct_per_step_counts_union_of_consecutive_tokens(tiny_trace):
    trace = read_trace(tiny_trace)
    k = trace.ids.shape[2]
    assert decode.distinct_per_step(trace, 0, 10, 1) == k  # one token: its k distinct experts
    two = decode.distinct_per_step(trace, 0, 2, 2)
    want = np.mean([len(np.unique(trace.ids[0:2, layer])) for layer in range(trace.ids.shape[1])])
    assert two == want and k <= two <= 2 * k


def test_engine_rows_on_cpu(tiny_trace):
    cfg = preset("tiny")
    bed = random_bed(cfg, seed=1, device="cpu", dtype=torch.float32)
    args = {"tokens": 6, "warmup": 3, "prompt_len": 5, "hf_tokens": 2, "policy": "lfru", "decode_tokens": 16,
            "seed": 0}
    bw = {"hbm_GBps": 100.0, "link_GBps": 10.0}
    data = decode.run(cfg, tiny_trace, [0.5, 0.25], [1, 4], ["resident", "uva", "slots"], args, bed=bed, bw=bw)
    rows = data["rows"]
    assert [(r["backend"], r["budget"], r["batch"]) for r in rows] == [
        ("resident", None, 1), ("resident", None, 4), ("uva", None, 1), ("uva", None, 4),
        ("slots", 0.5, 1), ("slots", 0.5, 4), ("slots", 0.25, 1), ("slots", 0.25, 4)]
    assert all(data["greedy_tokens_equal_to_resident"].values()) and len(data["greedy_tokens_equal_to_resident"]) == 6
    for r in rows:
        assert r["timed_tokens"] == r["batch"] * args["tokens"] and r["tok_s"] > 0
        seconds = r["hbm_bytes_per_step"] / 100e9 + r["link_bytes_per_step"] / 10e9
        assert r["roofline_tok_s"] == pytest.approx(r["batch"] / seconds)
    res1 = rows[0]
    assert res1["link_bytes_per_step"] == 0
    assert res1["hbm_bytes_per_step"] == bed.dense_bytes + cfg.top_k * len(bed.host) * bed.row_bytes
    slots = [r for r in rows if r["backend"] == "slots"]
    assert all(0 < r["hit_rate"] < 1 for r in slots)
    # a smaller cache misses more
    assert slots[2]["hit_rate"] < slots[0]["hit_rate"]
    text = decode.table(rows)
    assert "tok/s" in text and "roofline" in text
    assert len(data["trace_file"]["sha256"]) == 64 and data["trace_file"]["synth"]["seed"] == 3
    assert all(v in ("reference", "exact") for v in data["output_checks"].values())


def test_a_slots_file_row_runs_its_counts_per_layer(tiny_trace):
    """args["slots_per_layer"] (bench decode --expert-slots-file): one more slots row whose layers hold
    those slots, named @file, its budget their share, its outputs exact against the reference."""
    cfg = preset("tiny")
    bed = random_bed(cfg, seed=1, device="cpu", dtype=torch.float32)
    per_layer = {0: 4, 1: 9, 2: 6, 3: 12}
    args = {"tokens": 4, "warmup": 2, "prompt_len": 5, "hf_tokens": 2, "policy": "lfru", "decode_tokens": 16,
            "seed": 0, "slots_per_layer": per_layer}
    data = decode.run(cfg, tiny_trace, [0.25], [2], ["resident", "slots"], args, bed=bed,
                      bw={"hbm_GBps": 100.0, "link_GBps": 10.0})
    got = data["rows"][-1]
    assert [decode.row_name(r) for r in data["rows"]] == ["resident/b2", "slots@0.25/b2", "slots@file/b2"]
    assert got["slots_per_layer"] == {"0": 4, "1": 9, "2": 6, "3": 12} and got["slots"] == 7
    assert got["budget"] == pytest.approx(31 / (4 * cfg.num_experts))
    assert data["output_checks"]["slots@file/b2"] == "exact" and " file b2" in decode.table([got])
    assert use_backend(bed, "slots", 0.25, slots_per_layer=per_layer) == 7
    assert {b.layer: b.experts.cache.num_slots for b in bed.model.moe_blocks()} == per_layer


def test_plot_writes_png(tmp_path):
    pytest.importorskip("matplotlib")
    rows = [dict(backend=b, budget=bud, batch=n, tok_s=t) for b, bud, t in
            (("resident", None, 100.0), ("uva", None, 10.0), ("slots", 0.5, 60.0), ("slots", 1.0, 95.0),
             ("hf-accelerate", 0.5, 1.0), ("hf-accelerate", 1.0, 5.0)) for n in (1, 8)]
    cfg = {"layers": 2, "hidden": 64, "experts": 32, "top_k": 4}
    decode.plot({"rows": rows, "config": cfg}, str(tmp_path / "p.png"))
    assert (tmp_path / "p.png").stat().st_size > 10_000


def test_reference_falls_back_to_slots_and_a_row_that_differs_is_marked(tiny_trace, monkeypatch):
    cfg = preset("tiny")
    bed = random_bed(cfg, seed=1, device="cpu", dtype=torch.float32)
    args = {"tokens": 4, "warmup": 2, "prompt_len": 5, "hf_tokens": 2, "policy": "lfru", "decode_tokens": 16,
            "seed": 0}
    real = decode.bench_engine

    def broken_uva(bed, trace, path, backend, *a, **kw):  # a uva row whose request 0 reads a wrong logit at step 2
        rows = real(bed, trace, path, backend, *a, **kw)
        for r in rows if backend == "uva" else []:
            r["logits"][0][2, 7] += 100.0
            r["tokens"][0][2] = 7
        return rows

    monkeypatch.setattr(decode, "bench_engine", broken_uva)
    data = decode.run(cfg, tiny_trace, [0.5, 0.25], [1, 2], ["uva", "slots"], args, bed=bed,
                      bw={"hbm_GBps": 100.0, "link_GBps": 10.0})
    rows = data["rows"]
    # no resident row: the first slots row runs first and is every batch's reference, named in the record
    assert [(r["backend"], r["budget"]) for r in rows[:2]] == [("slots", 0.5)] * 2
    assert data["output_references"] == {"float32/1": "slots@0.5/b1", "float32/2": "slots@0.5/b2"}
    assert data["greedy_tokens_equal_to_resident"] == {}
    checks = data["output_checks"]
    assert checks["slots@0.5/b1"] == "reference" and checks["slots@0.25/b2"] == "exact"
    bad = [r for r in rows if r["backend"] == "uva"]
    for r in bad:
        c = r["check"]
        assert c["verdict"].startswith("MISMATCH") and c["diverged_at"] == {"request": 0, "step": 2}
        assert c["logits_rel_err"] > 1 and c["reference"] == f"slots@0.5/b{r['batch']}"
        assert "logits" not in r and "tokens" not in r  # the record keeps the verdict, not the arrays
    text = decode.table(rows)
    assert text.count("<<< OUTPUTS DIFFER") == 2 and text.count("check exact vs slots@0.5") == 2


def test_repeated_runs_report_the_median_and_spread_and_check_the_first():
    rates = iter([30.0, 10.0, 20.0, 40.0])
    calls = []

    def run(first):
        calls.append(first)
        tok_s = next(rates)
        return {"tok_s": tok_s, "step_ms_median": 1e3 / tok_s, "tokens": [[int(tok_s)]], "logits": ["kept"] if first else None}

    r = decode.repeated(run, 4)
    assert calls == [True, False, False, False]  # the first run's outputs are the ones checked
    assert r["tok_s"] == 25.0 and (r["tok_s_min"], r["tok_s_max"]) == (10.0, 40.0) and r["runs"] == 4
    assert r["step_ms_median"] == 1e3 / 20.0  # the lower middle run's own figures
    assert r["tokens"] == [[30]] and r["logits"] == ["kept"] and r["runs_tok_s"] == [30.0, 10.0, 20.0, 40.0]
    assert "(10.0-40.0 over 4)" in decode.table([{**r, "backend": "resident", "batch": 1, "roofline_tok_s": 1.0,
                                                  "of_roofline": 1.0, "hbm_bytes_per_step": 0, "link_bytes_per_step": 0}])


def test_bench_decode_refuses_zero_repeats():
    from typer.testing import CliRunner

    from moetier.cli.app import app

    r = CliRunner().invoke(app, ["bench", "decode", "--repeats", "0"])
    assert r.exit_code == 2 and "--repeats" in r.stderr


def hybrid_against_resident(trace_path: str, monkeypatch) -> dict:
    from moetier.experts.hybrid.cost_model import PathRates

    real = decode.host_options  # fixed rates, a slow link: every miss goes to the host (not the machine's load)
    monkeypatch.setattr(decode, "host_options", lambda *a: {**real(*a), "rates": PathRates(0.001, {"bfloat16": 1e3})})
    cfg = preset("tiny")
    bed = random_bed(cfg, seed=1, device="cpu", dtype=torch.bfloat16)
    args = {"tokens": 12, "warmup": 4, "prompt_len": 5, "hf_tokens": 2, "policy": "lfru", "decode_tokens": 16,
            "seed": 0, "host_kernel": "compiled"}
    data = decode.run(cfg, trace_path, [0.25], [4], ["resident", "hybrid"], args, bed=bed,
                      bw={"hbm_GBps": 100.0, "link_GBps": 10.0})
    (row,) = [r for r in data["rows"] if r["backend"] == "hybrid"]
    assert row["hybrid"]["host_experts_per_layer_step"] > 1  # the host computes a real share
    return row["check"]


def test_hybrid_rounding_is_within_tolerance_and_a_wrong_host_expert_is_a_mismatch(tiny_trace, monkeypatch):
    # bf16 on the CPU: the compiled host kernel (fp32 accumulation) against torch's bf16 ops, the CUDA
    # case in small (docs/hybrid.md, "Output check")
    from moetier.experts.hybrid import host_ext
    from moetier.experts.hybrid import backend as hybrid

    if not host_ext.available()[0]:
        pytest.skip("the compiled host kernel does not build here")
    ok = hybrid_against_resident(tiny_trace, monkeypatch)
    assert ok["verdict"].startswith("within tolerance") and 0 < ok["logits_rel_err"] < decode_outputs().LOGITS_RTOL
    start = hybrid.HybridExperts._start_host

    def wrong_expert(self, x, pos, experts, k, marks):  # a defect: each host pair computed with the next expert
        return start(self, x, pos, [(e + 1) % self.host.shape[0] for e in experts], k, marks)

    monkeypatch.setattr(hybrid.HybridExperts, "_start_host", wrong_expert)
    bad = hybrid_against_resident(tiny_trace, monkeypatch)
    assert bad["verdict"].startswith("MISMATCH") and bad["logits_rel_err"] > 2 * decode_outputs().LOGITS_RTOL


def decode_outputs():
    from moetier.bench import outputs

    return outputs


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_time_replays_leave_the_trace_cursor_and_later_runs_exact(tiny_trace):
    """replay_ms replays the decode graphs, whose trace replayer advances its cursor in the graph: it
    must put the cursor back, or the next batch of an engine routes by other trace rows than another
    row's engine (a hybrid row, which also replays its whole-step graph, then differed from resident
    from its second batch on, at every step)."""
    cfg = preset("tiny")
    bed = random_bed(cfg, seed=1, device="cuda", dtype=torch.float32)
    args = {"tokens": 4, "warmup": 2, "prompt_len": 5, "hf_tokens": 2, "policy": "lfru", "decode_tokens": 16,
            "seed": 0}
    bw = {"hbm_GBps": 1000.0, "link_GBps": 50.0}
    data = decode.run(cfg, tiny_trace, [0.5], [1, 4], ["resident", "slots"], args, bed=bed, bw=bw)
    assert all(v in ("reference", "exact") for v in data["output_checks"].values()), data["output_checks"]
    use_backend(bed, "slots", 0.5)
    llm = LLM.from_model(bed.model, bed.tokenizer, EngineConfig(replay_trace=tiny_trace, max_num_seqs=4,
                                                                decode_tokens=16, kv_tokens=256))
    try:
        decode_steps.decode_once(llm, 1, 5, 2, 2, 0)
        before = int(llm.replayer.cursor)
        assert decode_steps.replay_ms(llm, 1) is not None and int(llm.replayer.cursor) == before
    finally:
        llm.close()


def test_speculative_rows_run_beside_the_plain_ones_and_keep_their_tokens(tiny_trace):
    """--speculative-config: each engine row again with n-gram speculation, right after it; at batch 1
    the greedy tokens equal the reference's (the replay rewinds rejected drafts' rows), the counters
    cover the timed window, the speedup and roofline are the plain twin's."""
    cfg = preset("tiny")
    bed = random_bed(cfg, seed=1, device="cpu", dtype=torch.float32)
    args = {"tokens": 8, "warmup": 3, "prompt_len": 5, "hf_tokens": 2, "policy": "lfru", "decode_tokens": 16,
            "seed": 0, "speculative_config": '{"method": "ngram", "num_speculative_tokens": 2}'}
    data = decode.run(cfg, tiny_trace, [0.5], [1, 2], ["resident", "slots"], args, bed=bed,
                      bw={"hbm_GBps": 100.0, "link_GBps": 10.0})
    rows = data["rows"]
    assert [(r["backend"], r.get("spec"), r["batch"]) for r in rows] == [
        ("resident", None, 1), ("resident", None, 2), ("resident", "spec:ngram2", 1), ("resident", "spec:ngram2", 2),
        ("slots", None, 1), ("slots", None, 2), ("slots", "spec:ngram2", 1), ("slots", "spec:ngram2", 2)]
    checks = data["output_checks"]
    assert checks["resident/b1"] == "reference" and checks["slots@0.5/b1"] == "exact"
    assert checks["resident+spec:ngram2/b1"] == "tokens equal" and checks["slots+spec:ngram2@0.5/b1"] == "tokens equal"
    # batch 2: the verify step takes the trace's rows in another order (decode_spec.judge)
    assert checks["slots+spec:ngram2@0.5/b2"] in ("tokens equal", decode_spec.ROUTED_DIFFERENTLY)
    assert all(data["greedy_tokens_equal_to_resident"].values()) and len(data["greedy_tokens_equal_to_resident"]) == 2
    for r in (r for r in rows if r.get("spec")):
        s = r["spec_decode"]
        plain = next(p for p in rows if not p.get("spec") and p["backend"] == r["backend"] and p["batch"] == r["batch"])
        assert 0 <= s["spec_decode_num_accepted_tokens"] <= s["spec_decode_num_draft_tokens"] <= 2 * s[
            "spec_decode_num_drafts"]
        assert sum(s["spec_decode_num_accepted_tokens_per_pos"]) == s["spec_decode_num_accepted_tokens"]
        assert 1 <= s["tokens_per_seq_step"] <= 3 and set(s["spec_decode_k_chosen"]) <= {0, 1, 2}
        assert 0 < r["timed_tokens"] <= r["batch"] * args["tokens"]
        assert r["speedup_over_plain"] == pytest.approx(r["tok_s"] / plain["tok_s"])
        assert r["roofline_tok_s"] == plain["roofline_tok_s"] and r["speculative_config"]["method"] == "ngram"
    text = decode.table(rows)
    assert "+ngram2" in text and "tokens/seq/step" in text and "x plain" in text


def test_a_speculative_row_at_batch_above_one_that_differs_is_listed_not_flagged():
    from moetier.bench.outputs import flagged

    differs = {"verdict": "DIFFERS (diverged at step 3 of request 1; no logits to judge)", "reference": "resident/b4"}
    for batch, spec, want in ((4, "spec:ngram2", decode_spec.ROUTED_DIFFERENTLY), (1, "spec:ngram2", differs["verdict"]),
                              (4, None, differs["verdict"])):
        row = {"batch": batch, "spec": spec, "check": dict(differs)}
        decode_spec.judge(row)
        assert row["check"]["verdict"] == want and flagged(row["check"]) == (want != decode_spec.ROUTED_DIFFERENTLY)


def test_bench_decode_refuses_mtp_rows():
    from typer.testing import CliRunner

    from moetier.cli.app import app

    r = CliRunner().invoke(app, ["bench", "decode", "--speculative-config",
                                 '{"method": "mtp", "num_speculative_tokens": 2}'])
    assert r.exit_code == 2 and "method ngram" in r.stderr and "Traceback" not in r.stderr
