"""Grouped-query attention with RMSNorm on each head's q and k before rotary (Qwen3), over the paged
GQA cache (layers/kv_cache.GqaKVCache).

    x [N, H] -> qkv (one fused projection, rows [q; k; v]) -> q/k head norms, rotary, K/V written
      to their pages -> paged attention -> o_proj -> [N, H]

On CUDA the norms, rotary and the KV write are one Triton launch (layers/fused.qk_norm_rope_kv);
the CPU path and its oracle is qk_norm_rope_kv_reference.

Tensor parallelism (moetier/parallel.Parallel, tp ranks): rank r holds q heads
[r Hq/tp, (r+1) Hq/tp) and kv heads [r Hkv/tp, (r+1) Hkv/tp) (contiguous, so each q head's GQA
group stays on its rank), qkv column-split by those heads, o_proj row-split by the q heads; the
partial o_proj outputs are summed by one all-reduce, and the o_proj bias is added once, after it.
The KV cache of a rank holds its Hkv/tp heads only.

Dense weights kept in the checkpoint's format (held: ModelConfig.dense_quant, layers/quant_linear.py):
FP8 qkv stays FP8 when the q and k rows end on scale blocks (Hq D and Hkv D multiples of 128, as in
every published Qwen3 shape; under tensor parallelism v's too), o unless tensor parallelism cuts its
columns off the blocks; otherwise that weight is dequantized at load. 4-bit qkv and o always stay
4-bit (a tensor-parallel o whose columns cut a group is refused).
"""

from __future__ import annotations

import torch
from torch import nn

from moetier.layers.attention import AttnBatch, paged_attention_reference, write_kv
from moetier.layers.quant_linear import dense_weight, linear, rows_of
from moetier.layers.kv_cache import GqaKVCache
from moetier.layers.norm import rms_norm
from moetier.layers.param import param
from moetier.layers.rotary import apply_rope
from moetier.parallel import Parallel


def qk_norm_rope_kv_reference(qkv: torch.Tensor, q_norm: torch.Tensor, k_norm: torch.Tensor, cos: torch.Tensor,
                              sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                              slot_mapping: torch.Tensor, num_heads: int, num_kv_heads: int, eps: float
                              ) -> torch.Tensor:
    # qkv: [N, (Hq + 2 Hkv) * D] -> q [N, Hq, D]; writes k and v into the caches at slot_mapping.
    t, d = qkv.shape[0], k_cache.shape[-1]
    q, k, v = qkv.split([num_heads * d, num_kv_heads * d, num_kv_heads * d], dim=-1)
    q = rms_norm(q.view(t, num_heads, d), q_norm, eps)
    k = rms_norm(k.view(t, num_kv_heads, d), k_norm, eps)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    write_kv(k_cache, v_cache, k, v.view(t, num_kv_heads, d), slot_mapping)
    return q


class GqaAttention(nn.Module):
    def __init__(self, layer: int, hidden: int, num_heads: int, num_kv_heads: int, head_dim: int, bias: bool,
                 eps: float, dtype: torch.dtype, device: torch.device | str, par: Parallel = Parallel(),
                 held: str | None = None):
        super().__init__()
        self.layer, self.par = layer, par
        # this rank's heads (all of them without tensor parallelism)
        num_heads = par.tp_split(num_heads, "num_attention_heads")
        num_kv_heads = par.tp_split(num_kv_heads, "num_key_value_heads")
        self.hq, self.hkv, self.d, self.eps = num_heads, num_kv_heads, head_dim, eps
        q, kv, split = num_heads * head_dim, num_kv_heads * head_dim, par.tp > 1
        self.qkv = dense_weight(q + 2 * kv, hidden, dtype, device, held, (q, kv, kv), split)  # [q; k; v] rows
        self.o = dense_weight(hidden, q, dtype, device, held, k_split=split)
        rows = q + 2 * kv
        self.qkv_bias = param(rows, dtype=dtype, device=device) if bias else None
        self.o_bias = param(hidden, dtype=dtype, device=device) if bias else None
        self.q_norm = param(head_dim, dtype=dtype, device=device)
        self.k_norm = param(head_dim, dtype=dtype, device=device)

    def qkv_rows(self, proj: str) -> slice:
        """Rows of the fused qkv weight that checkpoint projection q_proj, k_proj or v_proj fills."""
        q, kv = self.hq * self.d, self.hkv * self.d
        return {"q_proj": slice(0, q), "k_proj": slice(q, q + kv), "v_proj": slice(q + kv, q + 2 * kv)}[proj]

    def qkv_part(self, proj: str) -> object:
        """Where checkpoint projection q_proj, k_proj or v_proj (this rank's heads) goes."""
        rows = self.qkv_rows(proj)
        return rows_of(self.qkv, rows.start, rows.stop)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, batch: AttnBatch,
                kv: GqaKVCache) -> torch.Tensor:
        # x: [N, H], the new tokens of every sequence in the step
        t = x.shape[0]
        k_cache, v_cache = kv.k[self.layer], kv.v[self.layer]
        qkv = linear(x, self.qkv, self.qkv_bias)
        args = (qkv, self.q_norm, self.k_norm, cos, sin, k_cache, v_cache, batch.slot_mapping,
                self.hq, self.hkv, self.eps)
        if qkv.is_cuda:
            from moetier.layers import fused

            q = fused.qk_norm_rope_kv(*args)
        else:
            q = qk_norm_rope_kv_reference(*args)
        if q.is_cuda:
            from moetier.layers.paged_attention_triton import paged_attention_triton

            out = paged_attention_triton(q, k_cache, v_cache, batch)  # [N, Hq, D]
        else:
            out = paged_attention_reference(q, k_cache, v_cache, batch)
        if self.par.tp == 1:
            return linear(out.reshape(t, self.hq * self.d), self.o, self.o_bias)
        # a partial sum over this rank's heads [N, H]; the bias joins once, after the sum
        part = self.par.all_reduce(linear(out.reshape(t, self.hq * self.d), self.o), "tp")
        return part if self.o_bias is None else part + self.o_bias
