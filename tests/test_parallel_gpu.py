"""Tensor and expert parallelism on two GPUs over NCCL (docs/parallel.md): the CPU/gloo tests
(test_tp.py) hold the protocol; these hold what only GPUs exercise: NCCL collectives, one rank per
device, the Triton expert kernels under EP (another rank's pairs carry -1), and the decode step
captured in a CUDA graph on every rank with its all-reduces inside. Skipped below two CUDA devices."""

from __future__ import annotations

import pytest
import torch

from moetier.checkpoint.writer import make_checkpoint
from moetier.engine.llm import LLM
from moetier.experts.placement import ExpertOptions
from moetier.sampling_params import SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")]

PROMPTS = [[5, 17, 99, 3, 250, 41, 7, 300, 12], [77, 2, 401], [9, 9, 130, 64, 211, 8]]
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
ENGINE = dict(device="cuda", kv_tokens=512, page_size=16, max_num_seqs=8, dist_timeout_s=120.0)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("par-gpu")
    return {name: make_checkpoint(root / name, name, seed=1, dtype="float32") for name in ("tiny", "tiny-dsv3", "tiny-glm5")}


def run(ckpt, experts, graphs: bool, **par) -> tuple[list[list[int]], list[list[int]]]:
    llm = LLM(ckpt, dtype="float32", experts=experts, cuda_graphs=graphs, **ENGINE, **par)
    try:
        batch = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]
        alone = [llm.generate([p], GREEDY)[0].outputs[0].token_ids for p in PROMPTS]
        runner = getattr(llm.runner, "inner", llm.runner)  # rank 0's ModelRunner under several ranks
        assert (runner.graph_steps > 0) == graphs  # decode replayed graphs (with the all-reduces inside)
        # every rank's expert statistics, asked between steps over the records' channel (RankQuery)
        world = max(par.get("tensor_parallel_size", 1), par.get("expert_parallel_size", 1))
        per = llm.metrics()["expert_stats_per_rank"]
        assert len(per) == world and per[0] == llm.metrics()["expert_stats"]
        return batch, alone
    finally:
        llm.close()


@pytest.mark.parametrize("preset,tp,ep,backend,graphs", [
    ("tiny", 2, 1, "resident", True), ("tiny", 1, 2, "slots", True), ("tiny", 2, 2, "slots", True),
    ("tiny", 2, 2, "uva", False), ("tiny-dsv3", 1, 2, "slots", True),
    ("tiny-dsv3", 2, 2, "slots", True), ("tiny-glm5", 2, 1, "resident", True),  # MLA heads split (test_tp_mla)
])
def test_nccl_greedy_equals_one_gpu(ckpts, preset, tp, ep, backend, graphs):
    """fp32 weights: the row-split GEMMs and the all-reduce change summation orders only, far below
    the greedy margins of these random models, so every token equals one GPU's, batched and alone."""
    experts = ExpertOptions(backend=backend, slots=4 if backend == "slots" else None)
    want, want_alone = run(ckpts[preset], experts, graphs)
    assert want == want_alone
    batch, alone = run(ckpts[preset], experts, graphs, tensor_parallel_size=tp, expert_parallel_size=ep)
    assert batch == alone == want


@pytest.mark.parametrize("records", ["gloo", "pipe"])
def test_nccl_step_records_beside_the_collectives(ckpts, records):
    """EngineConfig.step_record_group gloo (host sockets) or pipe (one OS pipe per worker, dist/channel.py)
    beside NCCL collectives: graphs replay on both ranks, the tokens stay one GPU's, and every rank's
    expert statistics come back (the query over the same channel)."""
    experts = ExpertOptions(backend="slots", slots=4)
    want, _ = run(ckpts["tiny"], experts, True)
    batch, alone = run(ckpts["tiny"], experts, True, expert_parallel_size=2, step_record_group=records)
    assert batch == alone == want


@pytest.mark.parametrize("preset,backend", [("tiny", "slots"), ("tiny-dsv3", "resident")])
def test_nccl_columns_expert_split_equals_one_gpu(ckpts, preset, backend):
    """--expert-split columns over NCCL: each rank's I/2-wide expert rows through the Triton kernels, the
    extra all-reduce inside the decode graphs; greedy tokens equal one GPU's."""
    experts = ExpertOptions(backend=backend, slots=4 if backend == "slots" else None, split="columns")
    want, _ = run(ckpts[preset], experts, True)
    batch, alone = run(ckpts[preset], experts, True, tensor_parallel_size=2)
    assert batch == alone == want
