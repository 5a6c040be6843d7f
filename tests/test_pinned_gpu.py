"""GPU tests of pinned experts (marked `gpu`, skipped without CUDA): the bookkeeping kernels with pinned
experts against the torch reference, the split store pinning only its cached rows, the graph-captured
slots layer with a split bit-exact against eager resident (decode and the large step, both prefill
streams), and the engine with CUDA graphs and continuous batching."""

from __future__ import annotations

import pytest
import torch

from tests.test_gpu import capture, random_ids, replay_against_resident

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

E, H, I, K = 64, 256, 128, 8
PINNED = tuple(range(0, E, 5))  # 13 of 64, spread so that cached runs are short


@pytest.mark.parametrize("policy", ["lru", "lfru"])
@pytest.mark.parametrize("num_slots", [8, 40])
def test_bookkeeping_kernels_with_pinned_match_reference(num_slots, policy):
    from moetier.experts.cache import slot_kernels as kernels
    from moetier.experts.cache.slots import SlotCache, policy_for

    pol = policy_for(policy, num_slots, K)
    ref = SlotCache(E, num_slots, policy=pol, pinned=PINNED)
    gpu = SlotCache(E, num_slots, "cuda", policy=pol, pinned=PINNED)
    scratch = kernels.BookkeepingScratch(E, num_slots, 64 * K, torch.device("cuda"))
    g = torch.Generator().manual_seed(num_slots)
    for i in range(300):
        t = [1, 2, 3, 16, 40][i % 5]  # 40 x 8 pairs take the barrier kernel
        ids = random_ids(g, t, dup=i % 7 == 0)
        want_slots, want_miss = ref.step_reference(ids)
        got = kernels.bookkeeping(gpu, scratch, ids.cuda())
        assert torch.equal(got.cpu(), want_slots), f"step {i}"
        n = int(want_miss.count)
        assert int(scratch.miss_count) == n and torch.equal(scratch.miss_expert[:n].cpu(), want_miss.expert[:n])
        for name in ("expert_slot", "slot_expert", "stamp", "clock", "stats", "freq", "fepoch"):
            assert torch.equal(getattr(gpu, name).cpu(), getattr(ref, name)), f"step {i}: {name}"
        gpu.check()
    s = ref.read_stats()
    assert s["pinned"] > 0 and s["misses"] > 0 and s["hits"] > s["pinned"]


def split_layer(prefill_stream="ring"):
    from moetier.experts.backends import ResidentExperts, SlotExperts
    from moetier.experts.cache.store import HostStore
    from moetier.experts.shape import RowLayout

    layout = RowLayout(H, I)
    g = torch.Generator().manual_seed(0)
    full = (torch.randn(E, layout.numel, generator=g) * 0.05).to(torch.bfloat16)
    store = HostStore([0], E, layout, torch.bfloat16, pin=True, pinned={0: PINNED})
    host = store.rows(0)
    cached = [e for e in range(E) if e not in PINNED]
    host[cached] = full[cached]  # the pinned experts' host rows stay unbacked and unregistered
    r = store.report()
    assert r["requested_bytes"] == len(cached) * layout.numel * 2 <= r["pinned_bytes"] == r["allocated_bytes"]
    s = 12
    dev = torch.empty(s + len(PINNED), layout.numel, dtype=torch.bfloat16, device="cuda")
    dev[s:] = full[list(PINNED)].cuda()
    slots = SlotExperts(host, layout, K, s, decode_tokens=4, device="cuda", policy="lfru",
                        prefill_stream=prefill_stream, pinned=PINNED, device_rows=dev)
    return ResidentExperts(full.cuda(), layout, K, decode_tokens=4), slots


def test_graph_captured_split_bit_exact_vs_eager_resident():
    resident, slots = split_layer()
    t = 2
    x = torch.zeros(t, H, dtype=torch.bfloat16, device="cuda")
    ids = torch.zeros(t, K, dtype=torch.int64, device="cuda")
    w = torch.zeros(t, K, dtype=torch.bfloat16, device="cuda")
    ids.copy_(random_ids(torch.Generator().manual_seed(0), t))
    graphs = {"split": capture(lambda: slots.forward(x, ids, w))}
    replay_against_resident(graphs, resident, slots, x, ids, w, 300, 1,
                            lambda g, step: random_ids(g, t, dup=step % 10 == 0))
    s = slots.stats()
    assert s["pinned"] > 100 and s["misses"] > 300 and s["overflow"] > 0


@pytest.mark.parametrize("stream", ["ring", "uva"])
def test_large_step_reads_pinned_slots_and_host(stream):
    resident, slots = split_layer(stream)
    g = torch.Generator().manual_seed(5)
    for step in range(6):
        t = [3, 40, 1, 100, 2, 7][step]  # 40 and 100 tokens: the large-step path
        x = torch.randn(t, H, generator=g).to(torch.bfloat16).cuda()
        ids = random_ids(g, t).cuda()
        w = torch.rand(t, K, generator=g).to(torch.bfloat16).cuda()
        assert torch.equal(slots.forward(x, ids, w), resident.forward(x, ids, w)), f"step {step}"
        slots.cache.check()
    assert slots.stats()["bypassed"] == 3


def test_engine_with_pinned_graphs_and_batching_equals_resident(tiny_ckpt):
    from moetier.engine import LLM
    from moetier.experts.placement import ExpertOptions
    from tests.test_engine import workload

    prompts, params = workload()
    pinned = {0: (0, 1, 2, 3, 4, 5), 1: tuple(range(0, 32, 3)), 3: (31,)}
    want = LLM(tiny_ckpt, device="cuda", experts=ExpertOptions("resident"), max_num_seqs=8, max_num_tokens=64)
    want = [o.outputs[0].token_ids for o in want.generate(prompts, params)]
    llm = LLM(tiny_ckpt, device="cuda", experts=ExpertOptions("slots", slots=4, pinned=pinned), max_num_seqs=8,
              max_num_tokens=64)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert llm.runner.graph_steps > 20 and got == want
    stats = llm.metrics()["expert_stats"]
    assert stats["pinned"] > 100 and stats["misses"] > 100
    llm.scheduler.check()


def test_random_bed_on_gpu_holds_pinned_rows_on_the_device_only():
    from moetier.checkpoint.random_bed import random_bed, use_backend
    from moetier.presets import preset

    cfg = preset("tiny")
    pinned = {layer: tuple(range(0, 32, 2)) for layer in cfg.moe_layers}
    bed = random_bed(cfg, seed=1, device="cuda", dtype=torch.bfloat16, pinned=pinned)
    plain = random_bed(cfg, seed=1, device="cuda", dtype=torch.bfloat16)
    for layer in cfg.moe_layers:
        assert bed.pinned_rows[layer].is_cuda
        assert torch.equal(bed.pinned_rows[layer].cpu(), plain.host[layer][list(pinned[layer])])
    use_backend(bed, "slots", budget=0.25, decode_tokens=8)
    use_backend(plain, "resident", decode_tokens=8)
    from tests.helpers import Sequence

    a, b = Sequence(plain.model, 64), Sequence(bed.model, 64)
    tok = torch.tensor([5, 17, 300, 42, 9], device="cuda")
    for _ in range(20):
        la, lb = plain.model.logits(a.forward(tok)), bed.model.logits(b.forward(tok))
        assert torch.equal(la, lb)
        tok = la[-1:].argmax(-1)
