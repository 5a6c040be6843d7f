from __future__ import annotations

import pytest
import torch

from moetier.errors import MoetierError
from moetier.layers.sampler import filter_top_k_top_p, sample, token_logprobs
from moetier.sampling_params import SamplingParams


def draw(logits, params, n):
    seed = params.noise_seed()
    return [int(sample(logits[None], [params], [seed], [i])[0]) for i in range(n)]


def test_greedy_is_argmax():
    logits = torch.randn(5, 1000)
    p = SamplingParams(temperature=0.0)
    got = sample(logits, [p] * 5, [0] * 5, [0] * 5)
    assert torch.equal(got, logits.argmax(-1))


def test_same_seed_same_tokens_other_seed_other_tokens():
    logits = torch.randn(300)
    a = draw(logits, SamplingParams(temperature=1.0, seed=7), 50)
    b = draw(logits, SamplingParams(temperature=1.0, seed=7), 50)
    c = draw(logits, SamplingParams(temperature=1.0, seed=8), 50)
    assert a == b and a != c


def test_top_k_never_leaves_its_support():
    logits = torch.randn(200)
    support = set(torch.topk(logits, 5).indices.tolist())
    picks = draw(logits, SamplingParams(temperature=2.0, top_k=5, seed=1), 400)
    assert set(picks) <= support and len(set(picks)) == 5


def test_top_p_never_leaves_its_support():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.04, 0.01])
    logits = probs.log()
    # p = 0.75: 0.5 + 0.3 passes it, so exactly the first two tokens stay.
    picks = draw(logits, SamplingParams(temperature=1.0, top_p=0.75, seed=2), 400)
    assert set(picks) == {0, 1}
    picks = draw(logits, SamplingParams(temperature=1.0, top_p=0.85, seed=3), 600)
    assert set(picks) == {0, 1, 2}


def test_top_p_tiny_keeps_the_top_token():
    logits = torch.randn(2, 50)
    out = filter_top_k_top_p(logits, torch.tensor([0, 3]), torch.tensor([1e-6, 1.0]))
    assert torch.isfinite(out[0]).sum() == 1 and out[0].argmax() == logits[0].argmax()
    assert torch.isfinite(out[1]).sum() == 3


def test_sampling_follows_the_distribution():
    probs = torch.tensor([0.1, 0.2, 0.3, 0.4])
    picks = torch.tensor(draw(probs.log(), SamplingParams(temperature=1.0, seed=4), 4000))
    freq = torch.bincount(picks, minlength=4).float() / len(picks)
    assert (freq - probs).abs().max() < 0.03


def test_temperature_sharpens():
    logits = torch.tensor([0.0, 1.0])
    cold = draw(logits, SamplingParams(temperature=0.1, seed=5), 300)
    hot = draw(logits, SamplingParams(temperature=5.0, seed=5), 300)
    assert cold.count(1) > 295 and 100 < hot.count(1) < 220


def test_rows_are_independent_of_batch():
    logits = torch.randn(3, 100)
    ps = [SamplingParams(temperature=1.0, seed=s) for s in (1, 2, 3)]
    batch = sample(logits, ps, [p.seed for p in ps], [5, 6, 7])
    alone = [int(sample(logits[i:i + 1], [ps[i]], [ps[i].seed], [5 + i])[0]) for i in range(3)]
    assert batch.tolist() == alone


@pytest.mark.parametrize("bad", [dict(temperature=-1), dict(top_p=0), dict(top_p=1.5), dict(top_k=-2),
                                 dict(max_tokens=-1), dict(stop=[""]), dict(logit_bias={5: 101.0}),
                                 dict(logit_bias={-1: 1.0}), dict(logit_bias={5: float("nan")})])
def test_invalid_params(bad):
    with pytest.raises(MoetierError, match="invalid sampling parameters"):
        SamplingParams(**bad).validate()


