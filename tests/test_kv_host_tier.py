"""The host KV tier: its slots and LRU, pinning, the copy plans, and the prefix cache over both tiers
(evicted to the host, brought back, the bytes checked on a fake device), plus random operation
sequences against the reference model with check() after every operation."""

from __future__ import annotations

import pytest

from moetier.engine.kv_host_tier import KVHostTier
from moetier.engine.pages import PagePool
from moetier.engine.prefix_cache import PrefixCache, hash_chain
from tests.prefix_reference import FakeDevice, keys_of, random_run

PS = 4



def test_a_chain_evicted_leaf_first_is_one_copy_run_each_way():
    from moetier.engine.kv_moves import runs

    host = KVHostTier(8)
    host.store(bytes([9]) * 32, 30)  # slot 0 taken: the chain starts at slot 1
    host.take_copies()
    chain = [bytes([i]) * 32 for i in range(1, 6)]  # pages 10..14, evicted from the leaf back
    host.store_many([(h, 10 + i) for i, h in reversed(list(enumerate(chain)))])
    host.check()
    plan = host.take_copies()
    assert plan.to_host == [(10, 1), (11, 2), (12, 3), (13, 4), (14, 5)]
    assert runs(plan.to_host) == [(10, 1, 5)], "one contiguous copy per layer row"
    assert [host.slot_of(h) for h in chain] == [1, 2, 3, 4, 5]
    host.store(bytes([7]) * 32, 31)  # one more page after the chain: the chain's leaf is evicted first
    host.store(bytes([8]) * 32, 32)
    host.store(bytes([6]) * 32, 33)  # the host is full: the page stored first (slot 0) goes
    host.store(bytes([10]) * 32, 34)  # then the chain's leaf, stored before its parents
    assert chain[4] not in host and all(h in host for h in chain[:4])
    for i, h in enumerate(chain[:3]):
        host.load(h, 40 + i)
    assert runs(host.take_copies().to_gpu) == [(1, 40, 3)]
    pages = PagePool(8)
    got = pages.allocate(3, "a") + pages.allocate(2, "b")
    pages.free(got[:3], "a")
    assert pages.allocate(4, "c") == [0, 1, 2, 5], "the lowest free pages first, in order"


def test_host_slots_lru_and_plan():
    host = KVHostTier(2)
    h1, h2, h3, h4 = (bytes([i]) * 32 for i in range(1, 5))
    assert host.store(h1, 10) == 0 and host.store(h2, 11) == 1
    assert host.store(h1, 12) is None, "already on the host: no second copy"
    assert host.store(h3, 13) == 1, "h2 was least recently used"
    host.check()
    assert host.take_dropped() == [h2] and h2 not in host
    plan = host.take_copies()
    assert plan.to_host == [(10, 0), (13, 1)] and plan.to_gpu == [], "h2's copy was dropped with it"
    host.pin([h1])  # h1 is least recently used now, but a pending load reads it
    assert host.store(h4, 14) == 1 and h1 in host and h3 not in host
    host.load(h1, 20)
    host.pin([h4])
    host.check()
    assert host.store(bytes(32), 15) is None and host.metrics.rejected == 1, "every slot pinned"
    plan = host.take_copies()
    assert plan.to_host == [(14, 1)] and plan.to_gpu == [(0, 20)]
    assert host.metrics.as_dict() == {"kv_host_hit_pages": 1, "kv_host_pages_to_host": 3,
                                      "kv_host_pages_to_gpu": 1, "kv_host_evictions": 2,
                                      "kv_host_rejected": 1}
    host.check()
    with pytest.raises(ValueError, match="at least one page"):
        KVHostTier(0)


