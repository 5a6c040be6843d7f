"""The memory plan's arithmetic on the real presets against figures computed by hand, units, and
automatic sizing never exceeding its budget (issue 14)."""

from __future__ import annotations

import pytest
import torch

from moetier import presets
from moetier.errors import MoetierError
from moetier.plan import residents
from moetier.plan.memory import PlanRequest, count
from moetier.plan.sizing import auto_plan, margin, suggestions
from moetier.plan.units import GB, GiB, MiB, both, gb, gib, parse_size

BF16 = torch.bfloat16


def item(plan, name: str) -> int:
    return next(i.bytes for i in plan.device + plan.host if i.name.startswith(name))


# -- units ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("text,total,want", [
    ("139GiB", None, 139 * 2**30), ("600GB", None, 600 * 10**9), ("512 MiB", None, 512 * 2**20),
    ("1.5TiB", None, int(1.5 * 2**40)), ("80%", 100 * 2**30, 80 * 2**30), ("4096B", None, 4096),
    ("2gib", None, 2 * 2**30),
])
def test_parse_size(text, total, want):
    assert parse_size(text, "--gpu-memory", total) == want


@pytest.mark.parametrize("text,says", [
    ("139", "say the unit"), ("12Gb", "ambiguous"), ("12 parsecs", "unknown unit"), ("80%", "a percentage needs"),
    ("-3GiB", "above zero"), ("0GiB", "above zero"), ("nanGiB", "give a size"), ("", "give a size"),
])
def test_parse_size_refuses(text, says):
    with pytest.raises(MoetierError, match=says):
        parse_size(text, "--gpu-memory")


def test_share_above_100_refused():
    with pytest.raises(MoetierError, match="at most 100%"):
        parse_size("120%", "--host-memory", 10 * GiB)


def test_formatting_says_the_unit():
    assert gib(139 * GiB) == "139.00 GiB"
    assert gb(139 * GiB) == "149.25 GB"  # 139 x 2^30 / 10^9 = 149.250... : the 7% of reference 000
    assert gib(5 * MiB) == "5.0 MiB"
    assert both(GB) == "0.93 GiB (1.00 GB)"


# -- the arithmetic on the published presets ---------------------------------------------------------
def test_qwen3_30b_by_hand():
    cfg = presets.preset("qwen3-30b-a3b")
    plan = count(PlanRequest(cfg, BF16, "cuda", backend="resident", max_model_len=40960, max_num_seqs=1))
    # embedding and untied LM head: 2 x vocab 151936 x hidden 2048 x 2 bytes
    assert item(plan, "dense: embedding") == 2 * 151936 * 2048 * 2 == 1_244_659_712
    # per layer: 2 norms (2048) + q (32*128 x 2048) + k, v (4*128 x 2048 each) + o (2048 x 32*128)
    #            + q_norm, k_norm (128 each) + router (128 x 2048); 48 layers; + final norm (2048); x 2 bytes
    per_layer = 2 * 2048 + 4096 * 2048 + 2 * 512 * 2048 + 2048 * 4096 + 2 * 128 + 128 * 2048
    assert per_layer == 19_140_864
    assert item(plan, "dense: decoder layers") == (48 * per_layer + 2048) * 2 == 1_837_527_040
    # one expert row: gate_up (2 x 768 x 2048) + down (2048 x 768), bf16 = 9 MiB; 48 layers x 128 experts = 54 GiB
    assert plan.row_bytes == 3 * 768 * 2048 * 2 == 9 * MiB
    assert item(plan, "routed experts") == 48 * 128 * 9 * MiB == 54 * GiB
    # KV: k and v, 48 layers x 4 kv heads x 128 x 2 bytes = 98,304 B/token; 40,960 tokens + one 16-token page
    assert item(plan, "KV pages") == 2 * 48 * 4 * 128 * 2 * (40960 + 16) == 4_028_104_704
    # expert workspaces: GemmScratch for 64 x 8 = 512 pairs: 4 int32 [512] + h [512, 768] + y [512, 2048] fp32
    # (each tensor rounded up to the allocator's 512-byte blocks: 2048 B are already whole blocks)
    assert item(plan, "expert workspaces") == 4 * 2048 + 512 * 768 * 4 + 512 * 2048 * 4
    # resident: no host store; nothing pinned
    assert plan.pinned == 0 and not any(i.name.startswith("expert store") for i in plan.host)


