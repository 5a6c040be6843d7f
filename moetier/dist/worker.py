"""A worker rank (1..N-1): load this rank's share of the model, then run every step rank 0 sends.

The step protocol (rank 0's side: dist/executor.py), per step with at least one sequence:
    rank 0:  sends the StepInput on the records' channel (dist/channel.py: broadcast_object_list on
             the world or gloo group, or the same pickled bytes written to each worker's pipe) ->
             every rank runs model.forward on the same tokens, positions and page tables (the
             collectives inside the forward pair up in the same order on every rank) -> rank 0
             alone computes logits and samples
    workers: receive it on the same channel, ModelRunner.run_worker_step(step): the decode
             graph replayed when step.replay says rank 0 replays its own (every rank captured the same
             sizes at start, in lockstep), else the eager forward
    speculative steps (engine/spec_step.py): rank 0 verifies, then sends the verdict (engine/step.
             StepVerdict: the kept tokens) on the same channel inside the step, where the workers need
             it (ModelRunner.shares_verdict: every rank decides alike from the StepInput): they roll
             recurrent state back where a draft was rejected and run the MTP passes with rank 0
    between steps, a query (engine/step.RankQuery, LLM.metrics): rank 0 sends it on the same
             channel, then every rank answers on it (all_gather_object on the group, or its pipe)
    shutdown: rank 0 sends None; workers leave the group and exit. Under "pipe" a worker whose pipe
             reaches EOF (rank 0 died) raises a MoetierError naming rank 0 and exits.
The scheduler and the page pool live on rank 0 only; a worker's KV cache has the same pages (the
page tables arrive in the StepInput) holding its own kv heads. A replayed trace is replayed on every
rank (each its own device-side cursor, advanced by the same steps), so all ranks route alike.

Two executors start this loop: torch.multiprocessing (main(), one machine, rank r on cuda:r) and
Ray actors (dist/ray_executor.py, any node, each actor on the one GPU Ray gave it): both call
run_rank().
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from moetier.checkpoint.random_bed import RandomModel, build_random
from moetier.dist.channel import GroupReceiver, PipeReceiver
from moetier.dist.group import Rendezvous, init_rank, leave, record_group
from moetier.engine.config import EngineConfig
from moetier.experts.placement import ExpertOptions


@dataclass(frozen=True)
class WorkerSpec:
    """Everything a worker needs to build its rank: plain data, pickled into the spawned process."""

    model: Path | RandomModel  # a checkpoint directory, or random weights each rank makes itself
    dtype: str
    device: str  # "cpu" or "cuda"
    config: EngineConfig  # config.experts: where this rank's routed experts live
    rendezvous: Rendezvous
    rank_plans: Any = None  # plan/nodes.RankPlans: each rank's memory share, checked before loading


def main(index: int, spec: WorkerSpec, ends: list | None = None) -> None:
    """Entry point of a spawned worker (torch.multiprocessing passes index 0..N-2: rank index + 1).
    ends: every worker's pipe end under step_record_group "pipe" (start_processes gives all workers
    the same arguments), else None."""
    pipe = None
    if ends is not None:
        pipe = ends[index]
        for i, end in enumerate(ends):
            if i != index:
                end.close()  # NOTE: only its worker may hold a pipe's end, or that worker's death is no EOF
    run_rank(index + 1, spec, index + 1, pipe)


def run_rank(rank: int, spec: WorkerSpec, gpu: int, pipe=None) -> None:
    """Join the group as `rank`, load this rank's share on GPU `gpu` (CUDA; a local index: Ray
    actors see only their own GPU, as 0) or the CPU, and run steps until rank 0 says stop. pipe:
    this worker's end of its step-record pipe (step_record_group "pipe"; executor.Workers)."""
    if spec.device == "cuda":
        torch.cuda.set_device(gpu)
        device = f"cuda:{gpu}"
    else:
        device = spec.device
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // spec.rendezvous.world))
    par = init_rank(spec.rendezvous, spec.config.layout(rank))
    records = record_group(spec.config.step_record_group, spec.rendezvous.timeout_s)
    channel = PipeReceiver(pipe, rank) if pipe is not None else GroupReceiver(records)
    try:
        if spec.rank_plans is not None:
            from moetier.plan.nodes import node_check

            if node_check(rank, spec.rank_plans, spec.device):
                return  # a node cannot hold its share: rank 0 names it; nothing was loaded
        runner = build_runner(spec, device, par)
        try:
            serve(runner, channel)
        finally:
            runner.release()  # graphs before the group (DecodeGraphs.release)
    finally:
        if pipe is not None:
            pipe.close()
        leave()


def load_share(spec_model, dtype: str, device: str, experts: ExpertOptions, decode_tokens: int, par,
               progress=None, dense_weights: str = "dequantize", mtp: bool = False):
    """-> (config, model with its experts attached) of this rank's share: read from a checkpoint, or
    made (random weights). Rank 0 (engine/llm.py) and the workers load through here alike."""
    if isinstance(spec_model, RandomModel):
        from moetier.checkpoint.loader import resolve_dtype
        from moetier.presets import preset

        cfg = preset(spec_model.preset, spec_model.layers)
        bed = build_random(spec_model, resolve_dtype(dtype if dtype != "auto" else "bfloat16", cfg), device,
                           decode_tokens, par)
        return bed.cfg, bed.model, bed
    from moetier.checkpoint.loader import load_model

    cfg, model, report = load_model(spec_model, dtype=dtype, device=device, experts=experts,
                                    decode_tokens=decode_tokens, progress=progress, parallel=par,
                                    dense_weights=dense_weights, mtp=mtp)
    return cfg, model, report


def build_runner(spec: WorkerSpec, device: str, par):
    from moetier.engine.graphs import captures, decode_graphs
    from moetier.engine.kv_setup import engine_kv, engine_moves
    from moetier.engine.runner import ModelRunner

    config = spec.config
    _, model, _ = load_share(spec.model, spec.dtype, device, config.experts, config.decode_tokens, par,
                             dense_weights=config.dense_weights, mtp=config.drafts_with_mtp)
    if config.replay_trace is not None:
        from moetier.traces.format import read_trace
        from moetier.traces.hooks import Replayer

        replayer = Replayer(model, read_trace(config.replay_trace))  # hooks the routers; lives as long as the model
    # the same page count as rank 0's pool (engine/llm.py: one scratch page more)
    kv = engine_kv(model.kv_spec(), config, model.dtype, model.device)
    dist.barrier()  # loaded: rank 0 waits here for every rank before its first step
    graphs = None
    if captures(config, model, parallel=True):  # exactly when rank 0 does (engine/llm.py)
        graphs = decode_graphs(model, kv, config, config.model_len(model.cfg.max_position_embeddings))
        if config.replay_trace is not None:
            replayer.cursor.zero_()  # as rank 0 (engine/llm.py): the capture's warm-up steps moved it
    return ModelRunner(model, kv, graphs, engine_moves(kv, config, model.kv_spec(), model.dtype),
                       mtp=config.drafts_with_mtp)


def serve(runner, channel) -> None:
    """Run the steps rank 0 sends on `channel` (dist/channel.py: GroupReceiver or PipeReceiver) until
    it sends None; answer its queries on the same channel (worker_group.WorkerGroup.gather)."""
    from moetier.engine.step import RankQuery

    while True:
        record = channel.recv()
        if record is None:
            return
        if isinstance(record, RankQuery):
            channel.answer(record.answer(runner.model))
            continue
        runner.run_worker_step(record, channel.recv)  # a speculative step's verdict comes mid-step
