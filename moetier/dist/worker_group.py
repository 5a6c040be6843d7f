"""The interface of rank 0's workers, however they were started: the liveness rules, the barrier,
the step broadcast and the shutdown order shared by the multiprocessing workers (executor.py) and
the Ray actors (ray_executor.py)."""

from __future__ import annotations

import time
from typing import NoReturn

import torch.distributed as dist

from moetier.dist.channel import GroupSender
from moetier.dist.group import Rendezvous, leave
from moetier.engine.step import RankQuery, StepInput, StepVerdict
from moetier.errors import MoetierError


class WorkerGroup:
    """Ranks 1..N-1 of one engine, however they were started (the multiprocessing Workers here, Ray
    actors in ray_executor.py), and the group rank 0 shares with them. An executor says which ranks
    are dead (dead()) and how to end them (_end()); the liveness rules, the barrier, the broadcast
    and the shutdown order are the same for both."""

    def __init__(self, rendezvous: Rendezvous):
        self.rendezvous, self.world = rendezvous, rendezvous.world  # where rank 0 meets them
        self.stopped = False
        self.channel = GroupSender()  # how the step records go (dist/channel.py); start() sets the configured one

    def dead(self) -> list[str]:  # 'rank r (...)' for every worker that is no longer running
        raise NotImplementedError

    def _end(self, graceful: bool) -> None:  # workers exit (waited for when graceful) or are killed
        raise NotImplementedError

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

    def broadcast(self, step: StepInput | StepVerdict | RankQuery | None) -> None:
        self.channel.send(step)

    def gather(self, query: RankQuery, mine) -> list:
        """Between steps: every rank's answer to `query`, in rank order (rank 0's is `mine`). The query
        goes out like a step record; the answers come back on the same channel (worker.serve:
        all_gather_object on the records' group, or each worker's pipe), so the timeout and the
        liveness rules hold as for a step."""
        self.broadcast(query)
        return self.channel.gather(mine)

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
        self._end(graceful)
        self.channel.close()
        leave()
