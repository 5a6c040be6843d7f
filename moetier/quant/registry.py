"""The weight formats this engine reads, by name: quant/format.Format records, one per format file.

    FORMATS   name -> Format ("fp8": block-scaled FP8, quant/fp8_block.py; "nvfp4": quant/nvfp4.py;
              "int4", "int4-g32": INT4 in groups of 128 or 32, quant/int4.py)
    QUANTS    the values RowLayout.quant and MoeShape.quant take: None (the model dtype) or a name
    PACKED4, GROUPS, GROUP_SCALES   the 4-bit formats, each one's group size and group scales' dtype
    get(name) the Format of a name, or one line naming the known ones

A format plugs in with one line here.
"""

from __future__ import annotations

from moetier.quant import fp8_block, int4, nvfp4
from moetier.quant.format import Format

FORMATS: dict[str, Format] = {f.name: f for f in (fp8_block.FORMAT, nvfp4.FORMAT, *int4.FORMATS)}
PACKED4 = ("nvfp4", *int4.GROUPS)  # the 4-bit formats (quant/packed4.py rows)
GROUPS = {"nvfp4": nvfp4.GROUP, **int4.GROUPS}  # a 4-bit format -> elements per group scale along K
GROUP_SCALES = {"nvfp4": nvfp4.E4M3, **dict.fromkeys(int4.GROUPS, int4.SCALE)}  # a 4-bit format -> its scales' dtype
QUANTS: tuple[str | None, ...] = (None, *FORMATS)


def get(name: str) -> Format:
    if name not in FORMATS:
        raise ValueError(f"unknown weight format {name!r}; one of {sorted(FORMATS)}")
    return FORMATS[name]
