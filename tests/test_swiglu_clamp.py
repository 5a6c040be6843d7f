"""The clamped SwiGLU (swiglu_limit, GLM-5.3-Flash) in every expert kernel: the Triton kernels in the
interpreter (clamp_interpreter.py), the host kernels (torch and compiled) against their reference with
a limit that clamps, the placement that no longer refuses the model, tiny-glm5-next through the engine
with the hybrid backend against resident on the CPU, and resident against slots on CUDA (marked gpu)."""

from __future__ import annotations

import pytest
import torch

from moetier.experts.hybrid import host_ext
from moetier.experts.hybrid.cost_model import PathRates
from moetier.experts.hybrid.host_kernels import KERNELS, host_kernel, reference
from moetier.experts.placement import ExpertOptions, ExpertPlacement
from moetier.experts.shape import MoeShape, RowLayout
from moetier.experts.kernels.swiglu_clamp import limit_args
from tests.conftest import hf_glm5_next_checkpoint
from tests.interpreter import run_script

needs_ext = pytest.mark.skipif(not host_ext.available()[0], reason="the compiled host kernel does not build here")
LIMIT = 0.3  # gate_up values of the rows below have a std of about 0.8: most are clamped


def test_triton_kernels_clamp_in_the_interpreter():
    out = run_script("clamp_interpreter.py")
    for name in ("decode grouped", "FP8 GEMV", "decode grouped t=3 fp8", "large", "ring"):
        assert name in out, out


def test_limit_args_are_none_without_a_limit_and_refuse_a_bad_one():
    assert limit_args(None) == dict(HAS_LIMIT=False, LIMIT=0.0)
    assert limit_args(7) == dict(HAS_LIMIT=True, LIMIT=7.0)
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="swiglu_limit must be a finite number above 0"):
            limit_args(bad)
    assert host_ext.limit_arg(RowLayout(8, 8)) == -1.0 and host_ext.limit_arg(RowLayout(8, 8, None, 2)) == 2.0


# -- host kernels -----------------------------------------------------------------------------------
def host_case(kind: str, limit, seed=0):
    from tests.test_host_ext import fp8_rows

    g = torch.Generator().manual_seed(seed)
    h, i, e, t, k = 200, 72, 8, 5, 3  # ragged: neither a multiple of 128 nor of any SIMD width
    plain = RowLayout(h, i)
    rows = (torch.randn(e, plain.numel, generator=g) * 0.1).to(torch.bfloat16)
    lay = RowLayout(h, i, None, limit)
    if kind == "fp8":
        rows, lay = fp8_rows(rows, plain), RowLayout(h, i, "fp8", limit)
    elif kind == "fp32":
        rows = rows.float()
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)]).reshape(-1)
    x = torch.randn(t, h, generator=g).to(torch.bfloat16 if kind == "bf16" else torch.float32)
    pairs = torch.tensor([0, 1, 2, 4, 6, 7, 9, 11, 12, 14])
    return lay, rows, x, pairs, ids[pairs], torch.rand(pairs.numel(), generator=g), k


def rel(a, b) -> float:
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


@pytest.mark.parametrize("kind", ["fp32", "bf16", "fp8"])
@pytest.mark.parametrize("name", KERNELS)
def test_host_kernels_clamp_as_the_reference(name, kind):
    """Each host kernel under a limit against the reference with the same limit, and clearly away from
    the unclamped reference; with no limit, against the unclamped reference."""
    if name == "compiled" and not host_ext.available()[0]:
        pytest.skip("the compiled host kernel does not build here")
    lay, rows, x, pairs, ids, w, k = host_case(kind, LIMIT)
    plain = RowLayout(lay.hidden, lay.inter, lay.quant)
    got = host_kernel(name, lay, threads=2)(x, pairs, ids, w, rows, k)
    want, unclamped = reference(x, pairs, ids, w, rows, lay, k), reference(x, pairs, ids, w, rows, plain, k)
    # fp32: one op order apart; bf16 / FP8 in a bf16 model: up to 2 bf16 steps (test_hybrid.py)
    tol = 1e-5 if x.dtype == torch.float32 else 2e-2
    assert rel(got, want) <= tol, rel(got, want)
    assert rel(got, unclamped) > 0.2, "the clamped output is not away from the unclamped one"
    got_plain = host_kernel(name, plain, threads=2)(x, pairs, ids, w, rows, k)
    assert rel(got_plain, unclamped) <= tol


