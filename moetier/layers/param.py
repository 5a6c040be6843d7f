"""Inference weights: uninitialised parameters without gradients, filled by the loader."""

from __future__ import annotations

import torch
from torch import nn


def param(*shape: int, dtype: torch.dtype, device: torch.device | str) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)
