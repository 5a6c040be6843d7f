"""GPU tests (marked `gpu`, skipped without CUDA): the Triton kernels against their torch references,
exact pinning, and the graph-captured slot cache bit-exact against the eager resident layer."""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

E, H, I, K = 64, 256, 128, 8


def rows_for(e=E, h=H, i=I, dtype=torch.bfloat16, pin=True, seed=0):
    from moetier.experts.store import HostStore, RowLayout

    layout = RowLayout(h, i)
    store = HostStore([0], e, layout, dtype, pin=pin)
    g = torch.Generator().manual_seed(seed)
    store.rows(0).copy_((torch.randn(e, layout.numel, generator=g) * 0.05).to(dtype))
    return store, layout


def test_store_pins_exact_size():
    from moetier.experts.store import PAGE, HostStore, RowLayout

    layout = RowLayout(1000, 36)  # rows of 216,000 bytes: no power of two anywhere
    store = HostStore([0, 1, 2], 37, layout, torch.bfloat16, pin=True)
    r = store.report()
    assert r["pinned_bytes"] == r["requested_bytes"] == 3 * 37 * 216_000
    assert r["allocated_bytes"] - r["requested_bytes"] <= PAGE * 3  # within one page per block
    for layer in range(3):
        assert store.rows(layer).data_ptr() % PAGE == 0


def random_ids(g, t, k=K, e=E, dup=False):
    if dup:
        return torch.randint(0, max(2, e // 8), (t, k), generator=g)
    return torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])


@pytest.mark.parametrize("policy", ["lru", "lfru"])
@pytest.mark.parametrize("num_slots", [8, 20, 64])
def test_bookkeeping_kernel_matches_reference(num_slots, policy):
    """Both bookkeeping kernels (registers for small steps, barriers for large) against the torch
    reference, with the copy kernel after each step: every slot must also hold its row."""
    from moetier.experts import kernels
    from moetier.experts.slots import SlotCache, policy_for
    from moetier.experts.store import DevicePointer

    pol = policy_for(policy, num_slots, K)
    ref, gpu = SlotCache(E, num_slots, policy=pol), SlotCache(E, num_slots, "cuda", policy=pol)
    scratch = kernels.Scratch(E, num_slots, 64 * K, torch.device("cuda"))
    host = torch.randn(E, 4100).to(torch.bfloat16).pin_memory()
    slot_rows = torch.zeros(num_slots, 4100, dtype=torch.bfloat16, device="cuda")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    g = torch.Generator().manual_seed(num_slots)
    hot = torch.randperm(E, generator=g)[:num_slots]
    for i in range(400):
        case = i % 6
        if case == 0:  # duplicates within the step
            ids = random_ids(g, 3, dup=True)
        elif case == 1:  # all hit (once warm): only experts held now
            held = ref.slot_expert[ref.slot_expert >= 0]
            ids = held[torch.randint(0, held.numel(), (2, K), generator=g)] if held.numel() else hot[None, :K]
        elif case == 2:  # overflow: more distinct experts than slots
            ids = random_ids(g, 16)
        else:
            ids = random_ids(g, [1, 2, 5][case - 3])
        want_slots, want_miss = ref.step_reference(ids)
        got_slots = kernels.bookkeeping(gpu, scratch, ids.cuda())
        kernels.copy_rows(DevicePointer(host), slot_rows, scratch, 2 * sms, block=1024)
        assert torch.equal(got_slots.cpu(), want_slots), f"step {i}"
        n = int(want_miss.count)
        assert int(scratch.miss_count) == n
        assert torch.equal(scratch.miss_expert[:n].cpu(), want_miss.expert[:n])
        assert torch.equal(scratch.miss_slot[:n].cpu(), want_miss.slot[:n])
        for name in ("expert_slot", "slot_expert", "stamp", "clock", "stats", "freq", "fepoch"):
            assert torch.equal(getattr(gpu, name).cpu(), getattr(ref, name)), f"step {i}: {name}"
        gpu.check()
        held = gpu.slot_expert.cpu()
        for slot in range(num_slots):
            if held[slot] >= 0:
                assert torch.equal(slot_rows[slot].cpu(), host[held[slot]]), f"step {i}: slot {slot} holds stale bytes"
    s = ref.read_stats()
    assert s["hits"] > 0 and s["misses"] > 0 and (num_slots == 64 or s["overflow"] > 0)


def test_copy_kernel_moves_exact_rows():
    from moetier.experts import kernels
    from moetier.experts.store import DevicePointer

    store, layout = rows_for()
    host = store.rows(0)
    slots = torch.full((16, layout.numel), float("nan"), dtype=host.dtype, device="cuda")
    sc = kernels.Scratch(E, 16, 16, torch.device("cuda"))
    experts = torch.tensor([5, 63, 0, 17, 40], dtype=torch.int32)
    where = torch.tensor([3, 0, 15, 7, 8], dtype=torch.int32)
    sc.miss_expert[:5], sc.miss_slot[:5], sc.miss_count[0] = experts.cuda(), where.cuda(), 5
    kernels.copy_rows(DevicePointer(host), slots, sc, programs=7, block=1024)
    for e, s in zip(experts.tolist(), where.tolist()):
        assert torch.equal(slots[s].cpu(), host[e])
    untouched = [s for s in range(16) if s not in where.tolist()]
    assert torch.isnan(slots[untouched].float()).all()
    sc.miss_count.zero_()
    before = slots.clone()
    kernels.copy_rows(DevicePointer(host), slots, sc, programs=7)
    assert torch.equal(torch.nan_to_num(slots.float()), torch.nan_to_num(before.float()))


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("t", [1, 3, 32])
def test_expert_kernel_matches_torch(dtype, tol, t):
    from moetier.experts import gemm
    from moetier.experts.backends import combine, expert_pairs, row_fetch
    from moetier.experts.store import DevicePointer

    store, layout = rows_for(e=E, h=200, i=72, dtype=dtype, seed=t)  # odd sizes: masks at every edge
    host = store.rows(0)
    dev = host.cuda()
    g = torch.Generator().manual_seed(t)
    x = torch.randn(t, 200, generator=g).to(dtype)
    ids = random_ids(g, t)
    w = torch.rand(t, K, generator=g).to(dtype)
    ref = combine(expert_pairs(x.double(), ids, row_fetch(host.double(), layout)), w.double())
    h = torch.full((t * K, 72), float("nan"), device="cuda")
    out = torch.full((t, 200), float("nan"), dtype=dtype, device="cuda")
    # half the pairs from device rows, half over the link from the host store
    slot_ids = torch.where(torch.rand(t, K, generator=g) < 0.5, ids, -1).int()
    gemm.expert_mlp(x.cuda(), slot_ids.cuda(), ids.cuda(), w.cuda(), dev, DevicePointer(host), 200, 72, h, out)
    err = ((out.double().cpu() - ref).norm() / ref.norm()).item()
    assert err <= tol, err


