"""`moetier bench prefill`: prompt tokens per second through the engine, every expert backend on the
same random weights and the same replayed routing (checkpoint/random_bed.py), with the bounds of
each row measured in the same run.

A row is (backend, expert budget, prompt length, prompts in the batch): the prompts are added at once
with max_tokens 1 and the engine steps until all are done (chunks of --chunk tokens; the one sampled
token per prompt is part of the step that ends its prompt). Untimed first: one prefill of the same
length (kernel compilation, allocator growth); then the median of --reps runs (fewer once the runs
of a row pass 2 s), each with the same routing; a row reports the median run's tok/s and the
spread (min-max) of its runs. Bytes over the link are counted on an untimed repeat
with the same routing (the replay cursor is set back): the large-step kernel reads a host row once
per chunk of up to block_m of its pairs (GemmConfig.large_blocks: larger for steps dense in pairs),
so per step and layer link rows = sum over the experts not in HBM of ceil(pairs / block_m). The
bounds: link bytes / measured host-to-device bandwidth, and max(HBM bytes / measured HBM bandwidth,
FLOPs / measured bf16 matmul rate).

Slots rows run once per prefill cache policy (--prefill-cache: bypass leaves the cache alone, refresh
moves the prompt's most used experts in; experts/prefill/cache_policy.py), each run from the same warm
cache (warm_slots before every prefill). Every row then measures the trade-off in the same run: the
same prompts again with --decode-steps more tokens each, and the first decode steps after their
prefill are timed (CUDA graphs, as served) with the hit rate the cache had over them.

Slots rows under bypass also run once per prefill stream mode (--prefill-stream: uva reads the
misses over the link in the kernel, ring stages them by the copy engine; experts/prefill/ring.py).
A ring row's link rows are the rows the ring copied (each missing expert once per step and layer,
counted by the backends), and the staged rows are read from HBM once per chunk like slots.

Every row's outputs (each prompt's sampled token and its logits, from the untimed logged repeat)
are checked against the first row of the same format, length and batch: resident, or the first slots
row where resident was not asked for (bench/outputs.py).
"""

from __future__ import annotations

import statistics
import time

import numpy as np
import torch

from moetier.bench.common import GB, batch_axes, finish_axis, save_figure, time_eager, trace_info
from moetier.bench.decode import bed_dtype
from moetier.bench.outputs import KeptLogits, References, column, strip
from moetier.checkpoint.random_bed import Bed, use_backend
from moetier.engine.config import EngineConfig
from moetier.engine.llm import LLM
from moetier.experts.backends import SlotExperts
from moetier.experts.kernels.gemm_config import GemmConfig
from moetier.experts.placement import ExpertOptions
from moetier.experts.prefill.ring import RING_DEPTH, RING_GROUP
from moetier.experts.registry import Resident, Slots, Uva, backend_kind
from moetier.sampling_params import SamplingParams


def matmul_tflops(n: int = 8192) -> float:
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    return 2 * n**3 / (time_eager(lambda: a @ b) / 1e3) / 1e12


class RouteLog:
    """Wraps each MoE block's route hook (the replayer) and keeps the ids it returns, per step."""

    def __init__(self, model):
        self.blocks = model.moe_blocks()
        self.ids: list[dict[int, np.ndarray]] = []
        self._orig = {b.layer: b.route_hook for b in self.blocks}
        for b in self.blocks:
            b.route_hook = self._hook

    def _hook(self, layer, ids, weights):
        orig = self._orig[layer]
        if orig is not None:
            ids, weights = orig(layer, ids, weights)
        if layer == self.blocks[0].layer:
            self.ids.append({})
        self.ids[-1][layer] = ids.cpu().numpy()
        return ids, weights

    def close(self) -> None:
        for b in self.blocks:
            b.route_hook = self._orig[b.layer]


def step_rows(log: RouteLog, in_hbm: dict[int, np.ndarray], gemm: GemmConfig) -> tuple[float, float]:
    """Expert rows read over the link and from HBM, summed over the logged steps and layers: a row
    once per chunk of its pairs, the chunk of the step's size (GemmConfig.large_blocks)."""
    link = hbm = 0
    for step in log.ids:
        for layer, ids in step.items():
            experts, pairs = np.unique(ids, return_counts=True)
            chunks = np.ceil(pairs / gemm.large_blocks(ids.size)[0])
            on_gpu = in_hbm[layer][experts]
            link += chunks[~on_gpu].sum()
            hbm += chunks[on_gpu].sum()
    return float(link), float(hbm)


