"""A worker rank (1..N-1): load this rank's share of the model, then run every step rank 0 sends.

The step protocol (rank 0's side: dist/executor.py), per step with at least one sequence:
    rank 0:  broadcast_object_list([StepInput])  -> every rank runs model.forward on the same tokens,
             positions and page tables (the collectives inside the forward pair up in the same order
             on every rank) -> rank 0 alone computes logits and samples
    workers: broadcast_object_list([None]) receives it, ModelRunner.forward_only(step)
    shutdown: rank 0 broadcasts None; workers leave the group and exit.
The scheduler and the page pool live on rank 0 only; a worker's KV cache has the same pages (the
page tables arrive in the StepInput) holding its own kv heads.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from moetier.dist.group import Rendezvous, init_rank, leave
from moetier.engine.config import EngineConfig
from moetier.experts.placement import ExpertOptions


@dataclass(frozen=True)
class WorkerSpec:
    """Everything a worker needs to build its rank: plain data, pickled into the spawned process."""

    model_dir: Path
    dtype: str
    device: str  # "cpu" or "cuda"
    experts: ExpertOptions
    config: EngineConfig
    rendezvous: Rendezvous

    @property
    def tp(self) -> int:
        return self.config.tensor_parallel_size

    @property
    def ep(self) -> int:
        return self.config.expert_parallel_size


def device_of(device: str, rank: int) -> str:
    """One GPU per rank (rank r on cuda:r); every CPU rank on the CPU."""
    return f"cuda:{rank}" if device == "cuda" else device


def main(index: int, spec: WorkerSpec) -> None:
    """Entry point of a spawned worker (torch.multiprocessing passes index 0..N-2: rank index + 1)."""
    rank = index + 1
    device = device_of(spec.device, rank)
    if spec.device == "cuda":
        torch.cuda.set_device(rank)
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // spec.rendezvous.world))
    par = init_rank(rank, spec.rendezvous, spec.tp, spec.ep)
    try:
        serve(build_runner(spec, device, par))
    finally:
        leave()


def build_runner(spec: WorkerSpec, device: str, par):
    from moetier.checkpoint.loader import load_model
    from moetier.engine.runner import ModelRunner

    config = spec.config
    _, model, _ = load_model(spec.model_dir, dtype=spec.dtype, device=device, experts=spec.experts,
                             decode_tokens=config.decode_tokens, parallel=par, fp8_dense=config.fp8_dense)
    # the same page count as rank 0's pool (engine/llm.py: one scratch page more)
    kv = model.kv_spec().allocate(config.num_pages + 1, config.page_size, model.dtype, model.device)
    dist.barrier()  # loaded: rank 0 waits here for every rank before its first step
    return ModelRunner(model, kv, None)


def serve(runner) -> None:
    """Run the steps rank 0 broadcasts until it sends None."""
    while True:
        box = [None]
        dist.broadcast_object_list(box, src=0)
        if box[0] is None:
            return
        runner.forward_only(box[0])
