"""Runs the grouped expert GEMMs on 4-bit rows (grouped_gemm.py with Q4 set: NVFP4, INT4 in groups of
128 and 32, symmetric and with zero points) in Triton's interpreter on the CPU. Run as a script
(TRITON_INTERPRET must be set before triton is imported); tests/test_quant4_kernels.py does that in a subprocess. Every case checks, for
the decode and the large-step path, with and without the SwiGLU clamp:

  - slots, uva and resident bit-equal (the same chunks over the same row bytes);
  - the output against a float64 oracle over the weights the torch reference dequantizes into the
    compute dtype (RowLayout.weights): fp32 1e-5, bf16 1e-2 relative;
  - the output against the CPU backend (the torch path every CPU backend runs) within the same bounds.
And, before them, the dequantized tiles themselves (quant/packed4_triton.dequant4_tile, float32 out)
against the torch references to the bit, signed zeros included: every byte value, every e4m3 scale
class (zero, subnormal, normal, the largest), NVFP4 and INT4 (elementwise: no BLAS order involved).
Shapes are ragged on purpose: K not a multiple of the group (hidden 200, inter 72 / 40), tiles that
cross groups, slots poisoned with 0xFF (NaN in e4m3 scales, -6 codes).
"""

from __future__ import annotations

import os
import sys

os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from moetier.experts.kernels import grouped_gemm as grouped  # noqa: E402
from moetier.experts.kernels import grouped_gemm_large as grouped_large  # noqa: E402
from moetier.experts.kernels.gemm_config import GemmConfig  # noqa: E402
from moetier.quant import int4, nvfp4, packed4  # noqa: E402
from moetier.quant.packed4_triton import dequant4_tile  # noqa: E402
from moetier.quant.rows import RowLayout  # noqa: E402
from tests.fp8_interpreter import check, inputs  # noqa: E402  (the same placements and checks as FP8 rows)

LARGE = GemmConfig(large_block_m=16, large_gate_up=(32, 32, 4), large_down=(32, 32, 4))


def rows4(layout: RowLayout, e: int, g: torch.Generator) -> torch.Tensor:
    rows = torch.zeros(e, layout.numel, dtype=torch.uint8)
    h, i = layout.hidden, layout.inter
    for part, shape in (("gate", (i, h)), ("up", (i, h)), ("down", (h, i))):
        for x in range(e):
            w = torch.randn(shape, generator=g) * 0.1
            w[:, :min(16, shape[1])] *= 8.0  # groups of different magnitude: every scale matters
            if layout.quant == "nvfp4":
                q, s, s2 = nvfp4.quantize(w)
                layout.part(rows, part + "_scale_2", x).copy_(s2)
            elif layout.asymmetric:
                q, s, z = int4.quantize(w, layout.group, asymmetric=True)
                layout.part(rows, part + "_zero_point", x).copy_(z)
            else:
                q, s = int4.quantize(w, layout.group)
            layout.part(rows, part, x).copy_(q)
            layout.part(rows, part + "_scale", x).copy_(s)
    return rows


# one-token steps run the GEMV (q4_gemv.py): tiles narrower than K (several per row, INT4's group of
# 128 spanning a tile of 32, NVFP4's groups of 16 whole in one) beside the default blocks' one tile
SMALL_GEMV = GemmConfig(q4_gemv_gate_up=(8, 32, 2), q4_gemv_down=(16, 64, 4))


