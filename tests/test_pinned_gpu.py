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


def draw_rows(n: int, layout, g: torch.Generator) -> torch.Tensor:
    """n random expert rows [n, R] on the GPU in the layout's format, drawn as the random bed draws them."""
    from moetier.checkpoint import random_bed

    rows = torch.empty(n, layout.numel, dtype=layout.row_dtype(torch.bfloat16), device="cuda")
    if layout.quant is None:
        return rows.normal_(0.0, 0.02, generator=g)
    fill = getattr(random_bed, "fill_fp8_rows" if layout.quant == "fp8" else "fill_4bit_rows")
    fill(rows, layout, g, torch.bfloat16)
    return rows


def formats() -> list[str | None]:
    from moetier.quant.registry import FORMATS

    return [None, *FORMATS]


@pytest.mark.parametrize("quant", formats())
def test_glm53_flash_layer_split_bit_exact_per_format(quant):
    """One MoE layer of GLM-5.3-Flash's shape (288 experts of 4096 x 2048, top-8) in every expert format:
    the plan's kind of split (a hot set pinned, a few slots, the rest on the host) against resident,
    decode steps in a CUDA graph and eager large steps, bit-exact."""
    from dataclasses import replace

    from moetier.experts.backends import ResidentExperts, SlotExperts
    from moetier.experts.cache.store import HostStore
    from moetier.presets import preset

    shape = preset("glm-5.3-flash", 4).moe_shape
    e, k, h = shape.num_experts, shape.top_k, shape.hidden
    layout = replace(shape.layout, quant=quant)
    g = torch.Generator(device="cuda").manual_seed(3)
    full = torch.cat([draw_rows(16, layout, g) for _ in range(e // 16)])
    hot = tuple(range(0, e, 2))[:120]  # a hot set of 120 pinned: every other id, so cached runs are short
    store = HostStore([0], e, layout, torch.bfloat16, pin=True, pinned={0: hot})
    cached = [x for x in range(e) if x not in hot]
    store.rows(0)[cached] = full[cached].cpu()
    s = 24
    dev = torch.empty(s + len(hot), layout.numel, dtype=full.dtype, device="cuda")
    dev[s:] = full[list(hot)]
    slots = SlotExperts(store.rows(0), layout, k, s, decode_tokens=8, device="cuda", policy="lfru", pinned=hot,
                        device_rows=dev)
    resident = ResidentExperts(full, layout, k, decode_tokens=8)
    cpu = torch.Generator().manual_seed(4)
    zipf = 1.0 / torch.arange(1, e + 1, dtype=torch.float64) ** 0.8  # hot ids first: most lookups pinned
    order = torch.tensor(hot + tuple(cached))

    def ids_of(t):
        return order[torch.stack([torch.multinomial(zipf, k, generator=cpu) for _ in range(t)])]

    t = 4
    x = torch.zeros(t, h, dtype=torch.bfloat16, device="cuda")
    ids = torch.zeros(t, k, dtype=torch.int64, device="cuda")
    w = torch.zeros(t, k, dtype=torch.bfloat16, device="cuda")
    ids.copy_(ids_of(t))
    graph, out = capture(lambda: slots.forward(x, ids, w))
    for step in range(60):
        x.copy_(torch.randn(t, h, generator=cpu).to(torch.bfloat16))
        ids.copy_(ids_of(t))
        w.copy_(torch.rand(t, k, generator=cpu).to(torch.bfloat16))
        graph.replay()
        assert torch.equal(out, resident.forward(x, ids, w)), f"decode step {step}"
    for n in (64, 300):  # the large-step path: pinned rows, slots and host rows in one GEMM
        xs = torch.randn(n, h, generator=cpu).to(torch.bfloat16).cuda()
        ids_n, ws = ids_of(n).cuda(), torch.rand(n, k, generator=cpu).to(torch.bfloat16).cuda()
        assert torch.equal(slots.forward(xs, ids_n, ws), resident.forward(xs, ids_n, ws)), f"{n} tokens"
    slots.cache.check()
    st = slots.stats()
    assert st["pinned"] > st["hits"] - st["pinned"] > 0 and st["misses"] > 0
