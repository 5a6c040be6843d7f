"""The weight formats this engine reads, by name: quant/format.Format records, one per format file.

    FORMATS   name -> Format ("fp8": block-scaled FP8, quant/fp8_block.py)
    QUANTS    the values RowLayout.quant and MoeShape.quant take: None (the model dtype) or a name
    get(name) the Format of a name, or one line naming the known ones

A format plugs in with one line here (NVFP4, INT4 next: issue 30).
"""

from __future__ import annotations

from moetier.quant import fp8_block
from moetier.quant.format import Format

FORMATS: dict[str, Format] = {f.name: f for f in (fp8_block.FORMAT,)}
QUANTS: tuple[str | None, ...] = (None, *FORMATS)


def get(name: str) -> Format:
    if name not in FORMATS:
        raise ValueError(f"unknown weight format {name!r}; one of {sorted(FORMATS)}")
    return FORMATS[name]
