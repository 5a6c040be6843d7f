"""Speculative decoding on CUDA (docs/speculative.md): the eager verify steps against the same engine
without speculation (decode steps replayed from CUDA graphs), greedy, float32, for n-gram drafts on
the embedded model and MTP drafts on a tiny DeepSeek-V3 with its MTP layer (every step eager there),
resident and slots backends; glm5_next's eager verify steps (state rollback, the kpool kernels);
expert-aware k's timed costs on the GPU (the link slower than HBM, an eager step dearer than a graph
replay).

NOTE: the verify step runs k + 1 tokens per sequence through kernels that may round differently from
the one-token decode graph's; float32 on these tiny models leaves no near-tie, so the tokens must be
equal, and a mismatch is a bug to look at before it is called rounding."""

from __future__ import annotations

import pytest
import torch

from moetier.checkpoint.writer import make_checkpoint
from moetier.engine.llm import LLM
from moetier.experts.placement import ExpertOptions
from moetier.sampling_params import SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

CODE = ["def foo(self):\n    return self.foo\n\ndef bar(self):\n    return self.",
        "import os\nimport sys\nimport os.path\nimport"]


def tokens(outs):
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("experts", [ExpertOptions("resident"), ExpertOptions("slots", slots=8)],
                         ids=["resident", "slots"])
def test_ngram_on_cuda_equals_graph_decode(experts):
    params = SamplingParams(max_tokens=48, ignore_eos=True)
    plain = LLM(None, device="cuda", dtype="float32", experts=experts)
    ps = [plain.encode(p) for p in CODE]
    want = tokens(plain.generate(ps, params))
    assert plain.runner.graph_steps > 0
    llm = LLM(None, device="cuda", dtype="float32", experts=experts,
              speculative_config={"method": "ngram", "num_speculative_tokens": 3, "expert_aware_k": False})
    assert tokens(llm.generate(ps, params)) == want
    assert llm.metrics()["spec_decode_num_accepted_tokens"] > 0 and llm.steps < plain.steps


def test_mtp_on_cuda_equals_plain(tmp_path):
    path = make_checkpoint(tmp_path / "m", "tiny-dsv3", seed=3, dtype="float32", mtp_layers=1)
    g = torch.Generator().manual_seed(1)
    ps = [torch.randint(0, 400, (n,), generator=g).tolist() for n in (5, 17, 30)]
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    want = tokens(LLM(path, device="cuda", dtype="float32").generate(ps, params))
    # a fixed k: expert-aware k prices steps by timings, and where it keeps k = 0 no draft is verified
    llm = LLM(path, device="cuda", dtype="float32",
              speculative_config={"method": "mtp", "num_speculative_tokens": 3, "expert_aware_k": False})
    assert llm.runner.graphs is None  # an engine drafting with MTP captures no decode graphs
    assert tokens(llm.generate(ps, params)) == want
    m = llm.metrics()
    assert m["spec_decode_num_draft_tokens"] > 0
    llm.scheduler.check()


def test_glm5_next_eager_verify_on_cuda_equals_graph_decode(tmp_path):
    """tiny-glm5-next (KDA state rolled back on a rejection, the kpool indexer selecting a verify
    step's rows with its kernels): with drafts right up to one spoiled draft per request
    (tests/test_spec_engine.oracle), the eager verify steps give the graph-decoded tokens."""
    pytest.importorskip("fla", reason="fla-core is not installed (pip install fla-core==0.6.0)")
    from tests.test_spec_engine import oracle_against_plain

    path = make_checkpoint(tmp_path / "g", "tiny-glm5-next", seed=5, dtype="float32")
    prompts, params, want, plain, llm, seen = oracle_against_plain(path, (9, 40, 21), 2, "cuda")
    assert plain.runner.graph_steps > 0
    assert tokens(llm.generate(prompts, params)) == want
    assert max(seen) == 3 and min(seen) < 3, seen
    llm.scheduler.check()


def test_expert_aware_k_prices_the_link_above_hbm():
    llm = LLM(None, device="cuda", dtype="bfloat16", experts=ExpertOptions("slots", slots=8),
              speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    chooser = llm.scheduler.spec.chooser
    c = chooser.costs
    assert c.link_expert_s > c.hbm_expert_s > 0
    # timed on the decode graphs after capture: an eager step's launches cost more than a replay's
    assert chooser.eager_s > 0 and chooser.replay_batch == llm.runner.graphs.max_batch and c.per_token_s >= 0
    p = llm.encode(CODE[0])
    llm.generate([p], SamplingParams(max_tokens=32, ignore_eos=True))
    assert sum(llm.metrics()["spec_decode_k_chosen"].values()) == llm.steps
