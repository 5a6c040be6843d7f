"""One decode run of an engine and what is measured around it: timed greedy steps, the GPU time of
a replayed step, the roofline of a step's bytes, the slot cache warmed to its steady state. The
one-GPU rows (decode.py) and the parallel rows (decode_parallel.py) both run through here."""

from __future__ import annotations

import contextlib
import statistics
import time

import numpy as np
import torch

from moetier.bench.common import GB
from moetier.bench.outputs import KeptLogits
from moetier.checkpoint.random_bed import Bed
from moetier.engine.llm import LLM
from moetier.experts.backends import SlotExperts
from moetier.models.base import CausalLM
from moetier.sampling_params import SamplingParams
from moetier.traces.format import Trace


def distinct_per_step(trace: Trace, start: int, end: int, batch: int) -> float:
    """Mean distinct experts per MoE layer per step when steps read `batch` consecutive trace tokens
    from [start, end) (the replay cursor wraps around the trace)."""
    ids = trace.ids  # [N, L, k]
    n = ids.shape[0]
    counts = []
    for s in range(start, end, batch):
        rows = np.arange(s, s + batch) % n
        step = ids[rows]  # [batch, L, k]
        counts.extend(len(np.unique(step[:, layer])) for layer in range(ids.shape[1]))
    return float(np.mean(counts)) if counts else 0.0


def roofline(bed: Bed, batch: int, step_experts: float, link_experts: float, hbm_GBps: float, link_GBps: float
             ) -> dict:
    """Per step: every dense weight once, each sequence's recurrent state (linear-attention models)
    read and written once, `step_experts` rows per MoE layer from HBM and `link_experts` rows per MoE
    layer across the link. -> bytes, seconds, tok/s."""
    layers = len(bed.host)
    state = 2 * batch * bed.model.kv_spec().state_bytes_per_seq(bed.model.dtype)
    hbm = bed.dense_bytes + state + step_experts * layers * bed.row_bytes
    link = link_experts * layers * bed.row_bytes
    seconds = hbm / (hbm_GBps * GB) + link / (link_GBps * GB)
    return {"hbm_bytes_per_step": hbm, "link_bytes_per_step": link, "roofline_step_ms": seconds * 1e3,
            "roofline_tok_s": batch / seconds}


def decode_once(llm: LLM, batch: int, prompt_len: int, warmup: int, tokens: int, seed: int,
                on_timed=None, keep_logits: bool = False) -> dict:
    """Greedy decode of `batch` random prompts; times the steps after every request has `warmup` tokens
    (on_timed() is called as the timed window opens: the collective timer of parallel rows starts).
    keep_logits: every step's logits of the first requests copied on the device, brought to the host
    after the timed window (bench/outputs.py: the row's output check)."""
    with KeptLogits(llm) if keep_logits else contextlib.nullcontext() as kept:
        r = _decode_once(llm, batch, prompt_len, warmup, tokens, seed, on_timed)
    ids = r.pop("request_ids")
    if keep_logits:
        r["logits"] = kept.per_request(ids, [len(t) for t in r["tokens"]])
    return r


def _decode_once(llm: LLM, batch: int, prompt_len: int, warmup: int, tokens: int, seed: int, on_timed) -> dict:
    g = torch.Generator().manual_seed(seed)
    vocab = llm.tokenizer.vocab_size
    prompts = torch.randint(0, vocab, (batch, prompt_len), generator=g).tolist()
    params = SamplingParams(max_tokens=warmup + tokens, ignore_eos=True)
    reqs = [llm.scheduler.requests[llm.add_request(p, params)] for p in prompts]
    while min(len(r.output_ids) for r in reqs) < warmup:
        llm.step()
    # every rank's counters (one process: a list of one), read before the timed window opens
    stats0, steps0, graphs0 = llm.expert_stats_per_rank(), llm.steps, llm.runner.graph_steps
    cursor0 = int(llm.replayer.cursor) if llm.replayer else 0
    done0 = sum(len(r.output_ids) for r in reqs)
    step_times = []
    if llm.model.device.type == "cuda":
        torch.cuda.synchronize()
    if on_timed is not None:
        on_timed()
    t0 = last = time.perf_counter()
    while llm.has_unfinished():
        llm.step()  # its sampled tokens were read back: the step is complete
        now = time.perf_counter()
        step_times.append(now - last)
        last = now
    seconds = last - t0
    stats1 = llm.expert_stats_per_rank()
    gpu_ms = replay_ms(llm, batch)
    whole_ms = replay_ms(llm, batch, whole=True)  # hybrid: the switch's whole-step graph, alone
    per_rank = [{k: after[k] - before[k] for k in after} for before, after in zip(stats0, stats1)]
    delta = per_rank[0]  # rank 0's: what the roofline and the hit rate of a row are computed from
    made = sum(len(r.output_ids) for r in reqs) - done0
    return {
        "batch": batch, "timed_tokens": made, "timed_steps": llm.steps - steps0,
        "graph_steps": llm.runner.graph_steps - graphs0, "seconds": seconds,
        "tok_s": made / seconds, "step_ms_median": statistics.median(step_times) * 1e3,
        # the slow tail: steps a GC pause, a switch's window read or a probe made longer than the median
        "step_ms_p90": sorted(step_times)[int(0.9 * (len(step_times) - 1))] * 1e3, "step_ms_max": max(step_times) * 1e3,
        "step_ms_mean": seconds / len(step_times) * 1e3,
        "expert_stats": delta, "hit_rate": hit_rate(delta),
        "expert_stats_per_rank": per_rank, "hit_rate_per_rank": [hit_rate(d) for d in per_rank],
        "cursor": [cursor0, int(llm.replayer.cursor) if llm.replayer else 0],
        "gpu_replay_ms": gpu_ms, "gpu_replay_whole_ms": whole_ms,
        "tokens": [r.output_ids for r in reqs], "request_ids": [r.id for r in reqs],
    }


