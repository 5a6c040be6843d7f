"""The GPU prefix cache's bookkeeping: the hash chain, capped hits, shared refcounts, LRU eviction that
never takes a page in use, state-checkpoint limits, and random operation sequences against a
reference model (tests/prefix_reference.py) with check() after every operation."""

from __future__ import annotations

import hashlib
import struct
import subprocess
import sys

import pytest

from moetier.engine.pages import PagePool
from moetier.engine.prefix_cache import PrefixCache, hash_chain
from tests.prefix_reference import random_run

PS = 4


def admit(cache, rid, tokens):
    """What the scheduler will do for a new request: match, acquire, pages for the rest, compute, insert."""
    hit = cache.match(tokens)
    cache.acquire(rid, hit)
    cache.allocate(rid, -(-len(tokens) // PS) - hit.num_pages)
    cache.insert(rid, tokens, len(tokens))
    cache.check()
    return hit


def test_prefix_cache_imports_no_torch():
    code = ("import sys, moetier.engine.prefix_cache, moetier.engine.kv_host_tier; "
            "assert 'torch' not in sys.modules, 'torch was imported'")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert p.returncode == 0, p.stderr


def test_hash_chain_follows_the_prefix():
    a = list(range(1, 17))
    assert hash_chain(a, PS) == hash_chain(a + [99], PS)  # a partial page has no hash
    assert len(hash_chain(a, PS)) == 4
    for i in range(4):
        b = list(a)
        b[i * PS + 1] += 100
        ha, hb = hash_chain(a, PS), hash_chain(b, PS)
        assert ha[:i] == hb[:i] and all(x != y for x, y in zip(ha[i:], hb[i:])), f"changed page {i}"
    assert hash_chain(a, PS, b"lora-1")[0] != hash_chain(a, PS)[0], "the extra key is not hashed"
    # the same page after a different prefix is a different page
    assert hash_chain([5] * 8, PS)[1] != hash_chain([6] * 4 + [5] * 4, PS)[1]


def test_hash_chain_is_sha256_of_the_packed_page():
    # the layout written out by hand (parent, the length-prefixed extra key, the ids as little-endian
    # int64), so packing the ids once per prompt cannot drift from it; ids above 2**31 included
    ids, key = [0, 1, 2**31 + 5, 2**40, 7, 154879, 3, 9], b"lora-1"
    parent, want = hashlib.sha256(b"moetier prefix cache").digest(), []
    for i in range(2):
        h = hashlib.sha256(parent)
        h.update(struct.pack("<I", len(key)) + key + struct.pack("<4q", *ids[4 * i:4 * i + 4]))
        parent = h.digest()
        want.append(parent)
    assert hash_chain(ids, PS, key) == want


def test_hash_is_stable_across_processes():
    code = ("from moetier.engine.prefix_cache import hash_chain; "
            "print(hash_chain(list(range(12)), 4, b'x')[-1].hex())")
    runs = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           env={"PYTHONHASHSEED": str(seed)}).stdout.strip() for seed in (1, 2)}
    assert runs == {hash_chain(list(range(12)), 4, b"x")[-1].hex()}


@pytest.mark.parametrize("length,pages", [(8, 1), (9, 2), (12, 2), (13, 3), (3, 0)])
def test_a_hit_never_covers_the_whole_prompt(length, pages):
    cache = PrefixCache(PagePool(16), PS)
    tokens = list(range(1, 21))
    admit(cache, "warm", tokens)
    cache.release("warm")
    hit = cache.match(tokens[:length])
    assert hit.num_pages == pages and hit.num_tokens == pages * PS < length


def test_shared_prefix_is_refcounted():
    cache = PrefixCache(PagePool(16), PS)
    system = list(range(1, 9))
    admit(cache, "a", system + [20, 21, 22])
    hit = admit(cache, "b", system + [30, 31])
    assert hit.num_tokens == 8 and cache.pages("b")[:2] == cache.pages("a")[:2]
    shared = cache.pages("a")[:2]
    assert [cache._refs[p] for p in shared] == [2, 2]
    cache.release("a")
    cache.check()
    assert [cache._refs[p] for p in shared] == [1, 1] and not set(shared) & cache._lru.keys()
    cache.release("b")
    cache.check()
    assert set(shared) <= cache._lru.keys() and cache.match(system + [1]).num_tokens == 8
    m = cache.metrics_dict()
    assert m["prefix_cache_queries"] == 11 + 10 and m["prefix_cache_hits"] == 8


