"""Tensor and expert parallelism (moetier/dist, docs/parallel.md) with 2 ranks over gloo on the CPU:
the same logits as one process (fp32 tolerance: the row-split GEMMs and the all-reduce change the
summation order, so never bit-exactness), batch == alone, bad layouts refused before any spawn, and a
dead worker failing the engine loudly within seconds."""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch

from moetier.checkpoint.writer import make_checkpoint
from moetier.engine.llm import LLM
from moetier.engine.step import SeqStep, StepInput
from moetier.errors import MoetierError
from moetier.experts.parallel.ep import local_ids, owned_experts
from moetier.experts.placement import ExpertOptions
from moetier.parallel import Parallel
from moetier.sampling_params import SamplingParams

PROMPTS = [[5, 17, 99, 3, 250, 41, 7, 300, 12], [77, 2, 401], [9, 9, 130, 64, 211, 8]]
GREEDY = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)


def dense_bias_checkpoint(out):
    """`tiny` through transformers' save_pretrained with dense SwiGLU layers (every other layer) and
    q/k/v/o biases: the dense MLP's split, the split biases and o_proj's bias added once."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from moetier import presets
    from moetier.tokenizer.synthetic import write_tokenizer

    d = presets.preset_dict("tiny", dtype="float32")
    d.pop("architectures"), d.pop("model_type")
    d.update(decoder_sparse_step=2, attention_bias=True)
    d["rope_parameters"] = {"rope_type": "default", "rope_theta": d.pop("rope_theta")}
    torch.manual_seed(3)
    model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**d)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.uniform_(-0.5, 0.5)  # transformers starts them at zero
    model.save_pretrained(out)
    write_tokenizer(out)
    return out


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("tp")
    out = {name: make_checkpoint(root / name, name, seed=1, dtype="float32") for name in ("tiny", "tiny-gqa", "tiny-dsv3")}
    out["tiny-fused"] = make_checkpoint(root / "fused", "tiny", seed=2, dtype="float32", fused_experts=True)
    out["dense-bias"] = dense_bias_checkpoint(root / "dense-bias")
    return out


def steps() -> list[StepInput]:
    """A prefill of two sequences, then a decode step of both (the second reads the KV the first wrote)."""
    g = SamplingParams(temperature=0.0)
    a, b = PROMPTS[0], PROMPTS[2]
    pre = StepInput([SeqStep("a", 0, a, [0], True, g, 0, 0), SeqStep("b", 0, b, [1], True, g, 0, 0)])
    dec = StepInput([SeqStep("a", len(a), [33], [0], True, g, 0, 1), SeqStep("b", len(b), [44], [1], True, g, 0, 1)])
    return [pre, dec]


def logits_of(llm: LLM) -> list[torch.Tensor]:
    """Every token's logits [N, V] of each step, run through the engine's runner (all ranks)."""
    return [llm.model.logits(llm.runner.forward_only(s)) for s in steps()]


def close_enough(got: torch.Tensor, ref: torch.Tensor) -> None:
    scale = ref.abs().max()
    assert scale > 0.1  # a real signal, not zeros on both sides
    err = (got - ref).abs().max()
    assert err <= 1e-5 * scale, f"max |diff| {err:.3g} against max |logit| {scale:.3g}"


ENGINE = dict(device="cpu", kv_tokens=256, page_size=16, max_num_seqs=8, dist_timeout_s=60.0)


@pytest.mark.parametrize("preset,tp,ep,backend", [
    ("tiny", 2, 1, "resident"), ("tiny", 2, 1, "slots"), ("tiny", 1, 2, "resident"), ("tiny", 1, 2, "slots"),
    ("tiny", 2, 2, "resident"), ("tiny", 2, 2, "slots"), ("tiny-gqa", 1, 2, "slots"),
    ("tiny", 2, 2, "uva"), ("tiny-dsv3", 1, 2, "slots"),
    ("tiny-fused", 2, 2, "slots"),  # fused [E, ...] expert tensors: each rank loads rows r::2
    ("dense-bias", 2, 2, "resident"),  # expert parallelism needs nothing from the family: MLA + shared experts
])
def test_logits_equal_one_process(ckpts, preset, tp, ep, backend):
    # 4 slots per layer (of 16 local experts under EP): decode steps miss and overflow, prefill bypasses
    experts = ExpertOptions(backend=backend, slots=4 if backend == "slots" else None)
    one = LLM(ckpts[preset], experts=experts, **ENGINE)
    ref = logits_of(one)
    llm = LLM(ckpts[preset], experts=experts, tensor_parallel_size=tp, expert_parallel_size=ep, **ENGINE)
    try:
        if ep > 1:  # rank 0 really holds half the experts, and its KV half the heads under TP
            tier = "device" if backend == "resident" else "host"
            assert llm.model.moe_blocks()[0].experts.inner.nbytes()[tier] == \
                one.model.moe_blocks()[0].experts.nbytes()[tier] // 2
        assert llm.kv.nbytes() * tp == one.kv.nbytes()  # KV: this rank's kv heads only
        for got, want in zip(logits_of(llm), ref):
            close_enough(got, want)
    finally:
        llm.close()


def test_greedy_batch_equals_each_alone_and_one_process(ckpts):
    experts = ExpertOptions(backend="slots", slots=4)
    one = LLM(ckpts["tiny"], experts=experts, **ENGINE)
    want = [o.outputs[0].token_ids for o in one.generate(PROMPTS, GREEDY)]
    llm = LLM(ckpts["tiny"], experts=experts, tensor_parallel_size=2, expert_parallel_size=2, **ENGINE)
    try:
        batch = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]
        alone = [llm.generate([p], GREEDY)[0].outputs[0].token_ids for p in PROMPTS]
        assert batch == alone == want

        def broken(step):
            raise ValueError("rank 0 broke mid-step")
        # rank 0 failing alone leaves the workers inside a collective: they are stopped, not left hanging
        llm.runner.inner.execute = broken
        llm.add_request(PROMPTS[0], GREEDY)
        with pytest.raises(ValueError, match="rank 0 broke"):
            llm.step()
        assert not any(p.is_alive() for p in llm._workers.processes)
    finally:
        llm.close()


def test_step_records_on_a_gloo_group_of_their_own(ckpts):
    """EngineConfig.step_record_group="gloo": the records travel on a second group (dist/group.record_group)
    and the tokens stay the one-process ones; rank 0 times its broadcasts (bench decode --parallel)."""
    one = LLM(ckpts["tiny"], **ENGINE)
    want = [o.outputs[0].token_ids for o in one.generate(PROMPTS, GREEDY)]
    llm = LLM(ckpts["tiny"], tensor_parallel_size=2, step_record_group="gloo", **ENGINE)
    try:
        assert llm._workers.channel.group is not None  # a group of their own, not the world (None)
        assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)] == want
        assert llm.runner.broadcasts > 0 and llm.runner.broadcast_s > 0
    finally:
        llm.close()
    with pytest.raises(MoetierError, match="step_record_group must be world, gloo or pipe"):
        LLM(ckpts["tiny"], tensor_parallel_size=2, step_record_group="nccl", **ENGINE)


def test_bad_layouts_are_refused_before_any_spawn(ckpts):
    cases = [
        (dict(tensor_parallel_size=2), "tiny-gqa", "num_key_value_heads (1)"),  # 6 heads but one kv head
        (dict(expert_parallel_size=3), "tiny", "num_experts (32)"),
        (dict(tensor_parallel_size=2, expert_parallel_size=4), "tiny", "tensor-parallel size 2 must be 1 or"),
        (dict(tensor_parallel_size=0), "tiny", "positive integers"),
    ]
    for options, preset, needle in cases:
        t0 = time.monotonic()
        with pytest.raises(MoetierError, match=needle.replace("(", r"\(").replace(")", r"\)")):
            LLM(ckpts[preset], **ENGINE, **options)
        assert time.monotonic() - t0 < 1.0  # refused before spawning (a spawn costs seconds)
    with pytest.raises(MoetierError, match="slots"):  # slots are per rank: at most 16 of 32 under EP 2
        LLM(ckpts["tiny"], experts=ExpertOptions(backend="slots", slots=20), expert_parallel_size=2, **ENGINE)
    with pytest.raises(MoetierError, match="hybrid"):
        LLM(ckpts["tiny"], experts=ExpertOptions(backend="hybrid"), expert_parallel_size=2, **ENGINE)
    with pytest.raises(MoetierError, match="rank 2 is outside"):
        Parallel(2, 2, 2, 1)


def test_a_dead_worker_fails_the_engine_loudly(ckpts):
    llm = LLM(ckpts["tiny"], tensor_parallel_size=2, **ENGINE)
    try:
        llm.add_request(PROMPTS[0], SamplingParams(max_tokens=50, ignore_eos=True))
        llm.step()
        pid = llm._workers.processes[0].pid
        os.kill(pid, signal.SIGKILL)
        # NOTE: wait until the kill has taken effect: on a loaded machine the next step's liveness check
        # could otherwise still see the worker alive and broadcast to it; a gloo send to a peer that
        # dies mid-step then waited for the group's timeout (60 s here) in one CI run
        llm._workers.processes[0].join(timeout=10.0)
        t0 = time.monotonic()
        with pytest.raises(MoetierError, match=rf"rank 1 \(pid {pid}, exit code -9\) died"):
            for _ in range(3):  # the first step after the kill sees it (or its collective fails)
                llm.step()
        assert time.monotonic() - t0 < 5.0
        with pytest.raises(MoetierError, match="workers are gone"):
            llm.step()
    finally:
        llm.close()  # idempotent after the failure: the group is already gone


def test_strided_ownership_and_local_ids():
    assert owned_experts(8, 1, 2) == [1, 3, 5, 7]
    ids = torch.tensor([[0, 3, 6], [7, 2, 5]])
    assert local_ids(ids, 1, 2).tolist() == [[-1, 1, -1], [3, -1, 2]]
    assert local_ids(ids, 0, 2).tolist() == [[0, -1, 3], [-1, 1, -1]]


def test_generate_cli_with_tp_and_ep():
    """`moetier generate --tp 2 --ep 2` (the embedded model, a subprocess as a user runs it) prints the
    tokens one process makes; a layout the model cannot split is one line and exit code 2."""
    import json
    import subprocess
    import sys

    def run(*args):
        return subprocess.run([sys.executable, "-m", "moetier.cli", "generate", "Tell me a story", "--max-tokens",
                               "8", "--ignore-eos", "--device", "cpu", *args], capture_output=True, text=True,
                              timeout=120)

    p = run("--json", "--tp", "2", "--ep", "2", "--expert-backend", "slots", "--expert-slots", "4")
    assert p.returncode == 0, p.stderr
    one = LLM(device="cpu")
    want = one.generate(["Tell me a story"], SamplingParams(max_tokens=8, ignore_eos=True, temperature=0.0))
    assert json.loads(p.stdout)["token_ids"] == want[0].outputs[0].token_ids
    bad = run("--tp", "3")
    assert bad.returncode == 2 and bad.stderr.startswith("error: ") and "tensor parallelism 3" in bad.stderr


def test_rendezvous_from_torchrun_variables(monkeypatch):
    from moetier.dist.group import from_env

    for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(k, raising=False)
    with pytest.raises(MoetierError, match="RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT"):
        from_env("cpu")
    monkeypatch.setenv("RANK", "1"), monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1"), monkeypatch.setenv("MASTER_PORT", "29500")
    rank, rdv = from_env("cpu", timeout_s=5)
    assert (rank, rdv.world, rdv.backend, rdv.init_method) == (1, 2, "gloo", "env://")


def test_other_ranks_pairs_take_no_slot_and_contribute_zero():
    from moetier.experts.reference import expert_pairs
    from moetier.experts.cache.slots import SlotCache

    cache = SlotCache(4, 2)
    slots, miss = cache.step_reference(torch.tensor([[-1, 3], [2, -1], [3, -1]]))
    assert slots[:, 0].tolist()[0] == -1 and slots[1, 1] == -1 and slots[2, 1] == -1
    assert sorted(miss.expert[: int(miss.count)].tolist()) == [2, 3]  # -1 is no expert: never filled
    assert cache.read_stats()["misses"] == 2
    cache.check()
    h = torch.randn(2, 8)
    w = (torch.randn(6, 8), torch.randn(8, 3))
    out = expert_pairs(h, torch.tensor([[-1, 0], [0, -1]]), lambda key: w)
    assert out[0, 0].abs().sum() == 0 and out[1, 1].abs().sum() == 0 and out[0, 1].abs().sum() > 0
