"""Rank 0's side of a parallel engine: spawn the worker ranks, join the group, broadcast each step,
and turn a dead worker into one loud error naming its rank (never a hang).

    par, workers = start(spec)                 # spawns ranks 1..N-1, joins as rank 0
    ... rank 0 loads its share with par ...
    workers.ready()                            # every rank has loaded (a barrier)
    runner = DistributedRunner(ModelRunner(model, kv), workers)
    runner.execute(step) -> StepOutput         # the engine's runner interface, unchanged
    workers.stop()                             # workers leave and exit; the group is destroyed

Liveness: before each step every worker process is checked (a dead one fails the step at once,
named); a worker that dies during a step breaks its sockets, the collective raises on rank 0, and
the error names it too; a worker that hangs without dying fails the collective after the group's
timeout (EngineConfig.dist_timeout_s).
"""

from __future__ import annotations

import time
from typing import NoReturn

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from moetier.dist.group import init_rank, leave, local_rendezvous
from moetier.dist.worker import WorkerSpec, main
from moetier.engine.runner import ModelRunner
from moetier.engine.step import StepInput, StepOutput
from moetier.errors import MoetierError
from moetier.layers.parallel import Parallel


class Workers:
    """The spawned worker processes (rank r is process r - 1) and the group rank 0 shares with them."""

    def __init__(self, spec: WorkerSpec):
        self.world = spec.rendezvous.world
        self._ctx = mp.start_processes(main, args=(spec,), nprocs=self.world - 1, join=False, daemon=True,
                                       start_method="spawn")
        self.stopped = False

    @property
    def processes(self) -> list:
        return self._ctx.processes

    def dead(self) -> list[str]:
        """'rank r (pid p, exit code c)' for every worker that is no longer running."""
        return [f"rank {i + 1} (pid {p.pid}, exit code {p.exitcode})" for i, p in enumerate(self.processes)
                if not p.is_alive()]

    def check(self) -> None:
        if dead := self.dead():
            self._fail(f"parallel worker {', '.join(dead)} died", None)

    def failed(self, error: BaseException) -> NoReturn:
        """A collective raised: name the worker that died (waiting a moment for its exit to show), or
        say that none did (a timeout: a worker stopped answering)."""
        deadline = time.monotonic() + 3.0
        while not (dead := self.dead()) and time.monotonic() < deadline:
            time.sleep(0.05)
        what = f"parallel worker {', '.join(dead)} died" if dead else "a collective with the workers failed"
        self._fail(what, error)

    def _fail(self, what: str, error: BaseException | None) -> NoReturn:
        self.stop(graceful=False)
        cause = f" ({type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''})" if error else ""
        raise MoetierError(f"{what}{cause}; the engine cannot continue: its stderr says why, fix that and "
                           "start it again")

    def ready(self) -> None:
        """Wait until every rank has loaded its share (the workers' barrier in worker.build_runner)."""
        self.check()
        try:
            dist.barrier()
        except RuntimeError as e:
            self.failed(e)

    def broadcast(self, step: StepInput | None) -> None:
        dist.broadcast_object_list([step], src=0)

    def stop(self, graceful: bool = True) -> None:
        """Workers exit (told to, when all are alive and graceful; killed otherwise); the group goes."""
        if self.stopped:
            return
        self.stopped = True
        if graceful and not self.dead():
            try:
                self.broadcast(None)
            except RuntimeError:
                pass
        for p in self.processes:
            p.join(timeout=10.0 if graceful else 0.5)
            if p.is_alive():
                p.kill()
                p.join(timeout=5.0)
        leave()


def start(spec: WorkerSpec) -> tuple[Parallel, Workers]:
    """Spawn ranks 1..N-1 and join as rank 0 -> (rank 0's layout, the workers)."""
    workers = Workers(spec)
    try:
        par = init_rank(0, spec.rendezvous, spec.tp, spec.ep)
    except BaseException:
        workers.stop(graceful=False)
        raise
    return par, workers


def spec_for(model_dir, dtype: str, device: str, experts, config) -> WorkerSpec:
    if device == "cuda" and torch.cuda.device_count() < config.world_size:
        raise MoetierError(f"{config.world_size} ranks need {config.world_size} GPUs (one each) but "
                           f"{torch.cuda.device_count()} are visible; lower --tp/--ep or check CUDA_VISIBLE_DEVICES")
    return WorkerSpec(model_dir, dtype, device, experts, config,
                      local_rendezvous(config.world_size, device, config.dist_timeout_s))


class DistributedRunner:
    """ModelRunner's interface on rank 0: each step is broadcast, then run here (and sampled here)."""

    def __init__(self, inner: ModelRunner, workers: Workers):
        self.inner, self.workers = inner, workers

    @property
    def graph_steps(self) -> int:
        return self.inner.graph_steps

    def execute(self, step: StepInput) -> StepOutput:
        if not step.seqs:
            return self.inner.execute(step)  # nothing runs: nothing to broadcast
        return self._run(self.inner.execute, step)

    def forward_only(self, step: StepInput):
        """The step's forward on every rank -> rank 0's last hidden states [N, H] (tests compare them)."""
        return self._run(self.inner.forward_only, step)

    def _run(self, fn, step: StepInput):
        if self.workers.stopped:
            raise MoetierError("this parallel engine was closed (or failed before): its workers are gone; "
                               "start a new LLM")
        self.workers.check()
        try:
            self.workers.broadcast(step)
            return fn(step)
        except RuntimeError as e:  # torch.distributed errors (DistBackendError among them)
            self.workers.failed(e)
        except BaseException:
            # rank 0 failed on its own mid-step: the workers wait inside a collective it will never
            # join, so the ranks are out of step for good; stop them rather than leave them hanging
            self.workers.stop(graceful=False)
            raise
