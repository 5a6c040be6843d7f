"""The automatic prefill chunk (plan/chunk.py): the pure choice, and the plan that counts it (the
large-step GEMM's scratch included), reduced or refused with the numbers when it does not fit."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from typer.testing import CliRunner

from moetier import presets
from moetier.cli.app import app
from moetier.engine.config import EngineConfig
from moetier.errors import MoetierError
from moetier.experts.placement import ExpertOptions
from moetier.plan import chunk as ch
from moetier.plan.memory import PlanRequest, count
from moetier.plan.expert_plan import plan_for
from moetier.plan.units import GiB

BF16 = torch.bfloat16


def test_choose_chunk_by_placement_and_budget():
    per_token = lambda t: 1000 * t  # noqa: E731
    assert ch.choose_chunk(True, per_token, 10**12)[0] == ch.RESIDENT_CHUNK
    tokens, why = ch.choose_chunk(False, per_token, 10**12, device="cpu")
    assert tokens == ch.RESIDENT_CHUNK and "CPU" in why
    tokens, why = ch.choose_chunk(False, per_token, None)
    assert tokens == ch.OFFLOAD_CAP and "no device budget" in why
    tokens, why = ch.choose_chunk(False, per_token, 10**12)
    assert tokens == ch.OFFLOAD_CAP and "the cap" in why
    tokens, why = ch.choose_chunk(False, per_token, 3_000_000)  # 3000 tokens: the ALIGN multiple below
    assert tokens == 2816 and "fit their budget" in why and "5%" in why
    assert ch.choose_chunk(False, per_token, 1000)[0] == ch.MIN_CHUNK  # never below the floor
    assert ch.choose_chunk(False, per_token, 3_000_000, cap=2048)[0] == 2048


def test_largest_is_a_binary_search_over_align_multiples():
    calls = []

    def ok(t):
        calls.append(t)
        return t <= 5000
    assert ch.largest(512, 8192, ok) == 4864 and len(calls) <= 7
    assert ch.largest(512, 8192, lambda t: False) is None
    assert ch.largest(600, 700, lambda t: True) is None  # no multiple of 256 in between


def req(budget_gib, **kw):
    cfg = presets.preset("qwen3-30b-a3b")
    return PlanRequest(cfg, BF16, "cuda", max_num_tokens=None, max_model_len=8192, max_num_seqs=4,
                       gpu_budget=None if budget_gib is None else int(budget_gib * GiB), **kw)


def act(plan):
    return ch.activations(plan)


def test_resident_takes_2048_and_offload_the_cap_with_fewer_slots():
    plan = plan_for(req(139), ExpertOptions("auto"))
    assert plan.backend == "resident" and plan.request["max_num_tokens"] == 2048 and plan.fits()
    assert plan.chunk["automatic"] and "middle ground" in plan.chunk["reason"]
    assert any(n.startswith("prefill chunk: 2048") for n in plan.notes)
    off = plan_for(req(40), ExpertOptions("auto"))
    assert off.backend == "slots" and off.request["max_num_tokens"] == 8192 and off.fits()
    at_512 = plan_for(replace(req(40), max_num_tokens=512), ExpertOptions("auto"))
    assert at_512.chunk is None  # as given: no automatic choice
    # the chunk's activations came out of the slots: automatic sizing gave them the rest
    assert sum(off.slots_per_layer.values()) < sum(at_512.slots_per_layer.values())
    assert act(off) - act(at_512) >= (8192 - 512) * 8 * (768 + 2048) * 4  # the large-step h and y


def test_offload_chunk_within_its_share_of_a_small_budget():
    plan = plan_for(req(20), ExpertOptions("uva"))
    t = plan.request["max_num_tokens"]
    assert ch.MIN_CHUNK <= t < ch.OFFLOAD_CAP and t % ch.ALIGN == 0
    assert act(plan) <= ch.ACTIVATION_SHARE * 20 * GiB
    bigger = count(replace(req(20), backend="uva", max_num_tokens=t + ch.ALIGN))
    assert act(bigger) > ch.ACTIVATION_SHARE * 20 * GiB  # the largest that fits its share


def test_a_chunk_that_does_not_fit_is_reduced_or_refused_with_the_numbers():
    at_512 = count(replace(req(None), backend="resident", max_num_tokens=512))
    tight = (at_512.device_total + 64 * 2**20) / GiB  # 512 fits, 2048 does not
    plan = plan_for(req(tight), ExpertOptions("resident"))
    t = plan.request["max_num_tokens"]
    assert 512 <= t < 2048 and plan.fits()
    assert f"reduced from 2048 to {t} tokens" in plan.chunk["reason"] and "over the device budget" in plan.chunk["reason"]
    # auto (which keeps a margin free) keeps the model resident at a smaller chunk rather than
    # offloading it for its chunk
    from moetier.plan.sizing import margin

    auto_tight = (at_512.device_total + 64 * 2**20) / (1 - 0.02) / GiB
    assert margin(int(auto_tight * GiB)) > GiB
    auto = plan_for(req(auto_tight), ExpertOptions("auto"))
    assert auto.backend == "resident" and 512 <= auto.request["max_num_tokens"] < 2048
    assert "no longer hold every expert" in auto.chunk["reason"]
    none = plan_for(req(at_512.device_total / GiB - 0.5), ExpertOptions("resident"))
    assert not none.fits() and none.request["max_num_tokens"] == 512
    assert "does not hold the plan even at 512" in none.chunk["reason"]


def test_engine_config_accepts_an_automatic_chunk_and_the_policy_is_checked():
    from moetier.engine.llm import LLM
    from moetier.experts.placement import ExpertOptions

    assert EngineConfig().max_num_tokens is None and EngineConfig().experts.prefill == "bypass"
    EngineConfig.of(max_num_tokens=None)
    with pytest.raises(MoetierError, match="prefill cache policy 'always': choose bypass or refresh"):
        LLM(device="cpu", experts=ExpertOptions("slots", slots=4, prefill="always"))
    with pytest.raises(MoetierError, match="max_num_tokens must be a positive integer"):
        EngineConfig.of(max_num_tokens=0)


def test_engine_chunk_without_a_plan():
    cfg = presets.preset("qwen3-30b-a3b")
    assert ch.engine_chunk(cfg, BF16, "cuda", False, 141 * GiB)[0] == 2048
    assert ch.engine_chunk(cfg, BF16, "cuda", True, 141 * GiB)[0] == 8192
    tokens, why = ch.engine_chunk(cfg, BF16, "cuda", True, 16 * GiB)
    assert 512 <= tokens < 8192 and "fit their budget" in why
    assert ch.engine_chunk(cfg, BF16, "cpu", True, None)[0] == 2048


def test_plan_cli_prints_the_chunk_and_its_reason():
    r = CliRunner().invoke(app, ["plan", "--preset", "qwen3-30b-a3b", "--gpu-memory", "40GiB", "--host-memory",
                                 "1000GiB", "--max-model-len", "8192", "--expert-backend", "uva"])
    assert r.exit_code == 0, r.output
    assert "prefill chunk: 8192 tokens, the cap" in " ".join(r.stdout.split())
    r = CliRunner().invoke(app, ["plan", "--preset", "qwen3-30b-a3b", "--gpu-memory", "40GiB", "--host-memory",
                                 "1000GiB", "--max-model-len", "8192", "--max-num-tokens", "1024", "--json"])
    assert r.exit_code == 0, r.output
    assert '"chunk": null' in r.stdout and '"max_num_tokens": 1024' in r.stdout
