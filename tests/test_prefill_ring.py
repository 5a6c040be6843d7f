"""The ring prefill stream mode on the CPU (experts/prefill/ring.py): the same driver as on CUDA
(grouping, buffer reuse, masking of each pass, one combine at the end) with the torch reference as
its pass. Outputs bit-exact against the uva mode and against resident for several group sizes and
ring depths, with all hits, all misses, mixed steps and another rank's ids (-1); the cache untouched;
each missing expert copied once. The CUDA kernels' version: tests/test_gpu_prefill.py."""

from __future__ import annotations

import pytest
import torch

from moetier.experts.backends import ResidentExperts, SlotExperts, set_prefill_stream
from moetier.experts.prefill.ring import StagingRing, check_geometry, ring_forward, runs, split_hits
from moetier.experts.shape import RowLayout
from moetier.experts.cache.store import HostStore

E, S, K, H, I, DECODE = 16, 6, 4, 32, 16, 8


def build(stream: str, ring=(4, 2), dtype=torch.float32, seed=0):
    layout = RowLayout(H, I)
    store = HostStore([0], E, layout, dtype, pin=False)
    rows = store.rows(0)
    rows.copy_(torch.randn(E, layout.numel, generator=torch.Generator().manual_seed(seed)) * 0.1)
    slots = SlotExperts(rows, layout, K, S, DECODE, prefill_stream=stream, ring=ring)
    slots.cache.warm([1, 4, 5, 6, 9, 13])
    slots.slots.copy_(rows[slots.cache.slot_expert.long()])
    return ResidentExperts(rows.clone(), layout, K, DECODE), slots


def routing(g: torch.Generator, t: int, kind: str) -> torch.Tensor:
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(t)])
    if kind == "hits":
        pool = torch.tensor([1, 4, 5, 6, 9, 13])
        ids = torch.stack([pool[torch.randperm(6, generator=g)[:K]] for _ in range(t)])
    elif kind == "misses":
        pool = torch.tensor([0, 2, 3, 7, 8, 10, 11, 12, 14, 15])
        ids = torch.stack([pool[torch.randperm(10, generator=g)[:K]] for _ in range(t)])
    elif kind == "skipped":  # expert parallelism: another rank's pairs come in as -1
        ids = torch.where(torch.rand(t, K, generator=g) < 0.3, -1, ids)
    return ids


