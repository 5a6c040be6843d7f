"""quant/: the format registry and what each Format record declares (docs/fp8.md's row table)."""

from __future__ import annotations

import pytest
import torch

from moetier.quant import fp8_block
from moetier.quant.registry import FORMATS, QUANTS, get
from moetier.quant.rows import RowLayout


def test_registry_lists_each_format_once_under_its_name():
    assert QUANTS == (None, "fp8", "nvfp4", "int4", "int4-g32", "int4-asym", "int4-g32-asym")
    assert list(FORMATS) == list(QUANTS[1:])
    assert get("fp8") is fp8_block.FORMAT
    with pytest.raises(ValueError, match="unknown weight format 'mxfp4'"):
        get("mxfp4")
    with pytest.raises(ValueError, match="unknown expert quantization"):
        RowLayout(64, 32, "int8")


@pytest.mark.parametrize("hidden, inter, row, s13, s2", [
    (2048, 768, 4_719_744, 4_718_592, 4_719_360),      # Qwen3-30B-A3B
    (4096, 1536, 18_878_976, 18_874_368, 18_877_440),  # Qwen3-235B-A22B
    (6144, 2048, 37_757_952, 37_748_736, 37_754_880),  # GLM-5
    (200, 72, 43_232, 43_200, 43_216),                 # ragged: 8 bytes pad the row to 16
])
def test_fp8_row_bytes_are_exact(hidden, inter, row, s13, s2):
    fmt = get("fp8")
    lay = RowLayout(hidden, inter, "fp8")
    assert fmt.row_bytes(hidden, inter) == lay.numel == lay.row_bytes(torch.bfloat16) == row
    assert fp8_block.row_offsets(hidden, inter) == (s13, s2, row) == (lay.s13_offset, lay.s2_offset, lay.numel)
    assert row % fp8_block.ROW_ALIGN == 0 and s13 % fp8_block.ROW_ALIGN == 0
    assert 1.0 < fmt.bytes_per_weight(hidden, inter) < 1.01


def test_fp8_record_names_its_checkpoint_tensors_and_reference():
    fmt = get("fp8")
    assert fmt.weight_code == fp8_block.FP8_CODE == "F8_E4M3"
    assert fmt.scale_suffixes == ("_scale_inv",) and fp8_block.scale_name("x.weight") == "x.weight_scale_inv"
    w = torch.randn(200, 136, generator=torch.Generator().manual_seed(0))
    q, s = fp8_block.quantize(w)
    assert torch.equal(fmt.dequantize(q, s, torch.bfloat16), fp8_block.dequantize(q, s, torch.bfloat16))
    assert fmt.config_problems(fp8_block.QUANT_CONFIG) == []
    assert fmt.config_problems({**fp8_block.QUANT_CONFIG, "weight_block_size": [64, 64]})
