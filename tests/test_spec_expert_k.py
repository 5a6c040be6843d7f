"""spec/expert_k.py: the cost model that picks k per step from acceptance and the slots' contents."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from moetier.spec.expert_k import AcceptanceMeter, StepCosts, choose_k, expected_tokens, step_seconds, used_probability

L, E, TOP = 8, 256, 8  # GLM-5-like: 256 experts, top-8: the union grows almost linearly
UNIFORM = torch.full((L, E), 1.0 / E)


def test_expected_tokens():
    a = torch.tensor([0.8, 0.5, 0.5])
    assert expected_tokens(a, 0) == 1.0
    assert expected_tokens(a, 1) == pytest.approx(1.8)
    assert expected_tokens(a, 3) == pytest.approx(1 + 0.8 + 0.4 + 0.2)


def test_union_of_experts_grows_with_tokens():
    used = used_probability(UNIFORM, TOP, 1)
    assert float(used.sum()) == pytest.approx(L * TOP)  # one token: exactly top_k per layer
    two = float(used_probability(UNIFORM, TOP, 2).sum()) / L
    assert two == pytest.approx(E * (1 - (1 - TOP / E) ** 2)) and TOP < two < 2 * TOP
    skewed = torch.zeros(L, E)
    skewed[:, :TOP] = 1.0 / TOP  # every token picks the same 8: the union never grows
    assert float(used_probability(skewed, TOP, 5).sum()) == pytest.approx(L * TOP)


def test_all_resident_speculates_and_misses_make_it_a_loss():
    """Resident (HBM reads only): verifying more tokens is cheap, a large k wins at good acceptance
    (its union still costs HBM reads: k = 3 loses to 2). Half the experts in slots with uniform
    routing: each extra token brings ~top_k/2 misses per layer over a link 75x slower than HBM, and
    k = 0 wins at the same acceptance."""
    acc = torch.tensor([0.8, 0.7, 0.6])
    costs = StepCosts.from_rates(2 * 2**30, 9_400_000, 4.2e12, 55e9, per_token_s=1e-5, per_draft_token_s=5e-5)
    all_in = torch.ones(L, E, dtype=torch.bool)
    k, rates = choose_k(3, 1, acc, UNIFORM, all_in, TOP, costs)
    assert k >= 2 and rates[k] > 1.4 * rates[0]
    half = torch.zeros(L, E, dtype=torch.bool)
    half[:, : E // 2] = True
    k, rates = choose_k(3, 1, acc, UNIFORM, half, TOP, costs)
    assert k == 0 and all(r < rates[0] for r in rates[1:])


def test_skewed_routing_into_the_slots_speculates():
    """The same half-size cache, but the routing concentrated on the resident experts (a trained
    model's skew): the extra tokens mostly hit, so k > 0 pays again."""
    acc = torch.tensor([0.8, 0.7, 0.6])
    costs = StepCosts.from_rates(2 * 2**30, 9_400_000, 4.2e12, 55e9, per_token_s=1e-5, per_draft_token_s=5e-5)
    half = torch.zeros(L, E, dtype=torch.bool)
    half[:, : E // 2] = True
    routing = torch.where(half, 0.999, 0.001) / (E // 2 * 0.999 + E // 2 * 0.001)
    k, _ = choose_k(3, 1, acc, routing, half, TOP, costs)
    assert k >= 2


def test_low_acceptance_and_draft_cost_choose_zero_and_hybrid_caps_a_miss():
    acc = torch.tensor([0.05, 0.05])
    costs = StepCosts(1e-3, 1e-4, 1e-6, 1e-6, per_draft_token_s=1e-4)
    assert choose_k(2, 4, acc, UNIFORM, torch.ones(L, E, dtype=torch.bool), TOP, costs)[0] == 0
    link = StepCosts(0.0, 1e-5, 1e-6, 1e-3)
    host = StepCosts(0.0, 1e-5, 1e-6, 1e-3, host_expert_s=2e-4)
    assert host.miss_expert_s == pytest.approx(1 / (1e3 + 5e3))  # both paths at once: their rates add
    none = torch.zeros(L, E, dtype=torch.bool)
    assert step_seconds(1, 1, UNIFORM, none, TOP, host) < step_seconds(1, 1, UNIFORM, none, TOP, link) / 4
    with pytest.raises(ValueError, match="fewer than max_k"):
        choose_k(3, 1, acc, UNIFORM, none, TOP, costs)


def test_an_eager_verify_against_a_replayed_decode():
    """A verify step runs eagerly, a k = 0 step replays a graph: the launches the graph saves are
    charged to every k > 0 once per step. Resident at good acceptance k = 2 wins; with an eager
    step costing twice the whole replayed step, k = 0 does."""
    acc = torch.tensor([0.8, 0.7, 0.6])
    costs = StepCosts.from_rates(2 * 2**30, 9_400_000, 4.2e12, 55e9, per_token_s=1e-5)
    all_in = torch.ones(L, E, dtype=torch.bool)
    assert choose_k(3, 1, acc, UNIFORM, all_in, TOP, costs)[0] >= 2
    t0 = step_seconds(0, 1, UNIFORM, all_in, TOP, costs)
    eager = replace(costs, eager_s=2 * t0)
    assert step_seconds(0, 1, UNIFORM, all_in, TOP, eager) == t0
    assert step_seconds(1, 1, UNIFORM, all_in, TOP, eager) == pytest.approx(
        step_seconds(1, 1, UNIFORM, all_in, TOP, costs) + 2 * t0)
    assert choose_k(3, 1, acc, UNIFORM, all_in, TOP, eager)[0] == 0


def test_chained_mtp_passes_are_charged_per_draft_after_the_first():
    acc = torch.tensor([0.9, 0.9, 0.9])
    all_in = torch.ones(L, E, dtype=torch.bool)
    costs = StepCosts(1e-3, 0.0, 1e-9, 1e-9)
    passes = replace(costs, draft_pass_s=2e-3)
    for k in range(4):  # draft 1 comes from the catch-up, which runs whatever k is
        extra = step_seconds(k, 1, UNIFORM, all_in, TOP, passes) - step_seconds(k, 1, UNIFORM, all_in, TOP, costs)
        assert extra == pytest.approx(max(k - 1, 0) * 2e-3)
    assert choose_k(3, 1, acc, UNIFORM, all_in, TOP, costs)[0] == 3
    assert choose_k(3, 1, acc, UNIFORM, all_in, TOP, passes)[0] == 1  # each further pass doubles the step


def test_acceptance_meter_counts_each_position_where_it_was_tried():
    m = AcceptanceMeter(3, prior=0.5, decay=0.0)  # decay 0: the last step's fractions
    # accepted 0 of 3, 1 of 3, 3 of 3, 2 of 2: position 0 tried by all 4 (kept by 3), position 1 by
    # the last 3 (kept by 2), position 2 by the third only (the 2-draft sequence never drafted it)
    m.update(torch.tensor([0, 1, 3, 2]), torch.tensor([3, 3, 3, 2]))
    assert m.rate.tolist() == pytest.approx([3 / 4, 2 / 3, 1.0])
    slow = AcceptanceMeter(2, prior=0.5, decay=0.9)
    slow.update(torch.tensor([0]), torch.tensor([0]))  # nothing tried: unchanged
    assert slow.rate.tolist() == [0.5, 0.5]
    slow.update(torch.tensor([1]), torch.tensor([1]))
    assert slow.rate[0] == pytest.approx(0.9 * 0.5 + 0.1) and slow.rate[1] == 0.5
