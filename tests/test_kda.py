"""KDA's torch references (layers/kda_reference.py) against each other, mHC's Sinkhorn and the column
split of its decode kernel (layers/mhc_triton.py), and the state pool in the memory plan and the
engine: plain torch, no transformers."""

from __future__ import annotations

import pytest
import torch

from moetier.layers.kda_reference import causal_conv, causal_conv_step, kda_chunked, kda_recurrent
from moetier.layers.mhc import sinkhorn
from tests.test_parity import rel_err


def inputs(t: int, h: int = 3, dk: int = 16, dv: int = 8, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q, k = torch.randn(t, h, dk, generator=g), torch.randn(t, h, dk, generator=g)
    v = torch.randn(t, h, dv, generator=g)
    gate = -5 * torch.sigmoid(torch.randn(t, h, dk, generator=g))  # the lower-bounded forget gate
    beta = torch.rand(t, h, generator=g)
    return q, k, v, gate, beta, torch.randn(h, dk, dv, generator=g) * 0.1


def test_chunked_equals_recurrent_from_a_carried_state():
    q, k, v, g, beta, s0 = inputs(150)  # chunks 64, 64, 22
    o1, s1 = kda_chunked(q, k, v, g, beta, s0)
    o2, s2 = kda_recurrent(q, k, v, g, beta, s0)
    assert rel_err(o1, o2) <= 1e-5 and rel_err(s1, s2) <= 1e-5
    # split over two calls (a prompt over two steps): the second starts from the first's state
    oa, sa = kda_chunked(q[:50], k[:50], v[:50], g[:50], beta[:50], s0)
    ob, sb = kda_chunked(q[50:], k[50:], v[50:], g[50:], beta[50:], sa)
    assert rel_err(torch.cat([oa, ob]), o1) <= 1e-5 and rel_err(sb, s1) <= 1e-5
    # and the state matters: from zeros the outputs differ
    assert rel_err(kda_chunked(q, k, v, g, beta, torch.zeros_like(s0))[0], o1) > 1e-3


def test_conv_state_carries_over_steps():
    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(10, 6, generator=g), torch.randn(6, 1, 4, generator=g)
    whole, state = causal_conv(x, torch.zeros(6, 3), w)
    head, mid = causal_conv(x[:7], torch.zeros(6, 3), w)
    tail = []
    for t in range(7, 10):
        y, mid = causal_conv_step(x[t:t + 1], mid[None], w)
        mid = mid[0]
        tail.append(y)
    assert rel_err(torch.cat([head, *tail]), whole) <= 1e-6 and torch.equal(mid, state)
    assert torch.equal(state, x[-3:].t())  # the state is the last width - 1 inputs


def test_sinkhorn_is_doubly_stochastic():
    comb = torch.rand(5, 4, 4) + 0.1
    out = sinkhorn(comb, 20, 1e-6)
    assert torch.allclose(out.sum(-1), torch.ones(5, 4), atol=1e-3)
    assert torch.allclose(out.sum(-2), torch.ones(5, 4), atol=1e-5)


def test_plan_counts_the_state_slots():
    """GLM-5.3-Flash: 34 KDA layers x (64 heads x 128 x 128 fp32 + the conv's 3 inputs of 3 x 8192
    channels) per sequence, for max_num_seqs + 1 slots; the latent pages hold the 11 MLA layers only."""
    from moetier.plan.memory import PlanRequest, count
    from moetier.presets import preset

    cfg = preset("glm-5.3-flash")
    per_seq = 34 * (64 * 128 * 128 * 4 + 3 * 8192 * 3 * 2)
    items = {n: {i.name: i for i in count(PlanRequest(cfg, torch.bfloat16, max_num_seqs=n, max_model_len=4096)).device}
             for n in (8, 64)}
    for n, plan in items.items():
        assert abs(plan["KDA state slots"].bytes - (n + 1) * per_seq) < 2**21  # allocator rounding
    assert (64 + 1) * per_seq / 2**30 > 8.5  # the figure: about 8.5 GiB at 64 sequences
    assert "16,896 B/token" in items[8]["KV pages"].note  # 11 layers x (512 latent + 256 index key) x 2 B


def test_plan_counts_the_indexers_decode_selection():
    """The fixed-shape decode selection scores every page-table row, so the graph pool grows with the
    model length: GLM-5.3-Flash at batch 64 and 32,768 tokens, the kernels' float32 scores of 2,048
    pools a row, topk's 128 picks (values and indices) and the 2,063 tokens a row (the [k | gate]
    rows are read in place); GLM-5's [N, C] float32 scores (its kernel reads the keys in place), topk's
    2,048 picks and the 2,048 positions a row; none for Qwen3."""
    from moetier.plan.memory import PlanRequest, count
    from moetier.presets import preset

    bf = torch.bfloat16
    cfg = preset("glm-5.3-flash")
    assert cfg.decode_selection_activations(64, 32768, bf) == [64 * 2048 * 4, 64 * 128 * 4, 64 * 128 * 8, 64 * 2063 * 4]
    dsa = preset("glm-5")
    assert dsa.decode_selection_activations(64, 32768, bf) == [64 * 32768 * 4, 64 * 2048 * 4, 64 * 2048 * 8,
                                                               64 * 2048 * 4]
    assert preset("qwen3-30b-a3b").decode_selection_activations(64, 32768, bf) == []

    def pool(c, length):
        req = PlanRequest(c, bf, "cuda", max_num_seqs=64, max_model_len=length)
        return {i.name: i for i in count(req).device}["CUDA graph pool"].bytes

    # the scores 8 times wider at 32,768 rows a sequence than at 4,096; and at 32,768 two narrower context
    # buckets (4,096 and 16,384 tokens: engine/graphs.py) keep their own fp32 logits for each size 1..64
    grown = pool(cfg, 32768) - pool(cfg, 4096)
    buckets = 2 * sum((1, 2, 4, 8, 16, 32, 64)) * cfg.vocab_size * 4
    wider = sum(cfg.decode_selection_activations(64, 32768, bf)) - sum(cfg.decode_selection_activations(64, 4096, bf))
    assert wider == 7 * 64 * 256 * 4 and abs(grown - wider - buckets) < 2**23  # the allocator's rounding
    assert pool(preset("qwen3-30b-a3b", 4), 32768) == pool(preset("qwen3-30b-a3b", 4), 4096)


def test_engine_allocates_what_the_plan_counts(tmp_path):
    from moetier.checkpoint.writer import make_checkpoint
    from moetier.engine.kv_setup import num_checkpoints
    from moetier.engine.llm import LLM
    from moetier.sampling_params import SamplingParams

    path = make_checkpoint(tmp_path / "ckpt", "tiny-glm5-next", seed=0, dtype="float32")
    llm = LLM(path, device="cpu", max_num_seqs=3)
    spec = llm.model.kv_spec()
    # 3 sequences + the spare slot + 3 prefix-cache state checkpoints (engine/kv_setup.py)
    slots = 3 + 1 + num_checkpoints(llm.config, spec, torch.float32)
    assert slots == 7
    assert llm.kv.state.nbytes() == sum(spec.state.tensor_bytes(torch.float32, slots)) == \
        slots * spec.state_bytes_per_seq(torch.float32)
    outs = llm.generate([[1, 2, 3]] * 4 + [[9] * 70], SamplingParams(max_tokens=5, ignore_eos=True))
    assert len({tuple(o.outputs[0].token_ids) for o in outs[:4]}) == 1  # equal prompts, equal tokens
    llm.scheduler.check()


@pytest.mark.parametrize("sh", [1, 128, 129, 800, 8192, 8193, 16384, 400000])
def test_mhc_split_covers_every_column_once(sh):
    from moetier.layers.mhc_triton import BLOCK, MAX_SPLIT, split_of

    chunk, split = split_of(sh)
    assert chunk % BLOCK == 0 and 1 <= split <= MAX_SPLIT
    assert (split - 1) * chunk < sh <= split * chunk  # no program without columns, none left over


def test_decode_gates_kernel_in_the_interpreter():
    """layers/kda_gates_triton.py (a CUDA decode step's gates in one launch) against the torch ops it
    replaces, in Triton's interpreter: tests/kda_gates_interpreter.py."""
    pytest.importorskip("triton")
    from tests.interpreter import run_script

    lines = [x for x in run_script("kda_gates_interpreter.py").splitlines() if x.startswith("kda_gates ")]
    assert len(lines) == 4 and sum("bfloat16" in x for x in lines) == 2 and sum("bounded=True" in x for x in lines) == 2
