"""Layers shared by the model families. Each mirrors the numerics of the transformers reference
(float32 norms and softmax, cos/sin computed in float32 then cast) so that float32 parity holds to
rounding."""

from __future__ import annotations


import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # x: [..., D], weight: [D]; normalise in float32, scale in the input dtype.
    dtype = x.dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(dtype)


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


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int) -> torch.Tensor:
    """q: [T, Hq, D] for positions [start, start + T); k, v: [start + T, Hkv, D] -> [T, Hq, D].

    Softmax in float32 as the reference does; query i sees keys 0..start+i.
    """
    t, hq, d = q.shape
    s, hkv, _ = k.shape
    group = hq // hkv
    # [Hkv, group, T, D] x [Hkv, D, S] -> [Hkv, group, T, S]
    qg = q.transpose(0, 1).reshape(hkv, group, t, d)
    scores = torch.matmul(qg, k.permute(1, 2, 0)[:, None]) * d**-0.5
    if t > 1:
        mask = torch.arange(s)[None, :] > (torch.arange(t)[:, None] + start)
        scores = scores.masked_fill(mask.to(scores.device), float("-inf"))
    probs = F.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    out = torch.matmul(probs, v.transpose(0, 1)[:, None])  # [Hkv, group, T, D]
    return out.reshape(hq, t, d).transpose(0, 1)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    # gate_up: [..., 2I] with gate first, up second -> [..., I]
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up
