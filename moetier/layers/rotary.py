"""Rotary position embeddings (rotate-half convention). cos and sin are computed in float32, then
cast, as the transformers reference does."""

from __future__ import annotations

import torch


def rope_inv_freq(head_dim: int, theta: float) -> torch.Tensor:
    # [head_dim / 2] float32
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))


def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    # positions: [T] -> cos, sin: [T, head_dim]
    freqs = positions[:, None].float() * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: [T, heads, head_dim]; cos, sin: [T, head_dim]; rotate-half convention.
    cos, sin = cos[:, None, :], sin[:, None, :]
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
