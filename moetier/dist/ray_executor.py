"""The Ray executor (EngineConfig.distributed_executor = "ray", `--distributed-executor ray`): ranks
1..N-1 as Ray actors, one per GPU (or one per CPU rank with --device cpu) on any node of a Ray
cluster, running the same worker loop as the multiprocessing executor (worker.run_rank) with the
same step protocol; rank 0 stays this process. Ray is optional: pip install 'moetier[ray]'.

    workers = RayWorkers(spec)   # connect, reserve N bundles, place the actors, start their loops
    ... then the WorkerGroup interface of worker_group.py: check(), ready(), broadcast(), stop()

Cluster: ray.init(address="auto") joins a running cluster (RAY_ADDRESS, or the one `ray start`
made on this machine); without one a local cluster is started (and shut down at stop()).
Placement: one placement group of N bundles ({"GPU": 1} or {"CPU": 1} each), packed; bundle 0 is
rank 0's and is pinned to this (the driver's) node, where a holder actor keeps it and says which
GPU Ray reserved for rank 0. Ray gives each actor its one GPU as cuda:0 (CUDA_VISIBLE_DEVICES).
The ranks meet at a TCP rendezvous on the driver's node address. A checkpoint directory (and a
replayed trace) must be at the same path on every node.

Liveness: each actor's loop is one Ray task (run); it ends only when the worker returns or dies,
so a finished task is a dead rank: check() names it before each step, and a collective broken by a
dead actor names it too (worker_group.WorkerGroup.failed), never a hang.
"""

from __future__ import annotations

import os

from moetier.dist.worker_group import WorkerGroup
from moetier.dist.group import local_rendezvous, release
from moetier.dist.worker import WorkerSpec
from moetier.errors import MoetierError

RAY_INSTALL = "pip install 'moetier[ray]'"


def import_ray():
    """The ray module, or one line saying how to install it."""
    try:
        import ray
    except ImportError:
        raise MoetierError(f"--distributed-executor ray needs Ray, which this install lacks: {RAY_INSTALL}") from None
    return ray


class RankActor:
    """A worker rank inside a Ray actor (wrapped by ray.remote when the executor starts)."""

    def gpu_ids(self) -> list:
        import ray

        return list(ray.get_gpu_ids())

    def run(self, rank: int, spec: WorkerSpec) -> None:
        from moetier.dist.worker import run_rank

        run_rank(rank, spec, 0)  # the one GPU Ray gave this actor is cuda:0 here


def connect(ray) -> bool:
    """Join a running cluster, else start a local one. -> whether this call connected (stop()
    then disconnects; a caller that initialised Ray itself keeps its session)."""
    if ray.is_initialized():
        return False
    try:
        ray.init(address="auto", log_to_driver=True)
    except ConnectionError:  # no cluster is running: a local one on this machine
        local_ray_init(ray)
    return True


def local_ray_init(ray) -> None:
    """Start a local Ray cluster with Ray's usage-stats reporting off. Ray reads its own switch,
    RAY_USAGE_STATS_ENABLED, from the environment of the process that starts the cluster (ray.init
    has no argument for it; docs.ray.io cluster/usage-stats): set for this call only, so the
    processes it starts inherit it and the caller's environment is left as it was."""
    import os

    before = os.environ.get("RAY_USAGE_STATS_ENABLED")
    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
    try:
        ray.init(log_to_driver=True)
    finally:
        if before is None:
            del os.environ["RAY_USAGE_STATS_ENABLED"]
        else:
            os.environ["RAY_USAGE_STATS_ENABLED"] = before


class RayWorkers(WorkerGroup):
    def __init__(self, spec: WorkerSpec):
        ray = import_ray()
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self._ray, self._owns = ray, connect(ray)
        self._actors: list = []
        self._holder = self._pg = None
        world, cuda = spec.rendezvous.world, spec.device == "cuda"
        try:
            host = ray.util.get_node_ip_address()  # the store listens there alone (dist/group.py)
            release(spec.rendezvous)  # the local one spec_for made is not used across machines
            super().__init__(local_rendezvous(world, spec.device, spec.config.dist_timeout_s, host))
            spec = _with(spec, rendezvous=self.rendezvous)
            bundle = {"GPU": 1, "CPU": 1} if cuda else {"CPU": 1}
            self._pg = placement_group([{**bundle, f"node:{host}": 0.001}] + [bundle] * (world - 1), strategy="PACK")
            timeout = min(spec.config.dist_timeout_s, 120.0)
            ready, _ = ray.wait([self._pg.ready()], timeout=timeout)
            if not ready:
                raise MoetierError(f"the Ray cluster has no room for {world} ranks of {bundle} (rank 0's on this "
                                   f"node, {host}) after {timeout:.0f} s; it has {ray.available_resources()}: "
                                   "add nodes or GPUs, or lower --tp/--ep")
            actor = ray.remote(RankActor)

            def at(i: int):
                return actor.options(num_gpus=1 if cuda else 0, num_cpus=1, scheduling_strategy=
                                     PlacementGroupSchedulingStrategy(self._pg, placement_group_bundle_index=i))

            if cuda:  # rank 0 (this process) takes the GPU Ray reserved in bundle 0
                self._holder = at(0).remote()
                _use_gpu(ray.get(self._holder.gpu_ids.remote(), timeout=timeout))
            self._actors = [at(r).remote() for r in range(1, world)]
            self._runs = [a.run.remote(r, spec) for r, a in enumerate(self._actors, start=1)]
        except BaseException:
            self._release()
            raise

    def dead(self) -> list[str]:
        done, _ = self._ray.wait(self._runs, num_returns=len(self._runs), timeout=0)
        out = []
        for rank, ref in enumerate(self._runs, start=1):
            if ref in done:
                try:
                    self._ray.get(ref, timeout=0)
                    why = "its worker loop returned"
                except Exception as e:  # noqa: BLE001 -- RayActorError, or the worker's own exception
                    why = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
                out.append(f"rank {rank} (Ray actor {self._actors[rank - 1]._actor_id.hex()[:12]}, {why})")
        return out

    def _end(self, graceful: bool) -> None:
        if graceful:
            self._ray.wait(self._runs, num_returns=len(self._runs), timeout=10.0)
        self._release()

    def _release(self) -> None:
        ray = self._ray
        for a in self._actors + ([self._holder] if self._holder is not None else []):
            try:
                ray.kill(a)
            except Exception:  # noqa: BLE001 -- already gone
                pass
        if self._pg is not None:
            from ray.util.placement_group import remove_placement_group

            remove_placement_group(self._pg)
            self._pg = None
        if self._owns:
            ray.shutdown()
            self._owns = False


def _with(spec: WorkerSpec, **fields) -> WorkerSpec:
    from dataclasses import replace

    return replace(spec, **fields)


def _use_gpu(ids: list) -> None:
    """Make Ray's GPU id for rank 0 this process's current device: an index into this process's
    CUDA_VISIBLE_DEVICES when it is set, else the physical id."""
    import torch

    gid = str(ids[0])
    visible = [v.strip() for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
    if visible and gid not in visible:
        raise MoetierError(f"Ray reserved GPU {gid} for rank 0 but this process sees only CUDA_VISIBLE_DEVICES="
                           f"{','.join(visible)}; unset it or start Ray with the same GPUs")
    torch.cuda.set_device(visible.index(gid) if visible else int(gid))
