"""Process-group setup for the ranks of one engine.

One machine, one process per rank: rank 0 is the engine's own process (the scheduler runs there),
ranks 1..N-1 are spawned workers (dist/executor.py). They meet at rank 0's TCP store. Its socket is
bound by us to one address (torch's own store would listen on every interface: unauthenticated, and
the step records behind it are pickles): 127.0.0.1 when every rank is on this machine (the mp
executor), the node address Ray names across machines (dist/ray_executor.py). On loopback the
collectives' own transports (gloo's pairs, NCCL's bootstrap) are kept on the loopback interface too.
`from_env()` reads the torchrun variables instead (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT) for
launchers that start every rank themselves (then the launcher's store and its binding apply).

Backend: gloo for CPU tensors, nccl for CUDA tensors (both run on two H200s: docs/parallel.md). The
timeout bounds every collective: a rank that stops answering without closing its socket fails the
others after it instead of hanging them forever.
"""

from __future__ import annotations

import os
import socket
import sys
from dataclasses import dataclass, replace
from datetime import timedelta

import torch
import torch.distributed as dist

from moetier.errors import MoetierError
from moetier.parallel import Parallel


@dataclass(frozen=True)
class Rendezvous:
    init_method: str  # "tcp://host:port" or "env://"
    world: int
    backend: str  # "gloo" or "nccl"
    timeout_s: float


def backend_for(device: str) -> str:
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


LOOPBACK = "127.0.0.1"
# rank 0's bound, listening store sockets by port, from local_rendezvous until init_rank hands one's
# descriptor to the store (which then owns and closes it) or leave() / release() closes it
_LISTENERS: dict[int, socket.socket] = {}


def local_rendezvous(world: int, device: str, timeout_s: float, host: str = LOOPBACK) -> Rendezvous:
    """Rank 0's TCP store at host:port, its socket bound and listening now on `host` alone (the OS
    picks the port; bound before the workers start, so no other process can take it in between):
    host is the driver's node address when the ranks sit on other machines (the Ray executor),
    127.0.0.1 when they are all local."""
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind((host, 0))
    s.listen(128)
    port = s.getsockname()[1]
    _LISTENERS[port] = s
    return Rendezvous(f"tcp://{host}:{port}", world, backend_for(device), timeout_s)


def release(rdv: Rendezvous) -> None:
    """Close rank 0's socket of a rendezvous that will not be used (idempotent)."""
    host, port = address(rdv)
    s = _LISTENERS.pop(port, None)
    if s is not None:
        s.close()


def address(rdv: Rendezvous) -> tuple[str, int]:
    host, _, port = rdv.init_method.removeprefix("tcp://").rpartition(":")
    return host, int(port)


def _store(rank: int, rdv: Rendezvous) -> dist.TCPStore:
    """Rank 0 serves the store on its bound socket; the others connect to it."""
    host, port = address(rdv)
    timeout = timedelta(seconds=rdv.timeout_s)
    if rank != 0:
        return dist.TCPStore(host, port, rdv.world, is_master=False, timeout=timeout)
    listener = _LISTENERS.pop(port, None)
    if listener is None:
        raise MoetierError(f"rank 0 holds no bound socket for {rdv.init_method} (made by another process?)")
    fd = listener.detach()  # the store's from here: it closes it
    try:
        return dist.TCPStore(host, port, rdv.world, is_master=True, timeout=timeout, wait_for_workers=False,
                             master_listen_fd=fd)
    except BaseException:
        os.close(fd)
        raise


def _loopback_transports() -> None:
    """gloo's pair sockets and NCCL's bootstrap on the loopback interface (each library's own
    variable; a value the user set stands)."""
    lo = "lo0" if sys.platform == "darwin" else "lo"
    os.environ.setdefault("GLOO_SOCKET_IFNAME", lo)
    os.environ.setdefault("NCCL_SOCKET_IFNAME", lo)


def from_env(device: str, timeout_s: float = 600.0) -> tuple[int, Rendezvous]:
    """(rank, rendezvous) from torchrun's variables; a clear error naming what is missing."""
    missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
    if missing:
        raise MoetierError(f"environment rendezvous needs {', '.join(missing)} set (as torchrun does)")
    return int(os.environ["RANK"]), Rendezvous("env://", int(os.environ["WORLD_SIZE"]), backend_for(device),
                                               timeout_s)


def init_rank(rdv: Rendezvous, layout: Parallel) -> Parallel:
    """Join the group as layout.rank (blocks until every rank has joined, at most the timeout) and
    return the layout with its collective timer (EngineConfig.layout makes it). One group per process:
    a second engine in the same process must wait until the first is closed."""
    if dist.is_initialized():
        raise MoetierError("this process already belongs to a torch.distributed group (another parallel "
                           "engine that was not closed?); call close() on it first")
    from moetier.dist.timing import CollectiveTimer

    if layout.world != rdv.world:
        raise MoetierError(f"the layout has {layout.world} ranks, the rendezvous {rdv.world}")
    rank, par = layout.rank, replace(layout, timer=CollectiveTimer())
    try:
        # NCCL: bind the group to this rank's GPU (set by the caller before joining), so barriers and
        # object collectives never guess the device
        device = {"device_id": torch.device("cuda", torch.cuda.current_device())} if rdv.backend == "nccl" else {}
        if rdv.init_method.startswith("tcp://"):
            if address(rdv)[0] == LOOPBACK:
                _loopback_transports()
            where = {"store": _store(rank, rdv)}
        else:
            where = {"init_method": rdv.init_method}
        dist.init_process_group(rdv.backend, rank=rank, world_size=rdv.world,
                                timeout=timedelta(seconds=rdv.timeout_s), **where, **device)
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
    """Leave the group and close rank 0's store sockets (idempotent)."""
    if dist.is_initialized():
        dist.destroy_process_group()
    for port in list(_LISTENERS):
        _LISTENERS.pop(port).close()
