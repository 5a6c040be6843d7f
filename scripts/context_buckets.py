"""Decode with and without the decode graphs' context buckets (engine/graphs.py): an indexer model
(GLM-5.3-Flash or GLM-5, cut to a few layers, random weights, resident experts, replayed routing) whose
engine admits long requests (max_model_len, so the page table is wide) decodes short contexts. With one
bucket (the whole width) every indexed layer scores every key of the table each step; with buckets it
scores the narrowest bucket that holds the batch. Both runs in one process, alternated; greedy tokens
checked equal; the step's median wall time and its graph replay (bench/decode_steps.replay_ms).

    python scripts/context_buckets.py OUT.json [--preset glm-5.3-flash] [--layers 4] [--batch 1 --batch 8]
        [--model-len 131072] [--prompt-len 512] [--steps 32] [--rounds 2]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from moetier.bench.decode_steps import replay_ms
from moetier.checkpoint.random_bed import random_bed, use_backend
from moetier.engine import LLM, EngineConfig
from moetier.engine import graphs as graphs_mod
from moetier.plan.residents import BUCKET_TOKENS
from moetier.presets import preset
from moetier.sampling_params import SamplingParams
from moetier.traces.format import write_trace
from moetier.traces.synth import SynthParams, meta_of, synthesize


def run(bed, trace: str, batch: int, args, buckets: bool) -> dict:
    # without buckets: a first bucket wider than any table, so the whole width only
    graphs_mod.BUCKET_TOKENS = BUCKET_TOKENS if buckets else 1 << 62
    config = EngineConfig(replay_trace=trace, max_num_seqs=batch, max_model_len=args.model_len,
                          kv_tokens=args.model_len + batch * (args.prompt_len + args.steps + 32),
                          enable_prefix_caching=False)
    llm = LLM.from_model(bed.model, bed.tokenizer, config)
    try:
        g = torch.Generator().manual_seed(0)
        prompts = torch.randint(0, bed.cfg.vocab_size, (batch, args.prompt_len), generator=g).tolist()
        params = SamplingParams(max_tokens=args.steps + 8, ignore_eos=True)
        ids = [llm.add_request(p, params) for p in prompts]
        tokens: dict[str, list[int]] = {}
        while len(tokens) < batch or min(len(t) for t in tokens.values()) < 8:  # prefills, first decode steps
            tokens.update({o.request_id: list(o.outputs[0].token_ids) for o in llm.step()})
        torch.cuda.synchronize()
        walls = []
        while llm.has_unfinished():
            t0 = time.perf_counter()
            outs = llm.step()
            walls.append((time.perf_counter() - t0) * 1e3)
            tokens.update({o.request_id: list(o.outputs[0].token_ids) for o in outs})
        graphs = llm.runner.graphs
        return {"buckets": list(graphs.buckets), "width_used": graphs.replayed(batch).width,
                "step_ms_median": statistics.median(walls), "step_ms": walls,
                "replay_ms": replay_ms(llm, batch), "tokens": [tokens.get(i) for i in ids]}
    finally:
        llm.close()


def positive(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out")
    ap.add_argument("--preset", default="glm-5.3-flash")
    ap.add_argument("--layers", type=positive, default=4)
    ap.add_argument("--batch", type=positive, action="append")
    ap.add_argument("--model-len", type=positive, default=131072)
    ap.add_argument("--prompt-len", type=positive, default=512)
    ap.add_argument("--steps", type=positive, default=32)
    ap.add_argument("--rounds", type=positive, default=2)
    args = ap.parse_args()
    if not Path(args.out).parent.is_dir() or Path(args.out).is_dir():
        ap.error(f"OUT {args.out}: not a file path in an existing directory")
    if args.prompt_len + args.steps + 8 > args.model_len:
        ap.error(f"--prompt-len {args.prompt_len} + --steps {args.steps} + 8 exceeds --model-len {args.model_len}")
    if not torch.cuda.is_available():
        raise SystemExit("error: context buckets are a property of the CUDA decode graphs; run on a CUDA machine")
    cfg = preset(args.preset, args.layers, "bfloat16")
    bed = random_bed(cfg, device="cuda")
    use_backend(bed, "resident")
    moe = sum(cfg.is_moe_layer(i) for i in range(cfg.num_layers))
    p = SynthParams(experts=cfg.num_experts, top_k=cfg.top_k, layers=moe, tokens=8192, skew=0.5, seed=7)
    trace = f"/tmp/context-buckets-{args.preset}-{moe}.mtrace"
    write_trace(trace, synthesize(p), meta_of(p))
    rows = []
    for batch in args.batch or [1, 8]:
        runs = {True: [], False: []}
        for _ in range(args.rounds):
            for buckets in (True, False):
                runs[buckets].append(run(bed, trace, batch, args, buckets))
        ref = runs[False][0]["tokens"]
        equal = all(r["tokens"] == ref for rs in runs.values() for r in rs)
        row = {"batch": batch, "tokens_equal": equal}
        for buckets, name in ((True, "buckets"), (False, "whole_width")):
            rs = runs[buckets]
            row[name] = {"buckets": rs[0]["buckets"], "width_used": rs[0]["width_used"],
                         "step_ms_median": [r["step_ms_median"] for r in rs], "replay_ms": [r["replay_ms"] for r in rs]}
        rows.append(row)
        b, w = row["buckets"], row["whole_width"]
        print(f"batch {batch}: step {statistics.median(b['step_ms_median']):.3f} ms with buckets (width "
              f"{b['width_used']} of {b['buckets']} pages), {statistics.median(w['step_ms_median']):.3f} ms at the "
              f"whole width; replay {b['replay_ms']} vs {w['replay_ms']} ms; tokens equal: {equal}", flush=True)
    with open(args.out, "w") as f:
        json.dump({"preset": args.preset, "layers": args.layers, "model_len": args.model_len,
                   "prompt_len": args.prompt_len, "steps": args.steps, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
