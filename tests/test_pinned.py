"""Pinned experts (experts/cache/split.py) on the CPU: the map marks them as permanent hits at rows after
the slots, the host store backs only the cached rows, and every backend path with a split stays
bit-exact against resident while the pinned experts' host rows hold NaN (a read of one would show)."""

from __future__ import annotations

import pytest
import torch

from moetier.experts.backends import ResidentExperts, SlotExperts
from moetier.experts.cache.slots import SlotCache, policy_for
from moetier.experts.cache.split import (backed_ranges, cached_run, check_pinned, local_pinned, read_pinned_file,
                                         runs, write_pinned_file)
from moetier.experts.cache.store import PAGE, HostStore
from moetier.experts.shape import RowLayout
from tests.test_slots import step

E, K, H, I = 12, 3, 40, 24
PINNED = (1, 4, 5, 11)


def test_pinned_are_permanent_hits_by_hand():
    c = SlotCache(num_experts=10, num_slots=2, pinned=(7, 3))
    assert c.pinned == (3, 7) and c.num_rows == 4
    # 3 and 7 sit at rows 2 and 3 (after the 2 slots) from the start: hits, no fill, no slot taken
    assert step(c, [[3, 7]]) == ([[2, 3]], [])
    assert step(c, [[0, 3], [1, 7]]) == ([[0, 2], [1, 3]], [(0, 0), (1, 1)])
    # three cached misses, two slots: 8 and 9 take them, 6 overflows; the pinned experts are never
    # victims, though the step needs more experts than there are slots
    assert step(c, [[8, 3], [9, 7], [6, 3]]) == ([[0, 2], [1, 3], [-1, 2]], [(8, 0), (9, 1)])
    assert c.read_stats() == {"hits": 6, "misses": 4, "overflow": 1, "steps": 3, "pinned": 6}
    assert c.stamp.tolist() == [2, 2] and c.slot_expert.tolist() == [8, 9]  # pinned rows take no stamp
    c.reset()
    c.check()
    assert c.expert_slot.tolist() == [-1, -1, -1, 2, -1, -1, -1, 3, -1, -1] and c.read_stats()["hits"] == 0


def test_check_catches_a_lost_pinned_expert():
    c = SlotCache(num_experts=8, num_slots=3, pinned=(2,))
    c.expert_slot[2] = -1
    with pytest.raises(AssertionError, match="pinned expert 2 maps to -1"):
        c.check()


def test_bad_pinned_sets():
    with pytest.raises(ValueError, match="slots must be in 1..6"):
        SlotCache(num_experts=8, num_slots=7, pinned=(0, 1))
    with pytest.raises(ValueError, match="distinct ids in 0..7"):
        SlotCache(num_experts=8, num_slots=2, pinned=(9,))
    assert check_pinned((0, 0), 8, 1) == ["pinned experts [0, 0] repeat an id"]
    assert check_pinned(tuple(range(8)), 8, 1) == ["all 8 experts pinned: that is the resident backend"]
    assert check_pinned((1, 2), 8, 7) == ["7 slots for the 6 cached experts: give at most that"]


def test_backed_ranges_cover_every_cached_byte_and_merge_shared_pages():
    assert runs([0, 1, 2, 5, 7, 8]) == [(0, 3), (5, 6), (7, 9)]
    # rows of 3 pages: cached 0, 2, 3 -> [0, 3p) and [6p, 12p); the pinned row 1 stays unbacked
    assert backed_ranges(4, (1,), 3 * PAGE, PAGE) == [(0, 3 * PAGE), (6 * PAGE, 12 * PAGE)]
    # rows of 100 bytes: every page is shared, one range
    assert backed_ranges(200, (5, 6, 100), 100, 4096) == [(0, 20480)]
    for e, pinned, row in ((9, (0, 8), 5000), (30, (3, 4, 5, 29), 7000), (5, (2,), 4096)):
        got = backed_ranges(e, pinned, row, 4096)
        for x in range(e):
            if x in pinned:
                continue
            assert any(a <= x * row and (x + 1) * row <= b for a, b in got), (e, pinned, x)
        assert all(a % 4096 == 0 and b % 4096 == 0 for a, b in got)
        assert all(b1 < a2 for (_, b1), (a2, _) in zip(got, got[1:]))  # disjoint, not touching
    # expert 0 pinned: the block's first page is still backed (the address kernels are handed)
    assert backed_ranges(4, (0, 1), 3 * PAGE, PAGE) == [(0, PAGE), (6 * PAGE, 12 * PAGE)]


