"""The hybrid backend's cost model (experts/hybrid/cost_model.py), pure arithmetic driven directly: which
misses go over the link and which to the host cores, on synthetic bandwidths."""

from __future__ import annotations

import itertools
import random

import pytest

from moetier.experts.hybrid.cost_model import CostModel, PathRates

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


# the H200's measured rates (bench/results/h200-decode-hybrid-uniform-4b7b6ff.json): link, compiled bf16
# kernel, its per-call overhead and per-token cost
H200 = {"link": 55.52, "host": 84.23, "overhead": 109e-6, "token": 7.36e-6}


def test_paths_overlap_the_layer_takes_the_slower_not_the_sum():
    m = model(**H200)
    s = m.split([1] * 4)  # batch 1 at 50% of uniform routing: about 4 misses a layer
    assert s.num_host == 2  # 2 over the link (0.34 ms), 2 on the host (0.11 + 2 x 0.11 ms)
    assert s.seconds == max(s.link_s, s.host_s) < s.link_s + s.host_s
    assert s.seconds == pytest.approx(2 * ROW / (H200["link"] * 1e9))
    assert s.seconds < 0.51 * m.all_link_s(4)  # half the layer's miss time of the slots path


@pytest.mark.parametrize("m_misses", [1, 2, 3, 4, 6, 8, 12, 16, 24, 32])
def test_split_balances_the_two_paths(m_misses):
    m = model(**H200)
    s = m.split([1] * m_misses)
    n = s.num_host

    def at(k):  # predicted layer time with k misses on the host
        host = H200["overhead"] + k * m.host_row_s if k else 0.0
        return max((m_misses - k) * m.link_row_s, host)
    assert s.seconds == pytest.approx(at(n))
    assert all(at(n) <= at(k) + 1e-12 for k in range(m_misses + 1))  # no other count is faster
    if 0 < n < m_misses:  # both paths in use: within one miss of each other
        assert abs(s.link_s - s.host_s) <= max(m.link_row_s, m.host_row_s)


def test_fixed_costs_on_both_paths_do_not_move_the_split():
    # a cost both paths pay before they start (the layer's sync, the choice) adds to the layer's time
    # and changes no choice; only a cost on one path moves misses to the other
    m, tokens = model(**H200), [1, 2, 1, 1, 3, 1, 1, 2]
    base = m.split(tokens)
    both = m.split(tokens, queued_link_s=3e-4, queued_host_s=3e-4)
    assert both.host == base.host and both.seconds == pytest.approx(base.seconds + 3e-4)
    assert m.split(tokens, queued_host_s=3e-4).num_host <= base.num_host  # e.g. work queued on the host


def test_bad_rates_are_refused():
    with pytest.raises(ValueError, match="link bandwidth"):
        PathRates(0.0, {BF16: 1.0})
    with pytest.raises(ValueError, match="host bandwidth"):
        PathRates(1.0, {BF16: -1.0})
    with pytest.raises(ValueError, match="no measured host expert throughput for float8"):
        CostModel(PathRates(1.0, {BF16: 1.0}), ROW, "float8_e4m3fn")
    with pytest.raises(ValueError, match="at least one token"):
        model(1.0, 1.0).split([1, 0])


def test_rates_from_bench_refit_at_the_threads_in_use():
    from moetier.experts.hybrid.cost_model import rates_from_bench

    def row(threads, tokens, experts, ms, dtype="bf16"):
        return {"kernel": "compiled", "dtype": dtype, "threads": threads, "tokens": tokens, "experts": experts,
                "ms": ms}
    data = {"shape": {"dtype": "bf16", "row_bytes": {"bf16": ROW, "fp8": ROW // 2}},
            "winner": {"kernel": "compiled", "threads": 16, "GBps": 80.0, "overhead_s": 1e-4},
            "winners": {"fp8": {"kernel": "compiled", "threads": 16, "GBps": 50.0, "overhead_s": 1e-4}},
            "results": [row(16, 1, 1, 0.2), row(16, 1, 8, 1.0), row(16, 8, 8, 1.4),
                        row(15, 1, 1, 0.3), row(15, 1, 8, 1.7), row(15, 8, 8, 2.26),
                        row(15, 1, 1, 0.3, "fp8"), row(15, 1, 8, 1.0, "fp8")]}
    r16, r15, r9 = (rates_from_bench(data, 50.0, t) for t in (16, 15, 9))
    assert r16 == rates_from_bench(data, 50.0) and r16.host_GBps == {BF16: 80.0, "fp8": 50.0}
    assert r15.host_GBps[BF16] == pytest.approx(ROW / 0.2e-3 / 1e9)  # (1.7 - 0.3) / 7 ms per expert
    assert r15.host_overhead_s == pytest.approx(1e-4)
    assert r15.host_token_s == pytest.approx(0.56e-3 / 56)
    assert r15.host_GBps["fp8"] == pytest.approx(ROW // 2 / 0.1e-3 / 1e9)
    assert r9 == r16  # not measured at 9 threads: the winner's fit
