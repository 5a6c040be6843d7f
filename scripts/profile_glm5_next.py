"""Where one decode step of glm5_next goes, part by part: GLM-5.3-Flash (or another glm5_next preset)
cut to N layers, random weights, replayed routing, `batch` requests decoding through the engine.

On CUDA every figure is a CUDA-graph replay (the mode we ship): the whole step is the engine's own
decode graph (bench/decode_steps.replay_ms); each part is captured alone on the inputs it had in one
forward of that step's static batch and replayed alone:

    KDA           the linear-attention layers' attention (projections, conv, fla's recurrent step,
                  gated norm, o_proj)
    MLA+indexer   the indexed layers' attention (projections, kpool selection, latent attention)
    mHC           both blocks' mixing weights (layers/mhc_triton.py) and expands, every layer
    routed        the expert backend of every MoE layer on the step's routed ids (after one run they
                  hit: the all-hit cost; misses are in the whole step, not here)
    LM head       the final norm over the streams' mean, and the logits
    rest          the whole step less the parts: embedding, norms, routers, shared experts, dense
                  MLPs and the gaps between launches

Beside each part its bytes (the weights it reads, KDA's recurrent and conv state read and written per
sequence, the distinct expert rows the step's routing reads) and the HBM time those bytes take at the
device-to-device copy rate measured in the same run: the part's time over that is how far it is from
its roofline (issue 29's KDA target: within 1.5x).

A part alone runs without its neighbours, so the parts need not sum to the step: the rest is shown
as it comes out (negative when the parts overlap less alone than in the step). Then the whole step's
graph under torch.profiler: how many kernels a step launches, the sum of their times (the replay less
that sum is launch gaps) and the longest kernels by total time. On the CPU (a dry run
of the attribution with a tiny preset) the figures are eager wall times instead, and say so.

    python scripts/profile_glm5_next.py [--preset glm-5.3-flash] [--layers 8] [--batch 1]
        [--backend resident|slots] [--budget 0.5] [--dtype bf16|fp8|nvfp4|int4] [--trace FILE] [--out FILE]
        [--part-kernels]

--dtype: the routed experts' format (quant/registry; dense weights stay bf16), as `bench decode --dtype`.

Without --trace, a synthetic trace for the preset's experts (the glm-5.3-like parameters of
`moetier trace synth`) is written to a temporary file.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

from moetier.bench.common import links, time_graph
from moetier.bench.decode_steps import kernels_by_name, replay_kernels, replay_ms
from moetier.checkpoint.random_bed import random_bed, use_backend
from moetier.engine import EngineConfig, LLM
from moetier.layers.kda import KdaAttention
from moetier.layers.mhc import expand, hyper_head
from moetier.layers.norm import rms_norm
from moetier.presets import preset
from moetier.sampling_params import SamplingParams

PARTS = ("KDA", "MLA+indexer", "mHC", "routed experts", "LM head")


def synthetic_trace(cfg, path: Path) -> Path:
    from moetier.traces.format import write_trace
    from moetier.traces.synth import SynthParams, meta_of, synthesize

    moe = sum(cfg.is_moe_layer(i) for i in range(cfg.num_layers))
    p = SynthParams(experts=cfg.num_experts, top_k=cfg.top_k, layers=moe, tokens=4096, skew=0.6, reuse=0.368,
                    window=2, layer_corr=0.2, seed=0)
    write_trace(path, synthesize(p), meta_of(p))
    return path


def timed_ms(fn, cuda: bool, reps: int = 7) -> float:
    if cuda:
        return time_graph(fn, reps=reps)
    fn()  # the CPU dry run: the mean eager wall time after one untimed call
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t0) / reps * 1e3


def step_inputs(llm: LLM, batch: int):
    """(ids, AttnBatch, kv) of the step to profile: the decode graphs' static inputs on CUDA (the last
    step's), else the last eager forward's arguments."""
    graphs = llm.runner.graphs
    if graphs is not None:
        w = graphs.replayed(batch).width  # the context bucket the last replay used
        return graphs.ids[:batch], graphs._batch(batch, w * llm.kv.page_size, w), llm.kv
    model, seen = llm.model, {}
    inner = model.forward

    def forward(ids, b, kv):
        seen["args"] = (ids, b, kv)
        return inner(ids, b, kv)
    model.forward = forward
    llm.step()
    model.forward = inner
    return seen["args"]


def part_kernels(fns: list, reps: int = 3) -> list:
    """The kernels of one part, its closures run eagerly under torch.profiler after a warm call (a
    kernel's time is the same eager as replayed; the gaps are not): [name, launches, us] per call of
    the part, longest first."""
    from torch.profiler import ProfilerActivity, profile

    for f in fns:
        f()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            for f in fns:
                f()
        torch.cuda.synchronize()
    return sorted(([n[:90], c, us] for n, c, us in kernels_by_name(prof, reps)), key=lambda r: -r[2])


def tensor_bytes(module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())


@torch.inference_mode()
def part_closures(model, ids, batch, kv, replayer) -> tuple[dict[str, list], dict[str, int]]:
    """One eager forward of the step with hooks that keep each part's inputs -> part -> closures."""
    parts: dict[str, list] = {p: [] for p in PARTS}
    nbytes = dict.fromkeys(PARTS, 0)
    n = ids.shape[0]
    state = kv.state if hasattr(kv, "state") else None  # one sequence's KDA state of one layer, both tensors
    per_seq = 0 if state is None else (state.conv[0, 0].numel() * state.conv.element_size()
                                       + state.recurrent[0, 0].numel() * state.recurrent.element_size())
    hooks = []
    for layer in model.layers:
        def on_attn(mod, args, layer=layer):
            kept = (args[0].clone(), *args[1:])
            kda = isinstance(mod, KdaAttention)
            parts["KDA" if kda else "MLA+indexer"].append(lambda: mod(*kept))
            nbytes["KDA" if kda else "MLA+indexer"] += tensor_bytes(mod) + (2 * n * per_seq if kda else 0)

        def on_layer(mod, args):
            s = args[0].clone()
            a = torch.randn(s.shape[0], s.shape[2], dtype=s.dtype, device=s.device)

            def mhc():
                for hc in (mod.attn_hc, mod.ffn_hc):
                    post, comb, _ = hc.weights(s)
                    expand(a, post, comb, s)
            parts["mHC"].append(mhc)
            nbytes["mHC"] += tensor_bytes(mod.attn_hc) + tensor_bytes(mod.ffn_hc)
        hooks += [layer.attn.register_forward_pre_hook(on_attn), layer.register_forward_pre_hook(on_layer)]
    for block in model.moe_blocks():
        def on_moe(mod, args):
            x = args[0].clone()
            ids_, w = mod.router(x)
            if mod.route_hook is not None:
                ids_, w = mod.route_hook(mod.layer, ids_, w)
            parts["routed experts"].append(lambda: mod.experts.forward(x, ids_, w))
            nbytes["routed experts"] += int(ids_.unique().numel()) * model.cfg.moe_shape.layout.row_bytes(model.dtype)
        hooks.append(block.register_forward_pre_hook(on_moe))
    cursor = replayer.cursor.clone() if replayer is not None else None
    try:
        hidden = model.forward(ids, batch, kv)
    finally:
        for h in hooks:
            h.remove()
        if cursor is not None:
            replayer.cursor.copy_(cursor)
    streams = torch.randn(hidden.shape[0], model.cfg.hc_mult, hidden.shape[1], dtype=hidden.dtype,
                          device=hidden.device)
    parts["LM head"].append(lambda: model.logits(rms_norm(hyper_head(streams), model.norm, model.cfg.rms_norm_eps)))
    nbytes["LM head"] = model.lm_head.numel() * model.lm_head.element_size()
    return parts, nbytes


def main(argv: list[str]) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="glm-5.3-flash")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--backend", default="resident", choices=("resident", "slots"))
    ap.add_argument("--budget", type=float, default=0.5)
    ap.add_argument("--dtype", default="bf16", help="routed experts: bf16, fp8, nvfp4, int4, ...")
    ap.add_argument("--trace", type=Path)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--part-kernels", action="store_true", help="list each part's kernels (CUDA)")
    a = ap.parse_args(argv)
    cuda = torch.cuda.is_available()
    cfg = preset(a.preset, a.layers, "bfloat16" if cuda else "float32")
    if cfg.model_type != "glm5_next":
        sys.exit(f"error: --preset {a.preset} is {cfg.model_type}; this script profiles glm5_next presets")
    trace = a.trace or synthetic_trace(cfg, Path(tempfile.mkdtemp()) / "routing.mtrace")
    bed = random_bed(cfg, device="cuda" if cuda else "cpu", dtype=torch.bfloat16 if cuda else torch.float32,
                     quant=None if a.dtype == "bf16" else a.dtype)
    use_backend(bed, a.backend, a.budget if a.backend == "slots" else 1.0)
    llm = LLM.from_model(bed.model, bed.tokenizer, EngineConfig(replay_trace=trace, max_num_seqs=max(8, a.batch),
                                                                kv_tokens=max(8, a.batch) * 128))
    for p in torch.randint(0, 400, (a.batch, 32)).tolist():
        llm.add_request(p, SamplingParams(max_tokens=40, ignore_eos=True))
    for _ in range(10):
        llm.step()
    ids, batch, kv = step_inputs(llm, a.batch)
    if cuda:
        torch.cuda.synchronize()
        whole = replay_ms(llm, a.batch)
        kernels = replay_kernels(llm, a.batch)
    else:
        kernels = None
        whole = timed_ms(lambda: bed.model.logits(bed.model.forward(ids, batch, kv)), False)
    parts, nbytes = part_closures(bed.model, ids, batch, kv, llm.replayer)
    ms = {p: sum(timed_ms(f, cuda) for f in fns) for p, fns in parts.items()}
    hbm = links(256 * 2**20)["d2d_GBps"] if cuda else None  # GB/s, read + write, this run
    at_hbm = {p: nbytes[p] / 1e9 / hbm * 1e3 for p in PARTS} if hbm else {}  # ms
    mode = "CUDA graphs" if cuda else "eager on the CPU (a dry run: not a measurement of the GPU)"
    print(f"{a.preset} cut to {a.layers} layers, {a.dtype} experts, "
          f"{a.backend}{f' {a.budget:.0%}' if a.backend == 'slots' else ''}, "
          f"batch {a.batch}, {mode}: whole step {whole:.3f} ms")
    for p in PARTS:
        line = f"  {p:<15} {ms[p]:9.3f} ms  {ms[p] / whole:6.1%}  ({len(parts[p])} calls)  {nbytes[p] / 1e6:9.1f} MB"
        if hbm and at_hbm[p] > 0:
            line += f"  {at_hbm[p]:7.3f} ms at {hbm:.0f} GB/s: {ms[p] / at_hbm[p]:5.2f}x its bytes"
        print(line)
    rest = whole - sum(ms.values())
    print(f"  {'rest':<15} {rest:9.3f} ms  {rest / whole:6.1%}")
    by_part = {p: part_kernels(parts[p]) for p in PARTS} if a.part_kernels and cuda else {}
    for p, rows in by_part.items():
        print(f"{p}: {sum(r[1] for r in rows):.0f} kernels, {sum(r[2] for r in rows):.1f} us (eager, per step)")
        for name, c, us in rows:
            print(f"    {us:8.1f} us  {c:4.0f}x  {name}")
    if kernels:  # the whole step's graph: launches and kernel time (the step less their sum: launch gaps)
        print(f"the step's graph: {kernels['kernels_per_step']:.0f} kernels per step, their times sum to "
              f"{kernels['kernel_ms_per_step']:.3f} ms of the {whole:.3f} ms replay\n{kernels['table']}")
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps({"command": " ".join(["python", "scripts/profile_glm5_next.py", *argv]),
                                     "mode": mode, "whole_ms": whole, "parts_ms": ms, "rest_ms": rest,
                                     "parts_bytes": nbytes, "hbm_GBps": hbm, "parts_ms_at_hbm": at_hbm,
                                     "preset": a.preset, "layers": a.layers, "batch": a.batch, "backend": a.backend, "dtype": a.dtype,
                                     "budget": a.budget if a.backend == "slots" else None,
                                     "trace": str(trace), "part_kernels": by_part,
                                     **({k: kernels[k] for k in ("kernels_per_step", "kernel_ms_per_step", "kernels")}
                                        if kernels else {})}, indent=2) + "\n")


if __name__ == "__main__":
    main(sys.argv[1:])
