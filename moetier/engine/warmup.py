"""What an engine runs before its first request, so that no request waits for Triton.

Triton compiles a kernel the first time a launch brings a specialization it has not met; on a
machine that has never run it that costs 0.3-1.4 s, and it stalls every request in the step
(docs/prefix-cache.md, "Compiles before serving"). The decode graphs' capture compiles the
decode-size steps. Before serving, on CUDA, this adds:

- the attention kernels' specializations that follow a step's shape (compile_attention: their per-step
  ints are left unspecialized, which leaves the longest chunk's tiles, split or not, the top-k walk
  and the combine's split padding; paged_attention_triton and latent_attention_triton compile them by
  launches on tiny dummy tensors);
- one large step (a prefill chunk above decode_tokens) on dummy tokens: the large-step expert path
  (its GEMM, plan, the prefill stream of the backend), and, for models that have them, the linear
  attention's chunked kernels (fla-core also autotunes there) and the indexer's prefill.

The dummy step is one sequence whose page table names only the pool's scratch page (the page padding
rows of graph-replayed steps write) and whose recurrent state is the spare slot, so no page or slot a
request can hold is written. Afterwards the expert caches are emptied and a replayed trace rewinds, as
after the graphs' capture. Skipped with several ranks (their steps run collectives in lockstep; the
workers do not run it) and while recording a trace (the recorder would keep the dummy's routing).
"""

from __future__ import annotations

import torch

from moetier.layers.attention import make_batch
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


def large_step_tokens(decode_tokens: int, max_num_tokens: int) -> int:
    """Tokens of the dummy large step: the smallest step above decode_tokens (the large-step path), 0
    when no step can be large (max_num_tokens <= decode_tokens)."""
    return decode_tokens + 1 if max_num_tokens > decode_tokens else 0


@torch.inference_mode()
def warm_up(model, kv, config, replayer=None, parallel: bool = False) -> None:
    """model: the engine's CausalLM; kv: its pool (scratch page config.num_pages, spare state slot
    config.max_num_seqs: engine/kv_setup.py); config: its EngineConfig; replayer: its trace replayer
    (rewound after the step)."""
    if model.device.type != "cuda" or parallel or config.record_trace is not None:
        return
    compile_attention(model, kv)
    t = large_step_tokens(config.decode_tokens, config.max_num_tokens)
    if not t:
        return
    pages = [config.num_pages] * -(-t // config.page_size)
    slots = [config.max_num_seqs] if getattr(kv, "state", None) is not None else None
    batch = make_batch([(0, t, pages)], config.page_size, model.device, slots)
    ids = torch.zeros(t, dtype=torch.long, device=model.device)
    model.logits(model.forward(ids, batch, kv)[-1:])
    torch.cuda.synchronize(model.device)
    model.reset_experts()  # the step ran the expert caches on dummy tokens: serve from empty
    if replayer is not None:
        replayer.cursor.zero_()
