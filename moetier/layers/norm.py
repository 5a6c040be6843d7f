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


def model_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """A model's RMSNorm over the last dim: on CUDA, rows [T, H] (unit stride along H) in the weight's
    dtype take the fused kernel, one launch where the torch form is eight; anything else the torch form
    (rms_norm above, also the kernel's oracle). The two round alike (layers/fused.py)."""
    if x.is_cuda and x.dim() == 2 and x.stride(1) == 1 and x.dtype == weight.dtype:
        return add_rms_norm(x, None, weight, eps)[0]
    return rms_norm(x, weight, eps)
