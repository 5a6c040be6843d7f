"""4-bit expert GEMV for one-token steps (decode at batch 1): every (token, expert) pair reads its own row.

At one token the grouped GEMM (grouped_gemm.py) has nothing to group: each chunk is one pair padded to
tl.dot's 16 rows, and on 4-bit rows each tile also goes codes -> float32 -> x group scale -> bf16 ->
the dot operand layout before the MMA, fifteen of its sixteen rows zeros. Here a program multiplies a
[BLOCK_N, BLOCK_K] tile of codes straight against the token's activations in float32, with no dot and
no layout change (quant/packed4_triton.dot4_tile):

    tile   codes [BLOCK_N, BLOCK_K] as exact float32 (NVFP4 e2m1, INT4 code - 8 or code - zero), the
           low nibbles (even columns) and the high ones (odd columns) apart, never interleaved
    part   p [BLOCK_N, G] = sum over each group of codes * x           (G = BLOCK_K / GROUP)
    acc    acc [BLOCK_N] += sum_G p * scale[n, g]                      (each group scale applied once)

so no weight is rounded: the result differs from the dequantize-then-multiply reference (the weights
rounded to the compute dtype first) only by that rounding and the summation order, within the bf16
tolerance the tests hold it to. Activations are rounded to the model dtype first (x already is; the
SwiGLU output h is rounded as the grouped GEMM's dot rounds it).

    gate_up  program (pair, I block): h[pair] = silu(x @ Wg^T) * (x @ Wu^T)   [P, I] fp32 (clamped
             first under a swiglu_limit: swiglu_clamp.py)
    down     program (pair, H block): y[pair] = h @ Wd^T                      [P, H] fp32
    combine  grouped_gemm.combine_pairs: the fixed-order weighted k-sum

NOTE: every backend runs this kernel at one token, so slots, uva and resident stay bit-exact against
each other (a pair's result depends only on its token and its row's bytes). Steps of more than one
token run the grouped GEMM, whose bits differ from these: batch == alone holds for greedy tokens, as
for FP8 rows (fp8_gemv.py), not for the bits of the logits.

A pair with a negative expert id (experts/parallel/ep.NOT_MINE) is skipped: its programs leave before
reading a row, its h and y rows stay unwritten, and the combine skips it.
"""

from __future__ import annotations

import triton
import triton.language as tl

from moetier.experts.kernels.fp8_gemv import pair_program, store_swiglu
from moetier.experts.kernels.swiglu_clamp import limit_args
from moetier.quant.dot import to_dot
from moetier.quant.packed4_triton import dot4_tile


