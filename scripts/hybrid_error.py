"""Is a hybrid row's logit difference from resident rounding or a defect? One decode step of B
sequences after the same prefill, run eagerly (no graphs) through resident, slots and hybrid over
the same random weights and replayed routing, and compared at the same inputs:

- per MoE layer, the hybrid layer's output against resident's on the SAME input (each layer is fed
  resident's input, so the host kernel's rounding of its share is seen alone, without what earlier
  layers did); and the share of that layer's pairs the host computed;
- the logits' relative error of the whole step (max |d| / max |ref| per sequence, the largest), for
  hybrid, and for a control: resident with every MoE layer's output multiplied by (1 + e * N(0, 1)),
  e = the per-layer error hybrid measured, i.e. a rounding-sized perturbation of the same size. If
  the control moves the logits as much as hybrid does, the depth of the random model amplifies
  rounding; a layer far above bf16's rounding (or a hybrid error far above the control's) is a defect.

    python scripts/hybrid_error.py --layers 8 --layers 48 --batch 8 --out hybrid-error.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from moetier.bench.common import record, write_json
from moetier.checkpoint.random_bed import random_bed, use_backend
from moetier.engine.config import EngineConfig
from moetier.engine.llm import LLM
from moetier.engine.step import SeqStep, StepInput
from moetier.presets import preset
from moetier.sampling_params import SamplingParams

TRACE = "data/traces/qwen3-30b-like.mtrace"


def steps(batch: int, prompt_len: int, vocab: int, page_size: int, seed: int) -> list[StepInput]:
    g = torch.Generator().manual_seed(seed)
    prompts = torch.randint(0, vocab, (batch, prompt_len), generator=g).tolist()
    per = -(-(prompt_len + 1) // page_size)
    pages = [list(range(i * per, (i + 1) * per)) for i in range(batch)]
    p = SamplingParams(temperature=0.0)
    pre = StepInput([SeqStep(f"s{i}", 0, prompts[i], pages[i], True, p, 0, 0) for i in range(batch)])
    nxt = torch.randint(0, vocab, (batch,), generator=g).tolist()
    dec = StepInput([SeqStep(f"s{i}", prompt_len, [nxt[i]], pages[i], True, p, 0, 1) for i in range(batch)])
    return [pre, dec]


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    """max over rows of max |got - ref| / max |ref| (the bench's logits check)."""
    d = (got.float() - ref.float()).abs().amax(-1) / ref.float().abs().amax(-1)
    return float(d.max())


def run_step(bed, backend: str, batch: int, prompt_len: int, seed: int, trace: str | None, feed: dict | None = None,
             noise: float = 0.0, host_options: dict | None = None) -> dict:
    """The decode step's logits, and per MoE layer its input and output (feed: layer -> input to use
    instead of the layer's own, resident's; noise: the control's relative perturbation)."""
    use_backend(bed, backend, 0.5 if backend != "resident" else 1.0, **(host_options or {}))
    cfg = EngineConfig(cuda_graphs=False, replay_trace=trace, max_num_seqs=batch, kv_tokens=batch * (prompt_len + 32),
                       page_size=16)
    llm = LLM.from_model(bed.model, bed.tokenizer, cfg)
    seen, hooks, decoding = {}, [], [False]
    g = torch.Generator(device=bed.model.device).manual_seed(seed + 1)
    for block in bed.model.moe_blocks():
        def pre(mod, args, layer=block.layer):
            if decoding[0] and feed is not None:
                return (feed[layer].to(args[0].dtype),)
        def post(mod, args, out, layer=block.layer):
            if not decoding[0]:
                return None
            seen[layer] = (args[0].detach().clone(), out.detach().clone())
            if noise:
                n = torch.randn(out.shape, generator=g, device=out.device, dtype=torch.float32)
                return (out.float() * (1 + noise * n)).to(out.dtype)
            return None
        hooks += [block.register_forward_pre_hook(pre), block.register_forward_hook(post)]
    try:
        pre_step, dec = steps(batch, prompt_len, bed.tokenizer.vocab_size, 16, seed)
        with torch.inference_mode():
            llm.runner.forward_only(pre_step)
            decoding[0] = True
            logits = llm.model.logits(llm.runner.forward_only(dec)).float().cpu()
        stats = llm.expert_stats_per_rank()[0]
    finally:
        for h in hooks:
            h.remove()
        llm.close()
    return {"logits": logits, "layers": seen, "stats": stats}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, action="append", required=True)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--preset", default="qwen3-30b-a3b")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--host-profile", default=None, help="scripts/bench_cpu_experts.py JSON: the hybrid rows' rates")
    ap.add_argument("--trace", default=TRACE, help="routing to replay ('none': the router's)")
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    trace = None if a.trace == "none" else a.trace
    problems = [f"--{name} must be positive, got {v}" for name, v in
                (("layers", min(a.layers)), ("batch", a.batch), ("prompt-len", a.prompt_len)) if v < 1]
    problems += [f"--{name} {v}: no such file" for name, v in (("trace", trace), ("host-profile", a.host_profile))
                 if v is not None and not Path(v).is_file()]
    if Path(a.out).is_dir() or not Path(a.out).parent.is_dir():
        problems.append(f"--out {a.out}: give a file in an existing directory")
    if a.host_profile and a.device != "cuda":
        problems.append("--host-profile: its rates are fitted at the measured link, which needs --device cuda")
    if a.device == "cuda" and not torch.cuda.is_available():
        problems.append("--device cuda: no CUDA device is visible; use --device cpu")
    if problems:
        print("error: " + "; ".join(problems), file=sys.stderr)
        return 2
    host = {}
    if a.host_profile:  # the rates at this machine's link (CUDA only: --device cpu measures none)
        from moetier.bench.common import links
        from moetier.bench.hybrid_rows import host_options
        bw = {"link_GBps": links()["h2d_copy_engine_GBps"]}
        host = host_options({"host_profile": a.host_profile}, bw)
    rows = []
    for n in a.layers:
        bed = random_bed(preset(a.preset, n, "bfloat16"), a.seed, device=a.device)
        ref = run_step(bed, "resident", a.batch, a.prompt_len, a.seed, trace)
        slots = run_step(bed, "slots", a.batch, a.prompt_len, a.seed, trace)
        feed = {layer: x for layer, (x, _) in ref["layers"].items()}
        hyb_fed = run_step(bed, "hybrid", a.batch, a.prompt_len, a.seed, trace, feed=feed, host_options=host)
        hyb = run_step(bed, "hybrid", a.batch, a.prompt_len, a.seed, trace, host_options=host)
        per_layer = [rel_err(hyb_fed["layers"][layer][1], ref["layers"][layer][1]) for layer in sorted(feed)]
        e = max(per_layer)
        ctrl = run_step(bed, "resident", a.batch, a.prompt_len, a.seed, trace, noise=e)
        st = hyb["stats"]
        row = {"layers": n, "batch": a.batch,
               "slots_logits_rel_err": rel_err(slots["logits"], ref["logits"]),
               "hybrid_layer_rel_err_same_input": per_layer, "hybrid_layer_rel_err_max": e,
               "hybrid_logits_rel_err": rel_err(hyb["logits"], ref["logits"]),
               "control_noise": e, "control_logits_rel_err": rel_err(ctrl["logits"], ref["logits"]),
               "hybrid_host_pairs": st.get("host_pairs", 0), "hybrid_host_experts": st.get("host", 0),
               "greedy_equal": bool(torch.equal(hyb["logits"].argmax(-1), ref["logits"].argmax(-1)))}
        rows.append(row)
        print(f"{n:3d} layers b{a.batch}: slots {row['slots_logits_rel_err']:.2e}  hybrid layer (same input) max "
              f"{e:.2e}  hybrid logits {row['hybrid_logits_rel_err']:.2e}  control (noise {e:.1e}) logits "
              f"{row['control_logits_rel_err']:.2e}  host pairs {row['hybrid_host_pairs']}", flush=True)
        for block in bed.model.moe_blocks():
            block.experts = None
        del bed
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    write_json(a.out, record("hybrid_error", {"rows": rows, "trace": trace}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
