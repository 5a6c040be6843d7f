"""`moetier bench batch`: N requests one after another against the same N as one continuous batch,
on the same engine, same weights and same prompts. Works on the CPU and on CUDA."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from moetier.bench.common import record
from moetier.engine.llm import LLM
from moetier.sampling_params import SamplingParams


def workload(n: int, prompt_len: int, max_tokens: int, vocab: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, vocab, (int(torch.randint(prompt_len // 2, prompt_len + 1, (1,), generator=g)),),
                             generator=g).tolist() for _ in range(n)]
    return prompts, [SamplingParams(max_tokens=max_tokens, ignore_eos=True) for _ in range(n)]


def run(llm: LLM, n: int, prompt_len: int, max_tokens: int, seed: int = 0, plan=None,
        progress: Callable[[str], None] = lambda text: None) -> dict:
    """llm: loaded by engine/startup.plan_then_load; plan: its memory plan, recorded.
    progress: told each phase (and each quarter of the requests one after another), one short line each."""
    prompts, params = workload(n, prompt_len, max_tokens, llm.tokenizer.vocab_size, seed)
    progress("warm-up")
    llm.generate(prompts[:2], params[:2])  # warm-up: first-call costs stay out of the figures

    t0 = time.perf_counter()
    alone = []
    for i, (p, sp) in enumerate(zip(prompts, params)):
        if i % max(1, n // 4) == 0:
            progress(f"one after another: request {i + 1} of {n}")
        alone.append(llm.generate([p], sp)[0])
    t_alone = time.perf_counter() - t0
    steps0 = llm.steps
    progress(f"continuous batch: {n} requests at once")
    t0 = time.perf_counter()
    batch = llm.generate(prompts, params)
    t_batch = time.perf_counter() - t0
    out_tokens = sum(len(o.outputs[0].token_ids) for o in batch)
    same = [a.outputs[0].token_ids for a in alone] == [b.outputs[0].token_ids for b in batch]
    return record("batch", {
        "model": str(llm.model_dir), "device": str(llm.model.device),
        "expert_backend": plan.backend if plan is not None else None,
        "requests": n, "prompt_tokens": sum(len(p) for p in prompts), "output_tokens": out_tokens,
        "one_by_one_s": t_alone, "batched_s": t_batch, "speedup": t_alone / t_batch,
        "one_by_one_tok_per_s": out_tokens / t_alone, "batched_tok_per_s": out_tokens / t_batch,
        "batched_steps": llm.steps - steps0, "greedy_tokens_identical": same,
        "plan": plan.as_dict() if plan is not None else None, "audit": llm.audits,
    })


def table(d: dict) -> str:
    return (f"{d['requests']} requests, {d['prompt_tokens']} prompt and {d['output_tokens']} output tokens on "
            f"{d['device']} ({d['expert_backend']}):\n"
            f"  one after another  {d['one_by_one_s']:8.2f} s  {d['one_by_one_tok_per_s']:8.1f} output tok/s\n"
            f"  continuous batch   {d['batched_s']:8.2f} s  {d['batched_tok_per_s']:8.1f} output tok/s  "
            f"({d['batched_steps']} steps)\n"
            f"  speedup {d['speedup']:.2f}x; greedy tokens identical: {d['greedy_tokens_identical']}")
