"""`moetier bench decode --parallel 1,tp2,ep2` on the CPU (two gloo ranks, the tiny preset): the
parallel rows run beside the one-GPU rows in one record, each says its world size and its all-reduce
time per step, EP rows make the one-GPU greedy tokens, and the row syntax is checked."""

from __future__ import annotations

import pytest
import torch

from moetier.bench import decode
from moetier.bench.decode_parallel import label, parse_layouts
from moetier.checkpoint.random_bed import RandomModel, random_bed, slots_for
from moetier.dist.timing import CollectiveTimer
from moetier.errors import MoetierError
from moetier.parallel import Parallel
from moetier.presets import preset
from tests.test_bench_decode import tiny_trace  # noqa: F401 -- the fixture


def lookups(stats: dict) -> int:
    return stats["hits"] + stats["misses"] + stats["overflow"]


def test_row_syntax():
    assert parse_layouts("1,tp2,ep2") == [(1, 1), (2, 1), (1, 2)]
    assert parse_layouts(" TP2EP2 ,1,tp2") == [(2, 2), (1, 1), (2, 1)]
    assert [label(*lay) for lay in parse_layouts("1,tp2,ep4,tp2ep2")] == ["1", "tp2", "ep4", "tp2ep2"]
    for bad, needle in (("tp1", "2 or more"), ("tp2ep4", "must be 1 or"), ("gpu2", "like 1,tp2,ep2"), ("", "like")):
        with pytest.raises(MoetierError, match=needle):
            parse_layouts(bad)


def test_budget_is_per_gpu_capped_at_the_experts_a_rank_owns():
    cfg = preset("tiny")  # 32 experts, top 4
    assert slots_for(cfg, "slots", 0.5) == 16 and slots_for(cfg, "slots", 0.5, ep=2) == 16
    assert slots_for(cfg, "slots", 0.75, ep=2) == 16 and slots_for(cfg, "slots", 0.25, ep=2) == 8
    assert slots_for(cfg, "resident", 0.5, ep=2) == 0
    assert RandomModel("tiny", budget=0.25).options(cfg, Parallel.of(ep=2)).slots == 8


def test_ep_shares_hold_the_one_process_experts():
    cfg = preset("tiny")
    one = random_bed(cfg, seed=4, device="cpu", dtype=torch.float32)
    halves = [random_bed(cfg, seed=4, device="cpu", dtype=torch.float32, par=Parallel(r, 2, 1, 2)) for r in (0, 1)]
    for layer, rows in one.host.items():
        assert torch.equal(halves[0].host[layer], rows[0::2]) and torch.equal(halves[1].host[layer], rows[1::2])
    assert torch.equal(halves[1].model.embed, one.model.embed)  # replicated weights: the same draws


def test_collective_timer_counts_spans_on_the_cpu():
    t = CollectiveTimer()
    x = torch.zeros(8, 4)
    with t.span("tp", x):  # off: span() still works, all_reduce simply does not call it
        pass
    t.start()
    for over in ("tp", "ep", "ep"):
        with t.span(over, x):
            pass
    got = t.take()
    assert got["ep"]["calls"] == 2 and got["tp"]["calls"] == 1 and got["ep"]["bytes"] == 2 * 8 * 4 * 4
    assert t.take() == {}


