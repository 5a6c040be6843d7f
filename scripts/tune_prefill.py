"""Times the large-step grouped expert GEMM (grouped_gemm.grouped_expert_mlp_large) on the GPU over a
sweep of block sizes (and pipeline stages), for T tokens of one layer of a preset's expert shape (bf16,
resident rows; routing from the qwen3-30b-like trace for qwen3-30b-a3b, else a glm-5.3-like synthetic
trace of the shape's experts), against the FLOP and byte floors. Kernel by kernel, as
tune_experts.py: gate_up's blocks (and the chunk's block_m, which both kernels share) with the
default down, then down's with the best gate_up; every time is the whole layer (plan, both GEMMs,
combine), eager, median of 10. The default GemmConfig is timed first, each config once.

    python scripts/tune_prefill.py [OUT.json] [--preset qwen3-30b-a3b] [--tokens 512,2048]

GLM-5.3-Flash's shape (--preset glm-5.3-flash: 288 experts of 48 MiB, top-8) at 2,048 tokens gives
each expert about 57 pairs: a step that reads every expert once, bound by HBM, not by the FLOPs.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path

import torch

from moetier.bench.common import GB, record, time_eager
from moetier.experts.kernels.gemm_config import GemmConfig
from moetier.experts.kernels.grouped_gemm_large import grouped_expert_mlp_large
from moetier.experts.shape import RowLayout
from moetier.presets import moe_shape
from moetier.traces.format import read_trace
from moetier.traces.synth import preset_params, synthesize

# (large_block_m, BLOCK_N, BLOCK_K, warps, stages) for gate_up; stages None: Triton's default. gate_up
# holds two [block_m, BLOCK_N] float32 accumulators (gate and up), down one: down takes wider tiles.
SWEEP = [(64, 64, 64, 4, None), (64, 128, 64, 4, None), (64, 64, 128, 4, None), (64, 128, 64, 8, None),
         (128, 64, 64, 8, None), (128, 128, 64, 8, None), (32, 64, 64, 4, None), (128, 64, 32, 4, None),
         (64, 128, 64, 8, 2), (64, 128, 64, 8, 4), (64, 64, 64, 8, 4), (128, 128, 64, 8, 4), (64, 256, 64, 8, 3),
         (32, 128, 128, 4, 3), (128, 128, 64, 8, 3), (128, 64, 64, 4, 3)]
# (BLOCK_N, BLOCK_K, warps, stages) for down, at the block_m gate_up chose
DOWN_SWEEP = [(128, 64, 4, None), (128, 64, 8, None), (256, 64, 8, None), (256, 64, 8, 3), (128, 64, 8, 3),
              (128, 64, 8, 4), (256, 32, 8, 4), (128, 128, 8, 3), (64, 128, 4, 3), (256, 64, 4, 3)]


def blocks(bn: int, bk: int, nw: int, st: int | None) -> tuple[int, ...]:
    """A GemmConfig block entry: (BLOCK_N, BLOCK_K, warps[, stages])."""
    return (bn, bk, nw) if st is None else (bn, bk, nw, st)


def routing(preset: str, experts: int, top_k: int, tokens: int):
    if preset == "qwen3-30b-a3b":
        return read_trace(Path(__file__).parents[1] / "data" / "traces" / "qwen3-30b-like.mtrace").ids[:tokens, 0]
    return synthesize(preset_params("glm-5.3-like", experts=experts, top_k=top_k, layers=1, tokens=tokens))[:, 0]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", nargs="?")
    ap.add_argument("--preset", default="qwen3-30b-a3b")
    ap.add_argument("--tokens", default="512,2048", help="comma list of step sizes")
    a = ap.parse_args(argv)
    try:
        sizes = [int(t) for t in a.tokens.split(",")]
    except ValueError:
        ap.error(f"--tokens {a.tokens!r}: give a comma list of whole token counts, e.g. 512,2048")
    if any(t < 1 for t in sizes):
        ap.error(f"--tokens {a.tokens}: every step size must be at least 1 token")
    if a.out and not Path(a.out).parent.is_dir():
        ap.error(f"OUT {a.out}: not a file path in an existing directory")
    try:
        s = moe_shape(a.preset)
    except Exception as exc:  # an unknown preset: the presets' own message
        ap.error(f"--preset {a.preset}: {exc}")
    if not torch.cuda.is_available():
        ap.error("this sweep times CUDA kernels; no CUDA device is visible")
    out = a.out
    h, i, e, k = s.hidden, s.inter, s.num_experts, s.top_k
    layout = RowLayout(h, i)
    rows = (torch.randn(e, layout.numel, device="cuda") * 0.02).to(torch.bfloat16)
    results = []
    default = GemmConfig()
    for t in sizes:
        ids = torch.as_tensor(routing(a.preset, e, k, t).astype("int64")).cuda()
        x = torch.randn(t, h, device="cuda").to(torch.bfloat16)
        w = torch.rand(t, k, device="cuda").to(torch.bfloat16)
        distinct = int(ids.unique().numel())
        flops = 2 * t * k * 3 * h * i

        def timed(kernel: str, cfg: GemmConfig) -> float:
            try:
                ms = time_eager(lambda: grouped_expert_mlp_large(x, ids.int(), ids, w, rows, rows, h, i, e, cfg),
                                reps=10)
            except Exception as exc:  # a config Triton cannot compile
                print(f"T={t} {kernel} {cfg}: {type(exc).__name__}: {str(exc)[:100]}")
                return float("inf")
            r = {"preset": a.preset, "tokens": t, "kernel": kernel, "block_m": cfg.large_block_m,
                 "gate_up": list(cfg.large_gate_up), "down": list(cfg.large_down), "ms": ms,
                 "tflops": flops / (ms / 1e3) / 1e12, "weights_GBps": distinct * layout.numel * 2 / GB / (ms / 1e3),
                 "distinct_experts": distinct}
            results.append(r)
            print(f"T={t:5d} {kernel:7} bm={cfg.large_block_m:3d} gate_up={cfg.large_gate_up} down={cfg.large_down}: "
                  f"{ms:7.3f} ms  {r['tflops']:6.1f} TFLOP/s  {r['weights_GBps']:7.1f} GB/s of weights", flush=True)
            return ms

        # each config once: the default first, a sweep entry equal to a config already timed is skipped
        trials = [default] + [c for c in (replace(default, large_block_m=bm, large_gate_up=blocks(bn, bk, nw, st))
                                          for bm, bn, bk, nw, st in SWEEP) if c != default]
        times = [timed("gate_up", c) for c in trials]
        base, best_gu = times[0], trials[times.index(min(times))]
        for c in (replace(best_gu, large_down=blocks(*d)) for d in DOWN_SWEEP):
            if c != best_gu:
                timed("down", c)
        win = min((r for r in results if r["tokens"] == t), key=lambda r: r["ms"])
        print(f"T={t}: default {base:.3f} ms; fastest bm={win['block_m']} gate_up={tuple(win['gate_up'])} "
              f"down={tuple(win['down'])} {win['ms']:.3f} ms ({base / win['ms']:.2f}x)")
    if out:
        Path(out).write_text(json.dumps(record("tune-prefill", {"results": results}), indent=1) + "\n")


if __name__ == "__main__":
    main()
