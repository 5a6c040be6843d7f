"""Overlapped scheduling (EngineConfig.async_scheduling, engine/overlap.py) against the synchronous loop
on one engine: random weights of a preset shape, CUDA graphs, greedy decode of 32-token prompts at batch
1 and 8 (8 warm-up tokens, 128 timed), the two loops alternated three times, medians and every run,
and the greedy tokens of each pair compared. CUDA only. Run from the repository root:

    python scripts/async_scheduling_ab.py PRESET LAYERS BACKEND OUT.json     (BACKEND: resident or slots)
"""

from __future__ import annotations

import json
import statistics
import sys

from moetier.bench.decode_steps import decode_once
from moetier.checkpoint.random_bed import RandomModel
from moetier.engine import LLM
from moetier.engine.overlap import Overlap
from moetier.errors import MoetierError


def main() -> None:
    if len(sys.argv) != 5 or sys.argv[3] not in ("resident", "slots") or not sys.argv[2].isdigit():
        print("error: usage: python scripts/async_scheduling_ab.py PRESET LAYERS resident|slots OUT.json",
              file=sys.stderr)
        sys.exit(2)
    preset, layers, backend, out = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
    # slots: half of each layer's routed experts in HBM, routed by the random router (no trace)
    try:
        llm = LLM.from_random(RandomModel(preset, layers, backend=backend, budget=0.5), dtype="bfloat16",
                              device="cuda", max_num_seqs=32, kv_tokens=16384)
    except (MoetierError, KeyError, ValueError) as e:  # an unknown preset, a layer count it does not have
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    rows = []
    for b in (1, 8):
        tok_s, same = {False: [], True: []}, True
        for rep in range(3):
            tokens = {}
            for overlap in (False, True):
                llm.overlap = Overlap(llm.scheduler, llm.runner) if overlap else None  # what async_scheduling builds
                r = decode_once(llm, b, 32, 8, 128, seed=rep)
                tok_s[overlap].append(r["tok_s"])
                tokens[overlap] = r["tokens"]
            same = same and tokens[False] == tokens[True]
        row = {"preset": preset, "layers": layers, "backend": backend, "batch": b,
               "sync_tok_s": statistics.median(tok_s[False]), "async_tok_s": statistics.median(tok_s[True]),
               "sync_all": tok_s[False], "async_all": tok_s[True], "tokens_equal": same}
        row["speedup"] = row["async_tok_s"] / row["sync_tok_s"]
        rows.append(row)
        print(json.dumps(row), flush=True)
    with open(out, "w") as f:
        json.dump({"command": "python " + " ".join(sys.argv), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
