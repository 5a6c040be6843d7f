"""`moetier bench chunk`: the prefill chunk under offload, measured. A long prompt arrives while
requests are decoding; for each chunk size (tokens per engine step, shared by the decodes and the
prompt's chunk) it reports the prompt's time to first token and the inter-token latency the running
decodes see while it prefills, against their latency before it came.

Why it matters: with experts off the GPU a step's link cost is nearly fixed (each missing expert a
chunk routes to crosses once per 64 of its pairs), so larger chunks amortize it over more prompt
tokens, but every step of the prefill is a step the decodes wait for. Same random weights, replayed
routing and slot warm-up as `bench prefill` (prefill.warm_slots).

Per row: the decodes (`streams` requests, 32-token prompts) run alone for `warm` steps (untimed,
then `before` timed steps); the prompt is added and the engine steps until it has its token; each
step's wall time is an inter-token latency of every decode in it (the step reads its sampled tokens
back, so it has finished). The prompt and the decodes are then aborted and the next row starts from
an empty pool with the same routing. --prefill-cache sets what the prompt's chunks do to the slot
cache (experts/prefill/cache_policy.py): the decodes beside them see its effect in their latency.
"""

from __future__ import annotations

import statistics
import time

import torch

from moetier.bench.common import trace_info
from moetier.bench.prefill import warm_slots
from moetier.checkpoint.random_bed import Bed, use_backend
from moetier.engine.config import EngineConfig
from moetier.engine.llm import LLM
from moetier.experts.placement import ExpertOptions
from moetier.experts.registry import backend_kind
from moetier.sampling_params import SamplingParams


def _step_times(llm: LLM, steps: int) -> list[float]:
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        llm.step()
        times.append(time.perf_counter() - t0)
    return times


def one_row(llm: LLM, prompt: list[int], streams: int, before: int, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    vocab = llm.tokenizer.vocab_size
    decodes = [llm.add_request(torch.randint(0, vocab, (32,), generator=g).tolist(),
                               SamplingParams(max_tokens=llm.scheduler.max_model_len - 32, ignore_eos=True))
               for _ in range(streams)]
    _step_times(llm, 8)  # the decodes' prefills and a few decode steps: untimed
    alone = _step_times(llm, before)
    finished: dict[str, bool] = {}
    rid = llm.add_request(prompt, SamplingParams(max_tokens=1, ignore_eos=True))
    t0 = time.perf_counter()
    during = []
    while rid not in finished:
        s = time.perf_counter()
        for out in llm.step():
            if out.finished:
                finished[out.request_id] = True
        during.append(time.perf_counter() - s)
    ttft = time.perf_counter() - t0
    for d in decodes:
        llm.abort(d)
    while llm.has_unfinished():
        llm.step()
    return {"ttft_ms": ttft * 1e3, "prefill_tok_s": len(prompt) / ttft, "steps": len(during),
            "itl_alone_ms": statistics.median(alone) * 1e3 if alone else None,
            "itl_during_median_ms": statistics.median(during) * 1e3, "itl_during_max_ms": max(during) * 1e3,
            "stalled_ms": sum(during) * 1e3}


def run(bed: Bed, trace_path: str, backends: list[tuple[str, float]], chunks: list[int], prompt_len: int,
        streams: int, args: dict) -> dict:
    rows = []
    g = torch.Generator().manual_seed(args["seed"])
    prompt = torch.randint(0, bed.tokenizer.vocab_size, (prompt_len,), generator=g).tolist()
    for backend, budget in backends:
        kind = backend_kind(backend)
        slots = use_backend(bed, backend, budget, args["policy"], args["decode_tokens"])
        for chunk in chunks:
            config = EngineConfig(replay_trace=trace_path, max_num_seqs=streams + 1, max_num_tokens=chunk,
                                  decode_tokens=args["decode_tokens"],
                                  experts=ExpertOptions(prefill=args.get("prefill_cache", "bypass")),
                                  kv_tokens=(streams + 1) * (prompt_len + 2048),
                                  enable_prefix_caching=False)  # the timed prompt ran untimed first
            llm = LLM.from_model(bed.model, bed.tokenizer, config)
            try:
                if kind.cached:
                    warm_slots(bed, trace_path)
                one_row(llm, prompt, streams, args["before"], args["seed"])  # untimed: compile, allocator
                llm.replayer.cursor.zero_()
                if kind.cached:
                    warm_slots(bed, trace_path)
                row = one_row(llm, prompt, streams, args["before"], args["seed"])
            finally:
                llm.close()
            row.update(backend=backend, budget=budget if kind.cached else None, slots=slots, chunk=chunk,
                       prefill_cache=args.get("prefill_cache", "bypass") if kind.cached else None,
                       prompt_len=prompt_len, streams=streams)
            rows.append(row)
            print(table([row]), flush=True)
    c = bed.cfg
    return {"config": {"layers": c.num_layers, "hidden": c.hidden_size, "experts": c.num_experts, "top_k": c.top_k,
                       "moe_inter": c.moe_intermediate_size, "dtype": "bf16"},
            "trace": trace_path, "trace_file": trace_info(trace_path), "args": args, "rows": rows}


def table(rows: list[dict]) -> str:
    out = []
    for r in rows:
        budget = "" if r["budget"] is None else f"{r['budget']:.0%}"
        out.append(f"{r['backend']:>9} {budget:>4} {r.get('prefill_cache') or '':>7} chunk {r['chunk']:>5}  pp{r['prompt_len']}: TTFT "
                   f"{r['ttft_ms']:8.1f} ms ({r['prefill_tok_s']:8.0f} tok/s, {r['steps']:3d} steps)  "
                   f"{r['streams']} decodes: ITL {r['itl_alone_ms']:6.2f} ms alone, "
                   f"{r['itl_during_median_ms']:7.2f} ms median / {r['itl_during_max_ms']:7.2f} ms max during")
    return "\n".join(out)
