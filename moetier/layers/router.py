"""Routers of the MoE block: hidden states -> (topk_ids [T, k] int64, topk_weights [T, k]).

    SoftmaxTopK   softmax over all experts, top-k, optional renormalisation (Qwen3-MoE, Mixtral)

On CUDA the softmax-top-k-renorm is one fused Triton kernel (layers/fused.route_topk); the CPU path
and its test oracle is route_reference.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from moetier.layers.param import param


def route_reference(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    # logits: [T, E] -> ids [T, k] int64, weights [T, k] in logits.dtype
    probs = F.softmax(logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return ids, weights.to(logits.dtype)


class SoftmaxTopK(nn.Module):
    def __init__(self, num_experts: int, hidden: int, top_k: int, renormalize: bool, dtype: torch.dtype,
                 device: torch.device | str):
        super().__init__()
        self.top_k, self.renormalize = top_k, renormalize
        self.weight = param(num_experts, hidden, dtype=dtype, device=device)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # x: [T, H] -> topk_ids [T, k] int64, topk_weights [T, k] in x.dtype
        logits = F.linear(x, self.weight)
        if logits.is_cuda:
            from moetier.layers import fused

            return fused.route_topk(logits, self.top_k, self.renormalize)
        return route_reference(logits, self.top_k, self.renormalize)
