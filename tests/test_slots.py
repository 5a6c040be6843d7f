"""The slot cache on the CPU: step semantics, integrity, and the cached and uva backends bit-exact
against resident over hundreds of churning decode steps."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from tests.helpers import Sequence

from moetier.experts.backends import ResidentExperts, SlotExperts, UvaExperts
from moetier.experts.placement import ExpertOptions
from moetier.experts.cache.slots import SlotCache
from moetier.experts.shape import RowLayout
from moetier.experts.cache.store import HostStore
from moetier.checkpoint.loader import load_model


def step(cache, ids):
    slots, miss = cache.step_reference(torch.tensor(ids))
    cache.check()
    n = int(miss.count)
    return slots.tolist(), list(zip(miss.expert[:n].tolist(), miss.slot[:n].tolist()))


def test_lru_by_hand():
    c = SlotCache(num_experts=10, num_slots=3)
    assert step(c, [[4, 7]]) == ([[0, 1]], [(4, 0), (7, 1)])  # empty slots first, in slot order
    assert step(c, [[7, 7]]) == ([[1, 1]], [])  # duplicate ids: one hit
    assert step(c, [[2, 9]]) == ([[2, 0]], [(2, 2), (9, 0)])  # 4 (slot 0) is least recent
    # 7 hits slot 1; slots 0 (expert 9) and 2 (expert 2) tie at stamp 2, so the lower slot goes
    assert step(c, [[7, 5]]) == ([[1, 0]], [(5, 0)])
    assert c.read_stats() == {"hits": 2, "misses": 5, "overflow": 0, "steps": 4, "pinned": 0}


def test_never_evicts_what_the_step_needs_and_overflows():
    c = SlotCache(num_experts=20, num_slots=4)
    step(c, [[0, 1, 2, 3]])
    slots, miss = step(c, [[0, 1, 10, 11], [12, 13, 0, 14]])
    # 0 and 1 hit and keep their slots; 2 victims (slots 2, 3) go to 10 and 11; 12, 13, 14 overflow
    assert slots == [[0, 1, 2, 3], [-1, -1, 0, -1]]
    assert miss == [(10, 2), (11, 3)]
    assert c.read_stats() == {"hits": 2, "misses": 6, "overflow": 3, "steps": 2, "pinned": 0}


def test_all_hit_and_all_miss():
    c = SlotCache(num_experts=8, num_slots=8)
    step(c, [list(range(8))])
    slots, miss = step(c, [[7, 6, 5, 4, 3, 2, 1, 0]])
    assert miss == [] and sorted(slots[0]) == list(range(8))
    c2 = SlotCache(num_experts=16, num_slots=4)
    for i in range(4):
        _, miss = step(c2, [[4 * i, 4 * i + 1, 4 * i + 2, 4 * i + 3]])
        assert len(miss) == 4
    assert c2.read_stats()["hits"] == 0


def test_integrity_check_catches_corruption():
    c = SlotCache(num_experts=8, num_slots=4)
    step(c, [[1, 2]])
    c.slot_expert[3] = 2
    with pytest.raises(AssertionError, match="resident in two slots"):
        c.check()


def make_backends(E=12, S=3, H=40, I=24, k=3, dtype=torch.float32, decode_tokens=8):
    layout = RowLayout(H, I)
    store = HostStore([0], E, layout, dtype, pin=False)
    rows = store.rows(0)
    rows.copy_(torch.randn(E, layout.numel) * 0.1)
    assert store.requested_bytes == E * layout.numel * dtype.itemsize
    return (ResidentExperts(rows.clone(), layout, k, decode_tokens),
            SlotExperts(rows, layout, k, S, decode_tokens), UvaExperts(rows, layout, k, decode_tokens))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_backends_bit_exact_under_churn(dtype):
    resident, slots, uva = make_backends(dtype=dtype)
    g = torch.Generator().manual_seed(0)
    for i in range(300):
        t = [1, 1, 2, 5, 12][i % 5]  # 5 tokens x 3 > 3 slots: overflow; 12 > decode_tokens: bypass
        x = torch.randn(t, 40, generator=g).to(dtype)
        ids = torch.stack([torch.randperm(12, generator=g)[:3] for _ in range(t)])
        w = torch.rand(t, 3, generator=g).to(dtype)
        want = resident.forward(x, ids, w)
        assert torch.equal(slots.forward(x, ids, w), want)
        assert torch.equal(uva.forward(x, ids, w), want)
        slots.cache.check()
    s = slots.cache.read_stats()
    assert s["misses"] > 200 and s["overflow"] > 50 and slots.bypassed == 60


def lockstep(path, steps, backends):
    models = {}
    for name, opts in backends.items():
        _, models[name], _ = load_model(path, experts=opts)
    seqs = {n: Sequence(m, steps + 16) for n, m in models.items()}
    tok = torch.tensor([5, 17, 300, 42, 9])
    g = torch.Generator().manual_seed(1)
    for i in range(steps):
        logits = {n: m.logits(seqs[n].forward(tok)) for n, m in models.items()}
        for n in models:
            assert torch.equal(logits[n], logits["resident"]), f"{n} differs from resident at step {i}"
        for n, m in models.items():
            for moe in m.moe_blocks():
                if hasattr(moe.experts, "cache"):
                    moe.experts.cache.check()
        # sample so that the routing churns; greedy on random weights settles into a loop
        probs = torch.softmax(logits["resident"][-1], -1)
        tok = torch.multinomial(probs, 1, generator=g)
    return models


def test_model_slots_and_uva_bit_exact_over_300_steps(tiny_ckpt):
    models = lockstep(tiny_ckpt, 310, {
        "resident": ExpertOptions("resident"),
        "slots": ExpertOptions("slots", slots=4),  # top_k = 4: as small as it can be
        "uva": ExpertOptions("uva"),
    })
    stats = models["slots"].expert_stats()
    # 4 MoE layers x 310 steps; on top-4 of 32 experts with 4 slots nearly every step misses
    assert stats["steps"] == 4 * 310 and stats["misses"] > 3000


def test_cli_slots_tokens_identical_to_resident(tiny_ckpt):
    def run(*extra):
        p = subprocess.run([sys.executable, "-m", "moetier.cli", "generate", "Once upon a time", "--model",
                            str(tiny_ckpt), "--max-tokens", "300", "--ignore-eos", "--temperature", "1.0",
                            "--seed", "3", "--json", *extra], capture_output=True, text=True, timeout=300,
                           env={**os.environ})
        assert p.returncode == 0, p.stderr
        return json.loads(p.stdout)["token_ids"]
    want = run()
    assert len(want) == 300 and len(set(want)) > 50
    assert run("--expert-backend", "slots", "--expert-slots", "4") == want
    assert run("--expert-backend", "uva") == want


def test_bad_slot_counts(tiny_ckpt):
    from moetier.errors import MoetierError

    for bad in (0, 33):
        with pytest.raises(MoetierError, match=rf"--expert-slots {bad}: it must be between 1 and the number of "
                                               r"experts \(32\)") as e:
            load_model(tiny_ckpt, experts=ExpertOptions("slots", slots=bad))
        assert str(e.value).count("--expert-slots") == 1  # said once, not once per layer
    with pytest.raises(MoetierError, match="unknown expert backend 'ram'"):
        load_model(tiny_ckpt, experts=ExpertOptions("ram"))
