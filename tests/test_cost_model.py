"""The hybrid backend's cost model (experts/cost_model.py), pure arithmetic driven directly: which
misses go over the link and which to the host cores, on synthetic bandwidths."""

from __future__ import annotations

import itertools
import random

import pytest

from moetier.experts.cost_model import CostModel, PathRates

ROW = 9_437_184  # one Qwen3-30B-A3B expert in bf16, bytes
BF16 = "bfloat16"


def model(link: float, host: float, overhead: float = 0.0, token: float = 0.0) -> CostModel:
    return CostModel(PathRates(link, {BF16: host}, overhead, token), ROW, BF16)


# -- cost model -----------------------------------------------------------------------------------
def test_fast_link_sends_everything_over_it():
    s = model(link=1000.0, host=10.0).split([1] * 8)
    assert s.num_host == 0 and s.link_s == pytest.approx(8 * ROW / 1000e9)


def test_fast_host_takes_everything():
    s = model(link=1.0, host=1000.0, overhead=1e-5).split([1] * 8)
    assert s.num_host == 8 and s.link_s == 0.0


def test_equal_rates_split_in_half_and_zero_host_rate_never_used():
    s = model(link=50.0, host=50.0).split([1] * 8)
    assert s.num_host == 4 and s.link_s == pytest.approx(s.host_s)
    assert model(link=1.0, host=0.0).split([1] * 8).num_host == 0


def test_split_between_follows_the_rates():
    # link 55, host 65 GB/s, 0.05 ms per host call: of 8 misses the host should take 4 (3: link 0.86 ms)
    s = model(link=55.0, host=65.0, overhead=5e-5).split([1] * 8)
    assert s.num_host == 4
    assert s.seconds < model(link=55.0, host=65.0).all_link_s(8)


def test_host_takes_the_misses_with_fewest_tokens():
    # a host token costs 1 ms more: the host takes the two one-token misses, the link the rest
    tokens = [8, 1, 3, 1, 8, 2]
    s = model(link=50.0, host=50.0, token=1e-3).split(tokens)
    assert s.host == (False, True, False, True, False, False)


def test_queued_work_moves_misses_to_the_idle_path():
    m = model(link=50.0, host=50.0)
    assert m.split([1] * 8, queued_link_s=10.0).num_host == 8
    assert m.split([1] * 8, queued_host_s=10.0).num_host == 0


def test_split_is_optimal_against_every_subset():
    rnd = random.Random(0)
    for _ in range(40):
        tokens = [rnd.randint(1, 6) for _ in range(rnd.randint(1, 7))]
        m = model(link=rnd.uniform(5, 100), host=rnd.uniform(5, 100), overhead=rnd.uniform(0, 5e-4),
                  token=rnd.uniform(0, 5e-5))

        def cost(chosen):
            host = sum(m.host_cost(t) for t, h in zip(tokens, chosen) if h)
            host += m.rates.host_overhead_s if any(chosen) else 0.0
            return max((len(tokens) - sum(chosen)) * m.link_row_s, host)
        best = min(cost(c) for c in itertools.product((False, True), repeat=len(tokens)))
        assert m.split(tokens).seconds == pytest.approx(best)


def test_bad_rates_are_refused():
    with pytest.raises(ValueError, match="link bandwidth"):
        PathRates(0.0, {BF16: 1.0})
    with pytest.raises(ValueError, match="host bandwidth"):
        PathRates(1.0, {BF16: -1.0})
    with pytest.raises(ValueError, match="no measured host expert throughput for float8"):
        CostModel(PathRates(1.0, {BF16: 1.0}), ROW, "float8_e4m3fn")
    with pytest.raises(ValueError, match="at least one token"):
        model(1.0, 1.0).split([1, 0])