def case(quant: str, t: int, k: int, h: int, i: int, dtype: torch.dtype, seed: int, large: bool,
         limit: float | None, config: GemmConfig = GemmConfig()) -> str:
    g = torch.Generator().manual_seed(seed)
    e = 6
    layout = RowLayout(h, i, quant, limit)
    rows = rows4(layout, e, g)
    x, w, ids, slots, mixed, none, dummy = inputs(layout, rows, t, k, h, dtype, g)

    def run(slot_ids, dev_rows, max_rows):
        if large:
            return grouped_large.grouped_expert_mlp_large(x, slot_ids, ids, w, dev_rows, rows, h, i, max_rows, LARGE,
                                                          quant, limit=limit)
        scratch = grouped.GemmScratch.make(64, h, i, torch.device("cpu"))
        out = torch.full((t, h), float("nan"), dtype=dtype)
        return grouped.grouped_expert_mlp(x, slot_ids, ids, w, dev_rows, rows, h, i, scratch, out, config,
                                          quant, limit).clone()

    out_slots, out_res, out_uva = run(mixed, slots, e + e // 2), run(ids.int(), rows, e), run(none, dummy, e)
    name = f"{quant} {'large' if large else 'decode'}{' small-gemv' if config is SMALL_GEMV else ''}"
    err = check(name, out_slots, out_res, out_uva, x, ids, w, rows, layout, dtype, limit)
    return f"{name} t={t} k={k} h={h} i={i} {str(dtype)[6:]} limit={limit} err={err:.2e}"


@triton.jit
def _tiles(codes, scales, zeros, out, gscale, N, K, SCALE_ROW, NVFP4: tl.constexpr, GROUP: tl.constexpr,
           ZERO: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    # program p: columns [p BLOCK_K, +BLOCK_K) of every row, dequantized to float32 [N, K]
    n = tl.arange(0, BLOCK_N)
    k0 = tl.program_id(0) * BLOCK_K
    v = dequant4_tile(codes, K // 2, scales, SCALE_ROW, n, n < N, k0, K, gscale, NVFP4, GROUP, tl.float32,
                      True, BLOCK_K, zeros, ZERO)
    kk = k0 + tl.arange(0, BLOCK_K)
    tl.store(out + n[:, None] * K + kk[None, :], v, mask=(n < N)[:, None] & (kk < K)[None, :])


def tiles_exact(quant: str) -> str:
    """dequant4_tile against the torch reference, bit for bit, over every byte value and scale class."""
    n, k = 16, 64  # 16 x 32 bytes: every byte value twice
    packed = (torch.arange(n * k // 2) % 256).to(torch.uint8).reshape(n, k // 2)
    group = nvfp4.GROUP if quant == "nvfp4" else int4.GROUPS[quant]
    g = packed4.cdiv(k, group)
    zero = None
    if quant == "nvfp4":  # e4m3 bytes: zero, subnormals 0x01..0x07, normals, 0x7E (448); signs both ways
        pick = torch.tensor([0x00, 0x01, 0x03, 0x07, 0x08, 0x38, 0x3F, 0x55, 0x7E, 0x81, 0xB8, 0xFE])
        scale = pick[torch.arange(n * g) % len(pick)].to(torch.uint8).reshape(n, g)
        ref = nvfp4.dequantize(packed, scale.view(torch.float8_e4m3fn), 0.3712, torch.float32)
        gscale, raw = 0.3712, scale
    else:
        gen = torch.Generator().manual_seed(0)
        scale = (torch.randn(n, g, generator=gen) * 0.05).to(torch.bfloat16)
        if quant in int4.ASYMMETRIC:  # every zero code
            zero = (torch.arange(n * g) % 16).to(torch.uint8).reshape(n, g)
        ref = int4.dequantize(packed, scale, torch.float32, group, zero=zero)
        gscale, raw = 1.0, scale.view(torch.uint8)
    out = torch.full((n, k), float("nan"))
    block_k = 32  # nvfp4: two groups of 16 per tile; int4-g32: one; int4: a group of 128 spans the tiles
    _tiles[(k // block_k,)](packed, raw, raw if zero is None else zero, out, gscale, n, k, g, quant == "nvfp4",
                            group, zero is not None, 16, block_k)
    same = torch.equal(out, ref) and torch.equal(torch.signbit(out), torch.signbit(ref))
    assert same, (quant, (out - ref).abs().max())
    return f"tiles {quant}: bit-exact over {n * k} weights"


FORMATS = ("nvfp4", "int4", "int4-g32", "int4-asym", "int4-g32-asym")
CASES = [  # (t, k, h, i)
    (1, 3, 200, 72),
    (5, 2, 64, 40),
]

if __name__ == "__main__":
    n = 0
    for quant in FORMATS:
        print(tiles_exact(quant), flush=True)
    for quant in FORMATS:
        for t, k, h, i in CASES:
            for dtype in (torch.float32, torch.bfloat16):
                for large in (False, True):
                    n += 1
                    print(case(quant, t, k, h, i, dtype, n, large, 0.5 if n % 3 == 0 else None), flush=True)
        seed = 100 + FORMATS.index(quant)  # apart from the cases' seeds, which stay as they were
        print(case(quant, 1, 3, 200, 72, torch.bfloat16, seed, False, 0.5 if quant == "nvfp4" else None, SMALL_GEMV),
              flush=True)
    sys.exit(0)
