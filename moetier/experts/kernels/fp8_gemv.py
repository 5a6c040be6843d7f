"""FP8 expert GEMV for one-token steps (decode at batch 1): every (token, expert) pair reads its own row.

At one token the grouped GEMM (grouped_gemm.py) has nothing to group: each chunk is one pair padded to
tl.dot's 16 rows, and on FP8 rows each tile also goes fp8 -> fp32 -> x block scale -> bf16 -> the
dot operand layout before the MMA, which left FP8 barely ahead of bf16 for half the bytes
(docs/measured-defaults.md). Here a program multiplies a [BLOCK_N, BLOCK_K] tile straight
against the token's activations in fp32, with no dot and no layout change:

    tile   w [BLOCK_N, C, 128] (C = BLOCK_K / 128: whole scale blocks of one row-block), x [C, 128]
    part   p [BLOCK_N, C] = sum_128 fp32(q) * x                 (one partial per scale block)
    acc    acc [BLOCK_N] += sum_C p * scale[n // 128, c]        (the block scale applied once per part)

so the scale multiplies a partial sum instead of each weight: fp32(q) is exact, so the result differs
from the dequantize-then-multiply reference (fp8.dequantize rounds q * scale to bf16 first) only by
that rounding, within the bf16 tolerance the tests hold it to. Activations are rounded to the model
dtype first (x already is; the SwiGLU output h is rounded as the grouped GEMM's dot does).

    gate_up  program (pair, I block): h[pair] = silu(x @ Wg^T) * (x @ Wu^T)   [P, I] fp32 (clamped
             first under a swiglu_limit, as the grouped GEMM: swiglu_clamp.py)
    down     program (pair, H block): y[pair] = h @ Wd^T                      [P, H] fp32
    combine  grouped_gemm.combine_pairs: the fixed-order weighted k-sum

NOTE: every backend runs this kernel at one token, so slots, uva and resident stay bit-exact against
each other (a pair's result depends only on its token and its row's bytes). Steps of more than one
token run the grouped GEMM, whose bits differ from these: batch == alone holds for greedy tokens, as
it does across cuBLAS's kernel choices for the dense layers, not for the bits of the logits.

A pair with a negative expert id (experts/parallel/ep.NOT_MINE) is skipped: its programs leave before reading
a row, its h and y rows stay unwritten, and the combine skips it (grouped_gemm._combine).
"""

from __future__ import annotations

import triton
import triton.language as tl

from moetier.experts.kernels.swiglu_clamp import limit_args, swiglu_clamp

SCALE_BLOCK = 128
# (BLOCK_N, BLOCK_K, num_warps) of gate_up and down; BLOCK_K a multiple of 128 (whole scale blocks)
GATE_UP = (8, 1024, 4)
DOWN = (16, 256, 4)


@triton.jit
def _row_base(dev_ptr, host_ptr, slot_ptr, expert_ptr, p, row):
    # pair p's row: slot s >= 0 in the device rows, else its expert's row of the host store;
    # and skip: its expert id is negative (no row: the caller leaves before reading one)
    slot = tl.load(slot_ptr + p)
    expert = tl.load(expert_ptr + p).to(tl.int64)
    on_host = slot < 0
    r = tl.where(on_host, expert, slot.to(tl.int64))
    return tl.where(on_host, host_ptr, dev_ptr) + r * row, expert < 0


@triton.jit
def pair_program(dev_ptr, host_ptr, slot_ptr, expert_ptr, row, N, BLOCK_N: tl.constexpr):
    # program (p, nb) of a GEMV kernel -> (p, n, nm, base, skip): pair p, its output rows
    # n = [nb * BLOCK_N, +BLOCK_N) (nm: those below N), its row's base pointer, skip (see _row_base)
    p = tl.program_id(0)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    base, skip = _row_base(dev_ptr, host_ptr, slot_ptr, expert_ptr, p, row)
    return p, n, n < N, base, skip


@triton.jit
def store_swiglu(h_ptr, p, inter, n, nm, acc_g, acc_u, HAS_LIMIT: tl.constexpr, LIMIT: tl.constexpr):
    # h[p, n] = silu(gate) * up of the fp32 accumulators [BLOCK_N], clamped first under a swiglu_limit
    acc_g, acc_u = swiglu_clamp(acc_g, acc_u, HAS_LIMIT, LIMIT)
    tl.store(h_ptr + p.to(tl.int64) * inter + n, acc_g / (1.0 + tl.exp(-acc_g)) * acc_u, mask=nm)


