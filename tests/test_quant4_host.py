"""4-bit rows (NVFP4, INT4 in groups of 128 and 32, symmetric or with zero codes; issue 30) on the host
cores: the compiled host kernel (experts/hybrid/csrc/host_experts.cpp, host_decode.h) decodes the
codes, scales and zero codes in registers. Against the fp32 oracle (host_kernels.reference, which dequantizes with the formats' torch
references) on ragged shapes with every nibble and e4m3 subnormal scales; bitwise independent of the
thread count (the hybrid backend with 4-bit rows: tests/test_host_ext.py).

Tolerances as tests/test_host_ext.py's: the kernel sums in its own fp32 order, the oracle in BLAS
order; fp32 hidden states leave only that difference (1e-5), bf16 ones the bf16 roundings (1e-2)."""

from __future__ import annotations

import pytest
import torch

from moetier.experts.hybrid import host_ext
from moetier.experts.hybrid.host_kernels import CompiledKernel, host_kernel, reference
from moetier.quant import nvfp4
from moetier.quant.rows import RowLayout
from tests.test_host_ext import H, I, lib, rel, rows_of, step  # noqa: F401 (lib: the built kernel, a fixture)

# on test_host_ext's ragged H, I: groups of 16, 128 and 32 end short
FORMATS = ("nvfp4", "int4", "int4-g32", "int4-asym", "int4-g32-asym")


def random_code_rows(quant: str, e: int = 5, seed: int = 4) -> tuple[RowLayout, torch.Tensor]:
    """Every byte of the codes random (all 16 nibbles in both positions); NVFP4 group scales random e4m3
    bytes from the subnormals up (no NaN), tensor scales random; INT4 scales random bf16 of both signs."""
    lay = RowLayout(H, I, quant)
    g = torch.Generator().manual_seed(seed)
    rows = torch.zeros(e, lay.numel, dtype=torch.uint8)
    n = lay.w13_numel + lay.w2_numel
    rows[:, :n] = torch.randint(0, 256, (e, n), generator=g, dtype=torch.uint8)
    for part in ("gate_up", "down"):
        scale = lay.part(rows, part + "_scale")
        if quant == "nvfp4":
            scale.view(torch.uint8).copy_(torch.randint(1, 0x60, scale.shape, generator=g, dtype=torch.uint8))
            lay.part(rows, part + "_scale_2").copy_(torch.rand(lay.part(rows, part + "_scale_2").shape,
                                                               generator=g) * 0.05)
        else:
            scale.copy_((torch.randn(scale.shape, generator=g) * 1e-2).to(scale.dtype))
        if lay.asymmetric:  # every zero code
            zero = lay.part(rows, part + "_zero_point")
            zero.copy_(torch.randint(0, 16, zero.shape, generator=g, dtype=torch.uint8))
    return lay, rows


@pytest.mark.parametrize("quant", FORMATS)
def test_compiled_kernel_decodes_every_code_and_scale_as_the_torch_reference(lib, quant):
    lay, rows = random_code_rows(quant)
    if quant == "nvfp4":  # the rows hold e4m3 subnormal group scales and every code
        assert lay.s13(rows).view(torch.uint8).lt(8).any() and nvfp4.decode(torch.arange(16)).unique().numel() == 15
    kern = host_kernel("compiled", lay, threads=2)
    assert isinstance(kern, CompiledKernel) and host_ext.kind_of(rows, lay) is not None
    x, ids, w = step(4, 2, rows.shape[0])
    pairs = torch.arange(8)
    got = kern(x.float(), pairs, ids, w, rows, 2)
    want = reference(x.float(), pairs, ids, w, rows, lay, 2)
    assert want.abs().max() > 0 and rel(got, want) <= 1e-5


@pytest.mark.parametrize("quant", FORMATS)
def test_compiled_kernel_in_a_bf16_model_matches_the_reference_and_grouped(lib, quant):
    lay, rows = rows_of(quant)
    t, k = 5, 3
    x, ids, w = step(t, k, rows.shape[0])
    pairs = torch.tensor([0, 1, 2, 4, 6, 7, 8, 12, 13, 14])  # token 3's pairs are not asked for
    got = host_kernel("compiled", lay, threads=2)(x, pairs, ids[pairs], w[pairs], rows, k)
    assert torch.equal(got[3], torch.zeros(H)) and got[0].abs().max() > 0
    assert rel(got, reference(x, pairs, ids[pairs], w[pairs], rows, lay, k)) <= 1e-2
    grouped = host_kernel("grouped", lay, threads=2)(x, pairs, ids[pairs], w[pairs], rows, k)
    assert rel(got, grouped) <= 2e-2


@pytest.mark.parametrize("quant", FORMATS)
def test_thread_count_and_tiling_never_change_a_bit(lib, quant):
    lay, rows = rows_of(quant, e=5, seed=2)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(11, H, generator=g).to(torch.bfloat16)
    tokens = torch.cat([torch.arange(11), torch.tensor([0, 1, 2, 3, 4, 0])])
    experts = torch.cat([torch.full((11,), 2), torch.tensor([0, 4, 0, 4, 1, 3])])
    outs = [host_ext.pair_outputs(lib, x, tokens, experts, rows, lay, n, block) for n, block in
            ((1, 0), (2, 0), (3, 0), (2, 512), (3, 300))]
    assert all(torch.equal(outs[0], o) for o in outs[1:])
    alone = host_ext.pair_outputs(lib, x, tokens[-2:-1], experts[-2:-1], rows, lay, 2)
    assert torch.equal(alone[0], outs[0][-2])


@pytest.mark.parametrize("quant", FORMATS)
def test_the_nodes_host_function_reads_4bit_rows_as_the_kernel(lib, quant):
    """The hybrid nodes mode's host-function node (csrc/host_node.cpp) passes a 4-bit row kind and
    offsets (host_ext.call_kind, as nodes.py builds its job) through to the same kernel: the same bits.
    Not the default mode for quantized rows (registry.nodes_by_default): it has not run on a GPU."""
    import ctypes

    from moetier.experts.hybrid.nodes import NodeJob
    from moetier.experts.registry import nodes_by_default

    assert not nodes_by_default("cuda", quant=quant)
    lay, rows = rows_of(quant, e=6, seed=3)
    g = torch.Generator().manual_seed(4)
    p, t = 10, 4
    x = torch.randn(t, H, generator=g).to(torch.bfloat16)
    tok, exp = torch.randint(0, t, (p,), generator=g), torch.randint(0, 6, (p,), generator=g)
    want = host_ext.pair_outputs(lib, x, tok, exp, rows, lay, 2)
    kind, s13, s2 = host_ext.call_kind(rows, lay, True)
    plan = torch.zeros(1 + 2 * p, dtype=torch.int64)
    plan[0], plan[1:1 + p], plan[1 + p:] = p, tok, exp
    xs, h, y = x.float(), torch.zeros(p, I), torch.full((p, H), float("nan"))
    job = NodeJob(rows.data_ptr(), rows.shape[0], rows.shape[1], kind, H, I, s13, s2, 1, host_ext.limit_arg(lay),
                  xs.data_ptr(), t, plan.data_ptr(), p, h.data_ptr(), y.data_ptr(), 2, 0)
    lib.moetier_host_node(ctypes.addressof(job))
    assert job.status == 0 and job.pairs == p and torch.equal(y, want)
