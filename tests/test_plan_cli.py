"""`moetier plan`, preflight in generate and bench batch, the audit's comparison, the machine's budgets
and the loader's byte progress (issue 14). All on the CPU."""

from __future__ import annotations

import json
import shutil

import pytest
from typer.testing import CliRunner

from moetier.cli.app import app
from moetier.engine.config import EngineConfig
from moetier.errors import CheckpointError, MoetierError
from moetier.experts.placement import ExpertOptions
from moetier.plan import audit, machine
from moetier.plan.expert_plan import PlanRefused
from moetier.plan.preflight import preflight
from moetier.plan.units import GiB
from tests.test_cli_errors import refuse

SIZES = ["--gpu-memory", "139GiB", "--host-memory", "100GiB"]


def invoke(*args: str):
    return CliRunner().invoke(app, list(args))


@pytest.mark.parametrize("args,says", [
    ((), "give --model DIR or --preset NAME"),
    (("--preset", "nope", *SIZES), "unknown preset 'nope'"),
    (("--preset", "qwen3-30b-a3b", "--layers", "99", *SIZES), "--layers 99"),
    (("--preset", "qwen3-30b-a3b", "--gpu-memory", "139"), "say the unit"),
    (("--preset", "qwen3-30b-a3b", "--gpu-memory", "139Gb"), "ambiguous"),
    (("--preset", "qwen3-30b-a3b", "--gpu-memory", "12 furlongs"), "unknown unit"),
    (("--preset", "qwen3-30b-a3b", "--gpu-memory", "139GiB", "--host-memory", "-1GB"), "--host-memory"),
    (("--preset", "qwen3-30b-a3b", "--max-num-seqs", "0", *SIZES), "--max-num-seqs 0"),
    (("--preset", "qwen3-30b-a3b", "--max-model-len", "1", *SIZES), "--max-model-len 1"),
    (("--preset", "qwen3-30b-a3b", "--expert-slots", "0", *SIZES), "--expert-slots 0"),
    (("--preset", "qwen3-30b-a3b", "--expert-slots", "500", *SIZES), "between 1 and the number of experts (128)"),
    (("--preset", "qwen3-30b-a3b", "--expert-slots", "8", "--expert-budget", "50%", *SIZES), "not several"),
    (("--preset", "qwen3-30b-a3b", "--expert-budget", "150%", *SIZES), "at most 100%"),
    (("--preset", "qwen3-30b-a3b", "--expert-backend", "ram", *SIZES), "choose auto, resident, slots, uva or hybrid"),
    (("--preset", "qwen3-30b-a3b", "--trace", "/nonexistent.mtrace", *SIZES), "no such file"),
])
def test_plan_cli_errors(args, says):
    assert says in refuse("plan", *args)


