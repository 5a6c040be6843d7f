"""KDA's causal depthwise conv in Triton: one decode step over the state pool in one launch (what
kda_reference.causal_conv_step does after a gather of the slots' states, and the scatter after it,
with no gather or scatter: graph-safe, every address comes from device tensors), and one sequence's
prefill chunk (conv_prefill, below).

Per sequence b and channel c, with state s = conv[slot_b, c, :] (the last W - 1 inputs, oldest first)
and x = qkv[b, c]:

    s = s if position_b > 0 else 0                      (a sequence at position 0 starts from zeros)
    y = silu(sum_j s[j] w[c, j] + x w[c, W - 1])        (float32, stored in x's dtype)
    conv[slot_b, c, :] = s[1:], x                       (in place)

Padding rows of a decode graph share the pool's spare slot: their reads and writes race there and
nowhere else. kda_reference.causal_conv_step is the oracle (tests/kda_interpreter.py).

Prefill (conv_prefill): one sequence's T new tokens x [T, C] after its state s [C, W - 1] (zeros for
a fresh sequence), per token t and channel c

    y[t, c] = silu(sum_j in[t - (W - 1) + j, c] w[c, j])      in[i] = x[i] for i >= 0, s[W - 1 + i] before

in float32, stored in x's dtype, the same terms as kda_reference.causal_conv (its oracle) without its
transposed, concatenated float32 copy of the whole chunk and the float32 conv over it; then the state
becomes the last W - 1 inputs. Programs of BLOCK_T tokens and BLOCK_C channels; the state is written
after the launch (a program would otherwise overwrite what another still reads).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_C = 256
PREFILL_T, PREFILL_C = 32, 128  # conv_prefill's tile: tokens, channels


@triton.jit
def _conv_step_kernel(x_ptr, stride_x, state_ptr, w_ptr, slot_ptr, pos_ptr, out_ptr, C,
                      W: tl.constexpr, BLOCK_C: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    m = c < C
    slot = tl.load(slot_ptr + b).to(tl.int64)
    live = tl.load(pos_ptr + b) > 0
    x = tl.load(x_ptr + b * stride_x + c, mask=m, other=0.0)
    row = state_ptr + slot * C * (W - 1) + c * (W - 1)
    acc = tl.zeros([BLOCK_C], dtype=tl.float32)
    for j in tl.static_range(W - 1):
        s = tl.load(row + j, mask=m, other=0.0)
        s = tl.where(live, s, tl.zeros_like(s))
        acc += s.to(tl.float32) * tl.load(w_ptr + c * W + j, mask=m, other=0.0)
        if j > 0:
            tl.store(row + j - 1, s, mask=m)
    acc += x.to(tl.float32) * tl.load(w_ptr + c * W + W - 1, mask=m, other=0.0)
    tl.store(row + W - 2, x.to(state_ptr.dtype.element_ty), mask=m)
    y = acc * tl.sigmoid(acc)
    tl.store(out_ptr + b * C + c, y.to(out_ptr.dtype.element_ty), mask=m)


def conv_step_slots(qkv: torch.Tensor, conv: torch.Tensor, weight: torch.Tensor, slots: torch.Tensor,
                    positions: torch.Tensor) -> torch.Tensor:
    """qkv: [B, C] (rows may be strided); conv: [slots, C, W - 1] one layer's pool, contiguous; weight:
    [C, 1, W] float32; slots, positions: [B] -> silu(conv) [B, C] in qkv's dtype; conv updated in place."""
    b, c = qkv.shape
    w = weight.shape[-1]
    if not conv.is_contiguous() or conv.shape[1:] != (c, w - 1) or qkv.stride(1) != 1:
        raise ValueError(f"conv_step_slots: pool {tuple(conv.shape)} (contiguous {conv.is_contiguous()}) and inputs "
                         f"{tuple(qkv.shape)} do not fit a conv of width {w}")
    out = torch.empty(b, c, dtype=qkv.dtype, device=qkv.device)
    if b:
        _conv_step_kernel[(b, triton.cdiv(c, BLOCK_C))](qkv, qkv.stride(0), conv, weight.reshape(c, w).contiguous(),
                                                         slots, positions, out, c, W=w, BLOCK_C=BLOCK_C)
    return out