def warm_slots(bed: Bed, trace_path: str) -> None:
    """Decode's steady state: each layer's slots hold the experts the trace uses most in that layer."""
    from moetier.traces.format import read_trace

    trace = read_trace(trace_path)
    bed.model.reset_experts()
    for j, b in enumerate(bed.model.moe_blocks()):
        counts = np.bincount(trace.ids[:, j % trace.ids.shape[1]].reshape(-1), minlength=bed.cfg.num_experts)
        hot = np.argsort(-counts, kind="stable")[: b.experts.cache.num_slots]
        b.experts.cache.warm(hot.tolist())
        idx = b.experts.cache.slot_expert.long().cpu()
        b.experts.slots.copy_(b.experts.host[idx].to(b.experts.slots.device))


def sync(llm: LLM) -> None:
    if llm.model.device.type == "cuda":
        torch.cuda.synchronize()


def decode_after(llm: LLM, prompts: list[list[int]], steps: int) -> dict:
    """The prompts prefilled (untimed), then `steps` decode steps of all of them timed: tok/s, ms per
    step and the experts' hit rate over those steps (None without a cache)."""
    params = SamplingParams(max_tokens=steps + 1, ignore_eos=True)
    ids = {llm.add_request(p, params) for p in prompts}
    first: set[str] = set()
    while first != ids:  # each prompt's first token comes with the step that ends its prefill
        first |= {out.request_id for out in llm.step()}
    before = llm.model.expert_stats()
    sync(llm)
    t0 = time.perf_counter()
    n = 0
    while llm.has_unfinished():
        llm.step()
        n += 1
    seconds = time.perf_counter() - t0
    after = llm.model.expert_stats()
    d = {k: after[k] - before.get(k, 0) for k in ("hits", "misses", "overflow")}
    looked = sum(d.values())
    return {"decode_steps": n, "decode_tok_s": steps * len(prompts) / seconds, "decode_ms_per_step": 1e3 * seconds / n,
            "decode_hit_rate": d["hits"] / looked if looked else None, "decode_misses": d["misses"]}


def prefill_once(llm: LLM, prompts: list[list[int]]) -> float:
    params = SamplingParams(max_tokens=1, ignore_eos=True)
    for p in prompts:
        llm.add_request(p, params)
    sync(llm)
    t0 = time.perf_counter()
    while llm.has_unfinished():
        llm.step()  # reads the sampled tokens back: the step is done
    return time.perf_counter() - t0


def prefill_checked(llm: LLM, prompts: list[list[int]]) -> tuple[list[list[int]], list]:
    """An untimed prefill of the prompts -> (each prompt's sampled token, as a list of one, and the
    logits that chose it: [1, V]), for the row's output check (bench/outputs.py)."""
    params = SamplingParams(max_tokens=1, ignore_eos=True)
    got: dict[str, list[int]] = {}
    with KeptLogits(llm) as kept:
        ids = [llm.add_request(p, params) for p in prompts]
        while llm.has_unfinished():
            got.update({out.request_id: list(out.outputs[0].token_ids) for out in llm.step()})
        tokens = [got[i] for i in ids]
        return tokens, kept.per_request(ids, [len(t) for t in tokens])