def test_store_holds_only_cached_rows():
    lay = RowLayout(H, I)
    store = HostStore([0, 1], E, lay, torch.float32, pin=False, pinned={1: PINNED})
    row = lay.numel * 4
    assert store.requested_bytes == (2 * E - len(PINNED)) * row
    assert store.allocated_bytes <= store.requested_bytes + 2 * len(PINNED) * PAGE + 2 * PAGE
    assert store.rows(1).shape == (E, lay.numel) and bool((store.rows(1)[list(PINNED)] == 0).all())
    assert cached_run(store.rows(1), PINNED).shape[0] == 5  # experts 6..10
    assert local_pinned((0, 3, 4, 9), 1, 2) == (1, 4) and local_pinned((0, 3, 4, 9), 0, 2) == (0, 2)


def test_pinned_file_round_trip(tmp_path):
    from moetier.errors import MoetierError

    write_pinned_file(tmp_path / "p.json", {3: (9, 1), 4: ()}, {"source": "test"})
    assert read_pinned_file(tmp_path / "p.json") == {3: (1, 9), 4: ()}
    (tmp_path / "bad.json").write_text('{"slots": {}}')
    with pytest.raises(MoetierError, match="not a pinned file"):
        read_pinned_file(tmp_path / "bad.json")


def split_backends(dtype, **kw):
    """Resident over every row; slots with PINNED on the device and NaN in their host rows."""
    lay = RowLayout(H, I)
    g = torch.Generator().manual_seed(0)
    rows = (torch.randn(E, lay.numel, generator=g) * 0.1).to(dtype)
    host = rows.clone()
    host[list(PINNED)] = float("nan")  # never read: a pinned expert's host row is not backed
    s = 3
    dev = torch.empty(s + len(PINNED), lay.numel, dtype=dtype)
    dev[s:] = rows[list(PINNED)]
    return lay, ResidentExperts(rows, lay, K, 8), dev, host, s, g


@pytest.mark.parametrize("prefill,stream", [("bypass", "ring"), ("bypass", "uva"), ("refresh", "uva")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_slots_with_pinned_bit_exact_under_churn(dtype, prefill, stream):
    lay, res, dev, host, s, g = split_backends(dtype)
    slots = SlotExperts(host, lay, K, s, 8, prefill=prefill, prefill_stream=stream, ring=(2, 2),
                        pinned=PINNED, device_rows=dev)
    for i in range(60):
        t = [1, 2, 5, 12][i % 4]  # 5 tokens x 3 pairs overflow 3 slots; 12 > decode_tokens: the large step
        x = torch.randn(t, H, generator=g).to(dtype)
        ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(t)])
        w = torch.rand(t, K, generator=g).to(dtype)
        assert torch.equal(slots.forward(x, ids, w), res.forward(x, ids, w)), i
        slots.cache.check()
    st = slots.stats()
    assert st["pinned"] > 20 and st["misses"] > 20 and st["overflow"] > 0 and st["bypassed"] == 15
    assert slots.nbytes()["host"] == (E - len(PINNED)) * lay.numel * dtype.itemsize


def test_hybrid_with_pinned_never_reads_a_pinned_host_row():
    from moetier.experts.hybrid.backend import HostPath, HybridExperts
    from moetier.experts.hybrid.cost_model import PathRates

    lay, res, dev, host, s, g = split_backends(torch.bfloat16)
    for link, tol in ((1e6, 0.0), (1e-3, 1e-2)):  # every miss over the link (bit-exact), every miss on the host
        rates = PathRates(link, {"bfloat16": 50.0, "float32": 50.0})
        hyb = HybridExperts(host, lay, K, s, 8, host=HostPath(lay, "grouped", 1, rates), pinned=PINNED,
                            device_rows=dev.clone())
        for i in range(12):
            t = [1, 3, 12][i % 3]
            x = torch.randn(t, H, generator=g).to(torch.bfloat16)
            ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(t)])
            w = torch.rand(t, K, generator=g)
            want, got = res.forward(x, ids, w).float(), hyb.forward(x, ids, w).float()
            assert bool(got.isfinite().all()) and (got - want).abs().max() <= tol * want.abs().max(), (link, i)
            hyb.cache.check()
        assert hyb.stats()["pinned"] > 0


