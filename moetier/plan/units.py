"""Byte sizes in and out, with their unit always said.

GiB is 2^30 bytes and GB is 10^9 bytes (reference 000: reading 249.81 GiB as 249.8 GB hid 7% of a
budget). Parsing accepts either, plus a share of a known total ("80%"); a bare number is refused,
because nobody can tell which unit it meant.
"""

from __future__ import annotations

import math
import re

from moetier.errors import MoetierError

KiB, MiB, GiB, TiB = 2**10, 2**20, 2**30, 2**40
KB, MB, GB, TB = 10**3, 10**6, 10**9, 10**12

UNITS = {"B": 1, "KiB": KiB, "MiB": MiB, "GiB": GiB, "TiB": TiB, "KB": KB, "MB": MB, "GB": GB, "TB": TB}
_LOWER = {k.lower(): v for k, v in UNITS.items()}
_SIZE = re.compile(r"\s*([+-]?[0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z%]*)\s*")
MAX_SIZE = 2**50  # 1 PiB: above any machine's memory, so a larger size is a typo


def parse_size(text: str, option: str, total: int | None = None, what: str = "the total") -> int:
    """'139GiB', '600GB', '512 MiB', '80%' (of `total`) -> bytes. Anything else is one clear error.

    total: the bytes a percentage is of (None: percentages are refused, saying why)."""
    m = _SIZE.fullmatch(str(text))
    if not m:
        raise MoetierError(f"{option} {text!r}: give a size with its unit, like 139GiB, 600GB or 80%")
    value, unit = float(m.group(1)), m.group(2)
    if not math.isfinite(value) or value <= 0:
        raise MoetierError(f"{option} {text!r}: a size must be above zero, like 139GiB")
    if unit == "%":
        if total is None:
            raise MoetierError(f"{option} {text!r}: a percentage needs {what}, which is unknown here; "
                               "give a size like 139GiB or 600GB")
        if value > 100:
            raise MoetierError(f"{option} {text!r}: a share can be at most 100%")
        return int(total * value / 100)
    if not unit:
        raise MoetierError(f"{option} {text!r}: say the unit (GiB = 2^30 bytes or GB = 10^9 bytes), "
                           f"e.g. {m.group(1)}GiB")
    scale = _LOWER.get(unit.lower())
    if scale is None:
        raise MoetierError(f"{option} {text!r}: unknown unit {unit!r}; use one of "
                           f"{', '.join(UNITS)} or %")
    if unit.lower() in ("gb", "mb", "kb", "tb") and unit not in UNITS and unit.upper() != unit:
        # 'Gb' reads as gigabits: refuse rather than guess by a factor of 8
        raise MoetierError(f"{option} {text!r}: {unit!r} is ambiguous (bits?); write GB or GiB")
    if value * scale > MAX_SIZE:
        raise MoetierError(f"{option} {text!r}: {value * scale / GiB:,.0f} GiB is more memory than any machine has "
                           f"(at most {MAX_SIZE // TiB:,} TiB); check the number and its unit")
    return int(value * scale)


def gib(n: float) -> str:
    """Bytes as GiB (2^30), 2 decimals, with the unit; small figures in MiB so they do not read 0.00."""
    if abs(n) < GiB / 10 and n != 0:
        return f"{n / MiB:.1f} MiB"
    return f"{n / GiB:.2f} GiB"


def gb(n: float) -> str:
    """Bytes as GB (10^9), 2 decimals, with the unit."""
    return f"{n / GB:.2f} GB"


def both(n: float) -> str:
    """'12.34 GiB (13.25 GB)': where a reader may compare against either kind of figure."""
    return f"{gib(n)} ({gb(n)})"


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def next_pow2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()
