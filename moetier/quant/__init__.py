"""Weight formats (block-scaled FP8 today; NVFP4 and INT4 next): each format's expert row layout,
its plain-torch dequantize reference, the Triton helpers kernels call to turn stored bytes into
values, and its checkpoint names and config rules. Imports nothing from moetier but moetier.errors:
layers/ (dense linears), experts/ (rows, grouped GEMMs, host kernels), checkpoint/ and the plan
import from here.

    format.py             Format: what one format declares (name, tensors, reference, row bytes)
    registry.py           FORMATS by name, QUANTS (the values RowLayout.quant takes)
    rows.py               RowLayout: where each weight and scale sits in one expert's row
    fp8_block.py          block-scaled FP8 (128 x 128 blocks): quantize, dequantize, checkpoint names
    fp8_block_triton.py   its Triton tile dequantize
    dot.py                the dot operand type and tl.dot of a weight-only GEMM (every format)
"""
