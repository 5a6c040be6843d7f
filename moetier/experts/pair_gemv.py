"""Triton per-pair expert GEMV: SwiGLU experts by row id, T tokens x k pairs, each pair reading its row.

A pair whose slot id is >= 0 reads slot row `slot` of the device rows; a pair whose slot id is -1
reads host row `expert` across the link (pinned memory seen through unified addressing). The
backends ran this kernel until the grouped GEMM (grouped_gemm.py) replaced it: that one is as fast at one
token and reads each distinct row once at more. It stays as the baseline scripts/tune_experts.py
measures the grouped GEMM against. The torch twin is reference.expert_pairs + combine.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _gate_up(x_ptr, dev_ptr, host_ptr, slot_ptr, expert_ptr, h_ptr, top_k: tl.constexpr, hidden: tl.constexpr,
             inter: tl.constexpr, row: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    # program (p, nb): pair p = t * top_k + j, intermediate rows [nb * BLOCK_N, +BLOCK_N)
    p = tl.program_id(0)
    nb = tl.program_id(1)
    t = p // top_k
    slot = tl.load(slot_ptr + p)
    on_host = slot < 0
    r = tl.where(on_host, tl.load(expert_ptr + p).to(tl.int64), slot.to(tl.int64))
    base = tl.where(on_host, host_ptr, dev_ptr) + r * row
    n = nb * BLOCK_N + tl.arange(0, BLOCK_N)
    nm = n < inter
    acc_g = tl.zeros([BLOCK_N], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_N], dtype=tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        km = kk < hidden
        x = tl.load(x_ptr + t * hidden + kk, mask=km, other=0.0).to(tl.float32)
        wm = nm[:, None] & km[None, :]
        wg = tl.load(base + n[:, None] * hidden + kk[None, :], mask=wm, other=0.0)
        wu = tl.load(base + (n[:, None] + inter) * hidden + kk[None, :], mask=wm, other=0.0)
        acc_g += tl.sum(wg.to(tl.float32) * x[None, :], axis=1)
        acc_u += tl.sum(wu.to(tl.float32) * x[None, :], axis=1)
    h = acc_g / (1.0 + tl.exp(-acc_g)) * acc_u
    tl.store(h_ptr + p * inter + n, h, mask=nm)


@triton.jit
def _down(h_ptr, weight_ptr, dev_ptr, host_ptr, slot_ptr, expert_ptr, out_ptr, top_k: tl.constexpr,
          hidden: tl.constexpr, inter: tl.constexpr, row: tl.constexpr, w13: tl.constexpr,
          BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    # program (t, nb): output rows [nb * BLOCK_N, +BLOCK_N) of token t, summing its k experts in order
    t = tl.program_id(0)
    nb = tl.program_id(1)
    n = nb * BLOCK_N + tl.arange(0, BLOCK_N)
    nm = n < hidden
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for j in range(0, top_k):
        p = t * top_k + j
        slot = tl.load(slot_ptr + p)
        on_host = slot < 0
        r = tl.where(on_host, tl.load(expert_ptr + p).to(tl.int64), slot.to(tl.int64))
        base = tl.where(on_host, host_ptr, dev_ptr) + r * row + w13
        part = tl.zeros([BLOCK_N], dtype=tl.float32)
        for k0 in range(0, inter, BLOCK_K):
            kk = k0 + tl.arange(0, BLOCK_K)
            km = kk < inter
            hk = tl.load(h_ptr + p * inter + kk, mask=km, other=0.0)
            w = tl.load(base + n[:, None] * inter + kk[None, :], mask=nm[:, None] & km[None, :], other=0.0)
            part += tl.sum(w.to(tl.float32) * hk[None, :], axis=1)
        acc += tl.load(weight_ptr + p).to(tl.float32) * part
    tl.store(out_ptr + t * hidden + n, acc.to(out_ptr.dtype.element_ty), mask=nm)


# (BLOCK_N, BLOCK_K, num_warps), from the tuning sweep of `moetier bench layer` on the H200
# (bench/results/h200-layer.json): (8, 512, 4) is within 1% of the best gate_up on both shapes; down
# wants longer rows of K when the intermediate size is large (GLM-5, I 2048: 0.153 ms against 0.164).
GATE_UP_CONFIG = None  # None: the rule below; the bench sets a tuple to sweep
DOWN_CONFIG = None


def configs(inter: int) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
    gate_up = GATE_UP_CONFIG or (8, 512, 4)
    down = DOWN_CONFIG or ((8, 512, 4) if inter >= 1536 else (8, 256, 4))
    return gate_up, down


def expert_mlp(x: torch.Tensor, slot_ids: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
               dev_rows: torch.Tensor, host_rows, hidden: int, inter: int, h: torch.Tensor, out: torch.Tensor,
               gate_up_config: tuple[int, int, int] = None, down_config: tuple[int, int, int] = None) -> torch.Tensor:
    """SwiGLU experts for T tokens x k pairs, rows by id. x [T, H]; slot_ids, topk_ids, topk_weights [T, k];
    dev_rows [S, R]; host_rows [E, R] (DevicePointer) or dev_rows again; h [T*k, I] float32 scratch;
    out [T, H] in x.dtype. Deterministic: each output sums its k experts in slot order."""
    t, k = topk_ids.shape
    row = dev_rows.shape[1]
    default_gate_up, default_down = configs(inter)
    bn, bk, nw = gate_up_config or default_gate_up
    _gate_up[(t * k, triton.cdiv(inter, bn))](x, dev_rows, host_rows, slot_ids, topk_ids, h, k, hidden, inter, row,
                                             BLOCK_N=bn, BLOCK_K=bk, num_warps=nw)
    bn, bk, nw = down_config or default_down
    _down[(t, triton.cdiv(hidden, bn))](h, topk_weights, dev_rows, host_rows, slot_ids, topk_ids, out, k, hidden,
                                        inter, row, 2 * inter * hidden, BLOCK_N=bn, BLOCK_K=bk, num_warps=nw)
    return out
