"""The cost side of speculative decoding on random weights (issue 35): decode step time against the
number of verified drafts k, with routing replayed from a trace, per expert backend. Random weights
accept nothing, so acceptance is not measured here: every step of a k row verifies exactly k drafts
(a forced drafter: the request's last token repeated), and the speedup a row implies at a stated
acceptance length A (field report 002: 2.37-2.57 with 3 MTP drafts) is

    implied = (A / step_ms(k)) / (1 / step_ms(0, graphs))     labelled "implied at A", never measured

Every row runs with CUDA graphs on: k = 0 replays the decode graphs (what the engine ships without
speculation), k > 0 the verify graphs (engine/verify_graphs.py; graph_steps counts the replays). The
k values of --eager-k are measured again with graphs off (default k = 0: what an eager step costs
over a replay). Each step routes k + 1 fresh
trace rows: the engine's rewind of the rows of rejected drafts (traces/hooks.Replayer.rewind: the
next step routes those positions again, as a run without speculation would) is turned off here,
because a rejected draft's position gets a new token whose routing the trace cannot know, and routing
the same rows again would fill the slots for the next step in advance. So each row's greedy tokens
are not compared across k: the routing differs between rows by design.

    python scripts/spec_verify_cost.py --preset qwen3-30b-a3b --layers 8 --trace q.mtrace \
        --backends resident,slots --budget 0.5 --batch 1,8 --k 0,1,2,3 --eager-k 0 --out spec-cost.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from moetier.checkpoint.random_bed import random_bed, use_backend
from moetier.engine.config import EngineConfig
from moetier.engine.llm import LLM
from moetier.presets import preset
from moetier.sampling_params import SamplingParams


def forced(llm: LLM) -> None:
    spec = llm.scheduler.spec
    spec.drafts = lambda req, budget: [req.output_ids[-1]] * spec.k_for(req, budget)
    llm.replayer.rewind = lambda rows: None  # k + 1 fresh trace rows a step (the module docstring)


def row(bed, trace: str, backend: str, budget: float, batch: int, k: int, graphs: bool, args) -> dict:
    slots = use_backend(bed, backend, budget, "lfru", args.decode_tokens)
    spec = {"method": "ngram", "num_speculative_tokens": k, "expert_aware_k": False} if k else None
    most = (args.warmup + args.tokens) * (k + 1) + 2  # output tokens: never reached (drafts rarely kept)
    config = EngineConfig(replay_trace=trace, max_num_seqs=batch, decode_tokens=args.decode_tokens,
                          max_num_tokens=max(512, batch * args.prompt_len),
                          kv_tokens=batch * (args.prompt_len + most + 16),
                          cuda_graphs=graphs, speculative_config=spec, enable_prefix_caching=False)
    llm = LLM.from_model(bed.model, bed.tokenizer, config)
    if k:
        forced(llm)
    try:
        g = torch.Generator().manual_seed(0)
        prompts = torch.randint(0, bed.tokenizer.vocab_size, (batch, args.prompt_len), generator=g).tolist()
        reqs = [llm.scheduler.requests[llm.add_request(p, SamplingParams(max_tokens=most, ignore_eos=True))]
                for p in prompts]
        for _ in range(args.warmup):
            llm.step()
        times = []
        for _ in range(args.tokens):
            if bed.model.device.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            llm.step()  # its tokens were read back: the step is complete
            times.append(time.perf_counter() - t0)
        st = llm.metrics()
        for r in reqs:
            llm.abort(r.id)
    finally:
        llm.close()
    ms = statistics.median(times) * 1e3
    return {"backend": backend, "budget": budget if backend != "resident" else None, "slots": slots,
            "batch": batch, "k": k, "graphs": graphs, "graph_steps": llm.runner.graph_steps,
            "verify_graph_steps": llm.runner.verify_graph_steps, "step_ms_median": ms,
            "step_ms_min": min(times) * 1e3, "step_ms_max": max(times) * 1e3, "steps": len(times),
            "verified_tokens_per_step": batch * (k + 1), "expert_hit_rate": st["expert_hit_rate"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", required=True)
    p.add_argument("--layers", type=int)
    p.add_argument("--trace", required=True)
    p.add_argument("--backends", default="resident,slots")
    p.add_argument("--budget", type=float, default=0.5)
    p.add_argument("--batch", default="1,8")
    p.add_argument("--k", default="0,1,2,3", help="k values run with CUDA graphs (the first must be 0)")
    p.add_argument("--eager-k", default="0", help="k values run again with graphs off")
    p.add_argument("--acceptance-length", type=float, default=2.4, help="A: the implied speedup's assumption")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--warmup", type=int, default=8)
    p.add_argument("--tokens", type=int, default=24)
    p.add_argument("--decode-tokens", type=int, default=64)
    p.add_argument("--device", default="cuda", help="cpu: a smoke run of the script itself (no figure)")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    bed = random_bed(preset(args.preset, args.layers, str(dtype).removeprefix("torch.")), 0, args.device, dtype)
    rows = []
    for backend in args.backends.split(","):
        for b in map(int, args.batch.split(",")):
            runs = [(k, True) for k in map(int, args.k.split(","))] + [(k, False) for k in map(int, args.eager_k.split(","))]
            got = [row(bed, args.trace, backend, args.budget, b, k, graphs, args) for k, graphs in runs]
            rows += got
            base = got[0]["step_ms_median"]  # k = 0 with graphs: the first of --k
            for r in got:
                if r["k"] + 1 >= args.acceptance_length:
                    r[f"implied_speedup_at_A{args.acceptance_length}"] = args.acceptance_length / r["step_ms_median"] * base
                print(json.dumps({x: r[x] for x in r if x not in ("slots",)}), flush=True)
    with open(args.out, "w") as f:
        json.dump({"args": vars(args), "rows": rows, "note": "implied speedups assume the stated acceptance length; "
                   "random weights accept nothing, so none is measured"}, f, indent=2)


if __name__ == "__main__":
    main()
