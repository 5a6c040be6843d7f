"""Rotary position embeddings (rotate-half and DeepSeek's interleaved convention), plain and YaRN
frequencies. cos and sin are computed in float32, then cast, as the transformers reference does."""

from __future__ import annotations

import math

import torch


def rope_inv_freq(head_dim: int, theta: float) -> torch.Tensor:
    # [head_dim / 2] float32
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))


def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype, attention_factor: float = 1.0
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    # positions: [T] -> cos, sin: [T, head_dim]; attention_factor: YaRN's scale on both (1.0 otherwise)
    freqs = positions[:, None].float() * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    if attention_factor != 1.0:
        return (emb.cos() * attention_factor).to(dtype), (emb.sin() * attention_factor).to(dtype)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: [T, heads, head_dim]; cos, sin: [T, head_dim]; rotate-half convention.
    cos, sin = cos[:, None, :], sin[:, None, :]
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def apply_rope_interleave(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """DeepSeek's interleaved layout: pairs (x0, x1), (x2, x3), ... each rotated by one frequency;
    the result is written de-interleaved ([evens rotated | odds rotated]), as transformers'
    apply_rotary_pos_emb_interleave does, so q and k agree and dot products are unchanged.

    x: [T, heads, d]; cos, sin: [T, d] from rope_cos_sin (cat(freqs, freqs)) -> [T, heads, d]."""
    half = x.shape[-1] // 2
    cos, sin = cos[:, None, :half], sin[:, None, :half]
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature correction for a context stretched by `factor`."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def yarn_inv_freq(dim: int, theta: float, factor: float, original_max_positions: int, beta_fast: float = 32.0,
                  beta_slow: float = 1.0, truncate: bool = True) -> torch.Tensor:
    """YaRN inverse frequencies [dim / 2] float32, computed as transformers' _compute_yarn_parameters
    does: frequencies that turn fewer than beta_slow times over the original context are
    interpolated (divided by factor), those that turn more than beta_fast times are kept, and a
    linear ramp blends the dimensions between."""
    def correction_dim(rotations: float) -> float:
        return dim * math.log(original_max_positions / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # a zero-width ramp would divide by zero
    pos_freqs = theta ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    keep = 1 - torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    return interpolation * (1 - keep) + extrapolation * keep
