"""Counts of next-layer expert prefetch in the engine (experts/prefetch.py) on the embedded model
(tiny-stdlib: real weights, so its routers predict something): per MoE layer the step's own hits,
misses and overflow, and the rows prefetch filled ahead, for prefetch off, router and trace, with the
model's own routing and with the held-out trace replayed. Counts, not speed: which fills leave the
step's critical path and how many rows cross the link in all. Checks every mode's tokens against off.

    python scripts/prefetch_engine_counts.py [--slots 8] [--tokens 80] [--device cpu] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from moetier.bench.common import record
from moetier.engine import LLM
from moetier.experts.placement import ExpertOptions
from moetier.sampling_params import SamplingParams

TRACE = Path(__file__).parents[1] / "data" / "traces" / "tiny-stdlib-heldout.mtrace"
PROMPTS = ["def parse(line):", "class Node:", "import os\n"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--slots", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=80)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    rows, tokens = [], {}
    for routing, trace in (("model", None), ("replayed", TRACE)):
        for mode in ("off", "router", "trace") if trace else ("off", "router"):
            llm = LLM(device=a.device, experts=ExpertOptions("slots", slots=a.slots, prefetch=mode), replay_trace=trace,
                      max_num_seqs=8)
            out = [r.outputs[0].token_ids for r in llm.generate(PROMPTS, SamplingParams(max_tokens=a.tokens,
                                                                                         ignore_eos=True))]
            st = [b.experts.stats() for b in llm.model.moe_blocks()]
            llm.close()
            same = out == tokens.setdefault(routing, out)
            rows.append({"routing": routing, "prefetch": mode, "tokens_equal_off": same,
                         "layers": [{k: s[k] for k in ("hits", "misses", "overflow", "prefetch_fills")} for s in st]})
            cells = "  ".join(f"{s['misses']:4d} miss {s['prefetch_fills']:4d} ahead" for s in st)
            print(f"{routing:8} {mode:6} {cells}  tokens {'= off' if same else 'DIFFER from off'}", flush=True)
    if a.out:
        a.out.write_text(json.dumps(record("prefetch-engine-counts", {"slots": a.slots, "tokens": a.tokens,
                                                                       "prompts": PROMPTS, "rows": rows}), indent=1))


if __name__ == "__main__":
    main()
