"""Weight-only 4-bit linear layers: the dense projections of an NVFP4 or INT4 checkpoint kept in its
own format (EngineConfig.dense_weights = "keep") instead of dequantized at load (docs/quant4.md).

    Packed4Weight  codes uint8 [N, K/2] (two per byte, the even element low: quant/packed4.py), group
                   scales [N, ceil(K/g)] in the format's dtype (NVFP4 e4m3, g 16; INT4 bf16, g 128
                   or 32), for NVFP4 the float32 tensor scale held per row, scale_2 [N], for
                   asymmetric INT4 each group's zero code, zero uint8 [N, ceil(K/g)]
    Packed4Rows    views of some rows: where the loader copies a checkpoint tensor's codes and scales

NVFP4's tensor scale is per row so that a fused weight (qkv, gate_up) keeps every part's own
weight_scale_2: checkpoints quantize q, k and v apart, and their tensor scales differ. 4 bytes a
row (K/2 + K/16 bytes of codes and scales a row beside it), and fusion never falls back: a 4-bit
group runs along K, so any row cut is exact. A tensor-parallel split of K (o_proj, down_proj) must
keep groups whole; one that does not is refused in one line (fits).

Every path computes with the format's torch reference weights exactly (quant/nvfp4.dequantize,
quant/int4.dequantize: one float32 product, rounded once to x.dtype):

    CPU            dequantize, then F.linear (reference(): the test oracle; the dispatch below is
                   layers/param.KeptWeight.linear, shared with Fp8Weight)
    CUDA, M <= 64  (decode) layers/packed4_linear_triton.q4_mm: each program loads a tile of codes and
                   its group scales and dequantizes it in registers (quant/packed4_triton.dequant4_tile,
                   the expert GEMMs' helper), tl.dot in fp32, K split by the shape alone and the
                   partials summed in a fixed order (as layers/fp8_linear_triton: a row's bits never
                   depend on M or on the other rows)
    CUDA, M > 64   (prefill, eager) dequantized by one Triton kernel into a transient [N, K] of x.dtype,
                   then F.linear (cuBLAS); the plan counts the largest such transient
Both CUDA paths allocate only through torch and read nothing back: safe inside a CUDA graph.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from moetier.errors import MoetierError
from moetier.layers.param import KeptWeight, param
from moetier.quant import int4, nvfp4, packed4
from moetier.quant.registry import GROUP_SCALES, GROUPS


def nbytes(quant: str, n: int, k: int) -> int:
    """Bytes a Packed4Weight [N, K] holds: codes, group scales, NVFP4's per-row tensor scale,
    asymmetric INT4's zero code per group."""
    groups = n * packed4.cdiv(k, GROUPS[quant])
    zeros = groups if quant in int4.ASYMMETRIC else 0
    return n * (k // 2) + groups * GROUP_SCALES[quant].itemsize + (4 * n if quant == "nvfp4" else 0) + zeros


class Packed4Weight(KeptWeight):
    """A dense weight held in 4 bits (module docstring); parameters without gradients, so
    parameters() counts their bytes."""

    def __init__(self, n: int, k: int, device: torch.device | str, quant: str):
        super().__init__()
        if k % 2:
            raise ValueError(f"a 4-bit weight packs two values per byte: K ({k}) must be even")
        self.quant, self.k, self.group = quant, k, GROUPS[quant]
        self.codes = param(n, k // 2, dtype=torch.uint8, device=device)
        self.scale = param(n, packed4.cdiv(k, self.group), dtype=GROUP_SCALES[quant], device=device)
        self.scale_2 = param(n, dtype=torch.float32, device=device) if quant == "nvfp4" else None
        self.zero = (param(*self.scale.shape, dtype=torch.uint8, device=device) if quant in int4.ASYMMETRIC
                     else None)  # asymmetric INT4: each group's zero code (z + 8)

    @classmethod
    def fits(cls, quant: str, n: int, k: int, parts: tuple[int, ...], split: bool, k_split: bool) -> bool:
        """Whether this weight can be held in 4 bits: K even (the format packs pairs; a checkpoint
        cannot hold codes otherwise). Row parts always fit; a K split by tensor parallelism (k is a
        rank's part) must keep the groups whole, else one line refuses it."""
        group = GROUPS[quant]
        if k_split and k % group:
            raise MoetierError(f"a tensor-parallel rank's {k} input columns of a dense {quant} weight [{n}, {k}] cut "
                               f"its groups of {group}; use --dense-weights dequantize or a tensor-parallel size "
                               f"that leaves each rank whole groups")
        return k % 2 == 0

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.codes.shape[0], self.k))

    def rows(self, start: int = 0, stop: int | None = None) -> Packed4Rows:
        """Views of rows [start, stop): a loader destination (any row cut is exact: groups run along K)."""
        stop = self.codes.shape[0] if stop is None else stop
        s2 = None if self.scale_2 is None else self.scale_2[start:stop]
        zero = None if self.zero is None else self.zero[start:stop]
        return Packed4Rows(self.codes[start:stop], self.scale[start:stop], s2, zero, self)

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        if self.scale_2 is not None:
            return nvfp4.dequantize(self.codes, self.scale, self.scale_2[:, None], dtype)
        return int4.dequantize(self.codes, self.scale, dtype, self.group, zero=self.zero)

    def decode_mm(self, x2: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        from moetier.layers import packed4_linear_triton as kernels

        return kernels.q4_mm(x2, self.codes, self.scale, self.scale_2, self.quant, bias, self.zero)

    def dequantize_cuda(self, dtype: torch.dtype) -> torch.Tensor:
        from moetier.layers import packed4_linear_triton as kernels

        return kernels.dequantize(self.codes, self.scale, self.scale_2, self.quant, dtype, self.zero)

    def extra_repr(self) -> str:
        return f"{self.codes.shape[0]}, {self.k}, {self.quant} in groups of {self.group}"


@dataclass(frozen=True)
class Packed4Rows:
    """Where a checkpoint's 4-bit codes and scales go (views into a Packed4Weight)."""

    codes: torch.Tensor
    scale: torch.Tensor
    scale_2: torch.Tensor | None
    zero: torch.Tensor | None = None
    owner: Packed4Weight | None = field(default=None, compare=False, repr=False)  # the weight they are rows of

    @property
    def nbytes(self) -> int:
        """Bytes of these rows as held (codes, group scales, tensor scales, zero codes): what the plan counts."""
        s2 = 0 if self.scale_2 is None else 4 * self.scale_2.numel()
        zeros = 0 if self.zero is None else self.zero.numel()
        return self.codes.numel() + self.scale.numel() * self.scale.element_size() + s2 + zeros

    def copy_(self, codes: torch.Tensor, scale: torch.Tensor, scale_2: torch.Tensor | None, name: str,
              zero: torch.Tensor | None = None) -> None:
        """codes uint8 [rows, K/2], scale [rows, G], scale_2 the checkpoint's one float32 tensor scale
        (NVFP4, already 1 / global for compressed-tensors) or None (INT4), zero uint8 [rows, G] the
        zero codes (asymmetric INT4) or None."""
        if (zero is None) != (self.zero is None) or (zero is not None and zero.shape != self.zero.shape):
            raise ValueError(f"{name}: zero codes {None if zero is None else list(zero.shape)} do not fit their "
                             f"destination {None if self.zero is None else list(self.zero.shape)}")
        if tuple(codes.shape) != tuple(self.codes.shape) or tuple(scale.shape) != tuple(self.scale.shape):
            raise ValueError(f"{name}: 4-bit codes {list(codes.shape)} with scales {list(scale.shape)} do not fit "
                             f"their destination {list(self.codes.shape)} with scales {list(self.scale.shape)}")
        with torch.no_grad():
            self.codes.copy_(codes)
            self.scale.copy_(scale)
            if self.scale_2 is not None:
                self.scale_2.copy_(scale_2.reshape(()).expand(self.scale_2.shape))
            if self.zero is not None:
                self.zero.copy_(zero)

