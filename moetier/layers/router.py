"""Routers of the MoE block: hidden states -> (topk_ids [T, k] int64, topk_weights [T, k]).

    SoftmaxTopK         softmax over all experts, top-k, optional renormalisation (Qwen3-MoE, Mixtral)
    GroupedSigmoidTopK  sigmoid scores + selection bias, group-limited top-k, routed scaling
                        (DeepSeek-V3, GLM-5); on CUDA one Triton launch (layers/router_triton.py)

On CUDA the softmax-top-k-renorm is one fused Triton kernel (layers/fused.route_topk); the CPU path
and its test oracle is route_reference.

Every router, on every device, lists a token's picks largest weight first (the grouped ones: equal
weights lowest id first). A replayed trace (traces/hooks.Replayer) gives its experts the router's
weights by position, so a CUDA and a CPU replay of one trace weigh each expert alike with no sort of
their own (a sort is five kernels per MoE layer inside the decode graph).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from moetier.layers.param import param


def route_reference(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    # logits: [T, E] -> ids [T, k] int64, weights [T, k] in logits.dtype
    probs = F.softmax(logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)  # sorted: largest weight first (module docstring)
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


def grouped_route_reference(logits: torch.Tensor, bias: torch.Tensor, top_k: int, n_group: int, topk_group: int,
                            renormalize: bool, scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3's router. logits: [T, E] float32; bias: [E] float32 (e_score_correction_bias)
    -> ids [T, k] int64, weights [T, k] float32.

    Scores are sigmoid(logits). The bias steers the choice only: groups (E / n_group experts each)
    are ranked by the sum of their two best biased scores, the best topk_group groups stay, and the
    top_k biased scores among their experts are the picks; the weights are the unbiased scores of
    the picks, optionally renormalised to sum 1, times routed_scaling_factor. Same ops, same order
    as transformers' DeepseekV3TopkRouter up to the picks, so ties break the same way; the picks
    are then listed largest weight first."""
    t, e = logits.shape
    scores = logits.sigmoid()
    choice = scores + bias
    if n_group > 1:
        group_scores = choice.view(t, n_group, e // n_group).topk(2, dim=-1)[0].sum(dim=-1)  # [T, G]
        group_idx = torch.topk(group_scores, k=topk_group, dim=-1, sorted=False)[1]
        group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1)
        keep = group_mask.unsqueeze(-1).expand(t, n_group, e // n_group).reshape(t, e)
        choice = choice.masked_fill(~keep.bool(), float("-inf"))
    ids = torch.topk(choice, k=top_k, dim=-1, sorted=False)[1]
    # listed largest weight first, equal weights lowest id first (the kernel's order: module docstring)
    ids = ids.sort(dim=-1).values
    weights = scores.gather(1, ids)
    order = weights.sort(dim=-1, descending=True, stable=True).indices
    ids, weights = ids.gather(1, order), weights.gather(1, order)
    if renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return ids, weights * scaling


class GroupedSigmoidTopK(nn.Module):
    """Sigmoid scores with a selection bias, group-limited top-k, routed scaling (DeepSeek-V3, GLM-5).
    The gate weight and the bias stay float32 whatever the model dtype, as in the checkpoints."""

    def __init__(self, num_experts: int, hidden: int, top_k: int, n_group: int, topk_group: int, renormalize: bool,
                 scaling: float, device: torch.device | str):
        super().__init__()
        if num_experts % n_group or not 1 <= topk_group <= n_group:
            raise ValueError(f"{num_experts} experts in {n_group} groups, topk_group {topk_group}: the experts "
                             "must split evenly into the groups and 1 <= topk_group <= n_group")
        self.top_k, self.n_group, self.topk_group = top_k, n_group, topk_group
        self.renormalize, self.scaling = renormalize, scaling
        self.weight = param(num_experts, hidden, dtype=torch.float32, device=device)
        self.bias = param(num_experts, dtype=torch.float32, device=device)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # x: [T, H] -> topk_ids [T, k] int64, topk_weights [T, k] in x.dtype (what the backends take)
        logits = F.linear(x.float(), self.weight)
        args = (logits, self.bias, self.top_k, self.n_group, self.topk_group, self.renormalize, self.scaling)
        if logits.is_cuda:
            from moetier.layers import router_triton

            if router_triton.route_grouped_supported(logits.shape[1], self.n_group):
                return router_triton.route_grouped(*args, x.dtype)
        ids, weights = grouped_route_reference(*args)
        return ids, weights.to(x.dtype)
