"""Sampling kernels: greedy, temperature, top-k, top-p, seeded per request, on device tensors only.

Works on a batch of rows, each with its own parameters, so the engine samples a mixed batch in one
call, and the same function runs inside the CUDA graph of the decode step (no host syncs, fixed
shapes). The noise is counter-based, not drawn from a generator's state: row i's noise for vocab
entry v is a hash of (its request's seed, the index of the token being sampled, v). So a request's
tokens depend only on its own seed and logits, never on what else shares its batch, on whether the
step ran eagerly or from a graph, or on a preemption that recomputed it.
"""

from __future__ import annotations

import torch

from moetier.sampling_params import SamplingParams

_MASK32 = 0xFFFFFFFF
# Odd multipliers below 2^31: a 32-bit value times one stays below 2^63, so int64 never overflows.
_M1, _M2, _M3 = 0x7FEB352D, 0x2C1B3C6D, 0x297A2D39


def _hash32(x: torch.Tensor) -> torch.Tensor:
    # x: int64 in [0, 2^32) -> int64 in [0, 2^32); a xor-shift-multiply mixer (three rounds).
    for m in (_M1, _M2, _M3):
        x = ((x ^ (x >> 16)) * m) & _MASK32
    return x ^ (x >> 15)


def uniform_noise(seeds: torch.Tensor, steps: torch.Tensor, vocab: int) -> torch.Tensor:
    """seeds, steps: [B] int64 -> [B, V] float32 in (0, 1), a pure function of (seed, step, v)."""
    key = _hash32(_hash32((seeds ^ (seeds >> 32)) & _MASK32) ^ (steps & _MASK32))  # [B]
    v = torch.arange(vocab, device=seeds.device, dtype=torch.int64)
    h = _hash32((key[:, None] + v[None, :] * _M2) & _MASK32)
    return ((h >> 8).float() + 0.5) * (1.0 / (1 << 24))


def filter_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """logits: [B, V] float32; top_k: [B] int (0 = off); top_p: [B] float (1 = off).

    Returns logits with everything outside each row's support set to -inf. Top-k first, then top-p
    over what remains (the order transformers uses). Ties at the top-k boundary keep the lower ids.
    """
    b, v = logits.shape
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True, stable=True)
    rank = torch.arange(v, device=logits.device).expand(b, v)
    k = torch.where(top_k > 0, top_k.clamp(max=v), torch.full_like(top_k, v))
    drop = rank >= k[:, None]
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    probs = torch.softmax(sorted_logits, dim=-1)
    # A token stays while the mass strictly before it is below p; the first token always stays.
    before = torch.cumsum(probs, dim=-1) - probs
    drop = drop | (before >= top_p[:, None])
    drop[:, 0] = False
    return torch.full_like(logits, float("-inf")).scatter(1, order, sorted_logits.masked_fill(drop, float("-inf")))


def sample_rows(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                seeds: torch.Tensor, steps: torch.Tensor, mode: str) -> torch.Tensor:
    """logits [B, V] float32; temperature, top_p [B] float32; top_k, seeds, steps [B] int64 -> [B] int64.

    mode: "greedy" (every row argmax), "sample" (temperature only) or "filter" (top-k / top-p too);
    the caller picks the cheapest mode that covers its rows. Rows with temperature 0 stay greedy in
    every mode. Graph-safe: fixed shapes, no host reads.
    """
    greedy = logits.argmax(dim=-1)
    if mode == "greedy":
        return greedy
    hot = temperature > 0
    scaled = logits / torch.where(hot, temperature, torch.ones_like(temperature))[:, None]
    if mode == "filter":
        scaled = filter_top_k_top_p(scaled, top_k, top_p)
    # Exponential race: argmax(p / q) with q ~ Exp(1) draws from p; in log space, logits - log(q).
    q = -torch.log(uniform_noise(seeds, steps, logits.shape[1]))
    picked = (scaled - torch.log(q)).argmax(dim=-1)
    return torch.where(hot, picked, greedy)


def bias_of(params: list[SamplingParams], device: torch.device) -> tuple[torch.Tensor, ...] | None:
    """The batch's logit_bias as (rows, token ids, biases) device tensors for add_bias, or None when no
    row has one. Built from host data: one pinned block copied up without waiting (a pageable copy
    would wait for the stream, a host sync inside the step)."""
    entries = [(i, t, b) for i, p in enumerate(params) for t, b in (p.logit_bias or {}).items()]
    if not entries:
        return None
    rows, ids, biases = zip(*entries)
    host = torch.tensor([rows, ids], dtype=torch.int64)
    values = torch.tensor(biases, dtype=torch.float32)
    if device.type == "cuda":
        host, values = host.pin_memory(), values.pin_memory()
    host, values = host.to(device, non_blocking=True), values.to(device, non_blocking=True)
    return host[0], host[1], values


def add_bias(logits: torch.Tensor, bias: tuple[torch.Tensor, ...] | None) -> torch.Tensor:
    """logits [B, V] float32 plus each row's logit_bias (a new tensor: the raw logits stay for logprobs)."""
    if bias is None:
        return logits
    rows, ids, values = bias
    return logits.index_put((rows, ids), values, accumulate=True)


def mode_of(params: list[SamplingParams]) -> str:
    if any(p.filters for p in params):
        return "filter"
    return "sample" if any(p.temperature > 0 for p in params) else "greedy"


def sample(logits: torch.Tensor, params: list[SamplingParams], seeds: list[int], steps: list[int]) -> torch.Tensor:
    """Eager entry: logits [B, V] float32 -> token ids [B] int64. seeds: each row's noise seed;
    steps: the index of the token each row samples (its output length so far)."""
    dev = logits.device
    return sample_rows(
        add_bias(logits, bias_of(params, dev)),
        torch.tensor([p.temperature for p in params], dtype=torch.float32, device=dev),
        torch.tensor([p.top_k for p in params], dtype=torch.int64, device=dev),
        torch.tensor([p.top_p for p in params], dtype=torch.float32, device=dev),
        torch.tensor(seeds, dtype=torch.int64, device=dev),
        torch.tensor(steps, dtype=torch.int64, device=dev),
        mode_of(params),
    )


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, k: int
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """logits [B, V] float32, tokens [B] int64 -> (logprob of each token [B], the k most likely
    alternatives' logprobs [B, k] and ids [B, k]), from the raw distribution (log-softmax of the
    logits, before temperature and filters, as vLLM reports them)."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    top, ids = torch.topk(logp, k, dim=-1) if k else (logp[:, :0], tokens[:, None][:, :0])
    return logp.gather(1, tokens[:, None])[:, 0], top, ids
