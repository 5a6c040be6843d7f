"""The headline figure of repeated benchmark runs: for each row present in the given records (`bench
decode` or `bench prefill` JSON, one per process), the median tok/s over the records and its spread
(min-max), with the row's output check in each. Headline figures are such medians, never the best run.

    python scripts/median_of_runs.py bench/results/h200-prefill-headline-run*.json [--row resident/pp512x1]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from moetier.bench import decode_report, prefill


def row_names(data: dict) -> dict[str, dict]:
    name = prefill.row_name if data.get("benchmark") == "prefill" else decode_report.row_name
    return {name(r): r for r in data["rows"]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("records", nargs="+", type=Path, help="JSON records of the same benchmark, one per run")
    ap.add_argument("--row", action="append", default=[], help="Only these rows (repeatable; default: all).")
    a = ap.parse_args(argv)
    runs = []
    for path in a.records:
        try:
            runs.append((path.name, row_names(json.loads(path.read_text()))))
        except (OSError, ValueError, KeyError) as e:
            print(f"error: {path}: not a bench decode/prefill record ({e})", file=sys.stderr)
            return 2
    names = a.row or list(dict.fromkeys(n for _, rows in runs for n in rows))
    for name in names:
        got = [(f, rows[name]) for f, rows in runs if name in rows]
        if not got:
            print(f"error: --row {name!r} is in none of the records", file=sys.stderr)
            return 2
        rates = [r["tok_s"] for _, r in got]
        checks = sorted({(r.get("check") or {}).get("verdict", "no check")[:40] for _, r in got})
        print(f"{name}: median {statistics.median(rates):,.1f} tok/s ({min(rates):,.1f} to {max(rates):,.1f} over "
              f"{len(rates)} runs: {', '.join(f for f, _ in got)}); checks: {'; '.join(checks)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
