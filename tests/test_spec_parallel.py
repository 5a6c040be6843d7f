"""Speculative decoding with several ranks (2 gloo ranks on the CPU; dist/worker.py, engine/step.
StepVerdict): rank 0 verifies, and the workers get its verdict inside the step. Greedy tokens equal one
process's plain decoding; a worker rolls its recurrent state back where a draft was rejected (glm5_next
under expert parallelism: a worker left with the drafts in its state sends wrong expert partials); the
MTP passes run on every rank in step, so rank 0's MTP drafts equal one process's."""

from __future__ import annotations

import pytest

from moetier.checkpoint.writer import make_checkpoint
from moetier.engine.llm import LLM
from moetier.sampling_params import SamplingParams
from tests.test_spec_engine import MTP, NGRAM, oracle, tokens, workload

ENGINE = dict(device="cpu", dtype="float32", kv_tokens=256, page_size=16, max_num_seqs=8, dist_timeout_s=60.0)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("spec-par")
    return {"dsv3": make_checkpoint(root / "dsv3", "tiny-dsv3", seed=3, dtype="float32", mtp_layers=1),
            "glm5-next": make_checkpoint(root / "glm5n", "tiny-glm5-next", seed=2, dtype="float32")}


def test_workers_roll_recurrent_state_back_on_a_rejection(ckpts):
    one = LLM(ckpts["glm5-next"], **ENGINE)
    prompts, params = workload(one.cfg.vocab_size, n=4, seed=2)
    want = tokens(one.generate(prompts, params))
    llm = LLM(ckpts["glm5-next"], expert_parallel_size=2, speculative_config=NGRAM, **ENGINE)
    try:
        keys = [tuple(p) for p in prompts]
        seen = oracle(llm, dict(zip(keys, want)), {k: 1 + 2 * i for i, k in enumerate(keys)})
        assert tokens(llm.generate(prompts, params)) == want
        assert 0 in seen and 3 in seen  # rolled back and kept whole
        llm.scheduler.check()
    finally:
        llm.close()


@pytest.mark.parametrize("layout", [dict(expert_parallel_size=2), dict(tensor_parallel_size=2),
                                    dict(expert_parallel_size=2, step_record_group="pipe")], ids=["ep2", "tp2", "ep2-pipe"])
def test_mtp_passes_run_on_every_rank(ckpts, layout):
    prompts, params = workload(400, n=3, seed=4)
    plain = tokens(LLM(ckpts["dsv3"], **ENGINE).generate(prompts, params))
    runs = []
    for options in (dict(), layout):
        llm = LLM(ckpts["dsv3"], speculative_config=MTP, **ENGINE, **options)
        try:
            drafts, execute = [], llm.runner.execute

            def watched(step, execute=execute, drafts=drafts):
                out = execute(step)
                drafts.append(out.drafts)
                return out

            llm.runner.execute = watched
            assert tokens(llm.generate(prompts, params)) == plain
            runs.append(drafts)
        finally:
            llm.close()
    assert runs[0] == runs[1] and any(runs[0])


def test_ngram_on_tensor_parallel_ranks_equals_plain(ckpts):
    prompts, params = workload(400, n=3, seed=6)
    want = tokens(LLM(ckpts["dsv3"], **ENGINE).generate(prompts, params))
    llm = LLM(ckpts["dsv3"], tensor_parallel_size=2, speculative_config=NGRAM, **ENGINE)
    try:
        keys = [tuple(p) for p in prompts]
        seen = oracle(llm, dict(zip(keys, want)), {k: 2 + 3 * i for i, k in enumerate(keys)})
        assert tokens(llm.generate(prompts, params)) == want and len(set(seen)) >= 2
        assert llm.metrics()["spec_decode_num_accepted_tokens"] == sum(seen)
    finally:
        llm.close()


@pytest.mark.parametrize("method", ["ngram", "mtp"])
def test_expert_aware_k_prices_rank_0s_own_experts(ckpts, method):
    """Under EP2 the chooser prices rank 0's own experts; with MTP it leaves the chained pass untimed
    (rank 0 alone would run the pass's collectives without its workers: a hang)."""
    from moetier.experts.placement import ExpertOptions

    llm = LLM(ckpts["dsv3"], expert_parallel_size=2, experts=ExpertOptions("slots", slots=4),
              speculative_config={"method": method, "num_speculative_tokens": 3}, **ENGINE)
    try:
        chooser = llm.scheduler.spec.chooser
        assert chooser.own.tolist() == list(range(0, llm.cfg.num_experts, 2)) and chooser.costs.draft_pass_s == 0
        llm.generate([[5, 17, 99, 3] * 3], SamplingParams(max_tokens=12, ignore_eos=True))
        assert sum(llm.metrics()["spec_decode_k_chosen"].values()) > 0
    finally:
        llm.close()
