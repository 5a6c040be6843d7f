"""The grouped sigmoid router (layers/router.grouped_route_reference) as one Triton launch per
step on CUDA: in torch it is about fifteen small kernels per MoE layer (sigmoid, bias, group top-2,
group top-k, masks, top-k, gather, renormalise, scale), some 1.5 us each even in a replayed graph,
so 75 GLM-5 MoE layers would pay over a millisecond per decode step for routing alone.

One program per token. With several groups E and n_group must be powers of two (DeepSeek-V3 and
GLM-5: 256 experts in 8 groups); one group takes any E (GLM-5.3-Flash's 288: the lanes padded to a
power of two and never picked); route_grouped_supported() says when. Equal scores go lowest index first, where
torch.topk's order on CUDA is unspecified; otherwise the picks equal the reference's, listed in its
order (largest weight first), and the weights differ from it by the float32 rounding of sigmoid. Fixed shapes, no host reads: graph-safe.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _grouped_route(logits_ptr, bias_ptr, ids_ptr, w_ptr, stride_l, stride_i, stride_w, scaling,
                   E: tl.constexpr, E_PAD: tl.constexpr, G: tl.constexpr, TOPK_GROUP: tl.constexpr,
                   K: tl.constexpr, RENORM: tl.constexpr, BLOCK_K: tl.constexpr):
    # logits: [T, E] float32; bias: [E] float32; ids: [T, K] int64; w: [T, K]; E_PAD = E with several
    # groups, else E's power of two (lanes >= E load zeros and are never open to a pick)
    row = tl.program_id(0).to(tl.int64)
    PER: tl.constexpr = E // G
    e = tl.arange(0, E_PAD)
    score = tl.sigmoid(tl.load(logits_ptr + row * stride_l + e, mask=e < E, other=0.0).to(tl.float32))
    choice = score + tl.load(bias_ptr + e, mask=e < E, other=0.0).to(tl.float32)
    if G > 1:
        # group score: the sum of the group's two best biased scores
        c2 = tl.reshape(choice, (G, PER))
        within = tl.reshape(e, (G, PER)) % PER
        best = tl.max(c2, axis=1)
        first = tl.min(tl.where(c2 == best[:, None], within, PER), axis=1)
        second = tl.max(tl.where(within == first[:, None], float("-inf"), c2), axis=1)
        gscore = best + second
        g = tl.arange(0, G)
        free = g < G  # groups not (yet) kept
        for _ in tl.static_range(TOPK_GROUP):
            top = tl.max(tl.where(free, gscore, float("-inf")), axis=0)
            pick = tl.min(tl.where(free & (gscore == top), g, G), axis=0)
            free = free & (g != pick)
        dropped = tl.reshape(tl.broadcast_to(free[:, None], (G, PER)), (E,))
        choice = tl.where(dropped, float("-inf"), choice)
    # the K picks: the largest biased choices (ties: lowest id first) ...
    open_ = e < E
    sel = e < 0
    for i in tl.static_range(K):
        top = tl.max(tl.where(open_, choice, float("-inf")), axis=0)
        idx = tl.min(tl.where(open_ & (choice == top), e, E), axis=0)
        sel = sel | (e == idx)
        open_ = open_ & (e != idx)
    # ... listed by their unbiased scores, the weights, largest first (ties: lowest id first): the
    # order of every router (layers/router.py), which a replayed trace pairs its experts in
    kk = tl.arange(0, BLOCK_K)
    ids = tl.zeros([BLOCK_K], dtype=tl.int32)
    ws = tl.zeros([BLOCK_K], dtype=tl.float32)
    for i in tl.static_range(K):
        top = tl.max(tl.where(sel, score, float("-inf")), axis=0)
        idx = tl.min(tl.where(sel & (score == top), e, E), axis=0)
        ids = tl.where(kk == i, idx, ids)
        ws = tl.where(kk == i, top, ws)
        sel = sel & (e != idx)
    if RENORM:
        ws = ws / (tl.sum(ws, axis=0) + 1e-20)  # lanes >= K hold 0
    ws = ws * scaling
    kok = kk < K
    tl.store(ids_ptr + row * stride_i + kk, ids.to(tl.int64), mask=kok)
    tl.store(w_ptr + row * stride_w + kk, ws.to(w_ptr.dtype.element_ty), mask=kok)


def route_grouped_supported(num_experts: int, n_group: int) -> bool:
    def pow2(n: int) -> bool:
        return n > 0 and n & (n - 1) == 0

    if n_group == 1:
        return num_experts >= 2
    return pow2(num_experts) and pow2(n_group) and num_experts // n_group >= 2


def route_grouped(logits: torch.Tensor, bias: torch.Tensor, top_k: int, n_group: int, topk_group: int,
                  renormalize: bool, scaling: float, out_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """logits: [T, E] float32; bias: [E] float32 -> ids [T, k] int64, weights [T, k] out_dtype
    (grouped_route_reference's, rounded to out_dtype)."""
    t, e = logits.shape
    assert logits.dtype == torch.float32 and logits.stride(1) == 1 and bias.is_contiguous()
    assert route_grouped_supported(e, n_group) and 0 < top_k <= e and 1 <= topk_group <= n_group
    ids = torch.empty(t, top_k, dtype=torch.int64, device=logits.device)
    weights = torch.empty(t, top_k, dtype=out_dtype, device=logits.device)
    _grouped_route[(t,)](logits, bias, ids, weights, logits.stride(0), ids.stride(0), weights.stride(0),
                         float(scaling), E=e, E_PAD=triton.next_power_of_2(e), G=n_group, TOPK_GROUP=topk_group,
                         K=top_k, RENORM=renormalize, BLOCK_K=triton.next_power_of_2(top_k),
                         num_warps=1 if e <= 128 else 2)
    return ids, weights
