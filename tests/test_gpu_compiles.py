"""No Triton compile in the middle of serving (docs/prefix-cache.md: one stalled every running
request for a second or so). Covered: the paged and the latent (MLA) attention (their shape-following
variants compiled at startup, engine/warmup.py), the slot cache's bookkeeping, the decode plan,
the large-step plan and the host tier's page copy (their per-step ints are not specialized), and the
large-step path (engine/warmup.py runs one large step at startup), KDA's l2 norm before the chunked
prefill. Skipped without CUDA."""

from __future__ import annotations

import random

import pytest
import torch

from moetier.engine.llm import LLM
from moetier.experts.placement import ExpertOptions
from moetier.sampling_params import SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

WATCHED = ("_attn", "_mla", "_combine", "_bookkeeping", "_bookkeeping_regs", "_plan", "_plan_sorted", "_copy_pages")
LARGE_STEP = ("_gate_up", "_down", "_copy_rows")  # the expert GEMM and the slot fill: engine/warmup.py's step


@pytest.fixture
def compiles():
    """The names of the watched kernels compiled (or loaded from Triton's disk cache: a new
    specialization in this process) while the fixture is active."""
    from triton import knobs

    seen: list[str] = []

    def hook(*args, **kwargs):
        fn = kwargs.get("fn")  # Triton's JitFunctionInfo: .name is the kernel's qualified name
        name = getattr(fn, "name", None) or str(kwargs.get("repr", "")).split("[")[0]
        seen.append(str(name).rsplit(".", 1)[-1])
        return False  # compile as usual

    old = knobs.runtime.jit_cache_hook
    knobs.runtime.jit_cache_hook = hook
    try:
        yield seen
    finally:
        knobs.runtime.jit_cache_hook = old


def test_attention_variants_cover_every_chunk_shape(compiles):
    from moetier.layers.attention import make_batch
    from moetier.layers.paged_attention_triton import compile_variants, paged_attention_triton

    hq, hkv, d, ps, dev = 32, 4, 128, 16, torch.device("cuda")
    compile_variants(hq, hkv, d, ps, torch.bfloat16, dev)
    compiles.clear()
    rng = random.Random(0)
    cache = torch.randn(400, ps, hkv, d, dtype=torch.bfloat16, device=dev)
    # (sequences, new tokens each, tokens before): a cached prefix's tails, odd sizes, one long chunk
    for seqs, new, done in ((16, 16, 4144), (3, 45, 700), (1, 7, 33), (30, 2, 100), (5, 130, 300), (1, 1, 5),
                            (2, 3, 0), (7, 64, 61)):
        pages = -(-(new + done) // ps)
        batch = make_batch([(done, new, rng.sample(range(400), pages)) for _ in range(seqs)], ps, dev)
        paged_attention_triton(torch.randn(seqs * new, hq, d, dtype=torch.bfloat16, device=dev), cache, cache, batch)
    torch.cuda.synchronize()
    assert [n for n in compiles if n in WATCHED] == []


@pytest.mark.parametrize("dsa", [False, True])
def test_latent_attention_variants_cover_every_chunk_shape(compiles, dsa):
    from moetier.layers.attention import make_batch
    from moetier.layers.latent_attention_triton import compile_variants, latent_attention_triton

    hq, r, p, ps, k, dev = 16, 512, 64, 16, 67, torch.device("cuda")  # k: kpool's widths are rarely "% 16"
    compile_variants(hq, r, p, ps, torch.bfloat16, dev, dsa)
    compiles.clear()
    rng = random.Random(1)
    latent = torch.randn(300, ps, r + p, dtype=torch.bfloat16, device=dev)
    for seqs, new, done in ((16, 16, 2000), (3, 45, 700), (1, 7, 33), (30, 1, 100), (5, 130, 300), (1, 1, 5)):
        pages = -(-(new + done) // ps)
        batch = make_batch([(done, new, rng.sample(range(300), pages)) for _ in range(seqs)], ps, dev)
        rows = seqs * new
        topk = torch.randint(0, max(1, done), (rows, k), dtype=torch.int32, device=dev) if dsa else None
        latent_attention_triton(torch.randn(rows, hq, r + p, dtype=torch.bfloat16, device=dev), latent, batch,
                                0.1, r, topk)
    torch.cuda.synchronize()
    assert [n for n in compiles if n in WATCHED] == []


def test_kda_l2norm_compiles_once_for_every_step_size(compiles):
    """KDA's q/k l2 norm before the chunked prefill (layers/l2norm_triton.py): steps of 1 to 9,000 tokens
    at 64 heads (fla-core's own l2norm autotuned again at every 65,536 rows: 1,024 tokens) compile
    nothing after the first; each result is the reference's to bf16 rounding."""
    from moetier.layers.kda_reference import L2_EPS, l2_normalize
    from moetier.layers.l2norm_triton import l2norm_rows

    l2norm_rows(torch.randn(3, 64, 128, dtype=torch.bfloat16, device="cuda"), L2_EPS)
    torch.cuda.synchronize()
    compiles.clear()
    for tokens in (1, 17, 1025, 3000, 9000):
        x = torch.randn(tokens, 64, 128, dtype=torch.bfloat16, device="cuda")
        y = l2norm_rows(x, L2_EPS)
        want = l2_normalize(x.float()).to(torch.bfloat16)
        assert (y.float() - want.float()).abs().max() <= 2 ** -8, tokens  # a bf16 ulp below 1
    torch.cuda.synchronize()
    assert "_l2norm_kernel" not in compiles, compiles


def test_serving_compiles_nothing_after_startup(compiles):
    """Slots (bookkeeping, decode plan, large-step plan and GEMM), a host tier (page copies), prefix
    hits: from the first request on (engine/warmup.py ran the large step at startup), requests of any
    shape compile none of the watched kernels."""
    llm = LLM(None, device="cuda", dtype="bfloat16", experts=ExpertOptions("slots", slots=4), page_size=16,
              kv_tokens=512, kv_host_bytes=16 << 20, max_num_tokens=256)
    g = torch.Generator().manual_seed(0)
    head = torch.randint(0, 440, (96,), generator=g).tolist()

    def run(n: int, tail: int, out: int) -> None:
        ps = [head + torch.randint(0, 440, (tail + i,), generator=g).tolist() for i in range(n)]
        llm.generate(ps, SamplingParams(max_tokens=out, ignore_eos=True))

    compiles.clear()
    for n, tail, out in ((1, 200, 4), (4, 20, 4), (3, 7, 5), (9, 33, 3), (16, 3, 6), (2, 150, 2), (5, 61, 9),
                         (11, 250, 2)):
        run(n, tail, out)
    torch.cuda.synchronize()
    m = llm.metrics()
    assert m["prefix_cache_hits"] > 0 and m["kv_host_pages_to_host"] > 0, m  # the paths ran
    assert [n for n in compiles if n in WATCHED + LARGE_STEP] == [], compiles