@pytest.mark.parametrize("ring", [(1, 2), (3, 2), (4, 3), (16, 2)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_ring_bit_exact_against_uva_and_resident(ring, dtype):
    resident, uva = build("uva", dtype=dtype)
    _, ringed = build("ring", ring, dtype)
    g = torch.Generator().manual_seed(ring[0] * 10 + ring[1])
    for n, kind in enumerate(["mixed", "hits", "misses", "skipped", "mixed"]):
        t = [20, 9, 33, 17, 40][n]  # above DECODE: the large-step path
        x = torch.randn(t, H, generator=g).to(dtype)
        ids = routing(g, t, kind)
        w = torch.rand(t, K, generator=g).to(dtype)
        state = ringed.cache.state()
        before = ringed.ring_rows
        got_uva, got_ring = uva.forward(x, ids, w), ringed.forward(x, ids, w)
        assert torch.equal(got_ring, got_uva), (kind, (got_ring - got_uva).abs().max())
        assert torch.equal(got_ring, resident.forward(x, ids, w)), kind
        slot_of = ringed.cache.expert_slot
        missing = {e for e in ids.flatten().tolist() if e >= 0 and int(slot_of[e]) < 0}
        assert ringed.ring_rows - before == len(missing), kind  # each missing expert copied once
        for name, v in ringed.cache.state().items():  # bypass: the cache untouched
            assert torch.equal(v, state[name]), name
    assert ringed.stats()["bypassed"] == uva.stats()["bypassed"] == 5
    assert ringed.stats()["hits"] == ringed.stats()["misses"] == 0
    ringed.reset()
    assert ringed.ring_rows == 0


def test_driver_passes_cover_every_pair_once_in_whole_experts():
    """The passes the driver runs: hits first, then groups of G missing experts in id order staged in
    buffer g % D; every pair with id >= 0 in exactly one pass, an expert never split across passes,
    and the buffer a pass reads holds its experts' rows."""
    g = torch.Generator().manual_seed(5)
    host = torch.randn(E, 8, generator=g)
    slot_of = torch.full((E,), -1, dtype=torch.int32)
    slot_of[torch.tensor([2, 3, 11])] = torch.tensor([0, 1, 2], dtype=torch.int32)
    slots = host[[2, 3, 11]].clone()
    ids = torch.tensor([[0, 2, 5, -1], [7, 3, 8, 12], [5, 9, 14, 15], [10, 11, 6, 1]])
    ring = StagingRing(3, 2, 8, host.dtype, torch.device("cpu"))
    seen, passes = torch.zeros_like(ids), []

    def run_pass(row_ids, pids, rows, max_rows):
        sel = pids >= 0
        seen.add_(sel.int())
        passes.append(sorted(set(pids[sel].tolist())))
        for e, r in zip(pids[sel].tolist(), row_ids[sel].tolist()):
            assert 0 <= r < max_rows and torch.equal(rows[r], host[e])
    n = ring_forward(ring, slot_of[ids.clamp(min=0)], ids, host, slots, run_pass)
    assert passes == [[2, 3, 11], [0, 1, 5], [6, 7, 8], [9, 10, 12], [14, 15]] and n == 11
    assert torch.equal(seen, (ids >= 0).int())


def test_helpers_and_checks():
    assert runs([0, 1, 2, 5, 7, 8]) == [(0, 0, 3), (3, 5, 1), (4, 7, 2)]
    assert runs([]) == []
    ids = torch.tensor([[1, 3], [3, -1], [0, 2]])
    slot_ids = torch.tensor([[0, -1], [-1, 5], [-1, 1]], dtype=torch.int32)
    assert split_hits(slot_ids, ids, 4) == (True, [0, 3])
    assert split_hits(torch.full_like(slot_ids, -1), ids, 4) == (False, [0, 1, 2, 3])
    assert check_geometry(0, 1) and not check_geometry(1, 2)
    with pytest.raises(ValueError, match="uva or ring"):
        build("stream")
    with pytest.raises(ValueError, match="depth"):
        build("ring", (4, 1))
    _, s = build("uva")
    set_prefill_stream(s, "ring")
    assert s.prefill_stream == "ring"
    resident, _ = build("uva")
    set_prefill_stream(resident, "ring")  # no slots: nothing to stream
    assert not hasattr(resident, "prefill_stream")


def test_refresh_policy_keeps_the_uva_path():
    """The ring streams a bypass step's misses; under refresh every used expert is filled first."""
    _, s = build("ring")
    s.prefill = "refresh"
    g = torch.Generator().manual_seed(3)
    x, ids, w = torch.randn(20, H, generator=g), routing(g, 20, "mixed"), torch.rand(20, K, generator=g)
    s.forward(x, ids, w)
    assert s.ring_rows == 0 and s.stats()["refreshed"] > 0


def test_memory_plan_counts_the_ring_in_the_ring_mode_only():
    from moetier import presets
    from moetier.plan.memory import PlanRequest, count

    cfg = presets.preset("qwen3-30b-a3b")
    slots = dict.fromkeys(cfg.moe_layers, 64)
    base = dict(backend="slots", slots_per_layer=slots, max_model_len=4096, max_num_tokens=2048)
    row = 9 * 2**20  # one bf16 Qwen3-30B-A3B expert row
    plans = {mode: count(PlanRequest(cfg, torch.bfloat16, "cuda", prefill_stream=mode, ring=(4, 3), **base))
             for mode in ("uva", "ring")}
    ring = [i for i in plans["ring"].device if i.name == "prefill staging ring"]
    assert len(ring) == 1 and ring[0].bytes == 3 * 4 * row  # D x G exact rows, one ring for all layers
    assert not [i for i in plans["uva"].device if i.name == "prefill staging ring"]
    act = {m: next(i.bytes for i in p.device if i.name.startswith("activations")) for m, p in plans.items()}
    assert act["ring"] >= act["uva"]  # the ring step's maps and masks (small: within segment rounding here)
    resident = count(PlanRequest(cfg, torch.bfloat16, "cuda", prefill_stream="ring", backend="resident",
                                 max_model_len=4096, max_num_tokens=2048))
    assert not [i for i in resident.device if i.name == "prefill staging ring"]  # no misses to stream


def test_engine_greedy_tokens_identical_uva_and_ring():
    """The embedded tiny model with 4 slots a layer: the prompt's large steps stream their misses
    through the ring (ExpertOptions.prefill_stream reaches every layer); not a token changes."""
    from moetier.engine.llm import LLM
    from moetier.experts.placement import ExpertOptions
    from moetier.sampling_params import SamplingParams

    text = "The ring stages the experts a prompt misses while the tensor cores run the others. " * 4
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    got = {}
    for mode in ("uva", "ring"):
        llm = LLM(device="cpu", experts=ExpertOptions("slots", slots=4, prefill_stream=mode), decode_tokens=16)
        got[mode] = llm.generate([text], params)[0].outputs[0].token_ids
        streamed = sum(b.experts.ring_rows for b in llm.model.moe_blocks())
        assert all(b.experts.prefill_stream == mode for b in llm.model.moe_blocks())
        assert (streamed > 0) == (mode == "ring")
    assert got["uva"] == got["ring"] and len(got["ring"]) == 12


def test_ring_on_the_large_step_kernels_in_the_interpreter():
    from tests.interpreter import run_script

    assert "ring steps ok" in run_script("prefill_ring_interpreter.py")
