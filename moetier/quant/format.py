"""What a weight format declares about itself: one record per format, listed in quant/registry.py.

A format is the way a checkpoint stores a quantized weight and the way the expert tiers hold it:
the tensors beside each weight, how a plain-torch reference turns them back into values, and the
exact bytes of one routed expert's row. Everything else a format needs lives in its own files:

    quant/<format>.py         the torch reference (quantize for the random-weight writer, dequantize
                              for the oracle and the CPU paths), the checkpoint names and the
                              config.json rules, and its FORMAT record
    quant/<format>_triton.py  the Triton helpers kernels call to turn a tile of stored bytes into
                              values (kept apart so that config-time imports stay torch-only)
    quant/rows.py             where each weight and scale sits in an expert's row (RowLayout)

A new format (NVFP4, INT4: issue 30) adds its files and one line to quant/registry.py; the rows, the
plan and the backends count its bytes through RowLayout, which asks the registry.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch


@dataclass(frozen=True)
class Format:
    """One weight format. Fields hold no tensors: a record the registry can list and tests can read.

    name            the value of ModelConfig.quant, MoeShape.quant and RowLayout.quant ("fp8"), and
                    the `--dtype` word of make-checkpoint and the benchmarks
    weight_code     safetensors dtype code of a quantized weight tensor ("F8_E4M3")
    scale_suffixes  the checkpoint tensors stored beside each quantized `x.weight`, as suffixes of
                    its name, in the order dequantize takes them (FP8: ("_scale_inv",))
    dequantize      the torch reference: (weight, *scales in scale_suffixes order, dtype) -> the
                    weight [..., N, K] in dtype; every kernel of the format is tested against it
    row_bytes       (hidden, inter) -> exact bytes of one routed expert's row: weights, scales and
                    alignment padding (what the host store pins and the plan counts)
    config_problems a config.json `quantization_config` -> what is wrong with it here, one line each
                    (empty: this engine reads it)
    """

    name: str
    weight_code: str
    scale_suffixes: tuple[str, ...]
    dequantize: Callable[..., torch.Tensor]
    row_bytes: Callable[[int, int], int]
    config_problems: Callable[[object], list[str]]

    def bytes_per_weight(self, hidden: int, inter: int) -> float:
        """Row bytes per weight of an expert of this shape (scales and padding included)."""
        return self.row_bytes(hidden, inter) / (3 * hidden * inter)
