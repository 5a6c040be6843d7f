"""step_record_group="pipe" (dist/channel.py): the step records reach the workers over one OS pipe
each, with 2 gloo ranks on the CPU. The same logits and greedy tokens as one process (EP 2, TP 2),
batch == alone, the pipe's protocol on its own (records in the order written, queries answered,
EOF a clear error naming rank 0), a killed worker named within seconds, a worker that outlives a
killed rank 0 by no more than seconds, and the refusals (Ray, a bad value) before any spawn. The
per-rank statistics over the pipes: tests/test_rank_stats.py."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from multiprocessing import Pipe

import pytest

from moetier.checkpoint.writer import make_checkpoint
from moetier.dist.channel import ChannelError, PipeReceiver, PipeSender
from moetier.dist.worker import serve
from moetier.engine.llm import LLM
from moetier.engine.step import RankQuery
from moetier.errors import MoetierError
from moetier.experts.placement import ExpertOptions
from moetier.sampling_params import SamplingParams
from tests.test_tp import ENGINE, GREEDY, PROMPTS, close_enough, logits_of, steps

PIPE = dict(ENGINE, step_record_group="pipe")
SLOTS = ExpertOptions(backend="slots", slots=4)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("pipes") / "tiny", "tiny", seed=1, dtype="float32")


@pytest.mark.parametrize("tp,ep", [(1, 2), (2, 1)])
def test_pipe_logits_and_tokens_equal_one_process(ckpt, tp, ep):
    one = LLM(ckpt, experts=SLOTS, **ENGINE)
    ref = logits_of(one)
    want = [o.outputs[0].token_ids for o in one.generate(PROMPTS, GREEDY)]
    llm = LLM(ckpt, experts=SLOTS, tensor_parallel_size=tp, expert_parallel_size=ep, **PIPE)
    try:
        assert isinstance(llm._workers.channel, PipeSender)  # the pipes, no group of their own
        for got, w in zip(logits_of(llm), ref):
            close_enough(got, w)
        batch = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]
        alone = [llm.generate([p], GREEDY)[0].outputs[0].token_ids for p in PROMPTS]
        assert batch == alone == want
        assert llm.runner.broadcasts > 0 and llm.runner.broadcast_s > 0  # rank 0 times its sends
    finally:
        llm.close()
    assert not any(p.is_alive() for p in llm._workers.processes)  # the None record: they exited


class Recorder:
    """A worker's runner that only keeps what it is asked to run."""

    def __init__(self):
        self.ran, self.model = [], self

    def run_worker_step(self, step, verdict):
        self.ran.append(step)

    def expert_stats(self):
        return {"steps": len(self.ran)}


def test_the_pipe_delivers_records_in_order_and_answers_queries():
    mine, theirs = Pipe(duplex=True)
    sender, runner = PipeSender([mine], 5.0, lambda: []), Recorder()
    records = steps()
    for record in records:
        sender.send(record)
    sender.send(RankQuery("expert_stats"))
    sender.send(None)
    serve(runner, PipeReceiver(theirs, 1))  # returns at None: every record was read, each once
    assert runner.ran == records  # in the order written, none stale, none repeated
    assert sender.gather({"steps": -1}) == [{"steps": -1}, {"steps": 2}]  # rank 0's, then rank 1's


def test_eof_names_rank_0_on_the_worker_and_the_worker_on_rank_0():
    mine, theirs = Pipe(duplex=True)
    mine.close()  # rank 0 died: its end is closed by the OS
    with pytest.raises(MoetierError, match="worker rank 1: rank 0 closed the step-record pipe"):
        PipeReceiver(theirs, 1).recv()
    mine, theirs = Pipe(duplex=True)
    theirs.close()  # a worker died
    with pytest.raises(ChannelError, match="from rank 1 closed"):
        PipeSender([mine], 5.0, lambda: []).gather(None)
    _, silent = Pipe(duplex=True)  # alive but never answers: the timeout, not a hang
    t0 = time.monotonic()
    with pytest.raises(ChannelError, match="rank\\(s\\) 1 did not answer within 0.5 s"):
        PipeSender([silent], 0.5, lambda: []).gather(None)
    assert time.monotonic() - t0 < 2.0


def test_a_killed_worker_is_named_in_a_step_and_in_a_query(ckpt):
    for ask in (lambda llm: [llm.step() for _ in range(3)], lambda llm: llm.metrics()):
        llm = LLM(ckpt, experts=SLOTS, expert_parallel_size=2, **PIPE)
        try:
            llm.add_request(PROMPTS[0], SamplingParams(max_tokens=50, ignore_eos=True))
            llm.step()
            pid = llm._workers.processes[0].pid
            os.kill(pid, signal.SIGKILL)
            llm._workers.processes[0].join(timeout=10.0)  # the kill has taken effect (tests/test_tp.py says why)
            t0 = time.monotonic()
            with pytest.raises(MoetierError, match=rf"rank 1 \(pid {pid}, exit code -9\) died"):
                ask(llm)
            assert time.monotonic() - t0 < 5.0
        finally:
            llm.close()


def test_a_worker_exits_when_rank_0_is_killed(ckpt, tmp_path):
    """Rank 0 killed (no None record, no atexit: the daemon workers are not reaped): the worker exits
    within seconds instead of waiting for a record. NOTE: torch's spawn sets PR_SET_PDEATHSIG
    (SIGINT) on Linux, which interrupts the worker's read first; the EOF path on its own is
    test_eof_names_rank_0_on_the_worker_and_the_worker_on_rank_0."""
    script = tmp_path / "rank0.py"
    script.write_text(textwrap.dedent(f"""
        import os, signal
        from moetier.engine.llm import LLM
        if __name__ == "__main__":
            llm = LLM({str(ckpt)!r}, expert_parallel_size=2, **{PIPE!r})
            llm.generate([[5, 17, 99]], __import__("moetier").SamplingParams(max_tokens=2))
            print(llm._workers.processes[0].pid, flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
    """))
    p = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "PYTHONPATH": os.getcwd()})
    assert p.returncode == -9, p.stderr
    pid = int(p.stdout.split()[0])
    deadline = time.monotonic() + 10.0
    while time.monotonic() < deadline and _alive(pid):
        time.sleep(0.1)
    assert not _alive(pid), "the worker outlived rank 0"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie (exited, parent gone) counts as exited
        return f.read().split(")")[-1].split()[0] != "Z"


def test_pipe_is_refused_under_ray_and_a_bad_value_by_name(ckpt):
    t0 = time.monotonic()
    with pytest.raises(MoetierError, match="step_record_group pipe needs the mp executor") as e:
        LLM(ckpt, expert_parallel_size=2, distributed_executor="ray", **PIPE)
    assert "\n" not in str(e.value) and "use world or gloo" in str(e.value)
    with pytest.raises(MoetierError, match="step_record_group must be world, gloo or pipe, got 'shm'"):
        LLM(ckpt, expert_parallel_size=2, **dict(ENGINE, step_record_group="shm"))
    assert time.monotonic() - t0 < 1.0  # before any spawn
