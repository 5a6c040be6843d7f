"""Block sizes of the grouped expert GEMM (grouped_gemm.py), passed in by whoever builds the backends:
plain data, importable without Triton (CPU installs have none)."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch


def compute_dtype(x: torch.dtype, rows: torch.dtype, quant: str | None) -> torch.dtype:
    """What the expert GEMMs multiply in: quantized rows dequantize to the activations' dtype, 16-bit
    rows multiply in their own."""
    return x if quant is not None else rows


def h_dtype(compute: torch.dtype) -> torch.dtype:
    """The dtype of a large step's h (the SwiGLU between gate_up and down) for the kernels' compute
    dtype: down rounds h to the dot's type before every product, so a 16-bit compute stores it in that
    type (half the bytes, the same bits); any other stays float32. The plan counts it by this too."""
    return compute if compute in (torch.bfloat16, torch.float16) else torch.float32


# (BLOCK_N, BLOCK_K, num_warps) of the gate_up and down kernels: what scripts/tune_experts.py and
# `bench layer --tune` try.
SWEEP = [(16, 256, 4), (32, 128, 4), (32, 256, 4), (64, 128, 4), (16, 512, 4), (32, 256, 8), (64, 64, 4),
         (128, 64, 4)]


@dataclass(frozen=True)
class GemmConfig:
    """Block sizes of the two GEMM kernels: the fastest of each sweep (scripts/tune_experts.py,
    scripts/tune_prefill.py; the figures are in docs/measured-defaults.md).

    NOTE: a backend holds one config for every step, never chosen by T or the routing, so every
    backend and every step of a shape runs the same compiled kernels (bit-exactness between them)."""

    gate_up: tuple[int, int, int] = (64, 128, 4)
    down: tuple[int, int, int] = (64, 128, 4)
    # Large steps (prefill, grouped_expert_mlp_large): pairs of one row per chunk, and the blocks of
    # the two kernels for them; a fourth entry, where given, is num_stages (else Triton's default).
    large_block_m: int = 64
    large_gate_up: tuple[int, ...] = (128, 64, 4)
    large_down: tuple[int, ...] = (128, 64, 4)
    # Large steps dense in pairs (at least large_dense_pairs (token, expert) pairs: 4,096 tokens at
    # top-8, over a hundred pairs per expert at 288 experts): chunks of 128 pairs, 8 warps, deeper
    # pipelines; at fewer pairs they waste a chunk's rows (docs/measured-defaults.md). Chosen by the
    # step's pair count alone, so every backend of a step runs the same chunks.
    large_dense_pairs: int = 32768
    large_dense_block_m: int = 128
    large_dense_gate_up: tuple[int, ...] = (128, 64, 8, 4)
    large_dense_down: tuple[int, ...] = (128, 64, 8, 3)
    # FP8 rows at decode: half the bytes per tile, so other blocks win. BLOCK_K must divide 128 here:
    # wider K tiles gather a scale per element.
    fp8_gate_up: tuple[int, int, int] = (32, 128, 4)
    fp8_down: tuple[int, int, int] = (128, 128, 4)
    # One-token steps on FP8 rows (fp8_gemv.py): BLOCK_K a multiple of 128.
    fp8_gemv_gate_up: tuple[int, int, int] = (8, 1024, 4)
    fp8_gemv_down: tuple[int, int, int] = (16, 256, 4)

    # 4-bit rows at decode (NVFP4, INT4; grouped_gemm.py with Q4): scripts/tune_experts.py's winners on
    # the H200 for both formats at 1 and 8 tokens (docs/quant4.md). BLOCK_K a power of two: a tile holds
    # whole groups or lies in one (quant/packed4_triton.py).
    q4_gate_up: tuple[int, int, int] = (32, 256, 4)
    q4_down: tuple[int, int, int] = (64, 64, 4)
    # One-token steps on 4-bit rows (q4_gemv.py): BLOCK_K a power of two.
    q4_gemv_gate_up: tuple[int, int, int] = (16, 512, 4)
    q4_gemv_down: tuple[int, int, int] = (16, 512, 4)

    def large_blocks(self, pairs: int) -> tuple[int, tuple[int, ...], tuple[int, ...]]:
        """(block_m, gate_up, down) of a large step of `pairs` (token, expert) pairs."""
        if pairs >= self.large_dense_pairs:
            return self.large_dense_block_m, self.large_dense_gate_up, self.large_dense_down
        return self.large_block_m, self.large_gate_up, self.large_down

    def _names(self, quant: str | None) -> tuple[str, str]:
        return {"fp8": ("fp8_gate_up", "fp8_down"), None: ("gate_up", "down")}.get(quant, ("q4_gate_up", "q4_down"))

    def _gemv_names(self, quant: str) -> tuple[str, str]:
        return ("fp8_gemv_gate_up", "fp8_gemv_down") if quant == "fp8" else ("q4_gemv_gate_up", "q4_gemv_down")

    def gemv_blocks(self, quant: str | None) -> tuple[tuple[int, int, int], tuple[int, int, int]] | None:
        """(gate_up, down) blocks of the one-token GEMV for rows of `quant` (fp8_gemv.py, q4_gemv.py);
        None for bf16 rows, which run the grouped GEMM at one token too."""
        if quant is None:
            return None
        gu, dn = self._gemv_names(quant)
        return getattr(self, gu), getattr(self, dn)

    def with_gemv(self, quant: str, gate_up=None, down=None) -> GemmConfig:
        """A copy with the one-token GEMV blocks of `quant` rows replaced (the tuners' trial configs)."""
        gu, dn = self.gemv_blocks(quant)
        names = self._gemv_names(quant)
        return replace(self, **{names[0]: gate_up or gu, names[1]: down or dn})

    def decode_blocks(self, quant: str | None) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
        """(gate_up, down) blocks of the decode kernels for rows of `quant`."""
        gu, dn = self._names(quant)
        return getattr(self, gu), getattr(self, dn)

    def with_decode(self, quant: str | None, gate_up=None, down=None) -> GemmConfig:
        """A copy with the decode blocks of `quant` rows replaced (the tuners' trial configs)."""
        gu, dn = self.decode_blocks(quant)
        names = self._names(quant)
        return replace(self, **{names[0]: gate_up or gu, names[1]: down or dn})
