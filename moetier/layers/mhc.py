"""Manifold-constrained hyper-connections (mHC, GLM-5.3-Flash): the residual stream is hc_mult
streams instead of one, and each attention and each MLP block is entered and left through learned,
per-token mixing weights.

    streams [N, S, H] (S = hc_mult) -> flatten [N, S*H] float32 -> unweighted RMS norm (eps rms_norm_eps)
      -> fn [(2 + S) * S, S*H] -> pre_w [N, S] | post_w [N, S] | comb_w [N, S, S]
    pre  = sigmoid(pre_w * scale[0] + base_pre) + hc_eps
    post = 2 sigmoid(post_w * scale[1] + base_post)
    comb = softmax(comb_w * scale[2] + base_comb, over the last dim) + hc_eps, then made (about)
           doubly stochastic by Sinkhorn: columns normalised once, then hc_sinkhorn_iters - 1 rounds
           of rows then columns (each sum + hc_eps)
    block input = sum_s pre[s] * streams[s]                               [N, H]
    streams'    = post[:, :, None] * block(input)[:, None] + comb^T @ streams   [N, S, H]

The head collapses the streams by their plain mean before the final norm. The same ops in the
same order as transformers' Glm5NextTextHyperConnection, so float32 agrees to rounding. fn is kept
in the model dtype and applied in float32; base and scale are float32 in the checkpoints.

On CUDA every step computes the weights and the collapse in two Triton launches (above
mhc_triton.MAX_ROWS tokens the projection is tiled over blocks of tokens instead of split per token) and
expands in one (layers/mhc_triton.py; these torch ops are their oracle).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from moetier.layers.param import param


def sinkhorn(comb: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    # comb: [..., S, S] positive -> rows and columns summing to about 1
    comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    return comb


class HyperConnection(nn.Module):
    """The mixing weights of one block (a layer has two: before attention, before the MLP)."""

    def __init__(self, hidden: int, streams: int, sinkhorn_iters: int, hc_eps: float, norm_eps: float,
                 dtype: torch.dtype, device: torch.device | str):
        super().__init__()
        self.s, self.iters, self.hc_eps, self.norm_eps = streams, sinkhorn_iters, hc_eps, norm_eps
        n = (2 + streams) * streams
        self.fn = param(n, streams * hidden, dtype=dtype, device=device)
        self.base = param(n, dtype=torch.float32, device=device)
        self.scale = param(3, dtype=torch.float32, device=device)

    def weights(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """streams [N, S, H] -> (post [N, S] float32, comb [N, S, S] float32, block input [N, H])."""
        if streams.is_cuda:
            from moetier.layers import mhc_triton  # on CUDA: a few launches for all of weights_reference

            if mhc_triton.supported(streams):
                return mhc_triton.mhc_weights_fused(streams, self.fn, self.base, self.scale, self.iters, self.hc_eps,
                                                    self.norm_eps)
        return self.weights_reference(streams)

    def weights_reference(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """weights() in torch ops, on any device: the CPU path and the kernels' oracle."""
        n, s = streams.shape[0], self.s
        flat = streams.reshape(n, -1).float()
        flat = flat * torch.rsqrt(flat.square().mean(-1, keepdim=True) + self.norm_eps)
        mixed = F.linear(flat, self.fn.float())
        pre_w, post_w, comb_w = mixed.split([s, s, s * s], dim=-1)
        pre_b, post_b, comb_b = self.base.split([s, s, s * s])
        pre_scale, post_scale, comb_scale = self.scale.unbind(0)
        pre = torch.sigmoid(pre_w * pre_scale + pre_b) + self.hc_eps
        post = 2 * torch.sigmoid(post_w * post_scale + post_b)
        comb = torch.softmax(comb_w.view(n, s, s) * comb_scale + comb_b.view(s, s), dim=-1) + self.hc_eps
        comb = sinkhorn(comb, self.iters, self.hc_eps)
        collapsed = (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)
        return post, comb, collapsed


def expand(out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor, streams: torch.Tensor) -> torch.Tensor:
    """A block's output back into the streams: out [N, H], post [N, S], comb [N, S, S], streams
    [N, S, H] (the block's input streams) -> [N, S, H]."""
    if streams.is_cuda:
        from moetier.layers import mhc_triton  # one launch for the five below

        if mhc_triton.supported(streams):
            return mhc_triton.expand_fused(out, post, comb, streams)
    dtype = streams.dtype
    return post.to(dtype).unsqueeze(-1) * out.unsqueeze(-2) + torch.matmul(comb.to(dtype).transpose(-1, -2), streams)


def hyper_head(streams: torch.Tensor) -> torch.Tensor:
    # streams [N, S, H] -> [N, H]: GLM-5.3-Flash's head is the unweighted mean of the streams
    return streams.mean(dim=1)