def bench_backend(bed: Bed, trace_path: str, backend: str, budget: float, lengths: list[int], batches: list[int],
                  args: dict, bw: dict, prefill: str = "bypass", stream: str = "uva") -> list[dict]:
    cfg, gemm, kind = bed.cfg, GemmConfig(), backend_kind(backend)
    ring = {"ring_group": args.get("ring_group", RING_GROUP), "ring_depth": args.get("ring_depth", RING_DEPTH)}
    slots = use_backend(bed, backend, budget, args["policy"], args["decode_tokens"],
                        **(ring if kind.cached else {}))
    ringed = kind.cached and stream == "ring" and prefill == "bypass"
    steps = args.get("decode_steps", 0)
    # graphs only for the decode after the prefill (prefill steps run eagerly either way)
    config = EngineConfig(replay_trace=trace_path, max_num_seqs=max(batches), max_num_tokens=args["chunk"],
                          decode_tokens=args["decode_tokens"], cuda_graphs=steps > 0,
                          experts=ExpertOptions(prefill=prefill, prefill_stream=stream if kind.cached else "uva"),
                          kv_tokens=max(batches) * (max(lengths) + steps + 16),
                          enable_prefix_caching=False)  # repeats time the same prompts: prefill, not a hit
    llm = LLM.from_model(bed.model, bed.tokenizer, config)
    blocks = bed.model.moe_blocks()

    def warm() -> None:  # every prefill starts from decode's steady state, whatever the last one did
        if kind.cached:
            warm_slots(bed, trace_path)

    warm()
    in_hbm = {b.layer: (np.ones(cfg.num_experts, bool) if not kind.host_store else
                        b.experts.cache.expert_slot.cpu().numpy() >= 0 if isinstance(b.experts, SlotExperts)
                        else np.zeros(cfg.num_experts, bool)) for b in blocks}
    g = torch.Generator().manual_seed(args["seed"])
    layers = len(bed.host)
    rows = []
    try:
        for n in lengths:
            for b in batches:
                prompts = torch.randint(0, bed.tokenizer.vocab_size, (b, n), generator=g).tolist()
                warm()
                prefill_once(llm, prompts)  # untimed: compile, grow the allocator
                cursor = int(llm.replayer.cursor)
                warm()
                times = [prefill_once(llm, prompts)]
                while len(times) < args["reps"] and sum(times) < 2.0:  # the median of up to `reps` runs
                    llm.replayer.cursor.fill_(cursor)
                    warm()
                    times.append(prefill_once(llm, prompts))
                seconds = statistics.median(times)
                after = {}
                if steps:  # the same prompts and routing, then the first decode steps after them
                    llm.replayer.cursor.fill_(cursor)
                    warm()
                    after = decode_after(llm, prompts, steps)
                llm.replayer.cursor.fill_(cursor)  # the same routing again, logged
                warm()
                log = RouteLog(bed.model)
                streamed = ring_rows(blocks)
                sampled, logits = prefill_checked(llm, prompts)
                streamed = ring_rows(blocks) - streamed
                log.close()
                if prefill == "refresh" and kind.cached:
                    # the rows filled, once each, then the experts not in slots after the refresh (exact
                    # when the prompt is one step; a chunked prompt's earlier steps saw earlier slots)
                    now = {b.layer: b.experts.cache.expert_slot.cpu().numpy() >= 0 for b in blocks}
                    link_rows, hbm_rows = step_rows(log, now, gemm)
                    link_rows += bed.model.expert_stats()["refreshed"]
                elif ringed:  # each missing row copied once (the backends' count), then read from HBM
                    link_rows, hbm_rows = step_rows(log, in_hbm, gemm)
                    link_rows, hbm_rows = float(streamed), hbm_rows + link_rows
                else:
                    link_rows, hbm_rows = step_rows(log, in_hbm, gemm)
                tokens = b * n
                link_bytes = link_rows * bed.row_bytes
                hbm_bytes = hbm_rows * bed.row_bytes + len(log.ids) * bed.dense_bytes
                flops = 2 * tokens * (cfg.top_k * 3 * cfg.hidden_size * cfg.moe_intermediate_size * layers
                                      + bed.dense_params)
                link_s = link_bytes / (bw["link_GBps"] * GB)
                work_s = max(hbm_bytes / (bw["hbm_GBps"] * GB), flops / (bw["tflops"] * 1e12))
                rows.append({"backend": backend, "budget": budget if kind.cached else None, "slots": slots,
                             "dtype": bed_dtype(bed),
                             "prefill_cache": prefill if kind.cached else None,
                             "prefill_stream": stream if kind.cached else None,
                             **({"ring": [ring["ring_group"], ring["ring_depth"]]} if ringed else {}), **after,
                             "prompt_len": n, "batch": b, "steps": len(log.ids), "seconds": seconds,
                             "runs_s": times, "runs": len(times),
                             "ms": seconds * 1e3, "tok_s": tokens / seconds,  # the median run's
                             "tok_s_min": tokens / max(times), "tok_s_max": tokens / min(times), "link_bytes": link_bytes,
                             "hbm_bytes": hbm_bytes, "flops": flops,
                             "link_bound_tok_s": tokens / link_s if link_s else None,
                             "work_bound_tok_s": tokens / work_s,
                             "of_link_bound": (tokens / seconds) / (tokens / link_s) if link_s else None,
                             "tokens": sampled, "logits": logits})
    finally:
        llm.close()
    return rows


def ring_rows(blocks) -> int:
    """Rows the slots layers' staging rings have copied (SlotExperts.ring_rows, host counts)."""
    return sum(getattr(b.experts, "ring_rows", 0) for b in blocks)


def run(bed: Bed, trace_path: str, budgets: list[float], lengths: list[int], batches: list[int], backends: list[str],
        args: dict, link: dict, bw: dict | None = None) -> dict:
    """bw: bandwidths and matmul rate already measured (tests on the CPU); else from `link` and a matmul."""
    bw = bw or {"hbm_GBps": link["d2d_GBps"], "link_GBps": link["h2d_copy_engine_GBps"], "tflops": matmul_tflops()}
    policies = args.get("prefill_cache", ["bypass"])
    streams = args.get("prefill_stream", ["uva"])
    plan = [(Resident.name, 1.0, "bypass", "uva")] * (Resident.name in backends)
    # the stream mode matters under bypass only (refresh fills every used expert it can first)
    plan += [(Slots.name, b, p, s) for b in budgets for p in policies for s in (streams if p == "bypass" else ["uva"])
             if Slots.name in backends]
    plan += [(Uva.name, 0.0, "bypass", "uva")] * (Uva.name in backends)
    rows: list[dict] = []
    refs = References()  # the first row of each (format, length, batch): resident, else the first slots row
    for backend, budget, policy, stream in plan:
        for r in bench_backend(bed, trace_path, backend, budget, lengths, batches, args, bw, policy, stream):
            # every backend computes the same pairs with the same kernel: bit-exact by design
            refs.check(r, (r["dtype"], r["prompt_len"], r["batch"]), row_name(r), exact_by_design=True)
            print(table([r]), flush=True)
            rows.append(r)
    c = bed.cfg
    return {"config": {"layers": c.num_layers, "hidden": c.hidden_size, "experts": c.num_experts, "top_k": c.top_k,
                       "moe_inter": c.moe_intermediate_size, "dtype": bed_dtype(bed), "row_bytes": bed.row_bytes,
                       "dense_bytes": bed.dense_bytes, "large_block_m": GemmConfig().large_block_m},
            "trace": trace_path, "trace_file": trace_info(trace_path), "links": link, "bandwidth": bw, "args": args, **refs.summary(rows, row_name),
            "rows": strip(rows)}


