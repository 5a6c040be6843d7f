"""Routed experts computed on the host cores, straight from the host store's rows (the `hybrid`
backend's second path for misses; scripts/bench_cpu_experts.py measures the kernels).

    kernel = host_kernel("grouped", layout, threads=16)
    out = kernel(x [T, H], pairs [P] int64, experts [P] int64, weights [P] fp32, rows [E, R], top_k) -> [T, H] fp32

`pairs` are flat pair indices t * top_k + j of the pairs to compute (any subset of a step's T x k),
`experts[i]` the host row pair i reads, `weights[i]` its routing weight. The result is the weighted
sum over those pairs only, per token, in fp32, summed in pair order j = 0..k-1 with absent pairs
contributing exact zeros: for a given set of pairs the sum order is fixed whichever kernel computed
the pair outputs (the backend adds it to the device's partial sum of the other pairs).

The torch kernel computes a pair as reference.expert_pairs does: F.linear(silu_mul(F.linear(x, w13),
limit), w2) in the compute dtype (the rows' dtype; the hidden state's for FP8 rows); limit is
layout.swiglu_limit (the clamped SwiGLU of GLM-5.3-Flash: both kernels clamp). Two kernels, and a choice:

    grouped   (torch) one F.linear per distinct expert over all of its tokens (each weight read once
              per call); torch's intra-op threads (oneDNN/MKL) split each GEMM
    compiled  csrc/host_experts.cpp (host_ext.py builds it at first use): one OpenMP region per call,
              every distinct expert's gate_up rows, then its down rows, cut into ~64 KB items the
              threads take in turn; bf16 -> fp32 by a shift, FP8 and 4-bit codes (NVFP4, INT4) decoded
              with their scales in registers (the formats' torch references' products), fp32 FMA with
              all of an expert's tokens per weight chunk. Each weight byte read once per call by one
              core. Its pair outputs are fp32 (the torch kernels' are rounded to the compute dtype);
              docs/hybrid.md has its numerics.
    auto      (host_kernel() only) compiled where it builds, else grouped, with a one-line warning

Quantized rows (layout.quant "fp8", "nvfp4", the INT4 names: uint8 rows of codes and scales, and
asymmetric INT4's zero codes)
compute in the hidden state's dtype: the torch kernels dequantize an expert's row into scratch (RowLayout.weights, the CPU
backends' own dequantization) before the same F.linear ops; the compiled kernel decodes the bytes in
registers. A dtype no kernel knows is refused, not silently computed wrong.

The combine's order is fixed whichever kernel computed the pairs. The compiled kernel's pair outputs
are in addition independent of its thread count and of the other pairs of the call, by construction
(each output element is one dot product of one thread in a fixed order; tested bitwise).
"""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F

from moetier.activation import silu_mul
from moetier.experts.hybrid import host_ext
from moetier.quant.rows import RowLayout

KERNELS = ("compiled", "grouped")  # the implementations
CHOICES = ("auto", *KERNELS)  # what an option may name (auto: compiled where it builds, else grouped)
DTYPES = (torch.bfloat16, torch.float16, torch.float32)  # rows of the model dtype; FP8 rows are uint8