def test_noise_is_uniform_and_keyed_by_seed_and_step():
    from moetier.layers.sampler import uniform_noise

    u = uniform_noise(torch.tensor([1, 1, 2]), torch.tensor([0, 1, 0]), 50_000)
    assert u.shape == (3, 50_000) and bool(((u > 0) & (u < 1)).all())
    for row in u:  # moments of U(0, 1): mean 1/2, variance 1/12; no value repeated much
        assert abs(float(row.mean()) - 0.5) < 0.01 and abs(float(row.var()) - 1 / 12) < 0.005
        assert row.unique().numel() > 49_000
    assert not torch.equal(u[0], u[1]) and not torch.equal(u[0], u[2])
    again = uniform_noise(torch.tensor([2, 1]), torch.tensor([0, 1]), 50_000)
    assert torch.equal(again[0], u[2]) and torch.equal(again[1], u[1])
    # neighbouring entries are uncorrelated
    c = torch.corrcoef(torch.stack([u[0, :-1], u[0, 1:]]))[0, 1]
    assert abs(float(c)) < 0.02


def test_greedy_rows_stay_greedy_in_a_sampling_batch():
    logits = torch.randn(4, 300)
    ps = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.5, seed=1),
          SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, top_k=3, seed=2)]
    got = sample(logits, ps, [0, 1, 0, 2], [0, 0, 0, 0])
    assert got[0] == logits[0].argmax() and got[2] == logits[2].argmax()
    assert got[3] in torch.topk(logits[3], 3).indices


def test_mode_is_the_cheapest_that_covers_the_batch():
    from moetier.layers.sampler import mode_of

    assert mode_of([SamplingParams()]) == "greedy"
    assert mode_of([SamplingParams(), SamplingParams(temperature=0.7)]) == "sample"
    assert mode_of([SamplingParams(temperature=0.7, top_p=0.9)]) == "filter"
    assert mode_of([SamplingParams(top_k=5)]) == "greedy"  # top-k means nothing when greedy


def test_token_logprobs_are_log_softmax_of_the_raw_logits():
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0], [5.0, 5.0, -1.0, 0.0]])
    chosen, top, ids = token_logprobs(logits, torch.tensor([1, 2]), 2)
    z = torch.log(torch.exp(logits).sum(-1))
    assert torch.allclose(chosen, torch.stack([1.0 - z[0], -1.0 - z[1]]))
    assert ids[0].tolist() == [3, 2] and torch.allclose(top[0], torch.tensor([3.0, 2.0]) - z[0])
    assert set(ids[1].tolist()) == {0, 1} and torch.allclose(top[1], (5.0 - z[1]).expand(2))
    assert token_logprobs(logits, torch.tensor([0, 0]), 0)[1].shape == (2, 0)


def test_logit_bias_is_added_per_row_before_sampling():
    logits = torch.randn(3, 50)
    biased = SamplingParams(logit_bias={7: 100.0, 3: -100.0})
    plain = SamplingParams()
    got = sample(logits, [biased, plain, biased], [0] * 3, [0] * 3)
    assert got.tolist() == [7, int(logits[1].argmax()), 7]
    hot = SamplingParams(temperature=1.0, top_k=5, logit_bias={11: 100.0})
    assert draw(logits[0], hot, 20) == [11] * 20  # before the filters too: the biased token is in the top-k
    ban = SamplingParams(temperature=1.0, logit_bias={int(logits[0].argmax()): -100.0})
    assert int(logits[0].argmax()) not in draw(logits[0] * 0, ban, 200)  # a flat distribution, one id banned


def test_llm_refuses_a_logit_bias_outside_the_vocabulary():
    from moetier.engine.llm import LLM

    llm = LLM(None, device="cpu")
    with pytest.raises(MoetierError, match="below the vocabulary size 448"):
        llm.add_request("x", SamplingParams(logit_bias={448: 1.0}))
    out = llm.generate(["def f():"], SamplingParams(max_tokens=4, logit_bias={llm.encode("x")[0]: 100.0}))
    assert out[0].outputs[0].text == "xxxx"