@needs_ext
@pytest.mark.parametrize("kind", ["fp32", "bf16", "fp8"])
def test_compiled_host_kernel_equals_the_torch_kernel_with_a_limit(kind):
    """The compiled kernel against the torch one (grouped), the same limit and pairs; and its pair outputs
    independent of its thread count (bitwise), clamp included."""
    lay, rows, x, pairs, ids, w, k = host_case(kind, LIMIT, seed=1)
    tol = 1e-5 if x.dtype == torch.float32 else 2e-2
    compiled, grouped = host_kernel("compiled", lay, threads=2), host_kernel("grouped", lay, threads=2)
    assert rel(compiled(x, pairs, ids, w, rows, k), grouped(x, pairs, ids, w, rows, k)) <= tol
    lib, tok = host_ext.load(), pairs // k
    one = host_ext.pair_outputs(lib, x, tok, ids, rows, lay, 1)
    assert torch.equal(one, host_ext.pair_outputs(lib, x, tok, ids, rows, lay, 3))
    assert not torch.equal(one, host_ext.pair_outputs(lib, x, tok, ids, rows, RowLayout(200, 72, lay.quant), 1))


# -- placement --------------------------------------------------------------------------------------
@pytest.mark.parametrize("backend", ["resident", "slots", "uva", "hybrid"])
def test_placement_takes_the_clamped_model_on_every_backend(backend):
    shape = MoeShape(8, 2, 16, 8, None, 0.15)
    assert ExpertOptions(backend).problems(shape, [0]) == []
    placement = ExpertPlacement(shape, torch.float32, [0], ExpertOptions(backend, host_kernel="grouped"), "cpu", 4)
    assert placement.layout.swiglu_limit == 0.15
    assert placement.build(0, placement.rows(0)).layout.swiglu_limit == 0.15


# -- the engine -------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def glm5_next(tmp_path_factory):
    """Written by transformers where it knows glm5_next's layer types; else (the GPU image's older
    transformers) by our own writer: these tests compare our backends with each other, not with HF."""
    out = tmp_path_factory.mktemp("glm5next-clamp") / "ckpt"
    try:
        return hf_glm5_next_checkpoint(out, seed=2)[0]
    except Exception as e:  # an older transformers refuses `indexed_attention` in layer_types (its own error type)
        if "indexed_attention" not in str(e):
            raise
    from moetier.checkpoint.writer import make_checkpoint
    return make_checkpoint(out, "tiny-glm5-next", seed=2, dtype="float32")


def run_engine(path, opts, device="cpu", steps=8, **engine):
    from moetier.engine.llm import LLM
    from moetier.sampling_params import SamplingParams
    from tests.test_glm5_next_engine import captured, prompts

    llm = LLM(path, dtype="float32", device=device, experts=opts, **engine)
    rows = captured(llm)
    outs = llm.generate(prompts()[:3], SamplingParams(max_tokens=steps, ignore_eos=True))
    return [o.outputs[0].token_ids for o in outs], torch.stack(rows).float().cpu(), llm


