"""Fails CI when a test that must run on a CPU machine was skipped: reads pytest's `-rs` summary
(`SKIPPED [N] path:line: reason`) from a log, prints the skips counted by reason, and exits 1 on any
reason other than the GPU one (tests/conftest.py GPU_SKIP)."""

from __future__ import annotations

import re
import sys
from collections import Counter

GPU_SKIP = "gpu: needs CUDA"
LINE = re.compile(r"^SKIPPED \[(\d+)\] ([^:]+(?::\d+)?): (.*)$")


def main(path: str) -> int:
    by_reason: Counter[str] = Counter()
    bad: list[str] = []
    for line in open(path, encoding="utf-8", errors="replace"):
        m = LINE.match(line.rstrip("\n"))
        if not m:
            continue
        n, where, reason = int(m[1]), m[2], m[3]
        by_reason[reason] += n
        if reason != GPU_SKIP:
            bad.append(f"  {n} at {where}: {reason}")
    for reason, n in by_reason.most_common():
        print(f"skipped {n:5d}: {reason}")
    if bad:
        print("CPU tests skipped (a missing dependency or tool on this machine; install it in .ci/run):")
        print("\n".join(bad))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
