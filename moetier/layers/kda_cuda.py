"""KDA on CUDA over the state pool, through fla-core's Triton ops (flash-linear-attention 0.6.0):
`chunk_kda` for prefill steps, `fused_recurrent_kda_fwd` for decode steps. Our own thin wrapper; the
math is layers/kda_reference.py's (the oracle of tests/test_kda_gpu.py and the CPU path).

What we hand fla, per layer (q, k, v raw after the conv; q and k l2-normalised with the reference's
eps, by fla inside its recurrent decode kernel, by layers/l2norm_triton.py before the chunked prefill
kernels; fla scales q by dk^-1/2; g the float32 log decay computed in torch, so its gate kernels are
not used; beta after the sigmoid):

    decode   q, k, v, g [B, 1, H, d], beta [B, 1, H]; the layer's whole pool rec [slots, H, dk, dv]
             float32 as initial_state, the step's state slots [B] as ssm_state_indices: each row reads
             its slot and writes it back in place. No host read, fixed shapes, fixed addresses (the
             pool and the slots buffer): graph-safe. Padding rows share the spare slot (garbage there).
    prefill  the step's tokens flattened [1, T, H, d] with cu_seqlens [S + 1] (the sequences with
             tokens this step), initial states gathered from their slots (zeros for a sequence whose
             step starts at position 0), final states scattered back. Eager (host integers).

fla-core is imported on first use on CUDA only: the CPU never needs it. Its kernels are pure
Triton; the import pulls einops and nothing else.
"""

from __future__ import annotations

import functools

import torch

from moetier.errors import MoetierError
from moetier.layers.kda_reference import L2_EPS

FLA_PIN = "fla-core==0.6.0"


@functools.cache
def fla_kda():
    """-> (chunk_kda, fused_recurrent_kda_fwd); one clear line when fla-core is missing."""
    try:
        from fla.ops.kda import chunk_kda
        from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd
    except ImportError as e:
        raise MoetierError(f"glm5_next's KDA layers on CUDA need fla-core, flash-linear-attention's Triton ops "
                           f"({e}); install it with: pip install {FLA_PIN}") from None
    return chunk_kda, fused_recurrent_kda_fwd


def kda_decode_slots(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                     pool: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """One token of B sequences, each reading and writing its own state slot in place.
    q, k, g: [B, H, dk]; v: [B, H, dv]; beta: [B, H]; pool: [slots, H, dk, dv] float32 contiguous (one
    layer's); slots: [B] int -> o [B, H, dv] in v's dtype. Graph-safe."""
    _, recurrent = fla_kda()
    b, h, dk = q.shape
    if not pool.is_contiguous() or pool.dtype != torch.float32:
        raise ValueError("the KDA state pool must be contiguous float32")
    o, _ = recurrent(q.reshape(b, 1, h, dk).contiguous(), k.reshape(b, 1, h, dk).contiguous(),
                     v.reshape(b, 1, h, -1).contiguous(), g.reshape(b, 1, h, dk).float().contiguous(),
                     beta.reshape(b, 1, h).contiguous(), initial_state=pool, scale=dk ** -0.5,
                     inplace_final_state=True, ssm_state_indices=slots, use_qk_l2norm_in_kernel=True)
    return o.view(b, h, -1)


def kda_prefill_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                       initial: torch.Tensor, starts: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """S sequences' tokens, concatenated. q, k, g: [T, H, dk]; v: [T, H, dv]; beta: [T, H]; initial:
    [S, H, dk, dv] float32 (the carried-in states); starts: [S + 1] host offsets, every sequence
    non-empty -> (o [T, H, dv] in v's dtype, final states [S, H, dk, dv] float32). Each sequence is
    chunked from its own first token, as the reference."""
    from moetier.layers.l2norm_triton import l2norm_rows  # Triton: CUDA only

    chunk, _ = fla_kda()
    cu_host = torch.tensor(starts, dtype=torch.long)
    q, k = l2norm_rows(q, L2_EPS), l2norm_rows(k, L2_EPS)  # not fla's: it autotunes per step size
    q, k, v, g, beta = (x.contiguous()[None] for x in (q, k, v, g.float(), beta))  # v: a view of the conv's output
    o, final = chunk(q, k, v, g, beta, scale=q.shape[-1] ** -0.5,
                     initial_state=initial.contiguous(), output_final_state=True, use_qk_l2norm_in_kernel=False,
                     cu_seqlens=cu_host.to(q.device), cu_seqlens_cpu=cu_host)
    return o[0], final