@triton.jit(do_not_specialize=["T"])  # the chunk's tokens: one kernel for every length (a compile each, else)
def _conv_prefill_kernel(x_ptr, stride_x, state_ptr, w_ptr, out_ptr, stride_plane, stride_row, T, C,
                         FRESH: tl.constexpr, W: tl.constexpr, PLANE: tl.constexpr, BLOCK_T: tl.constexpr,
                         BLOCK_C: tl.constexpr):
    # out: channel c of token t at (c // PLANE) * stride_plane + t * stride_row + c % PLANE
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    tm, cm = t < T, c < C
    acc = tl.zeros([BLOCK_T, BLOCK_C], dtype=tl.float32)
    for j in tl.static_range(W):
        i = t + j - (W - 1)  # [T]: the input this tap reads, negative in the state
        inx = (i >= 0)[:, None] & tm[:, None] & cm[None, :]
        v = tl.load(x_ptr + i.to(tl.int64)[:, None] * stride_x + c[None, :], mask=inx, other=0.0).to(tl.float32)
        if not FRESH:
            ins = (i < 0)[:, None] & tm[:, None] & cm[None, :]
            v += tl.load(state_ptr + c[None, :] * (W - 1) + (W - 1 + i)[:, None], mask=ins, other=0.0).to(tl.float32)
        acc += v * tl.load(w_ptr + c * W + j, mask=cm, other=0.0)[None, :]
    y = acc * tl.sigmoid(acc)
    at = (c // PLANE).to(tl.int64)[None, :] * stride_plane + t.to(tl.int64)[:, None] * stride_row + (c % PLANE)[None, :]
    tl.store(out_ptr + at, y.to(out_ptr.dtype.element_ty), mask=tm[:, None] & cm[None, :])


def conv_prefill(x: torch.Tensor, state: torch.Tensor, weight: torch.Tensor, fresh: bool,
                 out: torch.Tensor | None = None) -> torch.Tensor:
    """x: [T, C] one sequence's new inputs (rows may be strided); state: [C, W - 1] its slot's row of the
    pool, contiguous, updated in place to the last W - 1 inputs; weight: [C, 1, W] float32; fresh: the
    sequence starts here (the state is not read). -> silu(conv) in x's dtype: [T, C], or written into
    out [P, T, C / P] (planes of C / P channels, e.g. q, k and v each contiguous: no copy of a split's
    strided columns later), unit stride along channels, which it returns."""
    t, c = x.shape
    w = weight.shape[-1]
    if not state.is_contiguous() or state.shape != (c, w - 1) or x.stride(1) != 1:
        raise ValueError(f"conv_prefill: state {tuple(state.shape)} (contiguous {state.is_contiguous()}) and inputs "
                         f"{tuple(x.shape)} do not fit a conv of width {w}")
    if out is None:
        out = torch.empty(1, t, c, dtype=x.dtype, device=x.device)
        flat = True
    else:
        flat = False
        if out.dim() != 3 or out.shape[1] != t or out.shape[0] * out.shape[2] != c or out.stride(2) != 1:
            raise ValueError(f"conv_prefill: out {tuple(out.shape)} is no [planes, {t}, channels / planes] of {c} "
                             "channels with unit stride along them")
    if t:
        _conv_prefill_kernel[(triton.cdiv(t, PREFILL_T), triton.cdiv(c, PREFILL_C))](
            x, x.stride(0), state, weight.reshape(c, w).contiguous(), out, out.stride(0), out.stride(1), t, c,
            FRESH=fresh, W=w, PLANE=out.shape[2], BLOCK_T=PREFILL_T, BLOCK_C=PREFILL_C)
        keep = w - 1
        if t >= keep:
            state.copy_(x[t - keep:].t())
        else:  # the state's newest inputs, then all of x
            prev = state.zero_() if fresh else state
            state.copy_(torch.cat([prev[:, t:], x.t().to(state.dtype)], dim=-1))
    return out[0] if flat else out
