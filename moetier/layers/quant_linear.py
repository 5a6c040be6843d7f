"""The dense weights of a quantized checkpoint as the layers hold them: in the model dtype
(dequantized at load, the default) or, with EngineConfig.dense_weights "keep", in the checkpoint's
own format (ModelConfig.dense_quant names it). One table maps a format to its weight module:

    "fp8"                       layers/fp8_linear.Fp8Weight (FP8 blocks with their block scales)
    the 4-bit formats          layers/packed4_linear.Packed4Weight (4-bit codes, group scales,
      (quant/registry.PACKED4)  NVFP4's tensor scale, asymmetric INT4's zero codes)

    dense_weight(n, k, dtype, device, held, parts, split, k_split) -> a parameter, or the format's
        weight module where that format can hold this weight (its `fits`: FP8 needs fused parts and
        tensor-parallel cuts on 128-blocks and else falls back to the model dtype for that weight;
        4-bit fits any row cut and refuses a K split that cuts a group)
    rows_of(w, start, stop)  rows of a fused weight, the loader's destination
    destination(p)           a model.param() result as the loader copies into it: a kept module's
                             rows (its .rows()), kept rows as they are, None for a plain tensor
    linear(x, w, bias)       what every layer calls: F.linear for a tensor (cuBLAS on CUDA: a GEMV
                             of our own measured no faster at decode sizes, docs/bench-decode.md),
                             the module's own linear (CPU reference, CUDA kernels) for a kept weight
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from moetier.layers.fp8_linear import Fp8Rows, Fp8Weight
from moetier.layers.packed4_linear import Packed4Rows, Packed4Weight
from moetier.layers.param import param
from moetier.quant.registry import PACKED4

KEPT: dict[str, type] = {"fp8": Fp8Weight, **dict.fromkeys(PACKED4, Packed4Weight)}
WEIGHTS = (Fp8Weight, Packed4Weight)  # the kept weight modules
ROWS = (Fp8Rows, Packed4Rows)  # their row views (loader destinations)


def dense_weight(n: int, k: int, dtype: torch.dtype, device: torch.device | str, held: str | None = None,
                 parts: tuple[int, ...] | None = None, split: bool = False, k_split: bool = False
                 ) -> nn.Parameter | Fp8Weight | Packed4Weight:
    """A layer's [N, K] weight. held: the format kept (ModelConfig.dense_quant) or None; parts: the
    row sizes of the checkpoint tensors fused into it (default one part); split: tensor parallelism
    splits every part's rows again; k_split: it splits K (k is then this rank's part)."""
    cls = KEPT.get(held) if held else None
    if cls is not None and cls.fits(held, n, k, parts or (n,), split, k_split):
        return cls(n, k, device, held)
    return param(n, k, dtype=dtype, device=device)


def rows_of(w: torch.Tensor | Fp8Weight | Packed4Weight, start: int, stop: int
            ) -> torch.Tensor | Fp8Rows | Packed4Rows:
    """Rows [start, stop) of a fused weight, as the loader's destination."""
    return w[start:stop] if isinstance(w, torch.Tensor) else w.rows(start, stop)


def destination(p: object) -> Fp8Rows | Packed4Rows | None:
    """Where the loader copies a kept weight's stored tensors; None: a plain tensor (or nothing)."""
    if isinstance(p, WEIGHTS):
        return p.rows()
    return p if isinstance(p, ROWS) else None


def linear(x: torch.Tensor, w: torch.Tensor | Fp8Weight | Packed4Weight, bias: torch.Tensor | None = None
           ) -> torch.Tensor:
    """F.linear for a plain weight or a kept one. x [..., K] -> [..., N] in x.dtype."""
    if isinstance(w, torch.Tensor):
        return F.linear(x, w, bias)
    return w.linear(x, bias)
