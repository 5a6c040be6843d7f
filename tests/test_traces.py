"""Routing traces: format, synthesis and its calibration, the simulator against the slot cache,
record and replay through the engine, slots per layer."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
import torch

from moetier.errors import MoetierError
from moetier.experts.cache.slots import SlotCache, policy_for
from moetier.traces.format import TraceWriter, read_trace, write_trace
from moetier.traces.simulate import simulate
from moetier.traces.stats import coverage
from moetier.traces.synth import SynthParams, preset_params, synthesize


def test_format_round_trip_and_errors(tmp_path):
    rng = np.random.default_rng(0)
    ids = [rng.integers(0, 300, (3, t, 2)) for t in (5, 1, 1)]
    w = [rng.random((3, t, 2)).astype(np.float32) for t in (5, 1, 1)]
    with TraceWriter(tmp_path / "a.mtrace", 300, 2, [1, 3, 5], model="m") as tw:
        for i, (x, y) in enumerate(zip(ids, w)):
            tw.write(x, y, seq=np.arange(x.shape[1]) % 2, prefill=i == 0)
    t = read_trace(tmp_path / "a.mtrace")
    assert t.meta["model"] == "m" and t.layers == [1, 3, 5] and t.num_tokens == 7
    assert np.array_equal(t.ids, np.concatenate(ids, axis=1).transpose(1, 0, 2))
    assert np.allclose(t.weights, np.concatenate(w, axis=1).transpose(1, 0, 2), atol=1e-3)
    assert t.prefill.tolist() == [True] * 5 + [False] * 2 and t.steps.tolist() == [0] * 5 + [1, 2]
    data = (tmp_path / "a.mtrace").read_bytes()
    (tmp_path / "cut.mtrace").write_bytes(data[:-3])
    with pytest.raises(MoetierError, match="record 2 is truncated"):
        read_trace(tmp_path / "cut.mtrace")
    (tmp_path / "bad.mtrace").write_bytes(b"hello world, not a trace")
    with pytest.raises(MoetierError, match="not a moetier trace"):
        read_trace(tmp_path / "bad.mtrace")


def test_synthesis_is_seeded_and_validated():
    p = SynthParams(64, 4, 3, tokens=300, skew=1.0, reuse=0.4, layer_corr=0.3, seed=5)
    a, b = synthesize(p), synthesize(p)
    assert np.array_equal(a, b) and a.shape == (300, 3, 4)
    assert all(len(set(row)) == 4 for row in a.reshape(-1, 4).tolist())  # k distinct experts per token
    assert not np.array_equal(a, synthesize(SynthParams(**{**p.__dict__, "seed": 6})))
    with pytest.raises(MoetierError, match="reuse \\+ layer_corr must be at most 1"):
        SynthParams(64, 4, 3, reuse=0.7, layer_corr=0.5).check()
    with pytest.raises(MoetierError, match="top_k 9 must be in 1..experts"):
        SynthParams(8, 9, 1).check()


def test_presets_hit_their_published_figures():
    glm = synthesize(preset_params("glm-5.3-like"))
    lru = np.mean([simulate(glm[:, i], 256, 128, "lru", 8).hit_rate for i in range(glm.shape[1])])
    assert abs(lru - 0.75) <= 0.02  # reference 000: LRU with 128 of 256 slots hit 75%
    qwen = synthesize(preset_params("qwen3-30b-like"))
    cov = np.mean([coverage(qwen[:, i], 128) for i in range(qwen.shape[1])])
    assert 0.45 <= cov <= 0.51  # 45 to 51% of the experts cover 90% of routing


@pytest.mark.parametrize("policy", ["lru", "lfru", "lfu"])
def test_simulator_equals_the_slot_cache(policy):
    ids = synthesize(SynthParams(40, 4, 1, tokens=700, skew=1.1, reuse=0.3, seed=2))[:, 0]
    for slots in (4, 9, 20):
        cache = SlotCache(40, slots, policy=policy_for(policy, slots, 4))
        for i in range(0, len(ids), 1):
            cache.step_reference(torch.tensor(ids[i:i + 1]))
        ref = cache.read_stats()
        sim = simulate(ids, 40, slots, policy, 4)
        assert (ref["hits"], ref["misses"], ref["overflow"]) == (sim.hits, sim.misses, sim.overflow)
    # grouped steps (several tokens per step) too
    cache = SlotCache(40, 6, policy=policy_for(policy, 6, 4))
    for i in range(0, 600, 3):
        cache.step_reference(torch.tensor(ids[i:i + 3]))
    sim = simulate(ids[:600], 40, 6, policy, 4, group=np.arange(600) // 3)
    assert cache.read_stats()["hits"] == sim.hits and cache.read_stats()["overflow"] == sim.overflow


def test_belady_bounds_every_policy():
    ids = synthesize(SynthParams(64, 4, 1, tokens=1500, skew=1.0, reuse=0.3, seed=3))[:, 0]
    best = simulate(ids, 64, 16, "belady").hit_rate
    for pol in ("lru", "lfu", "lfru"):
        assert simulate(ids, 64, 16, pol, 4).hit_rate <= best


def test_engine_and_simulator_agree(tiny_ckpt, tmp_path):
    """A trace replayed through the engine's slot cache (torch path) takes the simulator's hits."""
    from moetier.engine import LLM
    from moetier.experts.placement import ExpertOptions
    from moetier.sampling_params import SamplingParams

    p = SynthParams(32, 4, 4, tokens=400, skew=1.0, reuse=0.3, layer_corr=0.2, seed=1)
    ids = synthesize(p)
    write_trace(tmp_path / "t.mtrace", ids, {"experts": 32, "top_k": 4, "layers": [0, 1, 2, 3]})
    steps = 250
    for policy in ("lru", "lfru"):
        llm = LLM(tiny_ckpt, device="cpu", experts=ExpertOptions("slots", slots=7, policy=policy),
                  replay_trace=tmp_path / "t.mtrace")
        llm.generate([[17]], SamplingParams(max_tokens=steps, ignore_eos=True))
        for i, moe in enumerate(llm.model.moe_blocks()):
            got = moe.experts.cache.read_stats()
            sim = simulate(ids[:steps, i], 32, 7, policy, 4)
            assert (got["hits"], got["misses"], got["overflow"]) == (sim.hits, sim.misses, sim.overflow)


def test_record_then_replay_reproduces_the_run(tiny_ckpt, tmp_path):
    def run(*extra):
        cmd = [sys.executable, "-m", "moetier.cli", "generate", "Once upon a time", "--model", str(tiny_ckpt),
               "--max-tokens", "40", "--ignore-eos", "--temperature", "1.0", "--seed", "4", "--json", *extra]
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        assert p.returncode == 0, p.stderr
        return json.loads(p.stdout)
    rec = tmp_path / "rec.mtrace"
    first = run("--record-trace", str(rec))
    t = read_trace(rec)
    n_prompt = len(first["prompt_token_ids"])
    assert t.num_tokens == n_prompt + 39 and t.layers == [0, 1, 2, 3] and t.top_k == 4
    assert t.prefill[:n_prompt].all() and not t.prefill[n_prompt:].any()
    assert ((t.ids >= 0) & (t.ids < 32)).all() and np.allclose(t.weights.sum(-1), 1, atol=1e-2)
    # replaying the recorded routing gives the same run (that replay drives the router is
    # test_engine_and_simulator_agree's to show: the random tiny model barely notices its experts)
    assert run("--replay-trace", str(rec))["token_ids"] == first["token_ids"]


def test_routers_list_their_picks_largest_weight_first():
    """The order a replayed trace pairs its experts in (layers/router.py): the softmax router's and the
    grouped sigmoid router's references, with equal weights in a row (the grouped one: lowest id
    first, as its CUDA kernel; tests/router_interpreter.py holds the kernels to the same order)."""
    from moetier.layers.router import grouped_route_reference, route_reference

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 16, generator=g)
    logits[0, 3] = logits[0, 9] = logits[0, 12] = 4.0  # three equal picks
    for renorm in (False, True):
        _, w = route_reference(logits, 4, renorm)
        assert bool((w[:, :-1] >= w[:, 1:]).all())
        for groups in ((4, 2), (1, 1)):
            ids, w = grouped_route_reference(logits, torch.zeros(16), 4, *groups, renorm, 2.5)
            assert bool((w[:, :-1] >= w[:, 1:]).all())
        assert ids[0, :3].tolist() == [3, 9, 12]  # one group: the three equal picks all kept


def test_replay_pairs_the_routers_weights_by_position():
    """The trace's k experts take the router's k weights in the router's order (largest first, on
    every device), with no sort of their own: inside the decode graph a sort costs five kernels per
    MoE layer."""
    from types import SimpleNamespace

    from moetier.traces.format import Trace
    from moetier.traces.hooks import Replayer

    block = SimpleNamespace(layer=0, route_hook=None)
    model = SimpleNamespace(cfg=SimpleNamespace(num_experts=8, top_k=3, num_layers=1), device=torch.device("cpu"),
                            moe_blocks=lambda: [block], real_rows=None)
    ids = np.array([[[5, 1, 7]], [[2, 0, 6]]])  # [N, L, k]
    trace = Trace({"experts": 8, "top_k": 3, "layers": [0]}, ids, None, np.zeros(2, np.int64), np.zeros(2, bool))
    Replayer(model, trace)
    w = torch.tensor([[0.5, 0.3, 0.2], [0.6, 0.3, 0.1]])
    got_ids, got_w = block.route_hook(0, torch.zeros(2, 3, dtype=torch.long), w)
    assert got_ids.tolist() == [[5, 1, 7], [2, 0, 6]] and got_w is w


def test_replay_refuses_a_trace_for_another_model(tiny_ckpt, tmp_path):
    from moetier.engine import LLM

    write_trace(tmp_path / "t.mtrace", np.zeros((4, 2, 8), dtype=np.int64), {"experts": 128, "top_k": 8,
                                                                             "layers": [0, 1]})
    with pytest.raises(MoetierError, match="routes top-8 of 128 experts; the model routes top-4 of 32"):
        LLM(tiny_ckpt, device="cpu", replay_trace=tmp_path / "t.mtrace")


def test_plan_slots_beats_an_even_split_and_loads(tiny_ckpt, tmp_path):
    from moetier.engine import LLM
    from moetier.experts.placement import ExpertOptions, read_slots_file
    from moetier.traces.slot_plan import plan

    # layers differ: a flat one, a skewed one, and two in between
    layers = [synthesize(SynthParams(32, 4, 1, tokens=800, skew=s, reuse=0.2, seed=i))[:, 0]
              for i, s in enumerate((0.0, 1.8, 0.8, 1.2))]
    ids = np.stack(layers, axis=1)
    write_trace(tmp_path / "t.mtrace", ids, {"experts": 32, "top_k": 4, "layers": [0, 1, 2, 3]})
    p = plan(read_trace(tmp_path / "t.mtrace"), budget=48, policy="lru")
    assert p["used"] == 48 and p["link_reads_per_token"] < p["even_link_reads_per_token"]
    assert p["slots"]["1"] < p["slots"]["0"]  # the skewed layer needs fewer slots than the flat one
    (tmp_path / "slots.json").write_text(json.dumps(p))
    per_layer = read_slots_file(tmp_path / "slots.json")
    llm = LLM(tiny_ckpt, device="cpu", experts=ExpertOptions("slots", slots_per_layer=per_layer))
    assert [m.experts.cache.num_slots for m in llm.model.moe_blocks()] == [per_layer[i] for i in range(4)]


def test_trace_cli(tmp_path):
    def run(*args):
        p = subprocess.run([sys.executable, "-m", "moetier.cli", "trace", *args], capture_output=True, text=True,
                           timeout=300)
        assert p.returncode == 0, p.stderr
        return p.stdout
    out = run("synth", "--experts", "32", "--topk", "4", "--layers", "2", "--tokens", "300", "--skew", "1.2",
              "--out", str(tmp_path / "s.mtrace"))
    assert "300 tokens, 2 layers" in out
    assert "experts covering 90% of routing" in run("stats", str(tmp_path / "s.mtrace"), "--slots", "8")
    sim = run("simulate", str(tmp_path / "s.mtrace"), "--slots", "8", "--preset", "tiny", "--policy", "lru",
              "--policy", "belady", "--plot", str(tmp_path / "c.png"), "--json", str(tmp_path / "s.json"))
    assert "belady" in sim and (tmp_path / "c.png").read_bytes()[:4] == b"\x89PNG"
    rows = json.loads((tmp_path / "s.json").read_text())["rows"]
    assert rows[0]["hit_rate"] <= rows[1]["hit_rate"]
    assert "slots per layer" in run("plan-slots", str(tmp_path / "s.mtrace"), "--budget", "20", "--out",
                                    str(tmp_path / "p.json"))


def test_damaged_header_and_nan_skew_are_clear_errors(tmp_path):
    from moetier.errors import MoetierError

    bad = tmp_path / "bad.mtrace"
    bad.write_bytes(b"MOETRACE\x01\x00\x00\x00\x05\x00\x00\x00{bad}")
    with pytest.raises(MoetierError, match="the trace header is damaged"):
        read_trace(bad)
    bad.write_bytes(b"MOETRACE\x01")
    with pytest.raises(MoetierError, match="the trace header is damaged"):
        read_trace(bad)
    with pytest.raises(MoetierError, match="skew must be a finite number"):
        SynthParams(experts=8, top_k=2, layers=1, skew=float("nan")).check()


def test_replay_with_the_cuda_router_kernels_equals_the_torch_routers():
    """The CUDA router kernels in Triton's interpreter against the torch routers under one replayed
    trace, on the embedded model and tiny glm5_next (tests/router_replay_interpreter.py)."""
    from tests.interpreter import run_script

    out = run_script("router_replay_interpreter.py")
    assert "tiny-glm5-next" in out and "tiny-stdlib" in out