def test_parallel_rows_beside_one_process(tiny_trace):  # noqa: F811
    cfg = preset("tiny")
    bed = random_bed(cfg, seed=1, device="cpu", dtype=torch.float32)
    args = {"tokens": 4, "warmup": 2, "prompt_len": 5, "hf_tokens": 2, "policy": "lfru", "decode_tokens": 16,
            "seed": 1, "preset": "tiny", "layers": None, "device": "cpu", "model_dtype": "float32"}
    bw = {"hbm_GBps": 100.0, "link_GBps": 10.0}
    data = decode.run(cfg, tiny_trace, [0.25], [1, 4], ["resident", "slots"], args, bed=bed, bw=bw,
                      layouts=((1, 1), (2, 1), (1, 2)))
    rows = data["rows"]
    assert [(r.get("parallel", "1"), r["backend"], r["batch"]) for r in rows] == [
        (p, b, n) for p in ("1", "tp2", "ep2") for b in ("resident", "slots") for n in (1, 4)]
    for r in rows:
        assert r["timed_tokens"] == r["batch"] * args["tokens"] and r["tok_s"] > 0
        if r.get("parallel", "1") != "1":
            assert r["world"] == 2
            over = "tp" if r["tp"] == 2 else "ep"
            c = r["collectives"][over]
            # TP: one all-reduce after attention and, under the columns expert split (what the default
            # auto picks), one after each MoE layer; EP: one per MoE layer
            assert r["expert_split"] == ("columns" if r["tp"] == 2 else "replicate")
            layers = cfg.num_layers + len(cfg.moe_layers) if r["tp"] == 2 else len(cfg.moe_layers)
            assert c["calls_per_step"] == pytest.approx(layers)
            assert c["bytes_per_step"] == pytest.approx(layers * r["batch"] * cfg.hidden_size * 4)
            assert r["all_reduce_ms_per_step"] > 0
            assert r["record_broadcast_ms_per_step"] > 0 and r["step_record_group"] == "world"
    ep_slots = [r for r in rows if r.get("parallel") == "ep2" and r["backend"] == "slots"]
    assert all(r["slots"] == 8 for r in ep_slots)  # 25% of 32 experts per GPU: 8 of the 16 a rank owns
    tp_slots = [r for r in rows if r.get("parallel") == "tp2" and r["backend"] == "slots"]
    # columns: a rank's rows are half an expert, so 25% of the model's expert bytes are 16 of its 32 rows
    assert all(r["slots"] == 16 for r in tp_slots)
    from moetier.bench.outputs import flagged

    for r in rows:  # EP rows against the one-GPU reference; TP rows (their own random shards) their layout's
        par = r.get("parallel", "1")
        want = f"resident/b{r['batch']}" + ("/tp2" if par == "tp2" else "")
        assert r["check"]["verdict"] == "reference" if r["backend"] == "resident" and par != "ep2" else (
            r["check"]["reference"] == want and not flagged(r["check"])), r["check"]
    assert data["output_references"]["float32/4/tp2"] == "resident/b4/tp2"
    same = data["greedy_tokens_equal_to_resident"]
    assert same["slots@0.25/b4/ep2"] and same["slots@0.25/b1"] and not any("tp2" in k for k in same)
    for r in rows:  # every rank's counters over the timed window, rank 0's first (one GPU: a list of one)
        per = r["expert_stats_per_rank"]
        assert len(per) == r.get("world", 1) and per[0] == r["expert_stats"]
        if r["backend"] == "slots":  # every rank's cache counted every MoE layer-step
            assert per[-1]["steps"] == r["expert_stats"]["steps"] > 0
    for r in ep_slots:  # each pair looked up on its owner only: the ranks' lookups are one GPU's
        alone = next(o for o in rows if o.get("parallel", "1") == "1" and o["backend"] == "slots"
                     and o["batch"] == r["batch"])
        assert sum(map(lookups, r["expert_stats_per_rank"])) == lookups(alone["expert_stats"])
    # the ranks own different experts: their counters differ (at batch 1 of this trace they may tie)
    assert any(r["expert_stats_per_rank"][0] != r["expert_stats_per_rank"][1] for r in ep_slots)
    text = decode.table(rows)
    assert "ep2:slots" in text and "all-reduce" in text
    rates = "/".join(f"{h:.1%}" for h in ep_slots[0]["hit_rate_per_rank"])
    assert f"hit {rates}" in text  # parallel rows show every rank's hit rate


def test_cli_refuses_bad_rows_in_one_line():
    from typer.testing import CliRunner

    from moetier.cli.app import app

    for args, needle in ((["--parallel", "gpu2"], "like 1,tp2,ep2"),
                         (["--parallel", "1,tp2", "--model", "."], "--parallel rows run random weights")):
        r = CliRunner().invoke(app, ["bench", "decode", *args])
        assert r.exit_code == 2 and r.stderr.startswith("error: ") and needle in r.stderr, r.stderr
