"""4-bit experts (NVFP4, INT4; issue 30) on CUDA (marked `gpu`, skipped without CUDA), beside
tests/test_quant4_kernels.py's kernel test: graph-captured slots and uva bit-exact against eager
resident on 4-bit rows, the large-step path against the dequantized reference and across backends,
and the engine end to end on 4-bit checkpoints of qwen3_moe and deepseek_v3 (glm5_next where
fla-core is installed): resident, slots and uva the same tokens, hybrid and the CPU path within bf16."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from tests.test_gpu import capture, random_ids, replay_against_resident

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

QE, QH, QI, QK = 64, 2048, 768, 8  # Qwen3-30B-A3B's expert shape, half its experts
FORMATS = ("nvfp4", "int4", "int4-g32")


def q4_store(quant: str, e: int = QE, seed: int = 0):
    """Pinned 4-bit rows of e experts, each projection quantized from random bf16 by the format's rule."""
    from moetier.checkpoint.random_bed import fill_4bit_rows
    from moetier.experts.cache.store import HostStore
    from moetier.experts.shape import RowLayout

    layout = RowLayout(QH, QI, quant)
    store = HostStore([0], e, layout, torch.bfloat16, pin=True)
    assert store.pinned_bytes == e * layout.numel  # exact: the row bytes, nothing rounded
    fill_4bit_rows(store.rows(0), layout, torch.Generator().manual_seed(seed))
    return store, layout


def oracle(x, ids, w, rows, layout):
    """float64 over the weights the reference model holds: each row dequantized into bf16."""
    from moetier.experts.reference import combine, expert_pairs, row_fetch

    fetch = row_fetch(rows, layout, torch.bfloat16)
    return combine(expert_pairs(x.double(), ids, lambda key: tuple(p.double() for p in fetch(key))), w.double())


@pytest.mark.parametrize("quant", FORMATS)
def test_4bit_graph_replay_equals_eager_resident(quant):
    from moetier.experts.backends import ResidentExperts, SlotExperts, UvaExperts

    store, layout = q4_store(quant, seed=1)
    host = store.rows(0)
    resident = ResidentExperts(host.cuda(), layout, QK)
    slots = SlotExperts(host, layout, QK, num_slots=QE // 4, device="cuda")
    uva = UvaExperts(host, layout, QK, device="cuda")
    t = 4
    x = torch.zeros(t, QH, dtype=torch.bfloat16, device="cuda")
    ids = torch.zeros(t, QK, dtype=torch.int64, device="cuda")
    w = torch.zeros(t, QK, dtype=torch.bfloat16, device="cuda")
    graphs = {}
    for name, b in (("slots", slots), ("uva", uva)):
        ids.copy_(random_ids(torch.Generator().manual_seed(0), t, QK, QE))
        graphs[name] = capture(lambda b=b: b.forward(x, ids, w))
    replay_against_resident(graphs, resident, slots, x, ids, w, 40, 3,
                            lambda g, step: random_ids(g, t, QK, QE, dup=step % 5 == 0))
    st = slots.cache.read_stats()
    assert st["misses"] > 50 and st["overflow"] > 0


@pytest.mark.parametrize("quant", FORMATS)
def test_4bit_large_step_vs_reference_and_backends(quant):
    from moetier.experts.backends import ResidentExperts, SlotExperts, UvaExperts

    store, layout = q4_store(quant, e=32, seed=2)
    host = store.rows(0)
    g = torch.Generator().manual_seed(5)
    t = 200  # above decode_tokens: the large-step grouped GEMM
    x = torch.randn(t, QH, generator=g).to(torch.bfloat16).cuda()
    ids = random_ids(g, t, QK, 32).cuda()
    w = torch.rand(t, QK, generator=g).to(torch.bfloat16).cuda()
    resident = ResidentExperts(host.cuda(), layout, QK).forward(x, ids, w)
    slots = SlotExperts(host, layout, QK, num_slots=8, device="cuda")
    slots.cache.warm(list(range(8)))
    slots.slots.copy_(host[:8].cuda())
    assert torch.equal(slots.forward(x, ids, w), resident)
    assert torch.equal(UvaExperts(host, layout, QK, device="cuda").forward(x, ids, w), resident)
    want = oracle(x.cpu(), ids.cpu(), w.cpu(), host, layout)
    err = ((resident.double().cpu() - want).norm() / want.norm()).item()
    assert err <= 1e-2, err


@pytest.mark.parametrize("preset", ["tiny", "tiny-dsv3", "tiny-glm5-next"])
@pytest.mark.parametrize("dtype,fmt", [("nvfp4", None), ("nvfp4", "compressed-tensors"), ("int4", None)])
def test_4bit_checkpoint_on_gpu(tmp_path, preset, dtype, fmt):
    """make-checkpoint --dtype nvfp4 | int4, loaded on CUDA (CUDA graphs): resident, slots and uva the
    same sampled tokens; hybrid's and the CPU path's logits (the torch references) within bf16."""
    from moetier.checkpoint.loader import load_model
    from moetier.checkpoint.writer import make_checkpoint
    from moetier.engine.generate import Generator
    from moetier.engine.llm import LLM
    from moetier.experts.placement import ExpertOptions
    from moetier.sampling_params import SamplingParams
    from tests.helpers import Sequence

    if preset == "tiny-glm5-next" and importlib.util.find_spec("fla") is None:
        pytest.skip("glm5_next on CUDA needs fla-core (pip install 'moetier[cuda]')")
    path = make_checkpoint(tmp_path / dtype, preset, seed=2, dtype=dtype, format=fmt)
    outs = {}
    for name, opts in {"resident": ExpertOptions("resident"), "slots": ExpertOptions("slots", slots=4),
                       "uva": ExpertOptions("uva")}.items():
        gen = Generator(LLM(path, experts=opts, device="cuda"))
        r = gen.generate(gen.prompt_ids("Once upon a time"),
                         SamplingParams(max_tokens=80, temperature=1.0, seed=3, ignore_eos=True))
        outs[name] = r.output_ids
        if name == "slots":
            assert gen.model.expert_stats()["misses"] > 50
        gen.llm.close()
    assert outs["slots"] == outs["resident"] == outs["uva"]
    prompt = torch.arange(3, 40)
    _, cpu, _ = load_model(path, dtype="bfloat16", device="cpu")
    a = cpu.logits(Sequence(cpu, 64).forward(prompt)).double()
    for opts in (ExpertOptions("resident"), ExpertOptions("hybrid", slots=2)):
        _, gpu, _ = load_model(path, dtype="bfloat16", device="cuda", experts=opts)
        b = gpu.logits(Sequence(gpu, 64).forward(prompt)).double().cpu()
        assert ((a - b).norm() / a.norm()).item() <= 2e-2, opts.backend