@pytest.mark.parametrize("mode", ["grouped", "compiled", "nodes"])
def test_engine_hybrid_equals_resident_on_the_cpu(glm5_next, mode):
    """tiny-glm5-next (swiglu_limit 0.15, which clamps its random experts) with the hybrid backend, the
    misses split between the link and the host kernel: resident's greedy tokens, logits within fp32
    rounding (the host kernels sum in another order); the host path really ran."""
    if mode != "grouped" and not host_ext.available()[0]:
        pytest.skip("the compiled host kernel does not build here")
    want_tokens, want, _ = run_engine(glm5_next, ExpertOptions("resident"))
    opts = ExpertOptions("hybrid", slots=4, rates=PathRates(50.0, {"float32": 50.0}), host_threads=1,
                         host_kernel="grouped" if mode == "grouped" else "compiled", hybrid_nodes=mode == "nodes")
    tokens, got, llm = run_engine(glm5_next, opts)
    assert tokens == want_tokens
    assert ((got - want).norm() / want.norm()).item() <= 1e-4
    s = llm.metrics()["expert_stats"]
    assert s["host"] > 0 and s["misses"] > 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_engine_glm5_next_resident_and_slots_bit_exact(glm5_next):
    """On CUDA every backend runs the same clamped Triton kernels: slots (and uva, hybrid with every miss
    over the link) give resident's bits over prefill and decode; resident is near the CPU's logits. Eager
    (cuda_graphs=False), with fla's chunked KDA in IEEE float32 dots (as shipped it takes TF32 ones:
    tests/test_glm5_next_gpu.py bounds those)."""
    from tests.helpers import ieee_fp32_dots

    _, cpu, _ = run_engine(glm5_next, ExpertOptions("resident"), "cpu", steps=20)
    pytest.importorskip("fla", reason="fla-core is not installed (pip install fla-core==0.6.0)")
    with ieee_fp32_dots("fla"):
        want_tokens, want, _ = run_engine(glm5_next, ExpertOptions("resident"), "cuda", steps=20, cuda_graphs=False)
        assert ((want - cpu).norm() / cpu.norm()).item() <= 1e-3  # fp32, another summation order
        link = PathRates(1e6, {"float32": 1e-3})
        for opts in (ExpertOptions("slots", slots=4), ExpertOptions("uva"),
                     ExpertOptions("hybrid", slots=4, rates=link, hybrid_nodes=False)):
            tokens, got, llm = run_engine(glm5_next, opts, "cuda", steps=20, cuda_graphs=False)
            assert tokens == want_tokens, opts.backend
            assert torch.equal(got, want), opts.backend
        assert llm.metrics()["expert_stats"]["misses"] > 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("t,quant", [(1, None), (8, None), (1, "fp8"), (8, "fp8"), (100, None)])
def test_gpu_kernels_clamp_as_the_reference(t, quant):
    """The compiled Triton kernels under a limit (t=1 FP8: the GEMV; 100 tokens: the large-step GEMM)
    against expert_pairs with the same limit in float64, and away from the unclamped result."""
    from moetier.experts.backends import ResidentExperts
    from moetier.experts.reference import combine, expert_pairs, row_fetch
    from tests.test_host_ext import fp8_rows  # NOTE: not fp8_interpreter's (importing it sets TRITON_INTERPRET)

    g = torch.Generator().manual_seed(t)
    e, k, h, i = 16, 4, 256, 128
    lay = RowLayout(h, i, quant, LIMIT)
    rows = (torch.randn(e, RowLayout(h, i).numel, generator=g) * 0.1).to(torch.bfloat16)
    if quant:
        rows = fp8_rows(rows, RowLayout(h, i))
    x = torch.randn(t, h, generator=g).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
    w = torch.rand(t, k, generator=g)
    got = ResidentExperts(rows.cuda(), lay, k, 64).forward(x.cuda(), ids.cuda(), w.cuda()).float().cpu()
    fetch = row_fetch(rows, lay, torch.bfloat16)

    def oracle(limit):
        pairs = expert_pairs(x.double(), ids, lambda key: tuple(p.double() for p in fetch(key)), limit)
        return combine(pairs, w.double())
    want, unclamped = oracle(LIMIT), oracle(None)
    assert ((got.double() - want).norm() / want.norm()).item() <= 1e-2
    assert ((got.double() - unclamped).norm() / unclamped.norm()).item() > 0.1
