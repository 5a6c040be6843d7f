"""GPU tests (marked `gpu`, skipped without CUDA): the Triton kernels against their torch references,
exact pinning, and the graph-captured slot cache bit-exact against the eager resident layer."""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

E, H, I, K = 64, 256, 128, 8


def capture(fn):
    """Warm fn up on a side stream (compile, allocate), then capture it -> (graph, its output)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out


def replay_against_resident(graphs, resident, slots, x, ids, w, steps: int, seed: int, new_ids) -> None:
    """From an empty cache, `steps` times: new inputs into x, ids (new_ids(g, step)), w; replay every
    captured graph; its output must equal the eager resident layer's bit for bit."""
    slots.cache.reset()
    g = torch.Generator().manual_seed(seed)
    for step in range(steps):
        x.copy_(torch.randn(x.shape, generator=g).to(torch.bfloat16))
        ids.copy_(new_ids(g, step))
        w.copy_(torch.rand(w.shape, generator=g).to(torch.bfloat16))
        want = resident.forward(x, ids, w).clone()
        for name, (graph, out) in graphs.items():
            graph.replay()
            assert torch.equal(out, want), f"{name} differs from resident at step {step}"
        slots.cache.check()


def rows_for(e=E, h=H, i=I, dtype=torch.bfloat16, pin=True, seed=0):
    from moetier.experts.shape import RowLayout
    from moetier.experts.cache.store import HostStore

    layout = RowLayout(h, i)
    store = HostStore([0], e, layout, dtype, pin=pin)
    g = torch.Generator().manual_seed(seed)
    store.rows(0).copy_((torch.randn(e, layout.numel, generator=g) * 0.05).to(dtype))
    return store, layout


def test_store_pins_exact_size():
    from moetier.experts.shape import RowLayout
    from moetier.experts.cache.store import PAGE, HostStore

    layout = RowLayout(1000, 36)  # rows of 216,000 bytes: no power of two anywhere
    store = HostStore([0, 1, 2], 37, layout, torch.bfloat16, pin=True)
    r = store.report()
    assert r["pinned_bytes"] == r["requested_bytes"] == 3 * 37 * 216_000
    assert r["allocated_bytes"] - r["requested_bytes"] <= PAGE * 3  # within one page per block
    for layer in range(3):
        assert store.rows(layer).data_ptr() % PAGE == 0


def replay_backends(host, layout, k: int, t: int, num_slots: int, steps: int, seed: int) -> dict:
    """resident, slots (num_slots) and uva layers over host rows [E, R]: slots and uva captured as CUDA
    graphs of t-token steps, replayed `steps` times against the eager resident layer, bit for bit
    (replay_against_resident) -> the slot cache's stats."""
    from moetier.experts.backends import ResidentExperts, SlotExperts, UvaExperts

    e = host.shape[0]
    resident = ResidentExperts(host.cuda(), layout, k)
    slots = SlotExperts(host, layout, k, num_slots=num_slots, device="cuda")
    uva = UvaExperts(host, layout, k, device="cuda")
    assert resident.decode_tokens >= t
    x = torch.zeros(t, layout.hidden, dtype=torch.bfloat16, device="cuda")
    ids = torch.zeros(t, k, dtype=torch.int64, device="cuda")
    w = torch.zeros(t, k, dtype=torch.bfloat16, device="cuda")
    graphs = {}
    for name, b in (("slots", slots), ("uva", uva)):
        ids.copy_(random_ids(torch.Generator().manual_seed(0), t, k, e))
        graphs[name] = capture(lambda b=b: b.forward(x, ids, w))
    replay_against_resident(graphs, resident, slots, x, ids, w, steps, seed,
                            lambda g, step: random_ids(g, t, k, e, dup=step % 5 == 0))
    return slots.cache.read_stats()


def random_ids(g, t, k=K, e=E, dup=False):
    if dup:
        return torch.randint(0, max(2, e // 8), (t, k), generator=g)
    return torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])


