"""Rank 0's wall time per step in the step record's send (DistributedRunner.broadcast_s), for each
step_record_group, over a 2-rank CPU engine on a `tiny` checkpoint (docs/parallel.md, "The records'
channel"). `moetier bench decode --parallel` is CUDA-only, hence this script.

    python scripts/bench_step_records.py [--groups world,gloo,pipe] [--tokens 64] [--batch 1] [--repeat 3]

Each run: a fresh engine (EP 2, gloo collectives), one warm-up generate, then `batch` greedy requests
of `tokens` tokens; prints per group the median over repeats of ms per step and the decode tok/s.
NOTE: CPU figures: on GPUs "world" is NCCL, whose cost (device copies, host reads) this cannot show.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path


def one_run(ckpt: Path, group: str, tokens: int, batch: int) -> tuple[float, float]:
    from moetier.engine.llm import LLM
    from moetier.sampling_params import SamplingParams

    llm = LLM(ckpt, device="cpu", expert_parallel_size=2, step_record_group=group, kv_tokens=4096,
              page_size=16, max_num_seqs=max(8, batch), dist_timeout_s=60.0)
    try:
        params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
        prompts = [[5 + i, 17, 99, 3, 250, 41, 7, 300] for i in range(batch)]
        llm.generate(prompts[:1], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
        sent = (llm.runner.broadcast_s, llm.runner.broadcasts)
        t0 = time.perf_counter()
        llm.generate(prompts, params)
        wall = time.perf_counter() - t0
        ms = (llm.runner.broadcast_s - sent[0]) * 1e3 / max(1, llm.runner.broadcasts - sent[1])
        return ms, batch * tokens / wall
    finally:
        llm.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--groups", default="world,gloo,pipe")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    from moetier.checkpoint.writer import make_checkpoint
    from moetier.engine.config import STEP_RECORD_GROUPS

    groups = [g.strip() for g in args.groups.split(",") if g.strip()]
    bad = [f"--groups {args.groups!r}: choose from {', '.join(STEP_RECORD_GROUPS)}"] * (
        not groups or bool(set(groups) - set(STEP_RECORD_GROUPS)))
    bad += [f"{name} must be at least 1, got {v}" for name, v in
            (("--tokens", args.tokens), ("--batch", args.batch), ("--repeat", args.repeat)) if v < 1]
    if bad:  # one line and exit code 2, as the CLI's refusals
        print(f"error: {bad[0]}", file=sys.stderr)
        sys.exit(2)

    with tempfile.TemporaryDirectory() as tmp:
        ckpt = make_checkpoint(Path(tmp) / "tiny", "tiny", seed=1, dtype="float32")
        for group in groups:
            runs = [one_run(ckpt, group, args.tokens, args.batch) for _ in range(args.repeat)]
            ms = [r[0] for r in runs]
            print(f"{group:6s} record {statistics.median(ms):.3f} ms/step (runs {', '.join(f'{m:.3f}' for m in ms)})  "
                  f"decode {statistics.median(r[1] for r in runs):.1f} tok/s  batch {args.batch}")


if __name__ == "__main__":
    main()
