"""Activations of the MLPs."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    # gate_up: [..., 2I] with gate first, up second -> [..., I] (SwiGLU)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up