@pytest.mark.parametrize("policy", ["lru", "lfru"])
@pytest.mark.parametrize("num_slots", [8, 20, 64])
def test_bookkeeping_kernel_matches_reference(num_slots, policy):
    """Both bookkeeping kernels (registers for small steps, barriers for large) against the torch
    reference, with the copy kernel after each step: every slot must also hold its row."""
    from moetier.experts.cache import slot_kernels as kernels
    from moetier.experts.cache.slots import SlotCache, policy_for
    from moetier.experts.cache.store import DevicePointer

    pol = policy_for(policy, num_slots, K)
    ref, gpu = SlotCache(E, num_slots, policy=pol), SlotCache(E, num_slots, "cuda", policy=pol)
    scratch = kernels.BookkeepingScratch(E, num_slots, 64 * K, torch.device("cuda"))
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
    from moetier.experts.cache import slot_kernels as kernels
    from moetier.experts.cache.store import DevicePointer

    store, layout = rows_for()
    host = store.rows(0)
    slots = torch.full((16, layout.numel), float("nan"), dtype=host.dtype, device="cuda")
    sc = kernels.BookkeepingScratch(E, 16, 16, torch.device("cuda"))
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
        graphs[name] = capture(lambda b=b: b.forward(x, ids, w))
    replay_against_resident(graphs, resident, slots, x, ids, w, 300, 1,
                            lambda g, step: random_ids(g, t, dup=step % 10 == 0))
    s = slots.cache.read_stats()
    assert s["misses"] > 1000 and s["overflow"] > 100


def test_generate_on_gpu_slots_equals_resident(tiny_ckpt):
    from moetier.engine.generate import Generator
    from moetier.engine.llm import LLM
    from moetier.experts.placement import ExpertOptions
    from moetier.sampling_params import SamplingParams

    outs = {}
    for name, opts in {"resident": ExpertOptions("resident"), "slots": ExpertOptions("slots", slots=4),
                       "uva": ExpertOptions("uva")}.items():
        gen = Generator(LLM(tiny_ckpt, experts=opts, device="cuda"))
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
    batch = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert llm.runner.graph_steps > 20
    alone = [llm.generate([p], sp)[0].outputs[0].token_ids for p, sp in zip(prompts, params)]
    assert batch == alone
    eager = LLM(tiny_ckpt, device="cuda", experts=ExpertOptionsSlots(), cuda_graphs=False)
    assert [o.outputs[0].token_ids for o in eager.generate(prompts, params)] == alone
    assert llm.metrics()["expert_stats"]["misses"] > 100
    llm.scheduler.check()


def ExpertOptionsSlots():
    from moetier.experts.placement import ExpertOptions

    return ExpertOptions("slots", slots=4)


def test_sampler_in_graph_equals_eager_and_alone(tiny_ckpt):
    """Issue 6: the sampler runs inside the decode graphs; seeded sampling with top-k / top-p through
    graph-replayed steps of every captured size gives each request the tokens it gets alone, eagerly."""
    from moetier.engine import LLM
    from moetier.sampling_params import SamplingParams

    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(0, 400, (int(n),), generator=g).tolist() for n in torch.randint(1, 30, (40,), generator=g)]
    kinds = [dict(), dict(temperature=0.8), dict(temperature=1.0, top_k=20), dict(temperature=1.2, top_p=0.9)]
    params = [SamplingParams(max_tokens=12 + i % 9, seed=100 + i, ignore_eos=True, **kinds[i % 4]) for i in range(40)]
    llm = LLM(tiny_ckpt, device="cuda", experts=ExpertOptionsSlots(), max_num_seqs=64, max_num_tokens=256)
    assert llm.runner.graphs.sizes[-1] >= 16
    batch = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert llm.runner.graph_steps > 10
    eager = LLM(tiny_ckpt, device="cuda", experts=ExpertOptionsSlots(), cuda_graphs=False)
    alone = [eager.generate([p], sp)[0].outputs[0].token_ids for p, sp in zip(prompts, params)]
    assert batch == alone


