"""Pinned experts through the model: a checkpoint loaded with a split, and the random-weight bed that
makes pinned rows on the device and only cached rows on the host, both bit-exact against resident on
the CPU; the options refuse a bad split in one line."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import Sequence
from tests.test_slots import lockstep

from moetier.checkpoint.loader import load_model
from moetier.experts.placement import ExpertOptions

# the tiny preset: MoE layers 0..3, 32 experts top-4
PINNED = {0: (0, 5, 6, 7, 31), 2: tuple(range(0, 32, 2)), 3: (9,)}


def test_checkpoint_with_pinned_experts_bit_exact(tiny_ckpt):
    models = lockstep(tiny_ckpt, 40, {
        "resident": ExpertOptions("resident"),
        "slots": ExpertOptions("slots", slots=4, pinned=PINNED),
        "ring": ExpertOptions("slots", slots=6, pinned=PINNED, prefill_stream="ring", prefill="refresh"),
    })
    stats = models["slots"].expert_stats()
    assert stats["pinned"] > 0 and stats["misses"] > 0 and stats["steps"] == 4 * 40
    for block in models["slots"].moe_blocks():
        held = PINNED.get(block.layer, ())
        assert block.experts.cache.pinned == held
        assert block.experts.nbytes()["host"] == (32 - len(held)) * block.experts.host.shape[1] * 4


def test_random_bed_pinned_rows_on_the_device_only(tmp_path):
    from moetier.checkpoint.random_bed import random_bed, use_backend
    from moetier.presets import preset

    cfg = preset("tiny")
    plain = random_bed(cfg, seed=3, device="cpu", dtype=torch.float32)
    split = random_bed(cfg, seed=3, device="cpu", dtype=torch.float32, pinned=PINNED)
    for layer, ids in PINNED.items():
        # the same draws; the pinned rows are on the device and absent (unbacked zeros) on the host
        assert torch.equal(split.pinned_rows[layer], plain.host[layer][list(ids)])
        assert bool((split.host[layer][list(ids)] == 0).all())
        rest = [e for e in range(32) if e not in ids]
        assert torch.equal(split.host[layer][rest], plain.host[layer][rest])
    use_backend(plain, "resident", decode_tokens=4)
    use_backend(split, "slots", budget=0.25, decode_tokens=4)
    seqs = (Sequence(plain.model, 40), Sequence(split.model, 40))
    tok = torch.tensor([5, 17, 300, 42, 9])
    for _ in range(12):
        a, b = (plain.model.logits(s.forward(tok)) for s in seqs)
        assert torch.equal(a, b)
        tok = a[-1:].argmax(-1)
    assert split.model.expert_stats()["pinned"] > 0
    use_backend(split, "resident")  # the split bed rebuilds a resident model from both halves
    assert torch.equal(split.model.moe_blocks()[0].experts.rows, plain.model.moe_blocks()[0].experts.rows)
    with pytest.raises(ValueError, match="not uva"):
        use_backend(split, "uva")


@pytest.mark.parametrize("opts,match", [
    (ExpertOptions("uva", pinned={0: (1,)}), "pinned experts need the slots or hybrid backend"),
    (ExpertOptions("slots", pinned={7: (1,)}), r"names layers \[7\]"),
    (ExpertOptions("slots", pinned={1: (40,)}), r"layer 1: pinned experts \[40\] are outside 0..31"),
    (ExpertOptions("slots", slots=30, pinned={1: (1, 2, 3)}), "30 slots for the 29 cached experts"),
])
def test_bad_splits_refused_in_one_line(tiny_ckpt, opts, match):
    from moetier.errors import MoetierError

    with pytest.raises(MoetierError, match=match) as e:
        load_model(tiny_ckpt, experts=opts)
    assert "\n" not in str(e.value)


def test_engine_batch_with_pinned_equals_resident_alone(tiny_ckpt):
    """Continuous batching (chunked prefill mixed with decode) over a split: the batch's tokens are
    each request's alone on resident experts."""
    from moetier.engine import LLM
    from tests.test_engine import workload

    prompts, params = workload(n=10)
    solo = LLM(tiny_ckpt, device="cpu")
    want = [solo.generate([p], sp)[0].outputs[0].token_ids for p, sp in zip(prompts, params)]
    llm = LLM(tiny_ckpt, device="cpu", experts=ExpertOptions("slots", slots=4, pinned=PINNED), max_num_tokens=24)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == want
    assert llm.metrics()["expert_stats"]["pinned"] > 0
    llm.scheduler.check()


