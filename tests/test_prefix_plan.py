"""The prefix cache in the memory plan and on the command line: the host KV tier counted (and pinned)
in the host budget next to the expert store, a budget that cannot hold both refused; state checkpoints
counted on the device; the options' nonsense refused in one line."""

from __future__ import annotations

import mmap

import pytest
import torch
from typer.testing import CliRunner

from moetier import presets
from moetier.cli.app import app
from moetier.engine.config import EngineConfig
from moetier.errors import MoetierError
from moetier.plan.memory import PlanRequest, count
from moetier.plan.units import GiB

BF16 = torch.bfloat16


def host_item(plan, name):
    return next((i for i in plan.host if i.name.startswith(name)), None)


def test_host_tier_counted_and_pinned_next_to_the_expert_store():
    cfg = presets.preset("qwen3-30b-a3b")
    slots = dict.fromkeys(cfg.moe_layers, 64)
    base = dict(backend="slots", slots_per_layer=slots, max_model_len=4096, max_num_seqs=4)
    without = count(PlanRequest(cfg, BF16, "cuda", **base))
    plan = count(PlanRequest(cfg, BF16, "cuda", kv_host_bytes=16 * GiB, **base))
    tier = host_item(plan, "KV host tier")
    page = 48 * 2 * 4 * 128 * 2 * 16  # layers x (k, v) x kv heads x head_dim x bf16 x page_size
    assert host_item(without, "KV host tier") is None and tier is not None
    assert tier.bytes == 16 * GiB // page * page + mmap.PAGESIZE  # one page-aligned block
    assert plan.request["kv_host_pages"] == 16 * GiB // page
    assert plan.pinned - without.pinned == 16 * GiB // page * page
    assert host_item(plan, "expert store") is not None  # both budgets, one table
    # a host that holds the expert store but not the tier as well is refused, saying the host is short
    room = without.host_total + without.host_margin + 8 * GiB
    short = count(PlanRequest(cfg, BF16, "cuda", kv_host_bytes=16 * GiB, host_available=room, **base))
    assert any("the host needs" in p for p in short.problems())
    assert not count(PlanRequest(cfg, BF16, "cuda", kv_host_bytes=4 * GiB, host_available=room, **base)).problems()


def test_state_checkpoints_counted_for_linear_attention_models():
    cfg = presets.preset("tiny-glm5-next")
    on = count(PlanRequest(cfg, BF16, "cuda", max_model_len=1024, max_num_seqs=4))
    off = count(PlanRequest(cfg, BF16, "cuda", max_model_len=1024, max_num_seqs=4, prefix_caching=False))
    names = [i.name for i in on.device]
    assert "KDA state checkpoints" in names and "KDA state checkpoints" not in [i.name for i in off.device]


def test_engine_config_refuses_a_host_tier_without_the_cache():
    with pytest.raises(MoetierError, match="needs prefix caching on"):
        EngineConfig.of(enable_prefix_caching=False, kv_host_bytes=1 << 30)
    with pytest.raises(MoetierError, match="kv_host_bytes must be a non-negative"):
        EngineConfig.of(kv_host_bytes=-1)
    assert EngineConfig().enable_prefix_caching and EngineConfig().kv_host_bytes == 0


@pytest.mark.parametrize("args,says", [
    (("--kv-host-memory", "16"), "say the unit"),
    (("--kv-host-memory", "-3GiB"), "above zero"),
    (("--kv-host-memory", "1GiB", "--no-enable-prefix-caching"), "needs prefix caching on"),
    (("--kv-host-memory", "1KiB"), "holds no KV page"),
])
def test_generate_refuses_bad_prefix_options(args, says):
    r = CliRunner().invoke(app, ["generate", "hi", "--device", "cpu", "--max-tokens", "1", *args])
    assert r.exit_code == 2, r.output
    err = r.stderr.strip()
    assert err.startswith("error: ") and says in err and "Traceback" not in r.output


def test_generate_runs_with_and_without_the_cache():
    for flag in ("--enable-prefix-caching", "--no-enable-prefix-caching"):
        r = CliRunner().invoke(app, ["generate", "hello", "--device", "cpu", "--max-tokens", "2", flag,
                                     "--kv-host-memory", "0"])
        assert r.exit_code == 0, r.output


def test_plan_command_lists_the_host_tier_beside_the_expert_store():
    r = CliRunner().invoke(app, ["plan", "--preset", "qwen3-30b-a3b", "--layers", "8", "--gpu-memory", "139GiB",
                                 "--host-memory", "200GiB", "--expert-backend", "slots", "--expert-budget", "50%",
                                 "--kv-host-memory", "32GiB"])
    assert r.exit_code == 0, r.output
    assert "KV host tier (exact size)" in r.stdout and "expert store" in r.stdout
    r = CliRunner().invoke(app, ["plan", "--preset", "qwen3-30b-a3b", "--layers", "8", "--gpu-memory", "139GiB",
                                 "--host-memory", "40GiB", "--expert-backend", "slots", "--expert-budget", "50%",
                                 "--kv-host-memory", "32GiB"])
    assert r.exit_code == 2 and "the host needs" in r.stderr


def test_verify_graphs_counted_for_ngram_speculation_only():
    """n-gram speculation captures verify graphs (engine/verify_graphs.py) beside the decode graphs: the
    plan counts their inputs and grows the pool to the largest verify step (with the DSA indexer's
    scores of every verified row); MTP drafting and models with recurrent state capture none."""
    from moetier.plan import residents as r

    assert r.verify_shapes((1, 2, 4, 8, 16, 32, 64), 3, 64) == [
        (1, 2), (2, 2), (4, 2), (8, 2), (16, 2), (32, 2), (1, 3), (2, 3), (4, 3), (8, 3), (16, 3),
        (1, 4), (2, 4), (4, 4), (8, 4), (16, 4)]
    cfg = presets.preset("qwen3-30b-a3b")
    base = dict(max_model_len=4096, max_num_seqs=8)
    off, ngram = count(PlanRequest(cfg, BF16, "cuda", **base)), count(PlanRequest(cfg, BF16, "cuda", draft_tokens=3, **base))
    mtp = count(PlanRequest(cfg, BF16, "cuda", draft_tokens=3, draft_distributions=True, **base))
    item = {p: {i.name: i.bytes for i in plan.device} for p, plan in (("off", off), ("ngram", ngram), ("mtp", mtp))}
    assert "verify graph inputs" in item["ngram"] and "verify graph inputs" not in item["mtp"]
    assert "verify graph inputs" not in item["off"]
    # 32 rows (8 sequences x 4) of logits and the verify arithmetic against 8 rows of decode: a larger pool
    assert item["ngram"]["CUDA graph pool"] > item["mtp"]["CUDA graph pool"] == item["off"]["CUDA graph pool"]
    glm = presets.preset("tiny-glm5-next")
    names = [i.name for i in count(PlanRequest(glm, BF16, "cuda", draft_tokens=3, **base)).device]
    assert "verify graph inputs" not in names  # KDA state: its verify steps stay eager
    dsa = presets.preset("tiny-glm5")
    pool = {d: {i.name: i.bytes for i in count(PlanRequest(dsa, BF16, "cuda", draft_tokens=d, **base)).device}
            for d in (0, 3)}
    assert "verify graph inputs" in pool[3]
    assert pool[3]["CUDA graph pool"] > pool[0]["CUDA graph pool"]
