"""The split in the memory plan (plan/split.py) and its per-layer choice on a trace (traces/split_plan.py):
the sums of both budgets, pinning more when the host shrinks, the stated default, a stable hot set
pinned and a drifting one left to the slots; the CLI end to end. All on the CPU."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from moetier import presets
from moetier.cli.app import app
from moetier.plan.memory import PlanRequest
from moetier.plan.sizing import auto_plan, margin
from moetier.plan.units import GiB
from moetier.traces.format import Trace
from moetier.traces.split_plan import choose, hottest

BF16 = torch.bfloat16
FLASH = dict(max_model_len=65536, gpu_budget=139 * GiB, gpu_source="--gpu-memory 139GiB")


def flash(host: int, layers: int = 14, dtype=BF16) -> PlanRequest:
    cfg = presets.preset("glm-5.3-flash", layers)
    return PlanRequest(cfg, dtype, "cuda", backend="auto", host_available=host, host_source="--host-memory", **FLASH)


def item(plan, name: str) -> int:
    return next(i.bytes for i in plan.device + plan.host if i.name.startswith(name))


def test_split_fills_both_budgets_and_every_byte_is_counted():
    req = flash(125 * GiB)
    plan = auto_plan(req)
    cfg, row = req.cfg, plan.row_bytes
    assert row == cfg.moe_shape.layout.row_bytes(BF16) == 3 * 4096 * 2048 * 2  # the format's row layout
    pins, slots = plan.pinned_per_layer, plan.slots_per_layer
    assert plan.backend == "slots" and plan.fits() and set(pins) == set(slots) == set(cfg.moe_layers)
    e = cfg.num_experts
    assert all(pins[la] + slots[la] <= e and slots[la] >= 1 for la in slots)
    assert {la: len(v) for la, v in plan.pinned_experts.items()} == pins
    assert item(plan, "routed experts pinned on the GPU") == sum(pins.values()) * row
    assert abs(item(plan, "expert slots") - sum(slots.values()) * row) <= 512 * len(slots)
    cached = len(slots) * e - sum(pins.values())
    store = item(plan, "expert store")
    assert cached * row <= store <= cached * row + 2 * 4096 * (sum(pins.values()) + len(slots))
    assert plan.device_total == sum(i.bytes for i in plan.device) <= req.gpu_budget - margin(req.gpu_budget)
    assert plan.host_total <= plan.host_available - plan.host_margin
    assert any(n.startswith("no trace: pinned only the") for n in plan.notes)
    # the host is the limit: what it cannot hold is pinned, and no more
    small = auto_plan(replace(req, host_available=64 * GiB))
    assert small.fits() and sum(small.pinned_per_layer.values()) > sum(pins.values())
    assert item(small, "expert store") < store and small.device_total <= req.gpu_budget


def test_plan_refuses_when_both_budgets_are_short():
    from moetier.errors import MoetierError

    with pytest.raises(MoetierError, match="the experts do not fit the two budgets: 12,096 rows"):
        auto_plan(flash(125 * GiB, layers=None))


def trace_of(ids: np.ndarray) -> Trace:
    n = ids.shape[0]
    meta = {"experts": 32, "top_k": ids.shape[2], "layers": list(range(ids.shape[1]))}
    return Trace(meta, ids, None, np.zeros(n, dtype=np.int64), np.zeros(n, dtype=bool))


def routed(n: int, hot_of, seed: int = 0) -> np.ndarray:
    """[n, 1, 4] of 32 experts: 3 of 4 choices from hot_of(t) (a set of 8), one uniform."""
    rng = np.random.default_rng(seed)
    out = np.empty((n, 1, 4), dtype=np.int64)
    for t in range(n):
        hot = hot_of(t)
        first = rng.choice(hot, 3, replace=False)
        rest = rng.choice([e for e in range(32) if e not in first], 1)
        out[t, 0] = np.concatenate([first, rest])
    return out


def test_stable_hot_set_pinned_drifting_left_to_slots():
    stable = routed(600, lambda t: list(range(8)))
    got = choose(stable[:, 0], 32, rows=12, min_pinned=0, top_k=4, policy="lfru")
    assert len(got.pinned) >= 8 and got.slots == 12 - len(got.pinned) and got.stability > 0.9
    assert set(range(8)) <= set(got.pinned) and got.pinned == hottest(stable[:, 0], 32, len(got.pinned))
    # the hot set moves every 50 tokens: the first half's hottest miss the second half, slots follow it
    drift = routed(600, lambda t: [(8 * (t // 50) + i) % 32 for i in range(8)])
    moved = choose(drift[:, 0], 32, rows=12, min_pinned=2, top_k=4, policy="lfru")
    assert len(moved.pinned) < len(got.pinned) and len(moved.pinned) >= 2 and moved.hit_rate > 0.3


def test_trace_chooses_the_split_in_auto_plan():
    cfg = presets.preset("tiny")  # 4 MoE layers of 32 experts, top-4
    base = PlanRequest(cfg, torch.float32, "cuda", backend="auto", max_model_len=256, gpu_budget=None)
    from moetier.plan.memory import count

    zero = count(replace(base, backend="slots", slots_per_layer=dict.fromkeys(cfg.moe_layers, 0)))
    budget = zero.device_total + margin(2 * GiB) + 4 * 12 * (zero.row_bytes + 64)  # 12 rows a layer
    stable = np.concatenate([routed(400, lambda t: list(range(8)), seed=s) for s in range(4)], axis=1)
    plan = auto_plan(replace(base, gpu_budget=budget), trace_of(stable))
    assert plan.fits() and plan.backend == "slots"
    assert all(n >= 8 for n in plan.pinned_per_layer.values()), plan.pinned_per_layer
    assert any(n.startswith("trace: ") for n in plan.notes)


def test_cli_plan_shows_the_split_and_writes_the_pinned_file(tmp_path):
    out = tmp_path / "pinned.json"
    args = ["plan", "--preset", "glm-5.3-flash", "--layers", "14", "--gpu-memory", "139GiB", "--max-model-len",
            "65536"]
    r = CliRunner().invoke(app, [*args, "--host-memory", "64GiB", "--pinned-out", str(out)])
    assert r.exit_code == 0, r.output
    assert "routed experts pinned on the GPU" in r.output and "+ pinned 195..195 per layer" in r.output
    assert "no trace: pinned only the 2145 experts the host cannot hold" in r.output
    from moetier.experts.cache.split import read_pinned_file

    pinned = read_pinned_file(out)
    assert sorted(pinned) == list(range(3, 14)) and {len(v) for v in pinned.values()} == {195}
    from moetier.experts.placement import read_slots_file

    assert set(read_slots_file(out).values()) <= {42, 43}  # the plan's slots beside them
    # the file given back as the split: the same pinned rows, slots by default
    r = CliRunner().invoke(app, [*args, "--host-memory", "64GiB", "--expert-backend", "slots", "--expert-slots", "40",
                                 "--pinned-experts-file", str(out), "--json"])
    assert r.exit_code == 0, r.output
    plan = json.loads(r.output)
    assert plan["pinned_per_layer"] == {str(la): 195 for la in range(3, 14)} and plan["fits"]
    r = CliRunner().invoke(app, [*args, "--expert-backend", "uva", "--pinned-experts-file", str(out)])
    assert r.exit_code == 2 and "needs --expert-backend slots or hybrid" in r.output


def test_bench_preflight_plans_a_split_bed_with_its_cached_store():
    """A random bed too large for the host: refused as a whole store, planned with the plan's pins."""
    from moetier.checkpoint.random_bed import RandomModel
    from moetier.engine.config import EngineConfig
    from moetier.plan.expert_plan import PlanRefused
    from moetier.plan.preflight import bench_preflight

    cfg = presets.preset("glm-5.3-flash", 14)
    config = EngineConfig(max_model_len=65536, decode_tokens=64)
    plan = auto_plan(flash(64 * GiB))
    pinned = {la: tuple(v) for la, v in plan.pinned_experts.items()}
    with pytest.raises(PlanRefused, match="host store does not fit"):
        bench_preflight(cfg, [("slots", 0.1)], config, "139GiB", "64GiB")
    bench_preflight(cfg, [("slots", 0.1)], config, "139GiB", "64GiB", pinned=pinned)
    opts = RandomModel("glm-5.3-flash", 14, "slots", 0.9, pinned=pinned).options(cfg)
    assert opts.pinned == pinned and opts.slots == 288 - 195  # capped at the cached experts



