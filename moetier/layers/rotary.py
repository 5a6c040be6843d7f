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


def apply_rope_interleave(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """DeepSeek's interleaved layout: pairs (x0, x1), (x2, x3), ... each rotated by one frequency;
    the result is written de-interleaved ([evens rotated | odds rotated]), as transformers'
    apply_rotary_pos_emb_interleave does, so q and k agree and dot products are unchanged.

    x: [T, heads, d]; cos, sin: [T, d] from rope_cos_sin (cat(freqs, freqs)) -> [T, heads, d]."""
    half = x.shape[-1] // 2
    cos, sin = cos[:, None, :half], sin[:, None, :half]
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
