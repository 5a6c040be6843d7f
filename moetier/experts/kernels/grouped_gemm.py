"""Grouped Triton expert GEMM for every decode step (T tokens x k experts): each distinct row read once.

A per-pair GEMV would read an expert's row once per (token, expert) pair; with T tokens many
pairs share a row (batch 8 of Qwen3-30B: 64 pairs on 29 distinct experts per layer under the
qwen3-30b-like trace, 52 under uniform routing), so it reads up to 2.2x the bytes the step needs.
Here the pairs are grouped by the row they read (key: the slot id when >= 0, else the host expert
id) and every weight tile is loaded once per chunk of up to BLOCK_M of a group's tokens and
multiplied against all of them with tl.dot.

    plan      pairs -> `order` (pair ids sorted by (key, pair)) and `chunk_end` (per sorted position:
              where the chunk starting there ends, 0 where no chunk starts)
    gate_up   per (chunk, I block): h[pair] = silu(x @ Wg^T) * (x @ Wu^T)   [P, I] fp32 (large steps:
              in the dot's type, the rounding down's mma does anyway, half the bytes:
              gemm_config.h_dtype)
              (clamped first under a swiglu_limit: swiglu_clamp.py)
    down      per (chunk, H block): y[pair] = h @ Wd^T                      [P, H] fp32
    combine   per (token, H block): out[t] = sum_j w[t, j] * y[t*k + j], j = 0..k-1 in order

FP8 rows (RowLayout quant "fp8", docs/fp8.md): with FP8 set the kernels scale each weight tile in
registers (fp32 x block scale, rounded once to the dot type: fp8.dequantize's weights exactly).
4-bit rows ("nvfp4", "int4", "int4-g32" and the asymmetric "int4-asym", "int4-g32-asym";
quant/packed4.py): with Q4 set the kernels unpack each tile's codes, subtract INT4's offset (8, or
with ZERO the group's zero code) and scale them in registers (quant/packed4_triton.py: the formats'
references exactly), weight-only: the activations stay in their dtype, no activation scale exists here.

A pair whose expert id is negative (experts/parallel/ep.NOT_MINE: another rank's expert) is no work: the plan
sorts it last under SKIP_KEY and starts no chunk there, a one-token chunk of it leaves at once (_chunk),
its h and y rows stay unwritten, and the combine skips it. The other pairs keep their chunks, tile rows
and k-sum order, so their bits are those of the same step with the skipped pairs' weights set to zero.

No host sync and no data-dependent shape: the plan is a fixed grid of O(P^2) compares (P = T*k, 512
at most for decode), gate_up and down take a grid of P chunk positions and the programs where no chunk
starts leave at once, so a CUDA graph replays the step. No atomics: the k-sum has a fixed order.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from moetier.experts.kernels.fp8_gemv import expert_gemv
from moetier.experts.kernels.gemm_config import GemmConfig, compute_dtype
from moetier.experts.kernels.q4_gemv import q4_gemv
from moetier.experts.kernels.swiglu_clamp import limit_args, swiglu_clamp
from moetier.quant import fp8_block as fp8
from moetier.quant.dot import dot_type as _dot_type
from moetier.quant.dot import mma as _mma
from moetier.quant.dot import to_dot
from moetier.quant.fp8_block_triton import dequant_tile as _dequant
from moetier.quant.packed4_triton import dequant4_tile as _dequant4
from moetier.quant.rows import RowLayout

BLOCK_M = 16  # tokens of a group per tl.dot (the smallest M tl.dot takes)
PLAN_BLOCK = 64
SKIP_KEY = 2**31 - 1  # the plan key of a skipped pair (expert id < 0): above every row key, starts no chunk


@triton.jit
def _keys(slot_ptr, expert_ptr, p, mask):
    # the row a pair reads: slot s >= 0 -> s, host expert e -> -1 - e (never equal to a slot key);
    # expert e < 0 (skipped, whatever its slot id) -> SKIP_KEY
    slot = tl.load(slot_ptr + p, mask=mask, other=0)
    expert = tl.load(expert_ptr + p, mask=mask, other=0).to(tl.int32)
    return tl.where(expert < 0, 2147483647, tl.where(slot >= 0, slot, -1 - expert))


@triton.jit(do_not_specialize=["n_pairs"])  # one kernel for every step's pair count (a compile each, else)
def _plan(slot_ptr, expert_ptr, order_ptr, chunk_end_ptr, n_pairs, BLOCK_M: tl.constexpr, BLOCK: tl.constexpr):
    # program a: pairs [a * BLOCK, +BLOCK) against all pairs. A pair's sorted position is
    # #(keys below) + #(same key, lower pair id): a stable sort without sorting, programs independent.
    a = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    am = a < n_pairs
    ka = _keys(slot_ptr, expert_ptr, a, am)
    below = tl.zeros([BLOCK], dtype=tl.int32)
    before = tl.zeros([BLOCK], dtype=tl.int32)
    same = tl.zeros([BLOCK], dtype=tl.int32)
    b0 = tl.full([], 0, tl.int32)
    while b0 < n_pairs:  # NOTE: a while loop: the interpreter takes no argument as a range bound
        b = b0 + tl.arange(0, BLOCK)
        bm = (b < n_pairs)[None, :]
        kb = _keys(slot_ptr, expert_ptr, b, b < n_pairs)
        eq = (kb[None, :] == ka[:, None]) & bm
        below += tl.sum(((kb[None, :] < ka[:, None]) & bm).to(tl.int32), axis=1)
        before += tl.sum((eq & (b[None, :] < a[:, None])).to(tl.int32), axis=1)
        same += tl.sum(eq.to(tl.int32), axis=1)
        b0 += BLOCK
    pos = below + before
    tl.store(order_ptr + pos, a, mask=am)
    # every BLOCK_M-th pair of a group starts a chunk that runs to BLOCK_M on or the group's end;
    # the skipped pairs' group (SKIP_KEY, sorted last) starts none
    starts = ((before % BLOCK_M) == 0) & (ka != 2147483647)
    end = tl.minimum(pos + BLOCK_M, below + same)
    tl.store(chunk_end_ptr + pos, tl.where(starts, end, 0), mask=am)


@triton.jit
def _chunk(order_ptr, slot_ptr, expert_ptr, dev_ptr, host_ptr, i, end, row, BLOCK_M: tl.constexpr):
    # the chunk at sorted positions [i, end) -> (pairs [BLOCK_M], valid [BLOCK_M], its row's base pointer,
    # skip). skip: its pairs' expert id is negative (a plan never makes such a chunk; the one-token
    # plan, a chunk per pair, does): the caller leaves before reading anything (no extra load: the
    # expert id is read for the host row anyway).
    m = i + tl.arange(0, BLOCK_M)
    mm = m < end
    pair = tl.load(order_ptr + m, mask=mm, other=0)
    p0 = tl.load(order_ptr + i)
    slot = tl.load(slot_ptr + p0)
    expert = tl.load(expert_ptr + p0).to(tl.int64)
    on_host = slot < 0
    r = tl.where(on_host, expert, slot.to(tl.int64))
    base = tl.where(on_host, host_ptr, dev_ptr) + r * row
    return pair, mm, base, expert < 0


@triton.jit
def _chunk_start(starts_ptr, chunk_end_ptr, LISTED: tl.constexpr):
    # -> (i, end, nb): this program's chunk, [i, end) in sorted positions (end <= i: none), and its
    # column block. Decode: grid (P, blocks), program i is sorted position i (most leave at once). Large
    # steps (LISTED): grid (blocks, C) over the listed chunk starts (-1 past the last), column blocks
    # fastest: programs running together share a chunk's x rows and its row's tiles (docs/bench-prefill.md).
    if LISTED:
        i = tl.load(starts_ptr + tl.program_id(1))
        end = tl.load(chunk_end_ptr + tl.maximum(i, 0))
        end = tl.where(i < 0, -1, end)
        nb = tl.program_id(0)
    else:
        i = tl.program_id(0)
        end = tl.load(chunk_end_ptr + i)
        nb = tl.program_id(1)
    return i, end, nb


@triton.jit
def _gate_up(x_ptr, dev_ptr, host_ptr, slot_ptr, expert_ptr, order_ptr, chunk_end_ptr, starts_ptr, h_ptr,
             top_k: tl.constexpr, hidden: tl.constexpr, inter: tl.constexpr, row: tl.constexpr,
             DOT: tl.constexpr, PRECISION: tl.constexpr, EMULATE: tl.constexpr,
             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, LISTED: tl.constexpr,
             FP8: tl.constexpr, S13: tl.constexpr, S2: tl.constexpr, NI: tl.constexpr, NH: tl.constexpr,
             Q4: tl.constexpr = False, NVFP4: tl.constexpr = False, GROUP: tl.constexpr = 1, GS: tl.constexpr = 0,
             ZERO: tl.constexpr = False, Z13: tl.constexpr = 0, Z2: tl.constexpr = 0,
             HAS_LIMIT: tl.constexpr = False, LIMIT: tl.constexpr = 0.0):
    # program (c, nb): chunk c (see _chunk_start), intermediate rows [nb * BLOCK_N, +BLOCK_N)
    i, end, nb = _chunk_start(starts_ptr, chunk_end_ptr, LISTED)
    if end <= i:
        return
    pair, mm, base, skip = _chunk(order_ptr, slot_ptr, expert_ptr, dev_ptr, host_ptr, i, end, row, BLOCK_M)
    if skip:
        return
    tok = (pair // top_k).to(tl.int64)
    n = nb * BLOCK_N + tl.arange(0, BLOCK_N)
    nm = n < inter
    acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    g_gate = 1.0
    g_up = 1.0
    if NVFP4:  # the float32 tensor scales at byte GS: gate's, up's (down's third)
        g_gate = tl.load((base + GS).to(tl.pointer_type(tl.float32), bitcast=True))
        g_up = tl.load((base + GS + 4).to(tl.pointer_type(tl.float32), bitcast=True))
    # NOTE: compiled for the GPU, a pair's result depends only on its token, its row's bytes and the
    # fixed K order: tl.dot rows are independent, padding rows are zeros, so neither its chunk-mates
    # nor where the row is read from (slot, host, resident) can change a bit (tests/test_gpu.py). In
    # Triton's CPU interpreter tl.dot is a BLAS matmul whose bits may depend on a row's place in the
    # tile: there only identical chunks promise identical bits (tests/grouped_interpreter.py).
    for k0 in range(0, hidden, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        km = kk < hidden
        xa = tl.load(x_ptr + tok[:, None] * hidden + kk[None, :], mask=mm[:, None] & km[None, :], other=0.0)
        if Q4:  # codes [2I, H/2] at 0, group scales [2I, NH] at byte S13 (NH: groups per row here), zero
            # codes (asymmetric INT4) [2I, NH] at byte Z13
            sb = 1 if NVFP4 else 2
            wg = _dequant4(base, hidden // 2, base + S13, NH, n, nm, k0, hidden, g_gate, NVFP4, GROUP, DOT, EMULATE,
                           BLOCK_K, base + Z13, ZERO)
            wu = _dequant4(base + inter * (hidden // 2), hidden // 2, base + S13 + sb * inter * NH, NH, n, nm, k0,
                           hidden, g_up, NVFP4, GROUP, DOT, EMULATE, BLOCK_K, base + Z13 + inter * NH, ZERO)
        else:
            wm = nm[:, None] & km[None, :]
            wg = tl.load(base + n[:, None] * hidden + kk[None, :], mask=wm, other=0.0)
            wu = tl.load(base + (n[:, None] + inter) * hidden + kk[None, :], mask=wm, other=0.0)
        if FP8:  # gate's scale grid [NI, NH] at byte S13 of the row, up's right after it
            wg = _dequant(wg, base + S13, n, nm, kk, km, k0, NH, DOT, EMULATE, BLOCK_K)
            wu = _dequant(wu, base + S13 + 4 * NI * NH, n, nm, kk, km, k0, NH, DOT, EMULATE, BLOCK_K)
        acc_g = _mma(xa, wg, acc_g, DOT, PRECISION, EMULATE)
        acc_u = _mma(xa, wu, acc_u, DOT, PRECISION, EMULATE)
    acc_g, acc_u = swiglu_clamp(acc_g, acc_u, HAS_LIMIT, LIMIT)
    h = acc_g / (1.0 + tl.exp(-acc_g)) * acc_u
    if h_ptr.dtype.element_ty != tl.float32:  # h in DOT (large steps): rounded here as _down's mma would
        h = to_dot(h, DOT, EMULATE)
    tl.store(h_ptr + pair[:, None].to(tl.int64) * inter + n[None, :], h, mask=mm[:, None] & nm[None, :])


@triton.jit
def _down(h_ptr, dev_ptr, host_ptr, slot_ptr, expert_ptr, order_ptr, chunk_end_ptr, starts_ptr, y_ptr,
          hidden: tl.constexpr, inter: tl.constexpr, row: tl.constexpr, w13: tl.constexpr,
          DOT: tl.constexpr, PRECISION: tl.constexpr, EMULATE: tl.constexpr,
          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, LISTED: tl.constexpr,
          FP8: tl.constexpr, S13: tl.constexpr, S2: tl.constexpr, NI: tl.constexpr, NH: tl.constexpr,
          Q4: tl.constexpr = False, NVFP4: tl.constexpr = False, GROUP: tl.constexpr = 1, GS: tl.constexpr = 0,
          ZERO: tl.constexpr = False, Z13: tl.constexpr = 0, Z2: tl.constexpr = 0):
    # program (c, nb): chunk c (see _chunk_start), output rows [nb * BLOCK_N, +BLOCK_N)
    i, end, nb = _chunk_start(starts_ptr, chunk_end_ptr, LISTED)
    if end <= i:
        return
    pair, mm, base, skip = _chunk(order_ptr, slot_ptr, expert_ptr, dev_ptr, host_ptr, i, end, row, BLOCK_M)
    if skip:
        return
    pair = pair.to(tl.int64)
    scales = base + S2  # FP8: down's scale grid [NH, NI]; 4-bit: its group scales [H, NI] (unused otherwise)
    zeros = base + Z2  # asymmetric INT4: down's zero codes [H, NI] (unused otherwise)
    g_down = 1.0
    if NVFP4:
        g_down = tl.load((base + GS + 8).to(tl.pointer_type(tl.float32), bitcast=True))
    base += w13
    n = nb * BLOCK_N + tl.arange(0, BLOCK_N)
    nm = n < hidden
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, inter, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        km = kk < inter
        ha = tl.load(h_ptr + pair[:, None] * inter + kk[None, :], mask=mm[:, None] & km[None, :], other=0.0)
        if Q4:
            w = _dequant4(base, inter // 2, scales, NI, n, nm, k0, inter, g_down, NVFP4, GROUP, DOT, EMULATE, BLOCK_K,
                          zeros, ZERO)
        else:
            w = tl.load(base + n[:, None] * inter + kk[None, :], mask=nm[:, None] & km[None, :], other=0.0)
        if FP8:
            w = _dequant(w, scales, n, nm, kk, km, k0, NI, DOT, EMULATE, BLOCK_K)
        acc = _mma(ha, w, acc, DOT, PRECISION, EMULATE)
    tl.store(y_ptr + pair[:, None] * hidden + n[None, :], acc, mask=mm[:, None] & nm[None, :])


@triton.jit
def _combine(y_ptr, weight_ptr, expert_ptr, out_ptr, top_k: tl.constexpr, hidden: tl.constexpr,
             BLOCK_N: tl.constexpr):
    # program (t, nb): out[t, nb block] = sum over j = 0..k-1, in that order, of w[t, j] * y[t*k + j],
    # a pair with expert id < 0 skipped: its y row (never written) is not read, and it adds (+0.0) * (+0.0).
    # NOTE: acc starts at +0.0 and a round-to-nearest sum is -0.0 only when both terms are, so acc is
    # never -0.0 and acc + (+0.0) == acc bit for bit: a skipped pair leaves the sum exactly as no term
    # would, and as the old 0-weight pair did (one exception: a fused multiply-add whose product is
    # below fp32's range rounds to -0.0; then the sign of that zero may differ). The select is on the
    # operands, never between the multiply and the add, so the other pairs' multiply-adds fuse as before.
    t = tl.program_id(0)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    nm = n < hidden
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for j in range(0, top_k):
        p = t * top_k + j
        e = tl.load(expert_ptr + p)
        mine = (tl.zeros([BLOCK_N], dtype=tl.int32) + e) >= 0  # a vector: the interpreter masks with no scalar
        wt = tl.where(e >= 0, tl.load(weight_ptr + p).to(tl.float32), 0.0)
        acc += wt * tl.load(y_ptr + p * hidden + n, mask=nm & mine, other=0.0)
    tl.store(out_ptr + t * hidden + n, acc.to(out_ptr.dtype.element_ty), mask=nm)


COMBINE_BLOCK = 256


@dataclass
class GemmScratch:
    """Buffers of grouped_expert_mlp for up to `max_pairs` pairs, allocated once (fixed addresses for graphs).

    NOTE: shared() hands one GemmScratch to every backend of a shape: the MoE layers run one after another
    on one stream and nothing in it outlives a call, so one copy serves all layers.
    """

    order: torch.Tensor      # [P] int32: pair ids sorted by (row key, pair id)
    chunk_end: torch.Tensor  # [P] int32: per sorted position, the end of the chunk starting there, else 0
    h: torch.Tensor          # [P, I] float32: SwiGLU of gate_up
    y: torch.Tensor          # [P, H] float32: each pair's down output, before weighting
    one_order: torch.Tensor  # [P] int32 0, 1, ...: the plan of a one-token step, every pair its own chunk
    one_end: torch.Tensor    # [P] int32 1, 2, ...

    @classmethod
    def make(cls, max_pairs: int, hidden: int, inter: int, device: torch.device) -> GemmScratch:
        i32 = dict(dtype=torch.int32, device=device)
        return cls(torch.empty(max_pairs, **i32), torch.empty(max_pairs, **i32),
                   torch.empty(max_pairs, inter, dtype=torch.float32, device=device),
                   torch.empty(max_pairs, hidden, dtype=torch.float32, device=device),
                   torch.arange(max_pairs, **i32), torch.arange(1, max_pairs + 1, **i32))

    @classmethod
    def shared(cls, max_pairs: int, hidden: int, inter: int, device: torch.device) -> GemmScratch:
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:  # "cuda" and "cuda:0" are one device
            device = torch.device("cuda", torch.cuda.current_device())
        key = (device, max_pairs, hidden, inter)
        if key not in _SHARED:
            _SHARED[key] = cls.make(max_pairs, hidden, inter, device)
        return _SHARED[key]

    @property
    def max_pairs(self) -> int:
        return self.order.shape[0]


_SHARED: dict[tuple, GemmScratch] = {}


def grouped_expert_mlp(x: torch.Tensor, slot_ids: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                       dev_rows: torch.Tensor, host_rows, hidden: int, inter: int, scratch: GemmScratch,
                       out: torch.Tensor, config: GemmConfig = GemmConfig(), quant: str | None = None,
                       limit: float | None = None) -> torch.Tensor:
    """SwiGLU experts for T tokens x k pairs, each distinct row read once. x [T, H]; slot_ids [T, k] int32
    (-1: read host row topk_ids); topk_ids, topk_weights [T, k]; dev_rows [S, R]; host_rows [E, R]
    (a DevicePointer) or dev_rows again; scratch for >= T*k pairs; out [T, H] in x.dtype; quant: the
    rows' RowLayout.quant (None, or "fp8": byte rows, computed in x.dtype); limit: the rows'
    RowLayout.swiglu_limit (None: the plain SwiGLU, the kernels compiled exactly as without it).
    Deterministic: each output sums its k experts in slot order."""
    t, k = topk_ids.shape
    n_pairs = t * k
    if n_pairs > scratch.max_pairs:
        raise ValueError(f"{n_pairs} (token, expert) pairs exceed the {scratch.max_pairs} the scratch holds")
    if not x.is_contiguous() or x.shape[0] < t:  # the kernels read row `token` at x + token * hidden
        raise ValueError(f"x must be dense [T, H] rows for the {t} tokens: got shape {tuple(x.shape)}, "
                         f"strides {x.stride()} (a stride-0 or strided view reads past its rows)")
    if t == 1 and quant == "fp8":  # one token on FP8 rows: the GEMV (fp8_gemv.py), then the same combine
        dot = _dot_type(x.dtype)[0]
        expert_gemv(x, slot_ids, topk_ids, dev_rows, host_rows, hidden, inter, fp8_args(hidden, inter, quant, ()),
                    scratch.h, scratch.y, dot, *config.gemv_blocks(quant), limit)
        return combine_pairs(scratch.y, topk_weights, topk_ids, out)
    lay = RowLayout(hidden, inter, quant)
    if t == 1 and lay.packed4:  # one token on 4-bit rows: the GEMV (q4_gemv.py), then the same combine
        dot, _, emulate = _dot_type(x.dtype)
        q4_gemv(x, slot_ids, topk_ids, dev_rows, host_rows, hidden, inter, fp8_args(hidden, inter, quant, ()),
                lay.w13_numel, scratch.h, scratch.y, dot, emulate, *config.gemv_blocks(quant), limit)
        return combine_pairs(scratch.y, topk_weights, topk_ids, out)
    if t == 1:
        # One token: a chunk per pair needs no plan (the profile's 2.4 us per layer). Duplicate ids
        # read their row twice, with the same bits, since a pair's result depends only on its row.
        order, chunk_end = scratch.one_order, scratch.one_end
    else:
        order, chunk_end = scratch.order, scratch.chunk_end
        blocks = triton.cdiv(n_pairs, PLAN_BLOCK)
        _plan[(blocks,)](slot_ids, topk_ids, order, chunk_end, n_pairs, BLOCK_M=BLOCK_M, BLOCK=PLAN_BLOCK)
    _experts(x, slot_ids, topk_ids, topk_weights, dev_rows, host_rows, hidden, inter, order, chunk_end, order,
             n_pairs, scratch.h, scratch.y, out, BLOCK_M, *config.decode_blocks(quant), listed=False, quant=quant,
             limit=limit)
    return out


def fp8_args(hidden: int, inter: int, quant: str | None, blocks_k: tuple[int, ...]) -> dict:
    """The FP8 constexprs of _gate_up and _down: byte offsets of the two scale grids in a row and the
    grid widths (zeros when the rows are not FP8); for 4-bit rows the Q4 ones (offsets, groups per
    row, the group size, the tensor scales' offset). Refuses a BLOCK_K that neither divides nor is a
    multiple of 128 (a K tile must never cut a scale block but at its edges)."""
    lay = RowLayout(hidden, inter, quant)
    if lay.packed4:  # NH, NI: groups per gate_up row and per down row
        s13, s2, gs, _ = lay.offsets4()
        z13, z2 = lay.zero_offsets() if lay.asymmetric else (0, 0)
        return dict(FP8=False, S13=s13, S2=s2, NI=-(-inter // lay.group), NH=-(-hidden // lay.group), Q4=True,
                    NVFP4=quant == "nvfp4", GROUP=lay.group, GS=gs, ZERO=lay.asymmetric, Z13=z13, Z2=z2)
    if quant != "fp8":
        return dict(FP8=False, S13=0, S2=0, NI=0, NH=0)
    bad = [bk for bk in blocks_k if fp8.BLOCK % bk and bk % fp8.BLOCK]
    if bad:
        raise ValueError(f"FP8 rows need BLOCK_K dividing or a multiple of {fp8.BLOCK} (K tiles aligned to the "
                         f"scale blocks); the GemmConfig has {bad}: choose a power of two")
    return dict(FP8=True, S13=lay.s13_offset, S2=lay.s2_offset, NI=lay.n_inter, NH=lay.n_hidden)


def _grid(programs: int, blocks: int, listed: bool) -> tuple[int, int]:
    # the launch grid of gate_up and down: column blocks fastest for large steps (_chunk_start)
    return (blocks, programs) if listed else (programs, blocks)


def _experts(x, slot_ids, topk_ids, topk_weights, dev_rows, host_rows, hidden, inter, order, chunk_end, starts,
             programs, h, y, out, block_m, gate_up, down, listed, quant=None, combine=True, limit=None):
    # gate_up -> down -> combine over a plan (order, chunk_end[, starts]); `programs` chunks at most.
    # limit: the SwiGLU clamp (fp8_gemv.limit_args: constexprs of gate_up only, none when None).
    # combine=False: stop at y (the pair outputs of the plan's pairs; the ring mode combines once, at
    # the end of its passes: experts/prefill/ring.py).
    k = topk_ids.shape[1]
    row = dev_rows.shape[1]
    q = fp8_args(hidden, inter, quant, (gate_up[1], down[1]))
    dot, precision, emulate = _dot_type(compute_dtype(x.dtype, dev_rows.dtype, quant))
    bn, bk, nw, *stages = gate_up  # a fourth entry: num_stages (GemmConfig), else Triton's default
    _gate_up[_grid(programs, triton.cdiv(inter, bn), listed)](
        x, dev_rows, host_rows, slot_ids, topk_ids, order, chunk_end, starts, h, k, hidden, inter,
        row, dot, precision, emulate, BLOCK_M=block_m, BLOCK_N=bn, BLOCK_K=bk, LISTED=listed, num_warps=nw, **q,
        **limit_args(limit), **({"num_stages": stages[0]} if stages else {}))
    bn, bk, nw, *stages = down
    _down[_grid(programs, triton.cdiv(hidden, bn), listed)](
        h, dev_rows, host_rows, slot_ids, topk_ids, order, chunk_end, starts, y, hidden, inter, row,
        RowLayout(hidden, inter, quant).w13_numel, dot, precision, emulate, BLOCK_M=block_m, BLOCK_N=bn, BLOCK_K=bk, LISTED=listed,
        num_warps=nw, **q, **({"num_stages": stages[0]} if stages else {}))
    if combine:
        combine_pairs(y, topk_weights, topk_ids, out)


def combine_pairs(y: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, out: torch.Tensor
                  ) -> torch.Tensor:
    """The combine of grouped_expert_mlp alone: out [T, H] = sum over j = 0..k-1, in order, of
    w[t, j] * y[t*k + j]; y [T*k, H] fp32 (pair outputs before weighting, from any path); pairs whose
    topk_ids [T, k] is negative are skipped (their y rows are not read)."""
    t, k = topk_weights.shape
    hidden = y.shape[1]
    _combine[(t, triton.cdiv(hidden, COMBINE_BLOCK))](y, topk_weights, topk_ids, out, k, hidden,
                                                       BLOCK_N=COMBINE_BLOCK, num_warps=4)
    return out
