"""FP8 experts on CUDA (marked `gpu`, skipped without CUDA): the grouped GEMM on FP8 rows against the
dequantized torch reference at Qwen3-30B-A3B sizes, bit-exact across slot, host and resident rows and
across batches, graph-captured slots/uva bit-exact against eager resident, the large-step path, and
the engine end to end on an FP8 checkpoint."""

from __future__ import annotations

import pytest
import torch

from tests.test_gpu import random_ids, replay_backends

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

QE, QH, QI, QK = 64, 2048, 768, 8  # Qwen3-30B-A3B's expert shape, half its experts


def fp8_store(e=QE, h=QH, i=QI, seed=0):
    """Pinned FP8 rows of e experts, each projection quantized from random bf16 by the block rule."""
    from moetier.experts.shape import RowLayout
    from moetier.experts.cache.store import HostStore
    from moetier.quant import fp8_block as fp8

    layout = RowLayout(h, i, "fp8")
    store = HostStore([0], e, layout, torch.bfloat16, pin=True)
    assert store.pinned_bytes == e * layout.numel  # exact: the row bytes, nothing rounded
    g = torch.Generator("cuda").manual_seed(seed)
    rows = store.rows(0)
    for part, shape in (("gate", (i, h)), ("up", (i, h)), ("down", (h, i))):
        w = (torch.randn(e, *shape, generator=g, device="cuda") * 0.02).to(torch.bfloat16)
        q, s = fp8.quantize(w)
        layout.part(rows, part).copy_(q)
        layout.part(rows, part + "_scale").copy_(s)
    return store, layout


def oracle(x, ids, w, rows, layout):
    """float64 over the weights the reference model holds: each row dequantized into bf16."""
    from moetier.experts.reference import combine, expert_pairs, row_fetch

    fetch = row_fetch(rows, layout, torch.bfloat16)
    return combine(expert_pairs(x.double(), ids, lambda key: tuple(p.double() for p in fetch(key))), w.double())


@pytest.mark.parametrize("t", [1, 8, 64])
@pytest.mark.parametrize("dup", [False, True])
def test_fp8_grouped_kernel_vs_reference_and_exact_across_backends(t, dup):
    from moetier.experts.kernels import grouped_gemm as grouped
    from moetier.experts.cache.store import DevicePointer

    store, layout = fp8_store()
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
                                   dev_rows, DevicePointer(host), QH, QI, scratch, out, quant="fp8")
        return out

    resident = run(ids.int(), dev)
    cached = torch.randperm(QE, generator=g)[: QE // 2]
    slot_of = torch.full((QE,), -1, dtype=torch.int32)
    slot_of[cached] = torch.randperm(QE // 2, generator=g).int()
    slots = torch.full((QE // 2, layout.numel), 0xFF, dtype=torch.uint8, device="cuda")
    slots[slot_of[cached].long().cuda()] = dev[cached.cuda()]
    mixed_ids = slot_of.cuda()[ids]
    mixed = run(mixed_ids, slots)
    uva = run(torch.full_like(mixed_ids, -1), torch.full((1, layout.numel), 0xFF, dtype=torch.uint8, device="cuda"))
    assert torch.equal(mixed, resident) and torch.equal(uva, resident)
    if t > 1:  # a token's bits do not depend on what else shares its step
        part = torch.randperm(t, generator=g)[: t // 2].cuda()
        assert torch.equal(run(mixed_ids, slots, part), resident[part])
    want = oracle(x.cpu(), ids.cpu(), w.cpu(), host, layout)
    err = ((resident.double().cpu() - want).norm() / want.norm()).item()
    assert err <= 1e-2, err


def test_fp8_graph_replay_equals_eager_resident():
    store, layout = fp8_store(seed=1)
    st = replay_backends(store.rows(0), layout, QK, 4, QE // 4, 60, 3)
    assert st["misses"] > 100 and st["overflow"] > 0


def large_step_against_oracle(host, layout, seed: int = 5, dense: bool = False) -> None:
    """A step of 200 tokens (above decode_tokens: the large-step grouped GEMM) over quantized host rows
    [E, R]: slots (8 warm) and uva bit-exact against resident, resident within bf16 of the oracle.
    dense: with the blocks of steps dense in pairs (GemmConfig.large_blocks; a real one is 4,096 tokens)."""
    from moetier.experts.backends import ResidentExperts, SlotExperts, UvaExperts
    from moetier.experts.kernels.gemm_config import GemmConfig

    gemm = GemmConfig(large_dense_pairs=0 if dense else GemmConfig().large_dense_pairs)

    e = host.shape[0]
    g = torch.Generator().manual_seed(seed)
    t = 200
    x = torch.randn(t, layout.hidden, generator=g).to(torch.bfloat16).cuda()
    ids = random_ids(g, t, QK, e).cuda()
    w = torch.rand(t, QK, generator=g).to(torch.bfloat16).cuda()
    resident = ResidentExperts(host.cuda(), layout, QK, gemm=gemm).forward(x, ids, w)
    slots = SlotExperts(host, layout, QK, num_slots=8, device="cuda", gemm=gemm)
    slots.cache.warm(list(range(8)))
    slots.slots.copy_(host[:8].cuda())
    assert torch.equal(slots.forward(x, ids, w), resident)
    assert torch.equal(UvaExperts(host, layout, QK, device="cuda", gemm=gemm).forward(x, ids, w), resident)
    want = oracle(x.cpu(), ids.cpu(), w.cpu(), host, layout)
    err = ((resident.double().cpu() - want).norm() / want.norm()).item()
    assert err <= 1e-2, err


@pytest.mark.parametrize("dense", [False, True])
def test_fp8_large_step_vs_reference_and_backends(dense):
    store, layout = fp8_store(e=32, seed=2)
    large_step_against_oracle(store.rows(0), layout, dense=dense)


def test_fp8_checkpoint_on_gpu(tmp_path):
    """make-checkpoint --dtype fp8, loaded on CUDA: resident, slots and uva give the same greedy tokens,
    and the logits are the CPU path's (the dequantized torch reference) within bf16 tolerance."""
    from moetier.checkpoint.loader import load_model
    from moetier.checkpoint.writer import make_checkpoint
    from moetier.engine.generate import Generator
    from moetier.engine.llm import LLM
    from moetier.experts.placement import ExpertOptions
    from moetier.sampling_params import SamplingParams
    from tests.helpers import Sequence

    path = make_checkpoint(tmp_path / "fp8", "tiny", seed=2, dtype="fp8")
    outs = {}
    for name, opts in {"resident": ExpertOptions("resident"), "slots": ExpertOptions("slots", slots=4),
                       "uva": ExpertOptions("uva")}.items():
        gen = Generator(LLM(path, experts=opts, device="cuda"))
        r = gen.generate(gen.prompt_ids("Once upon a time"),
                         SamplingParams(max_tokens=120, temperature=1.0, seed=3, ignore_eos=True))
        outs[name] = r.output_ids
        if name == "slots":
            assert gen.model.expert_stats()["misses"] > 100
    assert outs["slots"] == outs["resident"] == outs["uva"]
    prompt = torch.arange(3, 40)
    _, cpu, _ = load_model(path, dtype="bfloat16", device="cpu")
    _, gpu, _ = load_model(path, dtype="bfloat16", device="cuda")
    a = cpu.logits(Sequence(cpu, 64).forward(prompt)).double()
    b = gpu.logits(Sequence(gpu, 64).forward(prompt)).double().cpu()
    assert ((a - b).norm() / a.norm()).item() <= 2e-2
