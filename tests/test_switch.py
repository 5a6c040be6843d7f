"""engine/switch.Switch: which graph of a hybrid engine a decode step replays, judged by the cost
model on the recent misses and by the clock on the steps of each variant (fake counters, fake clock)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from moetier.engine.switch import Switch
from moetier.experts.hybrid.cost_model import PathRates
from moetier.experts.hybrid.backend import HostPath, HybridExperts
from moetier.experts.shape import RowLayout


def backend() -> HybridExperts:
    """A small hybrid backend whose cost model (link 50, host 50 GB/s) prices the host's saving."""
    lay = RowLayout(64, 32)
    rows = (torch.randn(16, lay.numel, generator=torch.Generator().manual_seed(0)) * 0.1).to(torch.bfloat16)
    rates = PathRates(50.0, {"bfloat16": 50.0, "float32": 50.0})
    return HybridExperts(rows, lay, 4, 6, decode_tokens=16, host=HostPath(lay, "grouped", 2, rates))


def test_switch_replays_pieces_only_while_misses_pay_for_them():
    b = backend()  # a real cost model (link 50, host 50 GB/s); the counters are set by hand
    fake = SimpleNamespace(cache=SimpleNamespace(stats=torch.zeros(4, dtype=torch.int64)), host_count=lambda: 0,
                           host_only_steps=0, host_saving_s=b.host_saving_s)
    sw = Switch([fake, fake], window=4, clock=StepClock().now)  # both variants equally fast: the model decides
    saving_at_4 = 2 * b.host_saving_s(4.0)
    assert saving_at_4 > 0 and b.host_saving_s(0.0) == 0.0 and b.host_saving_s(1.0) == 0.0

    def window(misses_per_layer_step, overhead):
        out = []
        for _ in range(4):
            fake.cache.stats += torch.tensor([0, misses_per_layer_step, 0, 1])
            out.append(sw.choose(overhead))
        return out
    assert window(4, overhead=saving_at_4 / 2) == [False] * 3 + [True]  # starts whole; 4 misses pay
    assert window(0, overhead=saving_at_4 / 2) == [True] * 3 + [False]  # no misses: the whole graph
    assert sw.last_misses_per_layer_step == 0.0
    assert window(4, overhead=saving_at_4 * 2) == [False] * 4  # misses, but not worth the syncs
    assert window(4, overhead=saving_at_4 / 2) == [False] * 3 + [True]
    assert sw.counts == {"pieces": 5, "whole": 11}
    assert Switch([fake]).pieces is False  # a fresh switch starts on the whole graph
    with pytest.raises(ValueError, match="window"):
        Switch([fake], window=0)


class StepClock:
    """A fake perf_counter: each read is `step` seconds after the one before."""

    def __init__(self, step: float = 1e-3):
        self.t, self.step = 0.0, step

    def now(self) -> float:
        self.t += self.step
        return self.t


def test_switch_keeps_the_whole_graph_where_the_pieces_measure_slower():
    """The cost model says pieces (4 misses a layer-step, a cheap overhead), but steps on pieces take
    twice as long: after one window of each the switch stays whole, trying pieces one window in `probe`;
    when the pieces become faster, the next probe keeps them."""
    b = backend()
    fake = SimpleNamespace(cache=SimpleNamespace(stats=torch.zeros(4, dtype=torch.int64)), host_count=lambda: 0,
                           host_only_steps=0, host_saving_s=b.host_saving_s)
    clock = StepClock()
    sw = Switch([fake], window=4, probe=3, clock=clock.now)
    cost = {True: 2e-3, False: 1e-3}  # a step's seconds on pieces / whole

    def windows(n: int, size: int = 8) -> list[bool]:
        out = []
        for _ in range(n * 4):
            fake.cache.stats += torch.tensor([0, 4, 0, 1])
            out.append(sw.choose(0.0, size))
            clock.step = cost[out[-1]]  # the next read comes after this step
        return out[3::4]  # each window's variant: its last step's, the first three being the last window's
    got = windows(7)
    # the start is whole; then pieces (the model; nothing measured yet); then whole, but pieces in every
    # third window (the probe)
    assert got == [True, False, True, False, False, True, False]
    assert sw.median_s[8, True] == pytest.approx(2e-3) and sw.median_s[8, False] == pytest.approx(1e-3)
    cost[True] = 0.5e-3  # the pieces got faster: the probe measures it, and they stay
    assert windows(3) == [False, True, True]
    assert windows(2) == [True, True]
    assert sw.choose(0.0, 16) is True  # another size has no whole-graph figure yet: the model decides


def test_switch_reads_a_device_counter_of_host_experts_with_the_cache_counters():
    """The nodes mode counts its host experts on the device (a tensor of one element): the switch's m sums
    them with the misses and overflow of every backend, eager backends' int counts included."""
    b = backend()
    nodes = SimpleNamespace(cache=SimpleNamespace(stats=torch.zeros(4, dtype=torch.int64)),
                            counters=torch.zeros(2, dtype=torch.int64), host_only_steps=0,
                            host_saving_s=b.host_saving_s)
    nodes.host_count = lambda: nodes.counters[:1]
    eager = SimpleNamespace(cache=SimpleNamespace(stats=torch.zeros(4, dtype=torch.int64)), host_count=lambda: 3,
                            host_only_steps=1, host_saving_s=b.host_saving_s)
    sw = Switch([nodes, eager], window=2, clock=StepClock().now)
    for _ in range(2):
        nodes.cache.stats += torch.tensor([5, 1, 1, 1])
        nodes.counters += torch.tensor([2, 4])
        eager.cache.stats += torch.tensor([5, 2, 0, 1])
        sw.choose(0.0)
    # over the window: misses 2 + 4, overflow 2, host 4 (device) + 3 - 3 (the int did not move); steps 2 + 2
    assert sw.last_misses_per_layer_step == pytest.approx((2 + 4 + 2 + 4) / 4)