def plan_cli(*args: str):
    return CliRunner().invoke(app, ["plan", "--preset", "glm-5.3-flash", "--gpu-memory", "139GiB", *args])


def test_quantized_preset_plans_fp8_rows_and_the_whole_model_is_refused_with_numbers():
    # the whole model in FP8 (25.2 MB rows) is more than 139 GiB + 125 GiB: refused, with the rows it lacks
    r = plan_cli("--dtype", "fp8", "--host-memory", "125GiB")
    assert r.exit_code == 2 and "12,096 rows of 25,171,968 B" in r.output and "must be pinned" in r.output
    r = plan_cli("--dtype", "fp8", "--layers", "24", "--host-memory", "125GiB", "--json")
    assert r.exit_code == 0, r.output
    plan = json.loads(r.output)
    assert plan["row_bytes"] == 25_171_968 and plan["fits"] and sum(plan["pinned_per_layer"].values()) > 0
    small = json.loads(plan_cli("--dtype", "fp8", "--layers", "24", "--host-memory", "64GiB", "--json").output)
    assert small["fits"] and sum(small["pinned_per_layer"].values()) > sum(plan["pinned_per_layer"].values())
    r = CliRunner().invoke(app, ["plan", "--model", "/nonexistent", "--dtype", "fp8", "--gpu-memory", "139GiB"])
    assert r.exit_code == 2


