"""The Ray executor (dist/ray_executor.py) on a local two-CPU Ray cluster with two gloo ranks: the
same logits as one process for TP and EP, the same greedy tokens, a killed actor named within
seconds. Skipped where ray is not installed (pip install 'moetier[ray]'); the missing-ray error
itself is tested in tests/test_parallel_cli.py, which needs no ray."""

from __future__ import annotations

import time

import pytest

ray = pytest.importorskip("ray", reason="ray is not installed (pip install 'moetier[ray]'): the Ray executor "
                                         "is not tested here")

from moetier.checkpoint.writer import make_checkpoint  # noqa: E402
from moetier.engine.llm import LLM  # noqa: E402
from moetier.errors import MoetierError  # noqa: E402
from moetier.experts.placement import ExpertOptions  # noqa: E402
from moetier.sampling_params import SamplingParams  # noqa: E402
from tests.test_tp import ENGINE, GREEDY, PROMPTS, close_enough, logits_of  # noqa: E402

RAY = dict(ENGINE, distributed_executor="ray")


@pytest.fixture(scope="module")
def cluster():
    """A local cluster of two CPUs: one bundle for rank 0 (this process), one for the actor."""
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("ray") / "tiny", "tiny", seed=1, dtype="float32")


@pytest.mark.parametrize("tp,ep", [(2, 1), (1, 2)])
def test_ray_logits_equal_one_process(cluster, ckpt, tp, ep):
    experts = ExpertOptions(backend="slots", slots=4)
    ref = logits_of(LLM(ckpt, experts=experts, **ENGINE))
    llm = LLM(ckpt, experts=experts, tensor_parallel_size=tp, expert_parallel_size=ep, **RAY)
    try:
        for got, want in zip(logits_of(llm), ref):
            close_enough(got, want)
        if ep > 1:  # the same greedy tokens through the whole engine (scheduler, broadcast, sampling)
            one = LLM(ckpt, experts=experts, **ENGINE)
            want = [o.outputs[0].token_ids for o in one.generate(PROMPTS, GREEDY)]
            before = llm.metrics()["expert_stats_per_rank"]  # the logits steps above counted too
            assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)] == want
            # the actor answers the statistics query with its own experts' (tests/test_rank_stats.py)
            per, alone = llm.metrics()["expert_stats_per_rank"], one.metrics()["expert_stats"]
            assert len(per) == 2 and per[0] != per[1]

            def lookups(s):
                return s["hits"] + s["misses"] + s["overflow"]
            assert sum(lookups(a) - lookups(b) for a, b in zip(per, before)) == lookups(alone)
    finally:
        llm.close()
    # the placement group is gone: the cluster's two CPUs are free again for the next engine
    deadline = time.monotonic() + 10
    while ray.available_resources().get("CPU", 0) < 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert ray.available_resources().get("CPU", 0) == 2


def test_a_dead_actor_fails_the_engine_loudly(cluster, ckpt):
    llm = LLM(ckpt, tensor_parallel_size=2, **RAY)
    try:
        llm.add_request(PROMPTS[0], SamplingParams(max_tokens=50, ignore_eos=True))
        llm.step()
        ray.kill(llm._workers._actors[0])
        t0 = time.monotonic()
        with pytest.raises(MoetierError, match=r"parallel worker rank 1 \(Ray actor [0-9a-f]+, .*\) died"):
            for _ in range(3):
                llm.step()
        assert time.monotonic() - t0 < 10.0
    finally:
        llm.close()
