"""The grouped expert GEMMs on 4-bit rows (issue 30): Triton's interpreter on the CPU
(tests/quant4_interpreter.py, tiny ragged shapes, with and without the SwiGLU clamp), and on CUDA
(marked gpu) the compiled kernels against the torch reference and bit-exact across backends."""

from __future__ import annotations

import pytest
import torch

from moetier.quant.rows import RowLayout

FORMATS = ("nvfp4", "int4", "int4-g32", "int4-asym")


def test_4bit_grouped_kernels_in_the_interpreter():
    pytest.importorskip("triton")
    from tests.interpreter import run_script

    out = run_script("quant4_interpreter.py")
    lines = [line for line in out.splitlines() if " decode " in line or " large " in line]
    # 5 formats x (2 cases x 2 dtypes x (decode, large) + one token on small GEMV tiles), some clamped
    assert len(lines) == 45 and sum("small-gemv" in line for line in lines) == 5, out
    assert sum("limit=0.5" in line for line in lines) == 14, out
    assert sum(line.endswith("bit-exact over 1024 weights") for line in out.splitlines()) == 5, out


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("quant", FORMATS)
@pytest.mark.parametrize("t", [1, 8, 100])
def test_gpu_4bit_grouped_gemm_matches_the_reference_and_is_placement_exact(quant, t):
    """Qwen3-30B's expert shape, bf16 activations: within bf16 of the torch reference (the weights the
    reference dequantizes, products in float64); resident, slots and host (uva) rows give the same bits."""
    placement_exact_against_the_oracle(quant, t, 2048, 768, None)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("t", [1, 8])
def test_gpu_nvfp4_at_glm53_flash_shape_with_its_clamp(t):
    """GLM-5.3-Flash's expert shape (4096 x 2048) and SwiGLU clamp (10.0): the one-token GEMV and the
    grouped GEMM, placement-exact and within bf16 of the reference."""
    placement_exact_against_the_oracle("nvfp4", t, 4096, 2048, 10.0)


def placement_exact_against_the_oracle(quant: str, t: int, h: int, i: int, limit: float | None) -> None:
    from moetier.experts.kernels import grouped_gemm as grouped
    from moetier.experts.kernels import grouped_gemm_large as grouped_large
    from moetier.checkpoint.random_bed import fill_4bit_rows
    from moetier.experts.reference import combine, expert_pairs, row_fetch

    g = torch.Generator().manual_seed(t)
    e, k = 16, 8
    lay = RowLayout(h, i, quant, limit)
    rows = torch.zeros(e, lay.numel, dtype=torch.uint8)
    fill_4bit_rows(rows, lay, g)  # N(0, 0.02) bf16 experts quantized by the format's rule
    x = torch.randn(t, h, generator=g).bfloat16()
    w = torch.rand(t, k, generator=g).bfloat16()
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
    dev = rows.cuda()
    host = rows.pin_memory()
    xs, ws, ids_d = x.cuda(), w.cuda(), ids.cuda()
    scratch = grouped.GemmScratch.make(t * k, h, i, torch.device("cuda"))

    def run(slot_ids, dev_rows, host_rows):
        if t > 64:
            return grouped_large.grouped_expert_mlp_large(xs, slot_ids, ids_d, ws, dev_rows, host_rows, h, i, e,
                                                          quant=quant, limit=limit).float().cpu()
        out = torch.full((t, h), float("nan"), dtype=torch.bfloat16, device="cuda")
        return grouped.grouped_expert_mlp(xs, slot_ids, ids_d, ws, dev_rows, host_rows, h, i, scratch, out,
                                          quant=quant, limit=limit).float().cpu()

    resident = run(ids_d.int(), dev, dev)
    slot_of = torch.randperm(e, generator=g).int().cuda()
    slots = torch.empty_like(dev)
    slots[slot_of.long()] = dev
    assert torch.equal(run(slot_of[ids_d], slots, dev), resident)
    from moetier.experts.cache.store import DevicePointer  # uva: every row read from pinned host memory

    none = torch.full_like(ids_d, -1, dtype=torch.int32)
    assert torch.equal(run(none, dev[:1], DevicePointer(host)), resident)
    fetch = row_fetch(rows, lay, torch.bfloat16)
    oracle = combine(expert_pairs(x.double(), ids, lambda key: tuple(p.double() for p in fetch(key)), limit),
                     w.double())
    assert ((resident.double() - oracle).norm() / oracle.norm()).item() <= 1e-2