def test_split_that_fits_only_at_a_smaller_chunk_takes_it():
    # at 8192-token steps the activations leave too few rows for what the host cannot hold; at 2816 they
    # fit (the GPU budget also holds the indexer's decode selection over the 1M-token context: 1.5 GiB)
    args = ("--dtype", "fp8", "--layers", "24", "--host-memory", "64GiB", "--gpu-memory", "116GiB")
    r = plan_cli(*args, "--max-num-tokens", "8192")
    assert r.exit_code == 2 and "the experts do not fit the two budgets" in r.output
    r = plan_cli(*args, "--json")
    assert r.exit_code == 0, r.output
    plan = json.loads(r.output)
    reason = plan["chunk"]["reason"]
    assert plan["fits"] and "reduced from 8192 to" in reason and "the experts would not fit the two budgets" in reason
    assert plan["chunk"]["tokens"] < 8192 and sum(plan["pinned_per_layer"].values()) == 3810


@pytest.mark.skipif("nvfp4" not in __import__("moetier.quant.registry", fromlist=["FORMATS"]).FORMATS,
                    reason="the NVFP4 rows come with issue 30's branch")
def test_whole_glm53_flash_in_nvfp4_fits_one_h200():
    r = plan_cli("--dtype", "nvfp4", "--host-memory", "125GiB", "--json")
    assert r.exit_code == 0, r.output
    plan = json.loads(r.output)
    cached = 42 * 288 - sum(plan["pinned_per_layer"].values())
    assert plan["fits"] and 0 < cached < 42 * 288 and plan["host_total"] < 125 * GiB
    # a 64 GiB host: the 1M-token KV leaves too few GPU rows for what it cannot hold; shorter requests fit
    r = plan_cli("--dtype", "nvfp4", "--host-memory", "64GiB")
    assert r.exit_code == 2 and "must be pinned on the GPU" in r.output
    small = json.loads(plan_cli("--dtype", "nvfp4", "--host-memory", "64GiB", "--max-model-len", "131072",
                                "--json").output)
    assert small["fits"] and sum(small["pinned_per_layer"].values()) > sum(plan["pinned_per_layer"].values())


def test_bench_rows_are_planned_in_their_own_format():
    """`bench decode --dtype nvfp4` plans NVFP4 rows: 150 experts a layer pinned on the GPU fit the H200 in
    NVFP4 (14.2 MB rows) and not in bf16 (50.3 MB), which is refused naming its format."""
    import typer

    from moetier.cli.bench_common import preflight_rows

    cfg = presets.preset("glm-5.3-flash", 45)
    pinned = {la: tuple(range(150)) for la in range(3, 45)}
    budgets = {"gpu_memory": "134GiB", "host_memory": "125GiB", "max_num_seqs": 8, "max_model_len": 128}
    preflight_rows(cfg, [("slots", 0.01)], ("nvfp4",), pinned=pinned, **budgets)
    with pytest.raises(typer.Exit):
        preflight_rows(cfg, [("slots", 0.01)], ("nvfp4", "bf16"), pinned=pinned, **budgets)


def test_bench_preflight_plans_the_slots_file_row():
    """A slots file's row is planned with its own counts: 100 slots a layer beside 150 pins overflow the
    134 GiB GPU (the row is refused by name), 16 fit."""
    from moetier.engine.config import EngineConfig
    from moetier.plan.expert_plan import PlanRefused
    from moetier.plan.preflight import bench_preflight

    from moetier.checkpoint.random_bed import quantized

    cfg = quantized(presets.preset("glm-5.3-flash", 45), "nvfp4")
    pinned = {la: tuple(range(150)) for la in range(3, 45)}
    config = EngineConfig(max_num_seqs=8, max_model_len=128)
    rows = [("slots", 0.01)]
    bench_preflight(cfg, rows, config, "134GiB", "125GiB", pinned=pinned, slots_per_layer=dict.fromkeys(pinned, 16))
    with pytest.raises(PlanRefused, match="the slots row of the slots file does not fit"):
        bench_preflight(cfg, rows, config, "134GiB", "125GiB", pinned=pinned,
                        slots_per_layer=dict.fromkeys(pinned, 100))
