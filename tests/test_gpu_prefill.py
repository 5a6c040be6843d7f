"""GPU tests of the large-step (prefill) expert path; skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

from tests.test_gpu import QE, QH, QK, qwen_rows, random_ids

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("t,dup", [(65, False), (512, False), (1024, True), (4096, False)])
def test_large_step_backends_vs_float64_exact_and_without_host_sync(t, dup):
    """Issue 16: steps above the decode limit take the large-step grouped GEMM on every backend: within
    bf16 tolerance of a float64 oracle, bit-exact between resident, slots (half the experts in slots,
    misses read across the link) and uva, and no host synchronisation anywhere in the step (CUDA's
    sync-debug mode raises on one). 4,096 tokens at top-8 take the blocks of steps dense in pairs
    (GemmConfig.large_blocks). The ring prefill stream (the default, experts/prefill/ring.py) reads
    its miss list on the host once per layer: it is held to the same bits outside sync-debug mode."""
    from moetier.experts.backends import ResidentExperts, SlotExperts, UvaExperts
    from moetier.experts.reference import combine, expert_pairs

    store, layout = qwen_rows(seed=2)
    host = store.rows(0)
    dev = host.cuda()
    resident = ResidentExperts(dev, layout, QK)
    slots, ring = (SlotExperts(host, layout, QK, num_slots=QE // 2, device="cuda", prefill_stream=mode)
                   for mode in ("uva", "ring"))
    for s in (slots, ring):
        s.cache.warm(list(range(0, QE, 2)))  # every other expert in a slot
        s.slots.copy_(dev[s.cache.slot_expert.long()])
    uva = UvaExperts(host, layout, QK, device="cuda")
    g = torch.Generator().manual_seed(t)
    x = torch.randn(t, QH, generator=g).to(torch.bfloat16).cuda()
    ids = random_ids(g, t, QK, QE, dup=dup).cuda()
    w = torch.rand(t, QK, generator=g).to(torch.bfloat16).cuda()
    state = slots.cache.state()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        got = {name: b.forward(x, ids, w) for name, b in (("resident", resident), ("slots", slots), ("uva", uva))}
    finally:
        torch.cuda.set_sync_debug_mode(0)
    got["ring"] = ring.forward(x, ids, w)
    for name in ("slots", "uva", "ring"):
        assert torch.equal(got[name], got["resident"]), name
    for k, v in slots.cache.state().items():  # prefill leaves the cache alone
        assert torch.equal(v, state[k]), k
    assert resident.stats()["bypassed"] == slots.stats()["bypassed"] == uva.stats()["bypassed"] == 1

    def fetch(key):
        row = dev[key:key + 1].double()
        return layout.w13(row)[0], layout.w2(row)[0]
    want = combine(expert_pairs(x.double(), ids, fetch), w.double())
    err = ((got["resident"].double() - want).norm() / want.norm()).item()
    assert err <= 1e-2, err


@pytest.mark.parametrize("ring", [(4, 2), (1, 3), (16, 2)])
@pytest.mark.parametrize("t,dup", [(65, False), (512, False), (2048, True)])
def test_ring_stream_bit_exact_against_uva_and_resident(ring, t, dup):
    """The ring prefill stream mode (experts/prefill/ring.py) on CUDA: the missing experts staged by
    the copy engine on a side stream, G rows a buffer, D buffers, the GEMM over the hits and then each
    group: bit-exact against the uva mode (misses read in the kernel) and resident, with another
    rank's ids (-1) in the step; two layers back to back share the one ring (the second's copies wait
    the first's reads), every missing expert copied once, the cache left alone."""
    from moetier.experts.backends import ResidentExperts, SlotExperts
    from moetier.experts.parallel.ep import NOT_MINE

    store, layout = qwen_rows(seed=3)
    host = store.rows(0)
    dev = host.cuda()
    resident = ResidentExperts(dev, layout, QK)
    made = {}
    for mode in ("uva", "ring"):
        layers = []
        for warm in (range(0, QE, 2), range(QE // 2)):  # two layers, different experts in slots
            s = SlotExperts(host, layout, QK, num_slots=QE // 2, device="cuda", prefill_stream=mode, ring=ring)
            s.cache.warm(list(warm))
            s.slots.copy_(dev[s.cache.slot_expert.long()])
            layers.append(s)
        made[mode] = layers
    g = torch.Generator().manual_seed(t + ring[0])
    x = torch.randn(t, QH, generator=g).to(torch.bfloat16).cuda()
    ids = random_ids(g, t, QK, QE, dup=dup)
    ids = torch.where(torch.rand(t, QK, generator=g) < 0.1, NOT_MINE, ids).cuda()
    w = torch.rand(t, QK, generator=g).to(torch.bfloat16).cuda()
    want = resident.forward(x, ids, w)
    state = [s.cache.state() for s in made["ring"]]
    torch.cuda.synchronize()
    got = {mode: [s.forward(x, ids, w) for s in layers] for mode, layers in made.items()}  # no sync between
    torch.cuda.synchronize()
    for a, b in zip(got["ring"], got["uva"]):
        assert torch.equal(a, b), (a.float() - b.float()).abs().max().item()
        assert torch.equal(a, want)
    for s, before in zip(made["ring"], state):
        slot_of = s.cache.expert_slot.cpu()
        missing = {e for e in ids.flatten().tolist() if e >= 0 and int(slot_of[e]) < 0}
        assert s.ring_rows == len(missing) and s.stats()["bypassed"] == 1
        for k, v in s.cache.state().items():
            assert torch.equal(v, before[k]), k


def test_ring_stream_in_the_engine_gives_the_uva_tokens(tiny_ckpt):
    """Greedy tokens of a long prompt through the engine on CUDA: ring and uva identical."""
    from moetier.engine.llm import LLM
    from moetier.experts.placement import ExpertOptions
    from moetier.sampling_params import SamplingParams

    prompt = list(range(3, 203))  # 200 tokens: above the decode limit, the large-step path
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    got = {}
    for mode in ("uva", "ring"):
        llm = LLM(tiny_ckpt, device="cuda", experts=ExpertOptions("slots", slots=4, prefill_stream=mode),
                  max_num_seqs=2)
        got[mode] = llm.generate([prompt], params)[0].outputs[0].token_ids
        streamed = sum(b.experts.ring_rows for b in llm.model.moe_blocks())
        assert (streamed > 0) == (mode == "ring")
        llm.close()
    assert got["uva"] == got["ring"]