def test_qwen3_30b_slots_host_store_exact():
    cfg = presets.preset("qwen3-30b-a3b")
    slots = dict.fromkeys(cfg.moe_layers, 32)
    plan = count(PlanRequest(cfg, BF16, "cuda", backend="slots", slots_per_layer=slots, max_model_len=4096,
                             page=4096))
    assert item(plan, "routed experts") == 48 * 32 * 9 * MiB  # 13.5 GiB of slots
    # the store: every expert, exact; one alignment page per layer block (store._aligned_empty)
    assert item(plan, "expert store") == 48 * 128 * 9 * MiB + 48 * 4096
    assert plan.pinned == 54 * GiB  # cudaHostRegister on the exact bytes
    # torch's pinned allocator would have charged the next power of two of each 1.125 GiB block: 2 GiB
    assert residents.torch_pinned_would_charge(48, 128, 9 * MiB) == 48 * 2 * GiB
    # slot state per layer: SlotCache (3 x [128] int32, [32] int32, [32] int64, clock, stats), the prefill
    # refresh counter ([1] int64) and the bookkeeping scratch ([128], [32], [32] victims, [1] int32 and
    # 3 x [512] int32 lists); every tensor under 512 B takes one 512-byte block: 12 of them, and the
    # three lists 2048 B each
    gemm = 4 * 2048 + 512 * 768 * 4 + 512 * 2048 * 4
    per_layer_state = 12 * 512 + 3 * 2048
    assert item(plan, "expert workspaces") == gemm + 48 * per_layer_state


