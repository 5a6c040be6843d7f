"""CUDA graphs of the verify step (engine/verify_graphs.py): n-gram speculation replays them, and its
tokens equal both the eager verify step's (the same engine with the graphs set aside) and plain
decoding's, greedy and sampled with filters, over a batch whose sequences drafted different numbers
of tokens (padded rows) and a captured size above the step's (padding sequences); GLM-5's DSA indexer
scoring the verified rows in place; the plan's graph pool holds what the capture allocated.

NOTE: float32 on the embedded tiny model leaves no near-tie (tests/test_spec_gpu.py), so the tokens
must be equal; a mismatch is a bug to look at before it is called rounding."""

from __future__ import annotations

import pytest
import torch

from moetier.engine.llm import LLM
from moetier.experts.placement import ExpertOptions
from moetier.sampling_params import SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

CODE = ["def foo(self):\n    return self.foo\n\ndef bar(self):\n    return self.",
        "import os\nimport sys\nimport os.path\nimport",
        "for i in range(10):\n    print(i)\nfor j in range(10):\n    print("]
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "expert_aware_k": False}


def tokens(outs):
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("experts", [ExpertOptions("resident"), ExpertOptions("slots", slots=8)],
                         ids=["resident", "slots"])
def test_verify_graphs_equal_the_eager_verify_and_plain_decoding(experts):
    llm = LLM(None, device="cuda", dtype="float32", experts=experts, speculative_config=NGRAM)
    assert llm.runner.verify is not None and (1, 4) in llm.runner.verify.graphs
    ps = [llm.encode(p) for p in CODE]
    greedy = SamplingParams(max_tokens=40, ignore_eos=True)
    sampled = [SamplingParams(max_tokens=40, ignore_eos=True, temperature=0.8, top_k=20, top_p=0.9, seed=s)
               for s in range(3)]
    got = [tokens(llm.generate(ps, greedy)), tokens(llm.generate(ps, sampled))]
    replays = llm.runner.verify_graph_steps
    assert replays > 0
    verify, llm.runner.verify = llm.runner.verify, None  # the same engine, its verify steps eager
    try:
        assert [tokens(llm.generate(ps, greedy)), tokens(llm.generate(ps, sampled))] == got
        assert llm.runner.verify_graph_steps == replays
    finally:
        llm.runner.verify = verify
    plain = LLM(None, device="cuda", dtype="float32", experts=experts)
    assert tokens(plain.generate(ps, greedy)) == got[0]
    assert llm.metrics()["spec_decode_num_accepted_tokens"] > 0
    llm.scheduler.check()


def test_a_batch_above_the_verify_graphs_runs_eagerly_and_equal():
    """max_num_seqs 4, decode_tokens 8: q = 4 holds 2 sequences, so a step of 3 sequences with 3
    drafts runs eagerly, and one of them alone (or with k = 1) replays."""
    llm = LLM(None, device="cuda", dtype="float32", speculative_config=NGRAM, max_num_seqs=4, decode_tokens=8)
    shapes = set(llm.runner.verify.graphs)
    assert (2, 4) in shapes and (4, 4) not in shapes and (4, 2) in shapes
    ps = [llm.encode(p) for p in CODE]
    params = SamplingParams(max_tokens=32, ignore_eos=True)
    got = tokens(llm.generate(ps, params))
    assert llm.runner.verify_graph_steps > 0
    assert got == tokens(LLM(None, device="cuda", dtype="float32", max_num_seqs=4, decode_tokens=8).generate(ps, params))


def test_dsa_verify_graphs_equal_plain_decoding(tmp_path):
    """tiny-glm5 (DSA indexer, index_topk 8: prompts longer than it, so the selection matters): the
    verify graphs score each verified row in place, and with drafts that are right up to one spoiled
    draft per request (tests/test_spec_engine.oracle) the tokens equal plain decoding's and the eager
    verify step's."""
    from moetier.checkpoint.writer import make_checkpoint
    from tests.test_spec_engine import oracle_against_plain

    path = make_checkpoint(tmp_path / "glm5", "tiny-glm5", seed=5, dtype="float32")
    prompts, params, want, plain, llm, seen = oracle_against_plain(path, (12, 30, 9), 3, "cuda")
    plain.close()
    assert llm.runner.verify is not None
    assert tokens(llm.generate(prompts, params)) == want
    assert llm.runner.verify_graph_steps > 0 and max(seen) == 3 and min(seen) < 3, seen
    llm.runner.verify = None  # the same engine, its verify steps eager
    assert tokens(llm.generate(prompts, params)) == want
    llm.scheduler.check()


def test_the_plan_holds_the_verify_graphs(tiny_ckpt):
    """generate with n-gram speculation audits the plan after graph capture: the allocated bytes match
    within the margin tests/test_gpu.py allows the tiny model (a process of its own, as there)."""
    import json
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "moetier.cli", "generate", "def foo(self):\n    return self.foo\n",
                        "--model", str(tiny_ckpt), "--device", "cuda", "--max-tokens", "16", "--max-model-len", "512",
                        "--speculative-config", json.dumps(NGRAM), "--json"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    d = json.loads(r.stdout)
    allocated = next(row for row in d["audit"][1]["rows"] if row["what"] == "torch allocated")
    assert abs(allocated["measured"] - allocated["planned"]) < 64 * 2**20, allocated