def hit_rate(stats: dict) -> float | None:
    """Hits over lookups (None: no lookup, e.g. resident or uva)."""
    looked = stats["hits"] + stats["misses"] + stats["overflow"]
    return stats["hits"] / looked if looked else None


def step_graph(llm: LLM, batch: int, whole: bool = False):
    """(model graph, greedy sampler graph) of `batch` rows as its last step replayed them (the context
    bucket it used: engine/graphs.py), whole: a hybrid engine's whole-step graph instead of the model's;
    or None: no graphs, no such size (no whole-step graph), or a parallel engine (rank 0 alone cannot
    replay a graph whose all-reduces wait for the other ranks)."""
    graphs = llm.runner.graphs
    if graphs is None or batch not in graphs.sizes or llm.parallel is not None:
        return None
    at = graphs.replayed(batch)
    graph = graphs.whole.get(batch) if whole else at.graph
    return None if graph is None else (graph, at.samplers["greedy"])


@contextlib.contextmanager
def cursor_kept(llm: LLM):
    """The trace replayer's cursor advances inside the graph: put it back, or the next run of this
    engine would route its tokens by other trace rows than the same run of another row's engine (rows
    with and without a whole-step graph replay a different number of times)."""
    cursor = llm.replayer.cursor.clone() if llm.replayer else None
    try:
        yield
    finally:
        if cursor is not None:
            llm.replayer.cursor.copy_(cursor)


def replay_ms(llm: LLM, batch: int, reps: int = 20, whole: bool = False) -> float | None:
    """GPU time of one decode step alone: the step's graphs replayed back to back on the last step's
    inputs. Without a replayed trace the slot cache then only hits; with one, the cursor advances inside
    the graph, so each replay routes the trace's next rows and fills its misses as a real step does.
    Against the step time it splits host from device time.
    whole: a hybrid engine's whole-step graph (what its switch replays when the pieces do not pay; None
    without one), so its GPU time can be held to slots' own graph."""
    graphs = step_graph(llm, batch, whole)
    if graphs is None:
        return None
    graph, sampler = graphs
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with cursor_kept(llm):
        graph.replay()
        start.record()
        for _ in range(reps):
            graph.replay()
            sampler.replay()
        end.record()
        end.synchronize()
    return start.elapsed_time(end) / reps


def kernels_by_name(prof, reps: int) -> list[list]:
    """A torch.profiler run's CUDA kernels by name: [name, launches, us] per rep."""
    by_name: dict[str, list[float]] = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            k = by_name.setdefault(e.name, [0, 0.0])
            k[0] += 1
            k[1] += e.device_time
    return [[n, c / reps, us / reps] for n, (c, us) in by_name.items()]


def replay_kernels(llm: LLM, batch: int, reps: int = 5, rows: int = 25) -> dict | None:
    """The kernels inside one decode step's graph (the same replays as replay_ms, under torch.profiler):
    how many a step launches, the sum of their times, every kernel by name with its launches and time
    per step, and the table of the longest by total time.
    Inside a graph each kernel still costs its launch gap, so a step of many small kernels is slower
    than their sum: the count says how much of the step that is."""
    from torch.profiler import ProfilerActivity, profile

    graphs = step_graph(llm, batch)
    if graphs is None:
        return None
    graph = graphs[0]
    with cursor_kept(llm):
        graph.replay()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(reps):
                graph.replay()
            torch.cuda.synchronize()
    # every kernel of the step, most launched first: [name, launches per step, us per step]
    kernels = sorted(kernels_by_name(prof, reps), key=lambda r: (-r[1], -r[2]))
    return {"kernels_per_step": sum(r[1] for r in kernels), "kernel_ms_per_step": sum(r[2] for r in kernels) / 1e3,
            "kernels": kernels,
            "table": prof.key_averages().table(sort_by="cuda_time_total", row_limit=rows, max_name_column_width=70)}


def warm_all(model: CausalLM) -> None:
    """Slots for every expert: place them all before timing, the cache's steady state (otherwise the
    timed window would still be paying each expert's first fill)."""
    for block in model.moe_blocks():
        b = getattr(block.experts, "inner", block.experts)  # under EP: the rank's own backend
        if isinstance(b, SlotExperts) and b.cache.num_slots == b.cache.num_experts:
            miss = b.cache.warm(list(range(b.cache.num_experts)))
            n = int(miss.count)
            b.slots[miss.slot[:n].long()] = b.host[miss.expert[:n].long().cpu()].to(b.slots.device)


def graph_mode(llm: LLM) -> str:
    g = llm.runner.graphs
    if g is None:
        return "eager"
    return "whole" if not g.piecewise else "auto" if g.switching else "piecewise"