def test_lfru_policy_with_pinned_matches_the_simulator():
    """The split simulator (traces/split_plan.py) counts what the cache counts."""
    import numpy as np

    from moetier.traces.split_plan import simulate_split

    g = torch.Generator().manual_seed(2)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(200)])
    cache = SlotCache(E, 4, policy=policy_for("lfru", 4, K), pinned=PINNED)
    for t in range(ids.shape[0]):
        cache.step_reference(ids[t:t + 1])
    got = simulate_split(np.asarray(ids), E, 4, "lfru", PINNED)
    want = cache.read_stats()
    assert (got.hits, got.misses, got.overflow, got.pinned) == (want["hits"], want["misses"], want["overflow"],
                                                               want["pinned"])


def test_two_simulated_ep_ranks_with_pinned_sum_to_one_process():
    """Expert parallelism: each rank pins its own share of the global pinned ids (local ids e // 2),
    the loader's home() sends them to its device block, and the ranks' sum is the one-process layer."""
    from moetier.experts.placement import ExpertOptions, ExpertPlacement
    from moetier.experts.shape import MoeShape
    from tests.test_ep_skip import NoGroup, close

    e, k = 16, 4
    shape = MoeShape(e, k, H, I)
    g = torch.Generator().manual_seed(4)
    rows = torch.randn(e, shape.layout.numel, generator=g) * 0.1
    one = ResidentExperts(rows, shape.layout, k, 8)
    opts = ExpertOptions("slots", slots=3, pinned={0: (0, 3, 5, 6, 11)})
    ranks = []
    for r in range(2):
        place = ExpertPlacement(shape, torch.float32, [0], opts, "cpu", 8, NoGroup(rank=r, world=2, ep=2))
        assert place.pinned == {0: local_pinned((0, 3, 5, 6, 11), r, 2)}
        host = place.rows(0)
        for expert in range(r, e, 2):
            dest, i = place.home(0, expert // 2, host)
            dest[i] = rows[expert]
        ranks.append(place.build(0, host))
    for t in (1, 3, 12):
        ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
        x, w = torch.randn(t, H, generator=g), torch.rand(t, k, generator=g)
        assert close(ranks[0].forward(x, ids, w) + ranks[1].forward(x, ids, w), one.forward(x, ids, w), 1e-5)
    assert sum(rk.inner.stats()["pinned"] for rk in ranks) > 0


def test_fp8_rows_with_pinned_bit_exact():
    """FP8 rows (uint8, scales in the row): the pinned block and the slots hold the same bytes."""
    from tests.test_host_ext import fp8_rows

    plain = RowLayout(256, 128)
    g = torch.Generator().manual_seed(7)
    src = (torch.randn(E, plain.numel, generator=g) * 0.05).to(torch.bfloat16)
    rows, lay = fp8_rows(src, plain), RowLayout(256, 128, "fp8")
    host = rows.clone()
    host[list(PINNED)] = 255  # the bytes of NaN scales and weights: a read of one would show
    dev = torch.empty(3 + len(PINNED), lay.numel, dtype=torch.uint8)
    dev[3:] = rows[list(PINNED)]
    res = ResidentExperts(rows, lay, K, 8)
    slots = SlotExperts(host, lay, K, 3, 8, pinned=PINNED, device_rows=dev)
    for i in range(16):
        t = [1, 4, 12][i % 3]
        x = torch.randn(t, 256, generator=g).to(torch.bfloat16)
        ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(t)])
        w = torch.rand(t, K, generator=g).to(torch.bfloat16)
        got = slots.forward(x, ids, w)
        assert bool(got.isfinite().all()) and torch.equal(got, res.forward(x, ids, w)), i
    assert slots.stats()["pinned"] > 0


def test_refresh_ranks_cached_experts_only():
    from moetier.experts.prefill.cache_policy import refresh_reference

    c = SlotCache(E, 2, pinned=PINNED)
    # pinned 1, 4, 5, 11 are the most used, then 7 and 2: the two slots go to 7 and 2
    ids = torch.tensor([[1, 4, 5], [1, 4, 11], [1, 5, 7], [4, 7, 2], [2, 11, 9]])
    miss = refresh_reference(c, ids)
    n = int(miss.count)
    assert sorted(miss.expert[:n].tolist()) == [2, 7] and c.read_stats()["steps"] == 0
    c.check()
