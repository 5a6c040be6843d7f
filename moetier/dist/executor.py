"""Rank 0's side of a parallel engine: spawn the worker ranks, join the group, broadcast each step,
and turn a dead worker into one loud error naming its rank (never a hang).

    par, workers = start(spec)                 # starts ranks 1..N-1 (mp or Ray), joins as rank 0
    ... rank 0 loads its share with par ...
    workers.ready()                            # every rank has loaded (a barrier)
    runner = DistributedRunner(ModelRunner(model, kv), workers)
    runner.execute(step) -> StepOutput         # the engine's runner interface, unchanged
    workers.stop()                             # workers leave and exit; the group is destroyed

Liveness: before each step every worker process is checked (a dead one fails the step at once,
named); a worker that dies during a step breaks its sockets, the collective raises on rank 0, and
the error names it too; a worker that hangs without dying fails the collective after the group's
timeout (EngineConfig.dist_timeout_s). The records travel on the channel step_record_group names
(dist/channel.py: a group's broadcast, or one OS pipe per worker); the rules are the same for each.
"""

from __future__ import annotations

import time
from dataclasses import replace

import torch
import torch.multiprocessing as mp

from moetier.dist.channel import GroupSender, PipeSender
from moetier.dist.group import init_rank, local_rendezvous, record_group
from moetier.dist.worker import WorkerSpec, main
from moetier.dist.worker_group import WorkerGroup
from moetier.engine.runner import ModelRunner
from moetier.engine.step import RankQuery, StepInput, StepOutput
from moetier.errors import MoetierError
from moetier.parallel import Parallel


class Workers(WorkerGroup):
    """The spawned worker processes of one machine (rank r is process r - 1, on cuda:r)."""

    def __init__(self, spec: WorkerSpec):
        super().__init__(spec.rendezvous)
        ends = None
        if spec.config.step_record_group == "pipe":  # made before the spawn: the workers inherit theirs
            pairs = [mp.get_context("spawn").Pipe(duplex=True) for _ in range(self.world - 1)]
            ends = [child for _, child in pairs]
            self.channel = PipeSender([mine for mine, _ in pairs], spec.rendezvous.timeout_s, self.dead)
        try:
            self._ctx = mp.start_processes(main, args=(spec, ends), nprocs=self.world - 1, join=False,
                                           daemon=True, start_method="spawn")
        finally:
            for end in ends or []:
                # NOTE: rank 0 keeps no copy of a worker's end, so a dead worker is EOF on rank 0's end
                end.close()

    @property
    def processes(self) -> list:
        return self._ctx.processes

    def dead(self) -> list[str]:
        return [f"rank {i + 1} (pid {p.pid}, exit code {p.exitcode})" for i, p in enumerate(self.processes)
                if not p.is_alive()]

    def _end(self, graceful: bool) -> None:
        for p in self.processes:
            p.join(timeout=10.0 if graceful else 0.5)
            if p.is_alive():
                p.kill()
                p.join(timeout=5.0)


def start(spec: WorkerSpec, rank_plans=None) -> tuple[Parallel, WorkerGroup]:
    """Start ranks 1..N-1 with the configured executor and join as rank 0 -> (rank 0's layout, the
    workers). rank_plans (plan/nodes.RankPlans): each rank's memory share, checked against its node's
    free memory before any rank loads (None: not checked)."""
    spec = replace(spec, rank_plans=rank_plans)
    if spec.config.distributed_executor == "ray":
        from moetier.dist.ray_executor import RayWorkers

        workers: WorkerGroup = RayWorkers(spec)
    else:
        workers = Workers(spec)
    try:
        par = init_rank(workers.rendezvous, spec.config.layout(0))
        records = record_group(spec.config.step_record_group, spec.rendezvous.timeout_s)
        if records is not None:  # gloo: a group of their own (pipe's channel was made at the spawn)
            workers.channel = GroupSender(records)
        if rank_plans is not None:
            from moetier.plan.nodes import node_check, refuse

            # every rank measures its node and gets the same answer (worker.run_rank): on a refusal
            # the workers return before loading, and rank 0 says why
            problems = node_check(0, rank_plans, spec.device)
            if problems:
                raise refuse(problems)
    except BaseException:
        workers.stop(graceful=False)
        raise
    return par, workers


def spec_for(model, dtype: str, device: str, config) -> WorkerSpec:
    """The workers' spec; model: a checkpoint directory or a RandomModel. The rendezvous is local for
    the multiprocessing executor; the Ray executor moves it to the driver's node address."""
    if (device == "cuda" and config.distributed_executor == "mp"
            and torch.cuda.device_count() < config.world_size):
        raise MoetierError(f"{config.world_size} ranks need {config.world_size} GPUs (one each) but "
                           f"{torch.cuda.device_count()} are visible; lower --tp/--ep or check CUDA_VISIBLE_DEVICES")
    return WorkerSpec(model, dtype, device, config,
                      local_rendezvous(config.world_size, device, config.dist_timeout_s))


class DistributedRunner:
    """ModelRunner's interface on rank 0: each step is broadcast, then run here (and sampled here)."""

    def __init__(self, inner: ModelRunner, workers: Workers):
        self.inner, self.workers = inner, workers
        self.broadcast_s, self.broadcasts = 0.0, 0  # rank 0's time in the record broadcast (benchmarks)
        inner.on_verdict = workers.broadcast  # inside a speculative step (worker.serve: mid-step)

    @property
    def graph_steps(self) -> int:
        return self.inner.graph_steps

    @property
    def graphs(self):
        return self.inner.graphs

    def release(self) -> None:
        self.inner.release()

    def execute(self, step: StepInput) -> StepOutput:
        if not step.seqs:
            return self.inner.execute(step)  # nothing runs: nothing to broadcast
        step.replay = self.inner.replays(step.seqs)  # the workers replay exactly when this rank does
        return self._run(self.inner.execute, step)

    def forward_only(self, step: StepInput):
        """The step's forward on every rank -> rank 0's last hidden states [N, H] (tests compare them)."""
        return self._run(self.inner.forward_only, step)

    def ask(self, query: RankQuery) -> list:
        """Every rank's answer to `query`, in rank order (ModelRunner.ask's, over the ranks). Between
        steps only (LLM.metrics): a dead worker is named before the query goes out, as before a step."""
        self._live()
        try:
            return self.workers.gather(query, self.inner.ask(query)[0])
        except RuntimeError as e:  # a worker died during the gather, or stopped answering (timeout)
            self.workers.failed(e)

    def _live(self) -> None:
        if self.workers.stopped:
            raise MoetierError("this parallel engine was closed (or failed before): its workers are gone; "
                               "start a new LLM")
        self.workers.check()

    def _run(self, fn, step: StepInput):
        self._live()
        try:
            t0 = time.perf_counter()
            self.workers.broadcast(step)
            self.broadcast_s += time.perf_counter() - t0
            self.broadcasts += 1
            return fn(step)
        except RuntimeError as e:  # torch.distributed errors (DistBackendError among them), channel.ChannelError
            self.workers.failed(e)
        except BaseException:
            # rank 0 failed on its own mid-step: the workers wait inside a collective it will never
            # join, so the ranks are out of step for good; stop them rather than leave them hanging
            self.workers.stop(graceful=False)
            raise