def test_served_random_weights_in_fp8_with_a_split(capsys):
    """moetier serve --preset tiny --dtype fp8 --pinned-experts-file: the plan counts FP8 rows and the
    store only the cached ones; the engine generates."""
    from moetier.checkpoint.random_bed import RandomModel
    from moetier.sampling_params import SamplingParams
    from moetier.server.run import EngineSpec, build_llm

    r = RandomModel("tiny", backend="slots", budget=0.25, quant="fp8", pinned=PINNED)
    llm, name = build_llm(EngineSpec(random=r, dtype="bfloat16", device="cpu",
                                     engine={"max_num_seqs": 2, "max_model_len": 256}))
    table = capsys.readouterr().err
    assert "experts FP8 slots" in table and "the 106 cached experts' rows" in table, table
    for block in llm.model.moe_blocks():
        held = PINNED.get(block.layer, ())
        assert block.experts.cache.pinned == held and block.experts.host.dtype == torch.uint8
    out = llm.generate([[5, 17, 300, 42]], SamplingParams(max_tokens=6, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 6 and llm.metrics()["expert_stats"]["pinned"] > 0



def test_hybrid_model_over_a_split_near_resident(tiny_ckpt):
    """hybrid with pinned experts through the whole model, every miss computed by the host cores (a link
    priced as slow): each step's logits within the hybrid tolerance of resident's, the pinned experts hits
    and never on the host (their host rows are not there)."""
    from moetier.bench.outputs import LOGITS_RTOL
    from moetier.experts.hybrid.cost_model import PathRates

    slow = PathRates(1e-3, {"bfloat16": 50.0, "float32": 50.0})
    _, resident, _ = load_model(tiny_ckpt, experts=ExpertOptions("resident"))
    _, hybrid, _ = load_model(tiny_ckpt, experts=ExpertOptions("hybrid", slots=4, pinned=PINNED, rates=slow,
                                                              host_kernel="grouped"))
    a, b = Sequence(resident, 40), Sequence(hybrid, 40)
    tok, g = torch.tensor([5, 17, 300, 42, 9]), torch.Generator().manual_seed(2)
    for step in range(24):
        want, got = resident.logits(a.forward(tok)), hybrid.logits(b.forward(tok))
        assert (got - want).abs().max() <= LOGITS_RTOL * want.abs().max(), f"step {step}"
        tok = torch.multinomial(torch.softmax(want[-1], -1), 1, generator=g)
    stats = hybrid.expert_stats()
    assert stats["pinned"] > 0 and stats["host"] > 0
    for block in hybrid.moe_blocks():
        assert block.experts.cache.pinned == PINNED.get(block.layer, ())
        block.experts.cache.check()


def test_served_random_weights_take_the_plans_slots_per_layer(capsys):
    """moetier serve --preset with --expert-slots-file (a plan's --pinned-out file): each layer gets its
    own slot count beside its pins, the plan counts them, and the engine generates as resident does."""
    from moetier.checkpoint.random_bed import RandomModel
    from moetier.sampling_params import SamplingParams
    from moetier.server.run import EngineSpec, build_llm

    per_layer = {0: 4, 1: 9, 2: 6, 3: 12}
    spec = {"dtype": "float32", "device": "cpu", "engine": {"max_num_seqs": 2, "max_model_len": 256}}
    llm, _ = build_llm(EngineSpec(random=RandomModel("tiny", backend="slots", pinned=PINNED,
                                                     slots_per_layer=per_layer), **spec))
    assert "slots 4..12 per layer" in capsys.readouterr().err
    assert {b.layer: b.experts.cache.num_slots for b in llm.model.moe_blocks()} == per_layer
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    got = llm.generate([[5, 17, 300, 42]], params)[0].outputs[0].token_ids
    resident, _ = build_llm(EngineSpec(random=RandomModel("tiny", backend="resident"), **spec))
    assert got == resident.generate([[5, 17, 300, 42]], params)[0].outputs[0].token_ids
    assert llm.metrics()["expert_stats"]["misses"] > 0
