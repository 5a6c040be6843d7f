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
    prefill  sequences of up to RECURRENT_TOKENS new tokens: the decode kernel over their tokens,
             flattened [1, T, H, d] with cu_seqlens [S + 1]; one such sequence alone in its step runs
             on a view of its pool row, updated in place (no host-to-device copy). Longer ones:
             `chunk_kda` the same way. Both varlen forms gather the initial states from the slots
             (zeros for a sequence whose step starts at position 0) and scatter the final states
             back. Eager (host integers).

Why two prefill kernels: the chunked form is a dozen launches, autotuned, whose chunk indices are
built on the host and copied over (a wait for the stream) in every layer; at a prefix hit's short
tail (or a short prompt) that host work was most of the layer (docs/prefix-cache.md). The choice is
per sequence, by its own token count, so a sequence computes the same in a batch as alone.

fla-core is imported on first use on CUDA only: the CPU never needs it. Its kernels are pure
Triton; the import pulls einops and nothing else.
"""

from __future__ import annotations

import functools

import torch

from moetier.errors import MoetierError
from moetier.layers.kda_reference import L2_EPS

FLA_PIN = "fla-core==0.6.0"
# fla's chunk size: up to it a sequence's prefill takes the recurrent kernel (docs/measured-defaults.md)
RECURRENT_TOKENS = 64


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


def _recurrent(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
               **state) -> tuple[torch.Tensor, torch.Tensor | None]:
    """fla's recurrent kernel as every caller here runs it: q, k, g [B, T, H, dk], v [B, T, H, dv],
    beta [B, T, H], made contiguous (g float32), q and k l2-normalised inside, scale dk^-1/2; `state`:
    the state arguments (initial_state, in place or not, slot indices, cu_seqlens) -> (o, final)."""
    _, recurrent = fla_kda()
    # out: every row is written (each program stores all its sequence's tokens), so no zeroed buffer
    # (fla's default, a fill kernel a layer)
    return recurrent(q.contiguous(), k.contiguous(), v.contiguous(), g.float().contiguous(), beta.contiguous(),
                     scale=q.shape[-1] ** -0.5, use_qk_l2norm_in_kernel=True,
                     out=torch.empty(v.shape, dtype=v.dtype, device=v.device), **state)


def kda_decode_slots(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                     pool: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """One token of B sequences, each reading and writing its own state slot in place.
    q, k, g: [B, H, dk]; v: [B, H, dv]; beta: [B, H]; pool: [slots, H, dk, dv] float32 contiguous (one
    layer's); slots: [B] int -> o [B, H, dv] in v's dtype. Graph-safe."""
    if not pool.is_contiguous() or pool.dtype != torch.float32:
        raise ValueError("the KDA state pool must be contiguous float32")
    o, _ = _recurrent(q[:, None], k[:, None], v[:, None], g[:, None], beta[:, None], initial_state=pool,
                      inplace_final_state=True, ssm_state_indices=slots)
    return o.view(q.shape[0], q.shape[1], -1)


def kda_prefill_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                       initial: torch.Tensor, starts: list[int], recurrent: bool = False
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """S sequences' tokens, concatenated. q, k, g: [T, H, dk]; v: [T, H, dv]; beta: [T, H]; initial:
    [S, H, dk, dv] float32 (the carried-in states); starts: [S + 1] host offsets, every sequence
    non-empty -> (o [T, H, dv] in v's dtype, final states [S, H, dk, dv] float32). Chunked: each
    sequence chunked from its own first token, as the reference; recurrent (sequences of up to
    RECURRENT_TOKENS): the decode kernel over each sequence's tokens, one launch for all of them."""
    from moetier.layers.l2norm_triton import l2norm_rows  # Triton: CUDA only

    cu_host = torch.tensor(starts, dtype=torch.long)
    if recurrent:
        o, final = _recurrent(q[None], k[None], v[None], g[None], beta[None], initial_state=initial.contiguous(),
                              output_final_state=True, inplace_final_state=False, cu_seqlens=cu_host.to(q.device))
        return o[0], final
    chunk, _ = fla_kda()
    q, k = l2norm_rows(q, L2_EPS), l2norm_rows(k, L2_EPS)  # not fla's: it autotunes per step size
    q, k, v, g, beta = (x.contiguous()[None] for x in (q, k, v, g.float(), beta))  # v: a view of the conv's output
    o, final = chunk(q, k, v, g, beta, scale=q.shape[-1] ** -0.5,
                     initial_state=initial.contiguous(), output_final_state=True, use_qk_l2norm_in_kernel=False,
                     cu_seqlens=cu_host.to(q.device), cu_seqlens_cpu=cu_host)
    return o[0], final


def kda_prefill_slot(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                     state: torch.Tensor) -> torch.Tensor:
    """One sequence's T new tokens from the state it carries, which is updated in place.
    q, k, g: [T, H, dk]; v: [T, H, dv]; beta: [T, H]; state: [1, H, dk, dv] float32, contiguous (a view
    of the sequence's pool row; zeroed by the caller for a fresh sequence) -> o [T, H, dv] in v's dtype.
    The decode steps' kernel and l2 norm, one token after another: no host integers, no copies."""
    if not state.is_contiguous() or state.dtype != torch.float32:
        raise ValueError("the KDA state must be a contiguous float32 view")
    o, _ = _recurrent(q[None], k[None], v[None], g[None], beta[None], initial_state=state, inplace_final_state=True)
    return o[0]