def test_replayed_trace_greedy_tokens_equal_resident_vs_slots():
    """Issue 6: for the same routing trace, greedy tokens are identical between resident and slots
    (a quarter of the experts in slots, so the cache misses and fills all the time)."""
    from pathlib import Path

    from moetier.engine import LLM
    from moetier.experts.placement import ExpertOptions
    from moetier.sampling_params import SamplingParams

    trace = Path(__file__).parents[1] / "data" / "traces" / "tiny-stdlib-heldout.mtrace"
    outs, stats = {}, {}
    for name, opts in {"resident": ExpertOptions("resident"), "slots": ExpertOptions("slots", slots=8)}.items():
        llm = LLM(device="cuda", experts=opts, replay_trace=trace, max_num_seqs=8)
        res = llm.generate(["def parse(line):", "class Node:", "import os\n"] * 3,
                           SamplingParams(max_tokens=150, ignore_eos=True))
        outs[name] = [r.outputs[0].token_ids for r in res]
        stats[name] = llm.model.expert_stats()
    assert outs["slots"] == outs["resident"]
    assert stats["slots"]["misses"] > 1000


def test_replayed_trace_in_padded_graphs_routes_as_eager():
    """Three sequences replay the graph of size 4 (one padding row): the trace cursor advances by the
    real rows only, so the graphs route every token by the trace row an eager run gives it (before,
    the padding moved the cursor and routing drifted from the eager run's)."""
    from pathlib import Path

    from moetier.engine import LLM
    from moetier.sampling_params import SamplingParams

    trace = Path(__file__).parents[1] / "data" / "traces" / "tiny-stdlib-heldout.mtrace"
    prompts = ["def parse(line):", "class Node:\n    def", "import os\n"]
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in (40, 25, 33)]
    runs = {}
    for graphs in (False, True):
        llm = LLM(device="cuda", replay_trace=trace, max_num_seqs=8, cuda_graphs=graphs)
        outs = llm.generate(prompts, params)
        runs[graphs] = [o.outputs[0].token_ids for o in outs], int(llm.replayer.cursor)
        assert (llm.runner.graph_steps > 10) == graphs
        llm.close()
    tokens = sum(len(o.prompt_token_ids) + len(o.outputs[0].token_ids) - 1 for o in outs)
    assert runs[False][1] == runs[True][1] == tokens
    assert runs[True][0] == runs[False][0]


# The grouped expert GEMM (experts/kernels/grouped_gemm.py) at Qwen3-30B sizes: bf16 rows of 2048 x 768, 128 experts, top-8.
QE, QH, QI, QK = 128, 2048, 768, 8


def qwen_rows(seed=0):
    from moetier.experts.shape import RowLayout
    from moetier.experts.cache.store import HostStore

    layout = RowLayout(QH, QI)
    store = HostStore([0], QE, layout, torch.bfloat16, pin=True)  # 1.2 GB pinned
    g = torch.Generator("cuda").manual_seed(seed)
    for e in range(QE):
        store.rows(0)[e].copy_((torch.randn(layout.numel, generator=g, device="cuda") * 0.02).to(torch.bfloat16))
    return store, layout