def row_name(r: dict) -> str:
    """resident/pp512x1, slots@0.5/bypass/ring/pp512x1, uva/pp512x4; quantized rows end in /fp8, /nvfp4, ...
    (or /fp8-dense, /nvfp4-dense, ...)."""
    # records from before the policy and stream options ran bypass and uva, what the names then say
    policy, stream = r.get("prefill_cache") or "bypass", r.get("prefill_stream") or "uva"
    name = r["backend"] if r["budget"] is None else f"{r['backend']}@{r['budget']}/{policy}/{stream}"
    return f"{name}/pp{r['prompt_len']}x{r['batch']}" + (f"/{r['dtype']}" if str(r.get("dtype")).startswith(("fp8", "nvfp4", "int4")) else "")


def table(rows: list[dict]) -> str:
    out = []
    for r in rows:
        budget = "" if r["budget"] is None else f"{r['budget']:.0%}"
        lb = "-" if r["link_bound_tok_s"] is None else f"{r['link_bound_tok_s']:9.0f}"
        of = "" if r["of_link_bound"] is None else f"{r['of_link_bound']:6.1%} of it"
        policy = r.get("prefill_cache") or ""
        if r.get("prefill_stream") == "ring":
            policy = "ring" + ("" if r.get("ring") is None else "{}x{}".format(*r["ring"]))
        dec = ""
        if r.get("decode_tok_s") is not None:
            hit = "-" if r.get("decode_hit_rate") is None else f"{r['decode_hit_rate']:.1%}"
            dec = f"  then decode {r['decode_tok_s']:8.1f} tok/s, hits {hit:>6}"
        spread = "" if r.get("tok_s_min") is None else f" ({r['tok_s_min']:.0f}-{r['tok_s_max']:.0f} over {r['runs']})"
        out.append(f"{r['backend']:>9} {r.get('dtype', ''):>9} {budget:>4} {policy:>8} pp{r['prompt_len']:<5} x{r['batch']} {r['tok_s']:9.0f} "
                   f"tok/s{spread} {r['ms']:9.1f} ms  link {r['link_bytes'] / GB:7.2f} GB  link bound {lb} tok/s {of:>12}  "
                   f"HBM/compute bound {r['work_bound_tok_s']:9.0f} tok/s{dec}"
                   + (f"  {column(r['check'])}" if r.get("check") else ""))
    return "\n".join(out)


def plot(result: dict, path: str) -> None:
    rows = result["rows"]
    batches = sorted({r["batch"] for r in rows})
    fig, axes = batch_axes(batches)
    for ax, b in zip(axes, batches):
        keys = sorted({(r["backend"], r["budget"], r.get("prefill_cache"), r.get("prefill_stream"), r.get("dtype"))
                       for r in rows if r["batch"] == b}, key=str)
        for backend, budget, policy, stream, dt in keys:
            pts = sorted((r["prompt_len"], r["tok_s"]) for r in rows if r["batch"] == b and r["backend"] == backend
                         and r["budget"] == budget and r.get("prefill_cache") == policy
                         and r.get("prefill_stream") == stream and r.get("dtype") == dt)
            label = backend if budget is None else f"{backend} {budget:.0%} {policy or ''}".rstrip()
            label += " ring" if stream == "ring" else ""
            label += f" {dt}" if dt else ""
            ax.plot([x for x, _ in pts], [y for _, y in pts], "o-", label=label)
        ax.set_xscale("log", base=2)
        finish_axis(ax, "prompt tokens", "prefill tok/s", f"{b} prompt(s) at once")
    c = result["config"]
    save_figure(fig, f"moetier bench prefill: {c['layers']} layers, hidden {c['hidden']}, {c['experts']} experts "
                     f"top-{c['top_k']}, {c.get('dtype', 'bf16')}", path)
