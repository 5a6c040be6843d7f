"""The step records' channel: how rank 0's StepInput / StepVerdict / RankQuery / None reaches the
workers, and how the workers' answers to a RankQuery come back (EngineConfig.step_record_group).

    world, gloo  broadcast_object_list / all_gather_object on a torch.distributed group (the world
                 group, or the gloo group of group.record_group): GroupSender on rank 0,
                 GroupReceiver on a worker
    pipe         one duplex OS pipe (multiprocessing.Pipe, a socket pair) per worker, made by rank 0
                 before it spawns the workers and handed to each through its spawn arguments
                 (executor.Workers; one node only: the Ray executor refuses it). PipeSender on rank 0
                 pickles each record once and writes the same bytes to every worker; PipeReceiver on
                 a worker blocks in a read (no polling: an idle server burns no CPU).

Both sides of a kind have the same two calls: rank 0 send(record) and gather(mine) -> every rank's
answer in rank order; a worker recv() -> record and answer(mine). Invariants of the pipes: rank 0
is the one writer of records and each worker the one writer of answers on its pipe; records are read
in the order written (a pipe is a byte stream, each record one length-prefixed message); at most one
query is outstanding (rank 0 reads every answer before it sends anything else), so an answer on a
pipe always belongs to the last query. The answers come back over the same pipes rather than through
a collective: a query then needs no group at all, and a dead worker shows up as EOF on its pipe.
"""

from __future__ import annotations

import pickle
import sys
import time
from multiprocessing.connection import wait

import torch.distributed as dist

from moetier.errors import MoetierError


class ChannelError(RuntimeError):
    """A pipe broke under rank 0 (a worker died: EOF or a broken pipe) or an answer did not come in
    time. A RuntimeError, as torch.distributed's errors are, so worker_group.WorkerGroup.failed names the
    dead worker for every channel alike."""


class GroupSender:
    """Rank 0 on a torch.distributed group (None: the world)."""

    def __init__(self, group=None):
        self.group = group

    def send(self, record) -> None:
        dist.broadcast_object_list([record], src=0, group=self.group)

    def gather(self, mine) -> list:
        # NOTE: all_gather_object rather than gather_object: the object collective node_check runs
        # on both backends, and the answers are a few integers per rank
        answers = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(answers, mine, group=self.group)
        return answers

    def close(self) -> None:
        pass  # the group goes with the process group (group.leave)


class GroupReceiver(GroupSender):
    """A worker on the same group: receives what GroupSender sends, meets it in the same gather."""

    def recv(self):
        box = [None]
        dist.broadcast_object_list(box, src=0, group=self.group)
        return box[0]

    def answer(self, mine) -> None:
        self.gather(mine)


class PipeSender:
    """Rank 0's ends of the workers' pipes, in rank order (rank r's is ends[r - 1]).

    timeout_s bounds the wait for an answer (EngineConfig.dist_timeout_s, as a collective's);
    dead() -> the workers no longer running (WorkerGroup.dead), asked while waiting so that a dead
    worker fails a query at once even when its pipe's EOF is late."""

    def __init__(self, ends: list, timeout_s: float, dead):
        self.ends, self.timeout_s, self.dead = ends, timeout_s, dead

    def send(self, record) -> None:
        data = pickle.dumps(record, protocol=pickle.HIGHEST_PROTOCOL)  # once, whatever the world
        for rank, end in enumerate(self.ends, start=1):
            try:
                end.send_bytes(data)
            except OSError as e:  # BrokenPipeError, ConnectionResetError: the worker is gone
                raise ChannelError(f"the step-record pipe to rank {rank} broke ({type(e).__name__})") from e

    def gather(self, mine) -> list:
        answers = [mine] + [None] * len(self.ends)
        waiting = dict(enumerate(self.ends, start=1))
        deadline = time.monotonic() + self.timeout_s
        while waiting:
            if time.monotonic() > deadline:
                raise ChannelError(f"rank(s) {', '.join(map(str, waiting))} did not answer within "
                                   f"{self.timeout_s:g} s")
            for end in wait(list(waiting.values()), timeout=0.2):
                rank = next(r for r, e in waiting.items() if e is end)
                try:
                    answers[rank] = pickle.loads(end.recv_bytes())
                except (EOFError, OSError) as e:
                    raise ChannelError(f"the step-record pipe from rank {rank} closed ({type(e).__name__})") from e
                del waiting[rank]
            if waiting and self.dead():
                raise ChannelError("a worker died while rank 0 waited for its answer")
        return answers

    def close(self) -> None:
        for end in self.ends:
            end.close()  # a worker still reading gets EOF: it exits (PipeReceiver.recv)


class PipeReceiver:
    """A worker's end of its pipe."""

    def __init__(self, end, rank: int):
        self.end, self.rank = end, rank

    def recv(self):
        try:
            data = self.end.recv_bytes()  # blocks in read(2) until rank 0 writes or its end closes
        except (EOFError, OSError):
            # rank 0 closed its end without the None record: it died (or was killed); nothing will
            # ever come, so the worker exits rather than wait (the caller's finally leaves the group).
            # Said on stderr too: a spawned worker's exception goes to torch's error file, which a
            # dead rank 0 never reads. NOTE: on Linux torch's spawn also sets PR_SET_PDEATHSIG
            # (SIGINT), which interrupts this read when rank 0 dies; EOF is the rule where it does not.
            error = MoetierError(f"worker rank {self.rank}: rank 0 closed the step-record pipe without "
                                 "saying stop (it died?); this worker exits")
            print(f"error: {error}", file=sys.stderr, flush=True)
            raise error from None
        return pickle.loads(data)

    def answer(self, mine) -> None:
        self.end.send_bytes(pickle.dumps(mine, protocol=pickle.HIGHEST_PROTOCOL))

    def close(self) -> None:
        self.end.close()
