"""Activations of the MLPs.

SwiGLU with clamps (GLM-5.3-Flash's swiglu_limit L): the gate is clamped above at L (silu of a
very negative gate is already ~0, so it has no lower clamp) and the up projection to [-L, L],
before silu(gate) * up. limit None: the plain SwiGLU of every other family, the same ops as before.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def silu_mul(gate_up: torch.Tensor, limit: float | None = None) -> torch.Tensor:
    # gate_up: [..., 2I] with gate first, up second -> [..., I] (SwiGLU, clamped when limit is set)
    gate, up = gate_up.chunk(2, dim=-1)
    if limit is not None:
        gate = gate.clamp(max=limit)
        up = up.clamp(min=-limit, max=limit)
    return F.silu(gate) * up


def checked_limit(limit: float) -> float:
    """A swiglu_limit as every kernel takes it (the Triton expert kernels, the compiled host kernel):
    a finite float above 0; anything else is refused, as the config refuses it (it would clamp nothing
    or everything, and the host kernel reads a limit <= 0 as none)."""
    limit = float(limit)
    if not math.isfinite(limit) or limit <= 0:
        raise ValueError(f"swiglu_limit must be a finite number above 0, got {limit}")
    return limit