def fill(cache, dev, rid, tokens):
    """Admit tokens: match, acquire, allocate, run the copies, check the hit's bytes, compute the rest."""
    hit = cache.match(tokens)
    pages = cache.acquire(rid, hit) + cache.allocate(rid, -(-len(tokens) // PS) - hit.num_pages)
    dev.run(cache.take_copies())
    keys = keys_of(tokens, PS, len(pages))
    assert [dev.gpu[p] for p in pages[:hit.num_pages]] == keys[:hit.num_pages], "a hit reused other KV"
    for p, key in zip(pages[hit.num_pages:], keys[hit.num_pages:]):
        dev.gpu[p] = key
    cache.insert(rid, tokens, len(tokens))
    cache.check()
    return hit


def test_evicted_to_host_and_brought_back():
    cache, dev = PrefixCache(PagePool(4), PS, host=KVHostTier(8)), FakeDevice()
    a, b = list(range(1, 14)), list(range(101, 114))  # 3 full pages and one token each
    fill(cache, dev, "a", a)
    cache.release("a")
    fill(cache, dev, "b", b)  # every page of the pool: a's three go to the host
    assert cache.match(a).gpu_pages == [None, None, None]
    cache.release("b")
    hit = fill(cache, dev, "a2", a)
    assert hit.num_tokens == 12 and hit.num_host_pages == 3
    m = cache.metrics_dict()
    assert (m["prefix_cache_hits"], m["kv_host_hits"], m["kv_host_hit_pages"]) == (12, 12, 3)
    assert m["kv_host_pages_to_host"] == 3 + 3 and m["kv_host_pages_to_gpu"] == 3  # b went out too
    assert cache.match(b).num_host_pages == 3


def test_a_match_continues_from_the_gpu_into_the_host_tier():
    cache, dev = PrefixCache(PagePool(5), PS, host=KVHostTier(8)), FakeDevice()
    a = list(range(1, 14))
    fill(cache, dev, "a", a)
    cache.release("a")
    cache.allocate("x", 3)  # two empty pages, then one eviction: a's tail page
    dev.run(cache.take_copies())
    hit = cache.match(a)
    assert hit.num_tokens == 12 and hit.gpu_pages[2] is None and None not in hit.gpu_pages[:2]
    cache.release("x")
    fill(cache, dev, "a2", a)
    assert cache.metrics.host_hits == 4


def two_pages_on_the_host():
    """A 4-page pool whose two cached pages (of a, 8 tokens) were pushed to the host; pool all empty."""
    cache, dev = PrefixCache(PagePool(4), PS, host=KVHostTier(8)), FakeDevice()
    a = list(range(1, 9))
    fill(cache, dev, "a", a + [0])
    cache.release("a")
    cache.allocate("x", 4)
    cache.release("x")
    dev.run(cache.take_copies())
    assert cache.match(a + [0]).gpu_pages == [None, None] and cache.pool.num_free == 4
    return cache, dev, a


def test_host_copy_is_kept_after_a_load():
    cache, dev, a = two_pages_on_the_host()
    fill(cache, dev, "a2", a + [0])  # back from the host
    cache.release("a2")
    cache.allocate("y", 4)  # evicted again: the host still holds both pages, so nothing is copied
    assert cache.take_copies().to_host == [] and cache.host.metrics.pages_to_host == 2
    cache.check()


def test_a_load_is_cancelled_when_its_request_ends_first():
    cache, dev, a = two_pages_on_the_host()
    cache.acquire("a2", cache.match(a + [0]))
    cache.release("a2")  # aborted in the same step, before its copies ran
    cache.check()
    assert cache.take_copies().to_gpu == [] and cache.pool.num_free == 4
    assert cache.match(a + [0]).gpu_pages == [None, None], "the host copy is still the page"


def test_checkpoints_follow_the_page_across_tiers():
    cache, dev = PrefixCache(PagePool(4), PS, host=KVHostTier(2), checkpoints=True), FakeDevice()
    a = list(range(1, 10))
    fill(cache, dev, "a", a)
    assert cache.record_checkpoint("a", 8, checkpoint_id=3) == 3
    cache.release("a")
    cache.allocate("x", 4)  # both of a's pages to the host: the checkpoint stays valid
    dev.run(cache.take_copies())
    assert cache.take_dropped_checkpoints() == [] and cache.match(a).checkpoint == 3
    cache.release("x")
    fill(cache, dev, "b", list(range(50, 59)))
    cache.release("b")
    cache.allocate("y", 4)  # b's pages push a's out of the host: gone from every tier
    assert cache.take_dropped_checkpoints() == [3] and cache.match(a).num_tokens == 0
    assert hash_chain(a, PS)[1] not in cache.host
    cache.check()


@pytest.mark.parametrize("checkpoints", [False, True])
@pytest.mark.parametrize("seed", range(4))
def test_random_operations_over_both_tiers_match_the_reference(seed, checkpoints):
    _, host_hits = random_run(seed, host_capacity=4, checkpoints=checkpoints, ops=200)
    assert host_hits > 0, "the run never hit the host tier: it tests nothing there"


def test_page_copy_kernel_matches_the_runs_copy_in_the_interpreter():
    """layers/page_copy_triton.py (the CUDA path of engine/kv_moves.py) against the CPU's copy along runs."""
    pytest.importorskip("triton")
    from tests.interpreter import run_script

    lines = run_script("page_copy_interpreter.py").splitlines()
    assert [line.split()[0] for line in lines] == ["gqa", "mla", "odd"] and all("equal" in line for line in lines)
    assert "uint8 int16" in lines[2], "the odd page sizes did not take byte and half-word copies"