def test_eviction_is_lru_and_tail_first():
    cache = PrefixCache(PagePool(6), PS)
    old, new = list(range(1, 9)), list(range(101, 109))
    admit(cache, "old", old + [0])
    admit(cache, "new", new + [0])
    cache.release("old")
    cache.release("new")
    assert cache.num_available == 6 and cache.pool.num_free == 2  # the partial pages went back empty
    old_pages, new_pages = [cache._page_of[h] for h in hash_chain(old, PS)], \
        [cache._page_of[h] for h in hash_chain(new, PS)]
    assert cache.allocate("x", 2) and cache.match(old + [0]).num_pages == 2, "empty pages go first"
    assert cache.allocate("x", 1) == [old_pages[1]], "the older request's tail goes first"
    assert cache.match(old + [0]).num_pages == 1 and cache.match(new + [0]).num_pages == 2
    assert cache.evict(2) == [old_pages[0], new_pages[1]]  # in eviction order
    assert cache.metrics.evictions == 3
    cache.check()


def test_eviction_never_takes_a_page_in_use():
    cache = PrefixCache(PagePool(4), PS)
    prompt = list(range(1, 13))
    admit(cache, "a", prompt)  # holds 3 full pages, all hashed and in use
    assert cache.num_available == 1 and not cache.can_allocate(2)
    with pytest.raises(RuntimeError, match="call can_allocate first"):
        cache.allocate("b", 2)
    assert cache.evict(4) == [] and len(cache.pages("a")) == 3
    cache.check()


def test_a_stale_hit_is_refused():
    cache = PrefixCache(PagePool(4), PS)
    prompt = list(range(1, 10))
    admit(cache, "a", prompt)
    cache.release("a")
    hit = cache.match(prompt)
    cache.allocate("x", 4)  # evicts the hit's pages
    with pytest.raises(RuntimeError, match="stale"):
        cache.acquire("b", hit)


def test_a_request_keeps_its_pages_when_its_cached_prefix_is_evicted_elsewhere():
    cache = PrefixCache(PagePool(6), PS)
    system = list(range(1, 9))
    admit(cache, "first", system + [50])
    cache.release("first")  # the system prompt is cached, evictable
    admit(cache, "mid", system + [60, 61, 62, 63, 64])  # mid-flight: shares the two cached pages
    held = list(cache.pages("mid"))
    admit(cache, "other", [70] * 7)  # needs 2 pages: only free + evictable ones may go
    cache.check()
    assert cache.pages("mid") == held and all(cache._refs[p] == 1 for p in held)
    assert cache.match(system + [60, 61, 62, 63, 64]).num_tokens == 12, "mid's own pages stay matchable"


def test_duplicate_pages_stay_private():
    cache = PrefixCache(PagePool(8), PS)
    prompt = list(range(1, 9))
    for rid in ("a", "b"):  # both computed before either was inserted: no hit for b
        cache.acquire(rid, cache.match(prompt))
        cache.allocate(rid, 2)
    cache.insert("a", prompt, 8)
    assert cache.insert("b", prompt, 8) == 0
    cache.release("b")
    cache.check()
    assert cache.pool.num_free == 6 and len(cache._lru) == 0, "b's duplicate pages went back empty"


def test_checkpoints_limit_a_match():
    cache = PrefixCache(PagePool(16), PS, checkpoints=True)
    prompt = list(range(1, 18))  # 4 full pages and one token
    admit(cache, "a", prompt)
    assert cache.match(prompt).num_tokens == 0, "no checkpoint: no reuse"
    assert cache.record_checkpoint("a", 8, checkpoint_id=7) == 7
    assert cache.record_checkpoint("a", 8, checkpoint_id=9) == 7, "the first checkpoint stays"
    hit = cache.match(prompt)
    assert (hit.num_tokens, hit.checkpoint) == (8, 7)
    assert cache.record_checkpoint("a", 16, checkpoint_id=8) == 8
    assert (cache.match(prompt).num_tokens, cache.match(prompt).checkpoint) == (16, 8)
    assert cache.match(prompt[:16]).num_tokens == 8, "the 16-token checkpoint would leave no token"
    for bad in (0, 6, 20):
        with pytest.raises(ValueError, match="not a hashed page boundary"):
            cache.record_checkpoint("a", bad, 1)
    cache.release("a")
    cache.evict(16)
    assert sorted(cache.take_dropped_checkpoints()) == [7, 8] and cache.take_dropped_checkpoints() == []
    cache.check()


def test_disabled_cache_only_tracks_pages():
    cache = PrefixCache(PagePool(8), PS, enabled=False)
    prompt = list(range(1, 10))
    admit(cache, "a", prompt)
    cache.release("a")
    assert cache.match(prompt).num_tokens == 0 and cache.pool.num_free == 8
    cache.check()


@pytest.mark.parametrize("checkpoints", [False, True])
@pytest.mark.parametrize("seed", range(4))
def test_random_operations_match_the_reference(seed, checkpoints):
    hits, _ = random_run(seed, checkpoints=checkpoints, ops=200)
    assert hits > 0, "the run never hit: it tests nothing"
