"""GLM-5.3-Flash (random weights, N layers, slots at 50%) through the offline engine with the shapes of
scripts/prefix_cache_h200.sh's multi-turn rows, to explain two things those rows showed:

1. compiles: which Triton kernels compile (or load a new specialization) after the engine started, per
   phase of multi-turn traffic with the prefix cache on (Triton's jit_cache_hook sees every kernel,
   fla-core's autotuning included), with each phase's engine step time and large-step time;
2. batch against alone, cache off: each request's greedy tokens in a batch of B against the same request
   alone; where they differ, the alone run's top-1 minus top-2 logprob gap at the first differing token
   against how far the chosen tokens' logprobs moved before it (rounding when the gap is within twice
   that movement, as bench decode judges a flip).

    python scripts/glm_serving_probe.py [--layers 4] [--batch 32] [--alone 12] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--alone", type=int, default=12)
    ap.add_argument("--chunk", type=int, default=8192)
    ap.add_argument("--preset", default="glm-5.3-flash")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--system", type=int, default=4096, help="tokens of the shared system prompt")
    ap.add_argument("--tail", type=int, default=512, help="new tokens of each turn")
    ap.add_argument("--out")
    args = ap.parse_args()
    if min(args.layers, args.batch, args.chunk, args.system, args.tail) < 1 or not 0 <= args.alone <= args.batch:
        ap.error("--layers, --batch, --chunk, --system, --tail take positive integers; --alone 0 to --batch")
    if args.device not in ("cuda", "cpu"):
        ap.error(f"--device {args.device}: cuda or cpu")
    if args.out and not os.path.isdir(os.path.dirname(os.path.abspath(args.out))):
        ap.error(f"--out {args.out}: not a file path in an existing directory")

    from triton import knobs

    from moetier.checkpoint.random_bed import RandomModel
    from moetier.engine.llm import LLM
    from moetier.sampling_params import SamplingParams

    seen: list[str] = []

    def hook(*a, **k):
        fn = k.get("fn")
        name = getattr(fn, "name", None) or str(k.get("repr", "")).split("[")[0]
        seen.append(str(name).rsplit(".", 1)[-1])
        return False

    knobs.runtime.jit_cache_hook = hook
    g = torch.Generator().manual_seed(0)

    random = RandomModel(args.preset, layers=args.layers, backend="slots", budget=0.5)
    vocab = 0

    def rand(n: int) -> list[int]:
        return torch.randint(10, vocab - 10, (n,), generator=g).tolist()

    def engine(cache: bool) -> tuple[LLM, float, list[str]]:
        seen.clear()
        t = time.perf_counter()
        llm = LLM.from_random(random, "bfloat16", args.device, kv_tokens=131072, max_num_tokens=args.chunk,
                              max_num_seqs=64, enable_prefix_caching=cache)
        return llm, time.perf_counter() - t, sorted(set(seen))

    from moetier.bench.common import command, provenance

    record: dict = {"command": command()[0], "provenance": provenance(), "args": vars(args)}
    llm, up, startup = engine(True)
    record["startup"] = {"s": up, "compiled": startup, "compiles": len(startup)}
    vocab = llm.model.cfg.vocab_size
    system = rand(args.system)
    phases = []
    greedy = SamplingParams(max_tokens=64, ignore_eos=True, logprobs=2)

    def phase(name: str, prompts: list[list[int]]):
        before = llm.metrics()
        seen.clear()
        t = time.perf_counter()
        outs = llm.generate(prompts, greedy)
        if args.device == "cuda":
            torch.cuda.synchronize()
        wall = time.perf_counter() - t
        after = llm.metrics()
        d = {k: after.get(k, 0) - before.get(k, 0) for k in ("steps", "large_steps", "step_seconds",
                                                             "large_step_seconds", "prefix_cache_hits")}
        phases.append({"phase": name, "requests": len(prompts), "s": round(wall, 3), **d,
                       "compiles": len(seen), "compiled": sorted(set(seen))})
        print(f"{name:28s} {wall:7.2f} s  steps {d['steps']:4.0f} large {d['large_steps']:3.0f} "
              f"({d['large_step_seconds']:.2f} s)  compiles {len(seen)} {sorted(set(seen))}", flush=True)
        return outs

    phase("warm-up: 2 conversations", [system + rand(args.tail) for _ in range(2)])
    for n in (16, 48):
        first = [system + rand(args.tail) for _ in range(n)]
        outs = phase(f"turn 1, {n} at once", first)
        phase(f"turn 2, {n} at once", [p + o.outputs[0].token_ids + rand(args.tail) for p, o in zip(first, outs)])
    record["phases"] = phases
    llm.close()
    if not args.alone:
        return dump(record, args.out)

    llm, _, _ = engine(False)  # batch against alone with the cache off: no hit changes a chunking
    prompts = [system[: args.system // 4 + 97 * i] + rand(args.tail) for i in range(args.batch)]
    batch = llm.generate(prompts, greedy)
    rows = []
    for i in range(args.alone):
        a = llm.generate([prompts[i]], greedy)[0].outputs[0]
        b = batch[i].outputs[0]
        row = {"request": i, "prompt": len(prompts[i]), "equal": a.token_ids == b.token_ids}
        diff = next((j for j, (x, y) in enumerate(zip(a.token_ids, b.token_ids)) if x != y), None)
        upto = len(a.token_ids) if diff is None else diff
        moved = max((abs(a.logprobs[j][0] - b.logprobs[j][0]) for j in range(upto)), default=0.0)
        row["moved_before"] = moved
        if diff is not None:
            top = sorted((lp for _, lp in a.logprobs[diff][1]), reverse=True)
            gap = top[0] - top[1] if len(top) > 1 else float("inf")
            row.update(first_diff=diff, gap=gap, rounding=gap <= 2 * moved)
        rows.append(row)
        print(row, flush=True)
    record["batch_vs_alone"] = rows
    llm.close()
    differ = [r for r in rows if not r["equal"]]
    print(f"batch {args.batch} vs alone: {len(differ)} of {len(rows)} differ; "
          f"rounding at the first difference: {sum(r['rounding'] for r in differ)} of {len(differ)}; "
          f"largest logprob movement before a difference (or over 64 tokens): "
          f"{max(r['moved_before'] for r in rows):.3g}")
    dump(record, args.out)


def dump(record: dict, path: str | None) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(record, f, indent=1)


if __name__ == "__main__":
    main()