class HostKernel:
    """Base: checks the arguments, groups the pairs by expert, owns the fixed-order combine."""

    name = "base"

    def __init__(self, layout: RowLayout, threads: int | None = None):
        self.layout = layout
        self.threads = threads or torch.get_num_threads()
        if self.threads < 1:
            raise ValueError(f"threads must be >= 1, got {self.threads}")

    def __call__(self, x: torch.Tensor, pairs: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor,
                 rows: torch.Tensor, top_k: int) -> torch.Tensor:
        self._check(x, pairs, experts, weights, rows)
        t = x.shape[0]
        y = torch.zeros(t * top_k, self.layout.hidden, dtype=torch.float32)  # [T*k, H]; absent pairs stay 0
        if pairs.numel():
            xs = x.to(compute_dtype(rows, x.dtype))
            out = self.pair_outputs(xs, pairs // top_k, experts, rows)  # [P, H] in rows.dtype
            y[pairs] = out.float() * weights.float()[:, None]
        return y.view(t, top_k, -1).sum(dim=1)  # fixed order over j

    def pair_outputs(self, x: torch.Tensor, tokens: torch.Tensor, experts: torch.Tensor, rows: torch.Tensor
                     ) -> torch.Tensor:
        raise NotImplementedError

    def start(self, x: torch.Tensor, tokens: torch.Tensor, experts: torch.Tensor, rows: torch.Tensor,
              out: torch.Tensor | None = None):
        """pair_outputs started on a native thread of the kernel's own (an object whose result() waits
        for it; out: an fp32 [P, H] tensor it may write into), or None where this kernel has none (the
        caller runs pair_outputs on a thread of its own)."""
        return None

    def _check(self, x, pairs, experts, weights, rows) -> None:
        if x.device.type != "cpu" or rows.device.type != "cpu":
            raise ValueError("host expert kernels take CPU tensors (copy the hidden state down first)")
        if self.layout.quant is not None and rows.dtype != torch.uint8:
            raise ValueError(f"{'FP8' if self.layout.quant == 'fp8' else self.layout.quant} rows are bytes "
                             f"(torch.uint8), got {rows.dtype}")
        if self.layout.quant is None and rows.dtype not in DTYPES:
            raise ValueError(f"no host expert kernel for {rows.dtype} rows yet (have {DTYPES})")
        if rows.dim() != 2 or rows.shape[1] != self.layout.numel:
            raise ValueError(f"rows must be [E, {self.layout.numel}], got {list(rows.shape)}")
        if x.dim() != 2 or x.shape[1] != self.layout.hidden:
            raise ValueError(f"x must be [T, {self.layout.hidden}], got {list(x.shape)}")
        if not pairs.shape == experts.shape == weights.shape or pairs.dim() != 1:
            raise ValueError("pairs, experts and weights must be 1-d and of one length")
        if experts.numel() and not 0 <= int(experts.min()) <= int(experts.max()) < rows.shape[0]:
            raise ValueError(f"expert ids must be in 0..{rows.shape[0] - 1}")

    def weights(self, rows: torch.Tensor, e: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Expert e's (w13 [2I, H], w2 [H, I]): views of unquantized rows, quantized rows dequantized to dtype."""
        w13, w2 = self.layout.weights(rows[e:e + 1], dtype)
        return w13[0], w2[0]

    @staticmethod
    def groups(experts: torch.Tensor) -> list[tuple[int, torch.Tensor]]:
        """(expert, pair indices in order) per distinct expert, experts ascending."""
        order = torch.argsort(experts, stable=True)
        uniq, counts = torch.unique_consecutive(experts[order], return_counts=True)
        return list(zip(uniq.tolist(), torch.split(order, counts.tolist())))


class GroupedKernel(HostKernel):
    """One GEMM per distinct expert over its tokens; torch's own threads (set to `threads`)."""

    name = "grouped"

    def pair_outputs(self, x, tokens, experts, rows):
        lay = self.layout
        out = x.new_empty(tokens.numel(), lay.hidden)
        # NOTE: sets the calling thread's torch thread count and leaves it (under OpenMP the count is
        # per thread; switching it back and forth every call costs more than a small GEMV). The hybrid
        # backend calls kernels from its own host thread, so the main thread's setting is untouched.
        if torch.get_num_threads() != self.threads:
            torch.set_num_threads(self.threads)
        for e, idx in self.groups(experts):
            w13, w2 = self.weights(rows, e, x.dtype)
            out[idx] = F.linear(silu_mul(F.linear(x[tokens[idx]], w13), lay.swiglu_limit), w2)
        return out


class CompiledKernel(HostKernel):
    """The compiled kernel (csrc/host_experts.cpp via host_ext.py); built at construction, so a build
    failure surfaces here (HostExtUnavailable), never in a step. Rows it has no code for (fp16) take the
    grouped torch kernel."""

    name = "compiled"

    def __init__(self, layout: RowLayout, threads: int | None = None):
        super().__init__(layout, threads)
        self.lib = host_ext.load()
        self._torch = GroupedKernel(layout, threads)
        self.block_bytes = 0  # weight bytes per work item the threads take in turn (0: the kernel's 64 KB)

    def pair_outputs(self, x, tokens, experts, rows):
        if host_ext.kind_of(rows, self.layout) is None or not rows.is_contiguous():
            return self._torch.pair_outputs(x, tokens, experts, rows)
        return host_ext.pair_outputs(self.lib, x, tokens, experts, rows, self.layout, self.threads,
                                     self.block_bytes)  # [P, H] fp32

    def start(self, x, tokens, experts, rows, out=None):
        if host_ext.kind_of(rows, self.layout) is None or not rows.is_contiguous():
            return None
        return host_ext.start(self.lib, x, tokens, experts, rows, self.layout, self.threads, self.block_bytes, out)


def host_kernel(name: str, layout: RowLayout, threads: int | None = None, fallback: bool = False) -> HostKernel:
    """The kernel `name` (one of CHOICES). "auto", or any name with fallback=True (the hybrid backend:
    never a crash at serve time): where the compiled kernel cannot be built, grouped, with a one-line
    warning; the kernel's `fallback_reason` keeps the reason."""
    if name not in CHOICES:
        raise ValueError(f"unknown host expert kernel {name!r}; choose one of: {', '.join(CHOICES)}")
    if name in ("auto", "compiled"):
        try:
            return CompiledKernel(layout, threads)
        except host_ext.HostExtUnavailable as e:
            if name == "compiled" and not fallback:
                raise
            warnings.warn(f"moetier: host expert kernel 'grouped' instead of 'compiled': {e}", stacklevel=2)
            kernel = GroupedKernel(layout, threads)
            kernel.fallback_reason = str(e)
            return kernel
    return GroupedKernel(layout, threads)


def compute_dtype(rows: torch.Tensor, x_dtype: torch.dtype) -> torch.dtype:
    """The dtype a pair is computed in: the rows' (the model dtype), or for quantized (byte) rows the
    hidden state's."""
    return rows.dtype if rows.is_floating_point() else x_dtype


def reference(x: torch.Tensor, pairs: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor,
              rows: torch.Tensor, layout: RowLayout, top_k: int) -> torch.Tensor:
    """The oracle: every pair on its own in fp32 math, combined as the kernels do. -> [T, H] fp32.
    Weights and outputs are rounded to the compute dtype as the torch kernels' are (quantized rows: weights
    dequantized to the hidden dtype, as RowLayout.weights does for every CPU path)."""
    t = x.shape[0]
    cdt = compute_dtype(rows, x.dtype)
    y = torch.zeros(t * top_k, layout.hidden, dtype=torch.float32)
    xs = x.to(cdt).float()
    for p, e, w in zip(pairs.tolist(), experts.tolist(), weights.tolist()):
        w13, w2 = (v[0].float() for v in layout.weights(rows[e:e + 1], cdt))
        h = silu_mul(xs[p // top_k] @ w13.T, layout.swiglu_limit).to(cdt).float()
        y[p] = (h @ w2.T).to(cdt).float() * w
    return y.view(t, top_k, -1).sum(dim=1)