@triton.jit
def _tile_dot(w_ptr, scale_ptr, v, n, nm, k0, K: tl.constexpr, KB: tl.constexpr, C: tl.constexpr,
              BLOCK_N: tl.constexpr):
    # sum over k in [k0, k0 + C*128) of fp32(q[n, k]) * v[k], each 128-block's part times its scale.
    # w_ptr: the projection's float8 bytes [N, K]; scale_ptr: its float32 grid [ceil(N/128), KB] (bytes)
    c = tl.arange(0, C)
    j = tl.arange(0, 128)
    kk = k0 + c[:, None] * 128 + j[None, :]  # [C, 128]
    km = kk < K
    w = tl.load(w_ptr + n[:, None, None] * K + kk[None, :, :], mask=nm[:, None, None] & km[None, :, :], other=0)
    part = tl.sum(w.to(tl.float8e4nv, bitcast=True).to(tl.float32) * v[None, :, :], axis=2)  # [BLOCK_N, C]
    kb = k0 // 128 + c
    sp = scale_ptr.to(tl.pointer_type(tl.float32), bitcast=True)
    s = tl.load(sp + (n // 128)[:, None] * KB + kb[None, :], mask=nm[:, None] & (kb < KB)[None, :], other=0.0)
    return tl.sum(part * s, axis=1)


@triton.jit
def _gate_up(x_ptr, dev_ptr, host_ptr, slot_ptr, expert_ptr, h_ptr, top_k: tl.constexpr, hidden: tl.constexpr,
             inter: tl.constexpr, row: tl.constexpr, S13: tl.constexpr, NI: tl.constexpr, NH: tl.constexpr,
             BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, HAS_LIMIT: tl.constexpr = False,
             LIMIT: tl.constexpr = 0.0):
    p, n, nm, base, skip = pair_program(dev_ptr, host_ptr, slot_ptr, expert_ptr, row, inter, BLOCK_N)
    if skip:
        return
    t = (p // top_k).to(tl.int64)
    C: tl.constexpr = BLOCK_K // 128
    acc_g = tl.zeros([BLOCK_N], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_N], dtype=tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        kk = k0 + tl.arange(0, C)[:, None] * 128 + tl.arange(0, 128)[None, :]
        v = tl.load(x_ptr + t * hidden + kk, mask=kk < hidden, other=0.0).to(tl.float32)
        acc_g += _tile_dot(base, base + S13, v, n, nm, k0, hidden, NH, C, BLOCK_N)
        acc_u += _tile_dot(base + inter * hidden, base + S13 + 4 * NI * NH, v, n, nm, k0, hidden, NH, C, BLOCK_N)
    store_swiglu(h_ptr, p, inter, n, nm, acc_g, acc_u, HAS_LIMIT, LIMIT)


@triton.jit
def _down(h_ptr, dev_ptr, host_ptr, slot_ptr, expert_ptr, y_ptr, hidden: tl.constexpr, inter: tl.constexpr,
          row: tl.constexpr, S2: tl.constexpr, NI: tl.constexpr, DOT: tl.constexpr, BLOCK_N: tl.constexpr,
          BLOCK_K: tl.constexpr):
    p, n, nm, base, skip = pair_program(dev_ptr, host_ptr, slot_ptr, expert_ptr, row, hidden, BLOCK_N)
    if skip:
        return
    C: tl.constexpr = BLOCK_K // 128
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for k0 in range(0, inter, BLOCK_K):
        kk = k0 + tl.arange(0, C)[:, None] * 128 + tl.arange(0, 128)[None, :]
        v = tl.load(h_ptr + p.to(tl.int64) * inter + kk, mask=kk < inter, other=0.0).to(DOT).to(tl.float32)
        acc += _tile_dot(base + 2 * inter * hidden, base + S2, v, n, nm, k0, inter, NI, C, BLOCK_N)
    tl.store(y_ptr + p.to(tl.int64) * hidden + n, acc, mask=nm)


def check_config(cfg: tuple[int, int, int]) -> None:
    if cfg[1] % SCALE_BLOCK:
        raise ValueError(f"FP8 GEMV BLOCK_K must be a multiple of {SCALE_BLOCK} (whole scale blocks), got {cfg}")


def expert_gemv(x, slot_ids, topk_ids, dev_rows, host_rows, hidden: int, inter: int, fp8_args: dict, h, y, dot,
                gate_up: tuple[int, int, int] = GATE_UP, down: tuple[int, int, int] = DOWN,
                limit: float | None = None) -> None:
    """Pair outputs of a one-token step on FP8 rows: y[p] = down(silu(gate) * up) of pair p, [k, H] fp32.
    x [1, H]; slot_ids, topk_ids [1, k]; dev_rows [S, R] uint8; host_rows [E, R] (a DevicePointer) or
    dev_rows; fp8_args: grouped_gemm.fp8_args' offsets; h [>= k, I], y [>= k, H] fp32 scratch; dot:
    the compute dtype's Triton type (h is rounded to it before down, as the grouped GEMM's dot does);
    limit: the SwiGLU clamp (RowLayout.swiglu_limit; swiglu_clamp.py), None for none."""
    check_config(gate_up)
    check_config(down)
    k = topk_ids.shape[1]
    row = dev_rows.shape[1]
    bn, bk, nw = gate_up
    _gate_up[(k, triton.cdiv(inter, bn))](x, dev_rows, host_rows, slot_ids, topk_ids, h, k, hidden, inter, row,
                                         fp8_args["S13"], fp8_args["NI"], fp8_args["NH"], BLOCK_N=bn, BLOCK_K=bk,
                                         num_warps=nw, **limit_args(limit))
    bn, bk, nw = down
    _down[(k, triton.cdiv(hidden, bn))](h, dev_rows, host_rows, slot_ids, topk_ids, y, hidden, inter, row,
                                       fp8_args["S2"], fp8_args["NI"], dot, BLOCK_N=bn, BLOCK_K=bk, num_warps=nw)