def test_plan_needs_a_budget_without_a_card(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    err = refuse("plan", "--preset", "qwen3-30b-a3b")
    assert "--gpu-memory" in err and "--device cpu" in err
    err = refuse("plan", "--preset", "qwen3-30b-a3b", "--device", "cuda", "--gpu-memory", "90%")
    assert "no CUDA device" in err


def test_plan_table_and_json():
    r = invoke("plan", "--preset", "qwen3-30b-a3b", "--layers", "8", *SIZES)
    assert r.exit_code == 0, r.output
    for word in ("dense: embedding", "routed experts", "KV pages", "CUDA graph pool", "CUDA context", "headroom",
                 "GiB", "GB", "resident"):
        assert word in r.stdout
    r = invoke("plan", "--preset", "qwen3-30b-a3b", "--gpu-memory", "24GiB", "--host-memory", "100GiB",
               "--max-model-len", "8192", "--json")
    d = json.loads(r.stdout)
    assert r.exit_code == 0 and d["backend"] == "slots" and d["units"] == "bytes"
    assert d["device_total"] <= 24 * GiB - GiB and d["fits"]
    assert d["host_total"] > 54 * GiB  # the exact store of every expert


def test_plan_refusal_one_screen_with_alternatives():
    r = invoke("plan", "--preset", "qwen3-30b-a3b", "--expert-backend", "resident", "--gpu-memory", "40GiB",
               "--host-memory", "100GiB", "--max-model-len", "8192")
    assert r.exit_code == 2
    assert r.stderr.startswith("error: the plan does not fit: the device needs")
    assert "what would fit instead:" in r.stderr and "--expert-slots" in r.stderr
    assert len(r.stderr.splitlines()) <= 50


def test_plan_expert_budget_and_trace(tmp_path):
    import numpy as np

    from moetier.traces.format import write_trace

    ids = np.stack([np.stack([np.random.default_rng(t).choice(128, 8, replace=False) for _ in range(8)])
                    for t in range(300)])
    write_trace(tmp_path / "t.mtrace", ids, {"experts": 128, "top_k": 8, "layers": list(range(8))})
    r = invoke("plan", "--preset", "qwen3-30b-a3b", "--layers", "8", *SIZES, "--expert-budget", "25%",
               "--trace", str(tmp_path / "t.mtrace"), "--json")
    d = json.loads(r.stdout)
    assert r.exit_code == 0, r.output
    assert d["backend"] == "slots" and sum(d["slots_per_layer"].values()) <= 8 * 32
    assert 0 < d["prediction"]["hit_rate"] < 1 and d["prediction"]["tok_per_s"] > 0
    r = invoke("plan", "--preset", "qwen3-30b-a3b", "--layers", "8", *SIZES, "--expert-budget", "2GiB", "--json")
    assert sum(json.loads(r.stdout)["slots_per_layer"].values()) == 2 * GiB // (9 * 2**20)


# -- preflight -------------------------------------------------------------------------------------------
def test_preflight_cpu_and_host_refusal(tiny_ckpt):
    plan, config, shares = preflight(tiny_ckpt, "auto", "cpu", EngineConfig(experts=ExpertOptions("auto")), None, "64GiB")
    assert shares is None  # one process: no rank shares
    assert plan.fits() and config.experts.backend == "resident"
    with pytest.raises(PlanRefused, match="what would fit instead"):
        preflight(tiny_ckpt, "auto", "cpu", EngineConfig(experts=ExpertOptions("auto")), None, "2GiB")


def test_preflight_missing_shard(tiny_ckpt, tmp_path):
    broken = tmp_path / "ckpt"
    shutil.copytree(tiny_ckpt, broken)
    shard = sorted(broken.glob("*.safetensors"))[0]
    shard.unlink()
    with pytest.raises((CheckpointError, MoetierError)):
        preflight(broken, "auto", "cpu", EngineConfig(experts=ExpertOptions("auto")), None, "64GiB")


def test_generate_refuses_before_loading_and_reports_the_plan(tiny_ckpt):
    r = invoke("generate", "hi", "--model", str(tiny_ckpt), "--device", "cpu", "--host-memory", "2GiB")
    assert r.exit_code == 2 and r.stderr.startswith("error: the plan does not fit")
    r = invoke("generate", "hi", "--model", str(tiny_ckpt), "--device", "cpu", "--max-tokens", "2",
               "--max-model-len", "256", "--json")
    d = json.loads(r.stdout)
    assert d["plan"]["backend"] == "resident" and d["plan"]["request"]["max_model_len"] == 256
    assert d["plan"]["request"]["kv_tokens"] == 256 and d["audit"] == []  # the audit runs on CUDA


def test_bench_batch_refuses(tiny_ckpt):
    r = invoke("bench", "batch", "--model", str(tiny_ckpt), "--device", "cpu", "--host-memory", "1GiB")
    assert r.exit_code == 2 and "the plan does not fit" in r.stderr


# -- audit, machine, loader --------------------------------------------------------------------------------
def test_audit_compares_and_warns_beyond_5_percent():
    from moetier import presets
    from moetier.plan.memory import PlanRequest, count
    import torch

    plan = count(PlanRequest(presets.preset("qwen3-30b-a3b", layers=2), torch.bfloat16, "cuda", max_model_len=1024))
    load = plan.stage_allocated("load")
    m = {"allocated": load, "reserved": load, "device_used": load, "host_VmRSS": 0, "host_VmLck": 0,
         "host_VmPin": 0}
    base = {"allocated": 0, "reserved": 0, "device_used": 0, "host_VmRSS": 0}
    rep = audit.report(plan, "after load", m, base)
    allocated = next(r for r in rep["rows"] if r["what"] == "torch allocated")
    assert allocated["off"] == 0
    m["allocated"] = int(load * 1.2)
    rep = audit.report(plan, "after load", m, base)
    assert any("torch allocated after load" in w and "+20.0%" in w for w in rep["warnings"])
    assert "memory audit after load:" in audit.lines(rep)[0]


def test_audit_counts_driver_memory_and_first_use_pages_at_capture_and_floors_small_gaps():
    from moetier import presets
    from moetier.plan import residents
    from moetier.plan.memory import PlanRequest, count
    import torch

    cfg = presets.preset("qwen3-30b-a3b", layers=8)
    plan = count(PlanRequest(cfg, torch.bfloat16, "cuda", backend="slots", slots_per_layer=dict.fromkeys(range(8), 64),
                             max_model_len=4096, max_num_seqs=8))
    driver = residents.modules_bytes(8)
    assert driver == 228 * 2**20 + 8 * 2458 * 1024
    assert sum(i.bytes for i in plan.device if i.stage == "driver") == driver
    ws = [i for i in plan.device if i.name.startswith("cuBLAS")]
    assert [(i.stage, i.bytes) for i in ws] == [("capture", 64 * 2**20), ("runtime", 32 * 2**20)]
    base = {"allocated": 0, "reserved": 0, "device_used": 0, "host_VmRSS": 0}
    store = next(i.bytes for i in plan.host if i.name.startswith("expert store"))
    for stage, stages, extra_host in (("after load", ("load",), 0),
                                      ("after graph capture", ("load", "capture"), residents.HOST_FIRST_USE)):
        use = sum(i.bytes for i in plan.device if i.stage in stages or i.name.startswith("allocator slack"))
        rows = {r.what: r for r in audit.compare(plan, stage, {
            "allocated": 0, "reserved": use, "device_used": use, "host_VmRSS": store + extra_host,
            "host_VmLck": 0, "host_VmPin": 0}, base)}
        assert rows["torch reserved"].planned == use
        assert rows["device used (cudaMemGetInfo)"].planned == use + (driver if "capture" in stages else 0)
        assert abs(rows["host resident (VmRSS)"].off) < 1e-5  # all but the graph inputs' pinned twins
    # a resident run plans almost nothing on the host: 80 MiB more is noise, not a warning
    res = count(PlanRequest(cfg, torch.bfloat16, "cuda", backend="resident", max_model_len=4096, max_num_seqs=8))
    m = {"allocated": res.stage_allocated("load"), "reserved": 0, "device_used": 0, "host_VmRSS": 80 * 2**20,
         "host_VmLck": 0, "host_VmPin": 0}
    assert not [w for w in audit.report(res, "after load", m, base)["warnings"] if "host" in w]
    assert residents.cublas_workspace(":4096:8") == 32 * 2**20
    assert residents.cublas_workspace(":4096:2:16:8") == 8 * 2**20 + 128 * 2**10
    assert residents.cublas_workspace("") == residents.CUBLAS_WORKSPACE_DEFAULT


def test_machine_reads_meminfo_cgroup_and_status(tmp_path):
    (tmp_path / "meminfo").write_text("MemTotal: 1000 kB\nMemAvailable: 800 kB\n")
    cg = tmp_path / "cg"
    cg.mkdir()
    (cg / "memory.max").write_text("512000\n")
    (cg / "memory.current").write_text("100000\n")
    assert machine.host_available(tmp_path / "meminfo", cg) == (412000, "cgroup memory.max - memory.current")
    (cg / "memory.max").write_text("max\n")
    assert machine.host_available(tmp_path / "meminfo", cg) == (800 * 1024, "MemAvailable")
    (tmp_path / "status").write_text("VmRSS:\t  2048 kB\nVmLck:\t0 kB\n")
    assert audit.proc_status(tmp_path / "status")["VmRSS"] == 2048 * 1024


def test_loader_progress_reports_bytes(tiny_ckpt):
    from moetier.checkpoint.index import Checkpoint
    from moetier.checkpoint.loader import load_model

    seen = []
    load_model(tiny_ckpt, progress=lambda done, total: seen.append((done, total)))
    total = Checkpoint(tiny_ckpt).nbytes()
    assert seen[-1][0] == seen[-1][1] and abs(seen[-1][1] - total) <= total * 0.01
    assert all(a[0] <= b[0] for a, b in zip(seen, seen[1:]))


def test_bench_preflight_names_the_row_that_does_not_fit():
    from moetier import presets
    from moetier.engine.config import EngineConfig
    from moetier.plan.preflight import bench_preflight

    cfg = presets.preset("qwen3-30b-a3b", layers=8)
    config = EngineConfig(max_num_seqs=8)
    bench_preflight(cfg, [("slots", 0.25)], config, gpu_memory="8GiB", host_memory="64GiB")  # fits
    with pytest.raises(PlanRefused, match="the resident row does not fit") as e:
        bench_preflight(cfg, [("slots", 0.25), ("resident", 1.0)], config, gpu_memory="8GiB", host_memory="64GiB")
    assert "the device needs" in str(e.value) and "what would fit instead" in str(e.value)
    with pytest.raises(PlanRefused, match="the random weights' host store does not fit"):
        bench_preflight(cfg, [("slots", 0.25)], config, gpu_memory="8GiB", host_memory="8GiB")
    with pytest.raises(PlanRefused, match="the hybrid row at 50% does not fit"):
        bench_preflight(cfg, [("hybrid", 0.5)], config, gpu_memory="6GiB", host_memory="64GiB")