def test_qwen3_30b_hybrid_counts_both_modes_buffers():
    """hybrid over slots: the pieces' pair outputs and the nodes mode's buffers in the workspaces (one set
    per model, both counted), and its host staging, pinned by torch's allocator, on the host."""
    cfg = presets.preset("qwen3-30b-a3b")
    slots = dict.fromkeys(cfg.moe_layers, 32)

    def plan(backend):
        return count(PlanRequest(cfg, BF16, "cuda", backend=backend, slots_per_layer=slots, max_model_len=4096))
    hybrid, plain = plan("hybrid"), plan("slots")
    p, h = 64 * 8, 2048  # pairs of 64 decode tokens of top-8; hidden
    statics = [4 * p * h]  # the pieces' pair outputs
    nodes = [4 * p * h, 4 * (p + 1) * h, 4 * p * h, 8 * p, 8 * p, 8 * (1 + 2 * p), 8 * p, 4 * 128, 4 * 128]
    blocks = sum(-(-n // 512) * 512 for n in statics + nodes)  # the allocator's 512-byte blocks
    assert item(hybrid, "expert workspaces") - item(plain, "expert workspaces") == blocks
    # pinned 2^n, the pieces' twice (a grown buffer's smaller blocks stay cached): ids 4 KiB, hidden bf16
    # 256 KiB, positions 4 KiB, outputs 4 MiB; the nodes': hidden fp32 512 KiB, job 8,200 B -> 16 KiB,
    # outputs 4 MiB; and h fp32 [512, 768] unpinned
    want = 2 * (4 + 256 + 4 + 4096) * 1024 + (512 + 16 + 4096) * 1024 + 512 * 768 * 4
    assert item(hybrid, "hybrid host staging") == want
    assert not any(i.name == "hybrid host staging" for i in plain.host)


def test_qwen3_235b_by_hand():
    cfg = presets.preset("qwen3-235b-a22b")
    plan = count(PlanRequest(cfg, BF16, "cuda", backend="resident", max_model_len=8192, max_num_seqs=4))
    assert item(plan, "dense: embedding") == 2 * 151936 * 4096 * 2 == 2_489_319_424
    per_layer = 2 * 4096 + 8192 * 4096 + 2 * 512 * 4096 + 4096 * 8192 + 2 * 128 + 128 * 4096
    assert per_layer == 71_835_904
    assert item(plan, "dense: decoder layers") == (94 * per_layer + 4096) * 2
    assert plan.row_bytes == 3 * 1536 * 4096 * 2 == 36 * MiB
    assert plan.expert_bytes == 94 * 128 * 36 * MiB == 423 * GiB
    # KV: 2 x 94 layers x 4 x 128 x 2 B = 192,512 B/token; 4 requests x 8,192 tokens + one page
    assert item(plan, "KV pages") == 2 * 94 * 4 * 128 * 2 * (4 * 8192 + 16)
    assert plan.request["graph_sizes"] == [1, 2, 4]


def test_cpu_plan_counts_everything_on_the_host():
    cfg = presets.preset("qwen3-30b-a3b", layers=2)
    plan = count(PlanRequest(cfg, BF16, "cpu", backend="resident", max_model_len=1024, host_available=64 * GiB))
    assert plan.device == [] and plan.gpu_budget is None
    assert item(plan, "routed experts") == 2 * 128 * 9 * MiB
    assert plan.fits()


# -- automatic sizing ----------------------------------------------------------------------------------
@pytest.mark.parametrize("name,layers", [("qwen3-30b-a3b", 8), ("qwen3-30b-a3b", None), ("qwen3-235b-a22b", None)])
def test_auto_sizing_never_exceeds_the_budget(name, layers):
    cfg = presets.preset(name, layers=layers)
    seen = set()
    for budget_gib in (8, 12, 16, 24, 40, 64, 80, 139, 200, 600):
        budget = budget_gib * GiB
        req = PlanRequest(cfg, BF16, "cuda", max_model_len=8192, max_num_seqs=4, gpu_budget=budget)
        try:
            plan = auto_plan(req)
        except MoetierError as e:
            assert "one slot per layer needs" in str(e)
            seen.add("refused")
            continue
        seen.add(plan.backend)
        assert plan.device_total <= budget - margin(budget), (budget_gib, plan.device_total)
        if plan.backend == "slots":
            assert all(1 <= s <= cfg.num_experts for s in plan.slots_per_layer.values())
            # not wasteful: one more slot in every layer would pass the limit
            more = {k: min(cfg.num_experts, v + 1) for k, v in plan.slots_per_layer.items()}
            assert count(PlanRequest(cfg, BF16, "cuda", backend="slots", slots_per_layer=more, max_model_len=8192,
                                     max_num_seqs=4)).device_total > budget - margin(budget)
    assert "slots" in seen


def test_auto_sizing_picks_resident_when_everything_fits():
    cfg = presets.preset("qwen3-30b-a3b", layers=8)  # 9 GiB of experts
    plan = auto_plan(PlanRequest(cfg, BF16, "cuda", max_model_len=4096, gpu_budget=139 * GiB))
    assert plan.backend == "resident" and "resident" in plan.notes[0]


# -- refusals and what would fit instead ---------------------------------------------------------------
def test_device_refusal_suggests_slots_length_and_batch():
    cfg = presets.preset("qwen3-30b-a3b")
    req = PlanRequest(cfg, BF16, "cuda", backend="slots", slots_per_layer=dict.fromkeys(cfg.moe_layers, 64),
                      max_model_len=32768, max_num_seqs=8, gpu_budget=40 * GiB)
    plan = count(req)
    assert not plan.fits() and "the device needs" in plan.problems()[0]
    alt = suggestions(req, plan)
    assert any(a.startswith("--expert-backend slots --expert-slots") for a in alt)
    length = int(next(a for a in alt if a.startswith("--max-model-len")).split()[1])
    batch = int(next(a for a in alt if a.startswith("--max-num-seqs")).split()[1])
    from dataclasses import replace

    assert count(replace(req, max_model_len=length)).device_total <= 40 * GiB
    assert count(replace(req, max_model_len=length + 16)).device_total > 40 * GiB
    assert count(replace(req, max_num_seqs=batch)).device_total <= 40 * GiB
    assert count(replace(req, max_num_seqs=batch + 1)).device_total > 40 * GiB


def test_host_and_memlock_refusals():
    cfg = presets.preset("qwen3-30b-a3b")
    req = PlanRequest(cfg, BF16, "cuda", backend="uva", max_model_len=4096, gpu_budget=139 * GiB,
                      host_available=60 * GiB, memlock=64 * 2**20)
    problems = count(req).problems()
    assert any("must keep 4.00 GiB" in p or "must keep" in p for p in problems)  # 54 GiB + 3 GiB + margin > 60
    assert any("ulimit -l" in p for p in problems)
    assert any("free" in a for a in suggestions(req, count(req)))