@triton.jit
def _activations(x_ptr, k0, K, BLOCK_K: tl.constexpr, DOT: tl.constexpr, EMULATE: tl.constexpr,
                 ROUND: tl.constexpr):
    # -> (xe, xo) float32 [BLOCK_K / 2]: the row's activations at the tile's even and odd columns
    # (zeros past K); ROUND: rounded to DOT first (the SwiGLU output h, as the grouped GEMM's dot rounds it)
    j = k0 + 2 * tl.arange(0, BLOCK_K // 2)
    xe = tl.load(x_ptr + j, mask=j < K, other=0.0).to(tl.float32)
    xo = tl.load(x_ptr + j + 1, mask=j + 1 < K, other=0.0).to(tl.float32)
    if ROUND:
        xe = to_dot(xe, DOT, EMULATE).to(tl.float32)
        xo = to_dot(xo, DOT, EMULATE).to(tl.float32)
    return xe, xo


@triton.jit
def _tensor_scale(base, GS: tl.constexpr, j: tl.constexpr, NVFP4: tl.constexpr):
    # NVFP4's float32 tensor scale j (0 gate, 1 up, 2 down) at byte GS of the row; 1.0 for INT4
    if NVFP4:
        return tl.load((base + GS + 4 * j).to(tl.pointer_type(tl.float32), bitcast=True))
    return 1.0


@triton.jit
def _gate_up(x_ptr, dev_ptr, host_ptr, slot_ptr, expert_ptr, h_ptr, top_k: tl.constexpr, hidden: tl.constexpr,
             inter: tl.constexpr, row: tl.constexpr, S13: tl.constexpr, NH: tl.constexpr, NVFP4: tl.constexpr,
             GROUP: tl.constexpr, GS: tl.constexpr, ZERO: tl.constexpr, Z13: tl.constexpr,
             BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, HAS_LIMIT: tl.constexpr = False,
             LIMIT: tl.constexpr = 0.0):
    # program (p, nb): pair p, intermediate rows [nb * BLOCK_N, +BLOCK_N) of gate and of up
    p, n, nm, base, skip = pair_program(dev_ptr, host_ptr, slot_ptr, expert_ptr, row, inter, BLOCK_N)
    if skip:
        return
    t = (p // top_k).to(tl.int64)
    g_gate = _tensor_scale(base, GS, 0, NVFP4)
    g_up = _tensor_scale(base, GS, 1, NVFP4)
    sb: tl.constexpr = 1 if NVFP4 else 2  # bytes per group scale: e4m3, bf16
    half: tl.constexpr = hidden // 2
    acc_g = tl.zeros([BLOCK_N], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_N], dtype=tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        xe, xo = _activations(x_ptr + t * hidden, k0, hidden, BLOCK_K, tl.float32, False, False)
        # codes [2I, H/2] at byte 0 (gate's rows, then up's), group scales [2I, NH] at S13, zeros at Z13
        acc_g += dot4_tile(base, half, base + S13, NH, n, nm, k0, hidden, g_gate, xe, xo, NVFP4, GROUP, BLOCK_K,
                           base + Z13, ZERO)
        acc_u += dot4_tile(base + inter * half, half, base + S13 + sb * inter * NH, NH, n, nm, k0, hidden, g_up,
                           xe, xo, NVFP4, GROUP, BLOCK_K, base + Z13 + inter * NH, ZERO)
    store_swiglu(h_ptr, p, inter, n, nm, acc_g, acc_u, HAS_LIMIT, LIMIT)


@triton.jit
def _down(h_ptr, dev_ptr, host_ptr, slot_ptr, expert_ptr, y_ptr, hidden: tl.constexpr, inter: tl.constexpr,
          row: tl.constexpr, w13: tl.constexpr, S2: tl.constexpr, NI: tl.constexpr, NVFP4: tl.constexpr,
          GROUP: tl.constexpr, GS: tl.constexpr, ZERO: tl.constexpr, Z2: tl.constexpr, DOT: tl.constexpr,
          EMULATE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    # program (p, nb): pair p, output rows [nb * BLOCK_N, +BLOCK_N); down's codes [H, I/2] at byte w13
    p, n, nm, base, skip = pair_program(dev_ptr, host_ptr, slot_ptr, expert_ptr, row, hidden, BLOCK_N)
    if skip:
        return
    g_down = _tensor_scale(base, GS, 2, NVFP4)
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for k0 in range(0, inter, BLOCK_K):
        xe, xo = _activations(h_ptr + p.to(tl.int64) * inter, k0, inter, BLOCK_K, DOT, EMULATE, True)
        acc += dot4_tile(base + w13, inter // 2, base + S2, NI, n, nm, k0, inter, g_down, xe, xo, NVFP4, GROUP,
                         BLOCK_K, base + Z2, ZERO)
    tl.store(y_ptr + p.to(tl.int64) * hidden + n, acc, mask=nm)


def check_config(cfg: tuple[int, int, int], group: int) -> None:
    bk = cfg[1]
    if bk & (bk - 1) or (bk < group and group % bk):
        raise ValueError(f"4-bit GEMV BLOCK_K must be a power of two (a tile holds whole groups of {group} or "
                         f"lies in one), got {cfg}")


def q4_gemv(x, slot_ids, topk_ids, dev_rows, host_rows, hidden: int, inter: int, q4_args: dict, w13: int, h, y,
            dot, emulate: bool, gate_up: tuple[int, int, int], down: tuple[int, int, int],
            limit: float | None = None) -> None:
    """Pair outputs of a one-token step on 4-bit rows: y[p] = down(silu(gate) * up) of pair p, [k, H] fp32.
    x [1, H]; slot_ids, topk_ids [1, k]; dev_rows [S, R] uint8; host_rows [E, R] (a DevicePointer) or
    dev_rows; q4_args: grouped_gemm.fp8_args' 4-bit offsets; w13: down's byte offset in a row
    (RowLayout.w13_numel); h [>= k, I], y [>= k, H] fp32 scratch; dot, emulate: quant/dot.dot_type's
    (h is rounded to dot before down); limit: the SwiGLU clamp (RowLayout.swiglu_limit), None for none."""
    a = q4_args
    check_config(gate_up, a["GROUP"])
    check_config(down, a["GROUP"])
    k = topk_ids.shape[1]
    row = dev_rows.shape[1]
    fmt = dict(NVFP4=a["NVFP4"], GROUP=a["GROUP"], GS=a["GS"], ZERO=a["ZERO"])
    bn, bk, nw = gate_up
    _gate_up[(k, triton.cdiv(inter, bn))](x, dev_rows, host_rows, slot_ids, topk_ids, h, k, hidden, inter, row,
                                         a["S13"], a["NH"], Z13=a["Z13"], BLOCK_N=bn, BLOCK_K=bk, num_warps=nw,
                                         **fmt, **limit_args(limit))
    bn, bk, nw = down
    _down[(k, triton.cdiv(hidden, bn))](h, dev_rows, host_rows, slot_ids, topk_ids, y, hidden, inter, row, w13,
                                       a["S2"], a["NI"], Z2=a["Z2"], DOT=dot, EMULATE=emulate, BLOCK_N=bn,
                                       BLOCK_K=bk, num_warps=nw, **fmt)
