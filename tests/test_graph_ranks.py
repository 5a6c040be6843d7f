"""The lockstep rule of decode graphs under several ranks (dist/executor.DistributedRunner, engine/
runner.ModelRunner, dist/worker.py), driven with fakes on the CPU: rank 0 decides per step whether it
replays its graph and the record it broadcasts says so, a worker replays exactly then, and an engine
destroys its graphs before its process group (a graph holding NCCL work made the group's destroy wait
forever on two H200s). The NCCL runs themselves: tests/test_parallel_gpu.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from moetier.dist.executor import DistributedRunner
from moetier.engine.llm import LLM
from moetier.engine.runner import ModelRunner
from moetier.engine.step import SeqStep, StepInput
from moetier.sampling_params import SamplingParams


class FakeGraphs:
    """fits() one-token steps of up to 2 sequences; run() records its calls."""

    def __init__(self):
        self.runs: list[tuple[int, bool]] = []
        self.released = False

    def fits(self, seqs):
        return 0 < len(seqs) <= 2 and all(s.num_tokens == 1 for s in seqs)

    def run(self, seqs, sample=True):
        self.runs.append((len(seqs), sample))
        return torch.zeros(len(seqs), dtype=torch.int64) if sample else None

    def release(self):
        self.released = True


class FakeWorkers:
    stopped = False

    def __init__(self, log):
        self.log, self.sent = log, []

    def check(self):
        pass

    def dead(self):
        return []

    def gather(self, query, mine):  # close() reads every rank's statistics while the graphs still live
        self.log.append("stats")
        return [mine, mine]

    def broadcast(self, step):
        self.sent.append(None if step is None else step.replay)

    def stop(self, graceful=True):  # idempotent, as WorkerGroup.stop
        if self.stopped:
            return
        self.log.append("stop")
        self.stopped = True


def seq(n_tokens: int, rid: str = "r") -> SeqStep:
    return SeqStep(rid, 4, list(range(n_tokens)), [0], True, SamplingParams(temperature=0.0), 0, 0)


def runner(graphs) -> ModelRunner:
    model = SimpleNamespace(device=torch.device("cpu"), expert_stats=lambda: {"hits": 0})
    # no KV pool: the steps here carry no host-tier copies or state checkpoints
    moves = SimpleNamespace(attach=lambda model: None, before=lambda step, layered=False: None,
                            after=lambda seqs: None, back_up=lambda seqs: None, backup_base=-1)
    r = ModelRunner(model, kv=None, graphs=graphs, moves=moves)
    r._forward = lambda seqs: (r.eager.append(len(seqs)), None, None)  # the eager forward, recorded
    r.eager = []
    return r


def test_the_broadcast_record_carries_rank_0s_choice():
    inner = runner(FakeGraphs())
    inner._output = lambda seqs, tokens, logits, n: "graphed"
    workers = FakeWorkers([])
    dr = DistributedRunner(inner, workers)
    assert dr.execute(StepInput([seq(1), seq(1, "s")])) == "graphed"
    inner.graphs_on = False  # bench decode --parallel's eager window: every rank eager together
    with pytest.raises(AttributeError):  # the fake eager forward has no batch to sample; the broadcast came first
        dr.execute(StepInput([seq(1)]))
    assert workers.sent == [True, False]


def test_a_worker_replays_exactly_when_the_record_says():
    g = FakeGraphs()
    w = runner(g)
    w.run_worker_step(StepInput([seq(1)], replay=True))
    w.run_worker_step(StepInput([seq(1)], replay=False))  # rank 0 ran this one eagerly: so does the worker
    w.run_worker_step(StepInput([seq(5)], replay=False))  # a prefill chunk
    assert g.runs == [(1, False)] and w.eager == [1, 1] and w.graph_steps == 1


def test_replays_follows_fits_and_the_switch():
    r = runner(FakeGraphs())
    assert r.replays([seq(1)]) and not r.replays([seq(3)]) and not r.replays([seq(1)] * 3)
    r.graphs_on = False
    assert not r.replays([seq(1)])
    assert not runner(None).replays([seq(1)])


def test_close_releases_the_graphs_before_the_group_goes():
    log: list[str] = []
    g = FakeGraphs()
    inner = runner(g)
    llm = LLM.__new__(LLM)
    llm._workers, llm.recorder, llm.replayer = FakeWorkers(log), None, None
    llm.runner = DistributedRunner(inner, llm._workers)
    orig = g.release
    g.release = lambda: (log.append("release"), orig())
    llm.close()
    assert log == ["stats", "release", "stop"] and inner.graphs is None
    llm.close()  # twice: nothing more
    assert log == ["stats", "release", "stop"]
    assert llm.expert_stats_per_rank() == [{"hits": 0}] * 2  # after close: the reading taken at close