@pytest.mark.parametrize("policy", ["lru", "lfru"])
def test_graph_captured_slots_bit_exact_vs_eager_resident_300_steps(policy):
    from moetier.experts.backends import ResidentExperts, SlotExperts, UvaExperts

    store, layout = rows_for()
    host = store.rows(0)
    resident = ResidentExperts(host.cuda(), layout, K, decode_tokens=4)
    slots = SlotExperts(host, layout, K, num_slots=K, decode_tokens=4, device="cuda", policy=policy)  # S = top-k
    uva = UvaExperts(host, layout, K, decode_tokens=4, device="cuda")
    t = 2
    x = torch.zeros(t, H, dtype=torch.bfloat16, device="cuda")
    ids = torch.zeros(t, K, dtype=torch.int64, device="cuda")
    w = torch.zeros(t, K, dtype=torch.bfloat16, device="cuda")
    graphs = {}
    for name, b in (("slots", slots), ("uva", uva)):
        ids.copy_(random_ids(torch.Generator().manual_seed(0), t))
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            b.forward(x, ids, w)
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            out = b.forward(x, ids, w)
        graphs[name] = (g, out)
    slots.cache.reset()
    g = torch.Generator().manual_seed(1)
    for step in range(300):
        x.copy_(torch.randn(t, H, generator=g).to(torch.bfloat16))
        ids.copy_(random_ids(g, t, dup=step % 10 == 0))
        w.copy_(torch.rand(t, K, generator=g).to(torch.bfloat16))
        want = resident.forward(x, ids, w).clone()
        for name, (graph, out) in graphs.items():
            graph.replay()
            assert torch.equal(out, want), f"{name} differs from resident at step {step}"
        slots.cache.check()
    s = slots.cache.read_stats()
    assert s["misses"] > 1000 and s["overflow"] > 100


def test_copy_engine_fill_bit_exact():
    from moetier.experts.backends import ResidentExperts, SlotExperts

    store, layout = rows_for()
    host = store.rows(0)
    resident = ResidentExperts(host.cuda(), layout, K)
    slots = SlotExperts(host, layout, K, num_slots=12, device="cuda", fill="copy")
    g = torch.Generator().manual_seed(2)
    for _ in range(100):
        x = torch.randn(1, H, generator=g).to(torch.bfloat16).cuda()
        ids = random_ids(g, 1).cuda()
        w = torch.rand(1, K, generator=g).to(torch.bfloat16).cuda()
        assert torch.equal(slots.forward(x, ids, w), resident.forward(x, ids, w))
    assert slots.cache.read_stats()["misses"] > 100


def test_generate_on_gpu_slots_equals_resident(tiny_ckpt):
    from moetier.experts.placement import ExpertOptions
    from moetier.generate import Generator
    from moetier.sampler import SamplingParams

    outs = {}
    for name, opts in {"resident": ExpertOptions("resident"), "slots": ExpertOptions("slots", slots=4),
                       "uva": ExpertOptions("uva")}.items():
        gen = Generator.from_dir(tiny_ckpt, experts=opts, device="cuda")
        r = gen.generate(gen.prompt_ids("Once upon a time"),
                         SamplingParams(max_tokens=200, temperature=1.0, seed=3, ignore_eos=True))
        outs[name] = r.output_ids
        if name == "slots":
            assert gen.model.expert_stats()["misses"] > 200
    assert outs["slots"] == outs["resident"] == outs["uva"]


def test_engine_batch_on_gpu_slots_and_graphs_equals_alone(tiny_ckpt):
    """Issue 4's GPU gate: a batch of 32 mixed requests through the slots backend with decode steps
    replayed from CUDA graphs gives every request the tokens it gets alone."""
    from moetier.engine import LLM
    from tests.test_engine import workload

    prompts, params = workload()
    llm = LLM(tiny_ckpt, device="cuda", experts=ExpertOptionsSlots(), max_num_seqs=8, max_num_tokens=64)
    batch = [o.output_ids for o in llm.generate(prompts, params)]
    assert llm.runner.graph_steps > 20
    alone = [llm.generate([p], sp)[0].output_ids for p, sp in zip(prompts, params)]
    assert batch == alone
    eager = LLM(tiny_ckpt, device="cuda", experts=ExpertOptionsSlots(), cuda_graphs=False)
    assert [o.output_ids for o in eager.generate(prompts, params)] == alone
    assert llm.metrics()["expert_stats"]["misses"] > 100
    llm.scheduler.check()


def ExpertOptionsSlots():
    from moetier.experts.placement import ExpertOptions

    return ExpertOptions("slots", slots=4)
