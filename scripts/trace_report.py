"""The numbers behind docs/traces.md: for every committed trace, routing statistics, hit rate
against slots for each policy (PNG), and LRU against LFRU at a quarter and half of the experts.

    python scripts/trace_report.py data/traces/*.mtrace --out data/traces/report.json --png docs/traces-curves.png
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from moetier.experts.cache.slots import CachePolicy, lfru
from moetier.traces.format import read_trace
from moetier.traces.report import curves
from moetier.traces.simulate import simulate, simulate_policy, token_steps
from moetier.traces.stats import summary


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("traces", nargs="+")
    ap.add_argument("--out", required=True)
    ap.add_argument("--png", required=True)
    ap.add_argument("--tokens", type=int, default=8192, help="Tokens of each trace to use.")
    args = ap.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    report = {}
    fig, axes = plt.subplots(1, len(args.traces), figsize=(5.2 * len(args.traces), 4.0), dpi=110, squeeze=False)
    for ax, path in zip(axes[0], args.traces):
        t = read_trace(path)
        t.ids = t.ids[: args.tokens]
        e, k = t.num_experts, t.top_k
        s = summary(t.ids, e, k)
        policies = {}
        for slots in (e // 4, e // 2):
            policies[slots] = {pol: float(np.mean([simulate(t.layer_ids(i), e, slots, pol, k).hit_rate
                                                   for i in range(t.ids.shape[1])]))
                               for pol in ("lru", "lfu", "lfru", "belady")}
        sweep = {}
        for slots in (e // 4, e // 2):  # LFRU's two parameters, in LRU lifetimes (S / k steps)
            for lives, half in [(0, 0)] + [(w, h) for w in (1, 2, 4, 8) for h in (4, 16, 0)]:
                pol = CachePolicy() if lives == 0 else (lfru(slots, k, lives, half) if half else
                                                        CachePolicy("lfru", lives * max(1, slots // k), 0))
                sweep[f"{slots} slots, weight {lives}, half-life {half or 'none'}"] = float(np.mean(
                    [simulate_policy(token_steps(t.layer_ids(i)), e, slots, pol).hit_rate
                     for i in range(t.ids.shape[1])]))
        grid, hit = curves(t, ["lru", "lfu", "lfru", "belady"])
        name = Path(path).stem
        report[name] = {"tokens": int(t.ids.shape[0]), "experts": e, "top_k": k, "layers": t.ids.shape[1],
                        "coverage90": s["coverage90"], "reuse": s["reuse"], "coverage90_per_layer":
                        s["coverage90_per_layer"], "reuse_per_layer": s["reuse_per_layer"],
                        "policies": policies, "lfru_sweep": sweep, "grid": grid, "curves": hit, "meta": t.meta}
        for pol, rates in hit.items():
            ax.plot(grid, [100 * r for r in rates], marker="o", ms=2.5, label=pol)
        ax.set_title(f"{name} (top-{k} of {e}, {t.ids.shape[0]} tokens)", fontsize=9)
        ax.set_xlabel("slots per layer")
        ax.set_ylabel("hit rate (%)")
        ax.set_ylim(0, 100)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        print(name, json.dumps({k2: v for k2, v in report[name].items() if k2 in ("coverage90", "reuse", "policies")}))
    fig.tight_layout()
    fig.savefig(args.png)
    Path(args.out).write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
