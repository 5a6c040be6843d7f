"""Kernel specializations compiled before serving.

Triton compiles a kernel for each constexpr value, and each "== 1", "% 16 == 0" and pointer alignment
of its arguments, that a launch brings; the first launch of each on a machine costs 0.3-1.4 s on an
H200 and stalls every running request (docs/prefix-cache.md, "Compiles before serving").
The attention kernels' per-step ints are left unspecialized, which leaves a few variants that follow
the step's shape (the longest chunk's tiles, split or not, the top-k walk, the combine's split
padding); this compiles those at engine startup, once per distinct attention layout, by launches on
tiny dummy tensors (paged_attention_triton.compile_variants, latent_attention_triton.compile_variants).
Decode-size steps of every other kernel are compiled by the decode graphs' capture.
"""

from __future__ import annotations

import torch

from moetier.layers.gqa_attention import GqaAttention
from moetier.layers.mla_attention import MlaAttention


def compile_attention(model: torch.nn.Module, kv) -> int:
    """On CUDA, the attention kernels' shape-following specializations for this model's GQA and MLA
    layers. Returns the launches made (0 off CUDA, or for a model with neither)."""
    gqa = next((m for m in model.modules() if isinstance(m, GqaAttention)), None)
    mla = [m for m in model.modules() if isinstance(m, MlaAttention)]
    launches = 0
    cache = getattr(kv, "k", None)
    if gqa is not None and cache is not None and cache.is_cuda:
        from moetier.layers.paged_attention_triton import compile_variants

        launches += compile_variants(gqa.hq, gqa.hkv, gqa.d, kv.page_size, cache.dtype, cache.device)
    latent = getattr(kv, "latent", None)
    if mla and latent is not None and latent.is_cuda:
        from moetier.layers.latent_attention_triton import compile_variants

        m, dsa = mla[0], any(x.indexer is not None for x in mla)
        launches += compile_variants(m.hq, m.r, m.rope, kv.page_size, latent.dtype, latent.device, dsa)
    return launches
