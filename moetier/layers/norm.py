"""RMSNorm, plain and fused with the residual add. The plain torch form mirrors the transformers
reference (normalise in float32, scale in the input dtype) so float32 parity holds to rounding; on
CUDA the fused Triton kernel (layers/fused.py) does the add and the norm in one launch."""

from __future__ import annotations

import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # x: [..., D], weight: [D]; normalise in float32, scale in the input dtype.
    dtype = x.dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(dtype)


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    # x, delta: [N, H] -> (rms_norm(x + delta), x + delta); x itself when delta is None.
    if x.is_cuda:
        from moetier.layers import fused

        return fused.rms_norm(x, weight, eps, delta)
    if delta is not None:
        x = x + delta
    return rms_norm(x, weight, eps), x