@pytest.mark.parametrize("t", [8, 64])
@pytest.mark.parametrize("dup", [False, True])
def test_grouped_kernel_qwen3_sizes_vs_float64_and_exact_across_backends(t, dup):
    """Against a float64 oracle, and bit-exact between slot rows, host rows and the resident layout, and
    whatever other tokens share the step (dup: 16 experts, groups of up to t*k pairs in many chunks)."""
    from moetier.experts.kernels import grouped_gemm as grouped
    from moetier.experts.reference import combine, expert_pairs
    from moetier.experts.cache.store import DevicePointer

    store, layout = qwen_rows()
    host = store.rows(0)
    dev = host.cuda()
    g = torch.Generator().manual_seed(t + dup)
    x = torch.randn(t, QH, generator=g).to(torch.bfloat16).cuda()
    ids = random_ids(g, t, QK, QE, dup=dup).cuda()
    w = torch.rand(t, QK, generator=g).to(torch.bfloat16).cuda()
    scratch = grouped.GemmScratch.make(64 * QK, QH, QI, torch.device("cuda"))

    def run(slot_ids, dev_rows, rows=slice(None)):
        out = torch.full((x[rows].shape[0], QH), float("nan"), dtype=torch.bfloat16, device="cuda")
        grouped.grouped_expert_mlp(x[rows], slot_ids[rows].contiguous(), ids[rows].contiguous(), w[rows].contiguous(),
                                   dev_rows, DevicePointer(host), QH, QI, scratch, out)
        return out

    resident = run(ids.int(), dev)
    cached = torch.randperm(QE, generator=g)[: QE // 2]  # half the experts in shuffled slots, half on the host
    slot_of = torch.full((QE,), -1, dtype=torch.int32)
    slot_of[cached] = torch.randperm(QE // 2, generator=g).int()
    slots = torch.empty(QE // 2, layout.numel, dtype=torch.bfloat16, device="cuda")
    slots[slot_of[cached].long().cuda()] = dev[cached.cuda()]
    mixed_ids = slot_of.cuda()[ids]
    mixed = run(mixed_ids, slots)
    uva = run(torch.full_like(mixed_ids, -1), torch.empty(1, layout.numel, dtype=torch.bfloat16, device="cuda"))
    assert torch.equal(mixed, resident) and torch.equal(uva, resident)
    part = torch.randperm(t, generator=g)[: t // 2].cuda()
    assert torch.equal(run(mixed_ids, slots, part), resident[part])

    def fetch(key):
        row = dev[key:key + 1].double()
        return layout.w13(row)[0], layout.w2(row)[0]
    want = combine(expert_pairs(x.double(), ids, fetch), w.double())
    err = ((resident.double() - want).norm() / want.norm()).item()
    assert err <= 1e-2, err


@pytest.mark.parametrize("t", [8, 64])
def test_grouped_graph_replay_equals_eager_qwen3_sizes(t):
    """Slots (half the experts) and uva steps of t tokens replayed from CUDA graphs equal the eager
    resident layer bit for bit: the grouped kernel's plan and grid are graph safe."""
    store, layout = qwen_rows(seed=1)
    st = replay_backends(store.rows(0), layout, QK, t, QE // 2, 40, 2)
    # at T = 64 most misses overflow: 64 slots cannot hold a step's experts
    assert st["misses"] + st["overflow"] > 100


def test_generate_json_carries_the_plan_and_two_audits(tiny_ckpt):
    """Issue 14: on CUDA, generate audits the plan after load and after graph capture; the allocated
    bytes of the tiny model's persistent tensors match the plan within a few MiB (fixed costs dominate
    at this size, so the 5% rule is for the published shapes: scripts/plan_audit.py). In a process of
    its own: torch keeps a cuBLAS workspace per stream it pools, so after an earlier engine of the
    same process the capture streams' 64 MiB the plan counts already exist (seen on the H200 after
    test_hybrid_nodes)."""
    import json
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "moetier.cli", "generate", "hi", "--model", str(tiny_ckpt), "--device",
                        "cuda", "--max-tokens", "4", "--max-model-len", "512", "--json"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    d = json.loads(r.stdout)
    assert [a["stage"] for a in d["audit"]] == ["after load", "after graph capture"]
    allocated = next(row for row in d["audit"][1]["rows"] if row["what"] == "torch allocated")
    assert abs(allocated["measured"] - allocated["planned"]) < 64 * 2**20, allocated
