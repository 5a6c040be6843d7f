"""Process-group setup for the ranks of one engine.

One machine, one process per rank: rank 0 is the engine's own process (the scheduler runs there),
ranks 1..N-1 are spawned workers (dist/executor.py). They meet at a TCP rendezvous on 127.0.0.1 at a
port rank 0 picked; `from_env()` reads the torchrun variables instead (RANK, WORLD_SIZE, MASTER_ADDR,
MASTER_PORT) for launchers that start every rank themselves.

Backend: gloo for CPU tensors, nccl for CUDA tensors (NOTE: the NCCL path is written, not yet run:
there was no GPU where step 1 was made). The timeout bounds every collective: a rank that stops
answering without closing its socket fails the others after it instead of hanging them forever.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from moetier.errors import MoetierError
from moetier.layers.parallel import Parallel


@dataclass(frozen=True)
class Rendezvous:
    init_method: str  # "tcp://host:port" or "env://"
    world: int
    backend: str  # "gloo" or "nccl"
    timeout_s: float


def backend_for(device: str) -> str:
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free now on `host` (the OS picks it; a race with another process is possible
    but harmless here: init then fails with a clear address-in-use error)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def local_rendezvous(world: int, device: str, timeout_s: float, host: str = "127.0.0.1") -> Rendezvous:
    """Rank 0's TCP store at host:port; host is the driver's node address when the ranks sit on
    other machines (the Ray executor), 127.0.0.1 when they are all local."""
    return Rendezvous(f"tcp://{host}:{free_port(host)}", world, backend_for(device), timeout_s)


def from_env(device: str, timeout_s: float = 600.0) -> tuple[int, Rendezvous]:
    """(rank, rendezvous) from torchrun's variables; a clear error naming what is missing."""
    missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
    if missing:
        raise MoetierError(f"environment rendezvous needs {', '.join(missing)} set (as torchrun does)")
    return int(os.environ["RANK"]), Rendezvous("env://", int(os.environ["WORLD_SIZE"]), backend_for(device),
                                               timeout_s)


def init_rank(rank: int, rdv: Rendezvous, tp: int, ep: int) -> Parallel:
    """Join the group as `rank` (blocks until every rank has joined, at most the timeout) and return
    this rank's layout. One group per process: a second engine in the same process must wait until
    the first is closed."""
    if dist.is_initialized():
        raise MoetierError("this process already belongs to a torch.distributed group (another parallel "
                           "engine that was not closed?); call close() on it first")
    from moetier.dist.timing import CollectiveTimer

    par = Parallel(rank, rdv.world, tp, ep, timer=CollectiveTimer())  # validates before anything connects
    try:
        # NCCL: bind the group to this rank's GPU (set by the caller before joining), so barriers and
        # object collectives never guess the device
        device = {"device_id": torch.device("cuda", torch.cuda.current_device())} if rdv.backend == "nccl" else {}
        dist.init_process_group(rdv.backend, init_method=rdv.init_method, rank=rank, world_size=rdv.world,
                                timeout=timedelta(seconds=rdv.timeout_s), **device)
    except (RuntimeError, ValueError) as e:
        raise MoetierError(f"rank {rank} could not join the process group at {rdv.init_method} "
                           f"({rdv.backend}): {e}") from None
    return par


def record_group(kind: str, timeout_s: float):
    """The group the step records travel on (EngineConfig.step_record_group): None for "world" (the
    default group) and "pipe" (no group: dist/channel.py's pipes), a new gloo group for "gloo". NOTE:
    every rank calls it right after init_rank, in the same order (new_group is collective)."""
    if kind != "gloo":
        return None
    return dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))


def leave() -> None:
    """Leave the group (idempotent)."""
    if dist.is_initialized():
        dist.destroy_process_group()
