"""KDA's causal depthwise conv for one decode step, over the state pool, in one Triton launch: what
kda_reference.causal_conv_step does after a gather of the slots' states, and the scatter after it,
with no gather or scatter (graph-safe: every address comes from device tensors).

Per sequence b and channel c, with state s = conv[slot_b, c, :] (the last W - 1 inputs, oldest first)
and x = qkv[b, c]:

    s = s if position_b > 0 else 0                      (a sequence at position 0 starts from zeros)
    y = silu(sum_j s[j] w[c, j] + x w[c, W - 1])        (float32, stored in x's dtype)
    conv[slot_b, c, :] = s[1:], x                       (in place)

Padding rows of a decode graph share the pool's spare slot: their reads and writes race there and
nowhere else. kda_reference.causal_conv_step is the oracle (tests/kda_interpreter.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_C = 256


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
