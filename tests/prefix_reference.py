"""A reference model of the prefix cache and host tier for randomized tests, and a fake device.

The model knows no page ids and no hashes: a cached page is the tuple of every token up to its end
(its whole prefix), so it checks the hash chain, the maps and the refcounts of the real cache by an
independent route. It states the policy in its plainest form: empty pages first, then evictable
pages least recently used first (a request's released tail first); an evicted page goes to the host,
whose LRU drops its oldest unpinned page when full; a host hit becomes a GPU page again and keeps its
host copy. The fake device holds, per GPU page and host slot, the prefix whose KV it contains, and
runs the copy plans in their stated order, so a hit that reuses the wrong bytes is caught.
"""

from __future__ import annotations

import random
from collections import Counter, OrderedDict

from moetier.engine.prefix_cache import PrefixCache, hash_chain


def keys_of(tokens, page_size, n):
    return [tuple(tokens[:(i + 1) * page_size]) for i in range(n)]


class ReferenceCache:
    def __init__(self, num_pages, page_size, host_capacity=0, checkpoints=False):
        self.ps, self.host_capacity, self.checkpoints = page_size, host_capacity, checkpoints
        self.empty = num_pages
        self.lru: OrderedDict[tuple, None] = OrderedDict()  # evictable keys, oldest first
        self.refs: Counter = Counter()  # registered keys in use -> holders
        self.host: OrderedDict[tuple, None] = OrderedDict()
        self.tables: dict[str, list] = {}  # request -> per page its key, or None (private)
        self.chains: dict[str, list] = {}  # request -> keys of its hashed pages
        self.ckpt: dict[tuple, int] = {}
        self.dropped: list[int] = []
        self.pinned: set[tuple] = set()  # host keys a pending plan loads from, until the plan is taken

    def registered(self):
        return set(self.lru) | set(self.refs)

    def match(self, tokens):
        """[(key, on GPU)] of the hit."""
        hit = []
        for key in keys_of(tokens, self.ps, (len(tokens) - 1) // self.ps):
            if key in self.lru or key in self.refs:
                hit.append((key, True))
            elif key in self.host:
                hit.append((key, False))
            else:
                break
        if self.checkpoints:
            keep = max((i + 1 for i, (k, _) in enumerate(hit) if k in self.ckpt), default=0)
            hit = hit[:keep]
        return hit

    def available(self):
        return self.empty + len(self.lru)

    def can_acquire(self, hit, n):
        taken = sum(on_gpu and k in self.lru for k, on_gpu in hit)
        return sum(not g for _, g in hit) + n <= self.available() - taken

    def _evict(self, n):
        for _ in range(n):
            key, _ = self.lru.popitem(last=False)
            if self.host_capacity:
                if key in self.host:
                    self.host.move_to_end(key)
                else:
                    if len(self.host) == self.host_capacity:
                        victim = next((k for k in self.host if k not in self.pinned), None)
                        if victim is not None:
                            del self.host[victim]
                            if victim not in self.registered():
                                self._drop(victim)
                    if len(self.host) < self.host_capacity:
                        self.host[key] = None
            if key not in self.host:
                self._drop(key)
            self.empty += 1

    def _drop(self, key):
        if key in self.ckpt:
            self.dropped.append(self.ckpt.pop(key))

    def _take(self, n):
        assert n <= self.available()
        if n > self.empty:
            self._evict(n - self.empty)
        self.empty -= n
        return [None] * n

    def acquire(self, rid, hit):
        for key, on_gpu in hit:
            if on_gpu:
                self.lru.pop(key, None)
                self.refs[key] += 1
        host_keys = [k for k, g in hit if not g]
        self.pinned |= set(host_keys)
        self._take(len(host_keys))
        for key in host_keys:
            self.host.move_to_end(key)
            self.refs[key] += 1
        self.tables[rid] = [k for k, _ in hit]
        self.chains[rid] = [k for k, _ in hit]

    def allocate(self, rid, n):
        self.tables[rid] += self._take(n)

    def insert(self, rid, tokens, num_computed):
        chain, table = self.chains[rid], self.tables[rid]
        for i in range(len(chain), num_computed // self.ps):
            key = tuple(tokens[:(i + 1) * self.ps])
            chain.append(key)
            if key not in self.registered():
                table[i] = key
                self.refs[key] += 1

    def release(self, rid):
        table = self.tables.pop(rid)
        self.chains.pop(rid)
        for key in reversed(table):
            if key is None:
                self.empty += 1
                continue
            self.refs[key] -= 1
            if not self.refs[key]:
                del self.refs[key]
                self.lru[key] = None

    def record_checkpoint(self, rid, num_tokens, ckpt):
        key = self.chains[rid][num_tokens // self.ps - 1]
        if key not in self.registered() and key not in self.host:
            return None
        return self.ckpt.setdefault(key, ckpt)


class FakeDevice:
    """Per GPU page and host slot: the prefix (a key) whose KV it holds."""

    def __init__(self):
        self.gpu: dict[int, tuple] = {}
        self.host: dict[int, tuple] = {}

    def run(self, plan):
        for page, slot in plan.to_host:
            self.host[slot] = self.gpu[page]
        for slot, page in plan.to_gpu:
            self.gpu[page] = self.host[slot]


def hash_of_key(key, page_size, extra_key=b""):
    return hash_chain(key, page_size, extra_key)[-1]


def assert_same_state(cache: PrefixCache, ref: ReferenceCache, dev: FakeDevice):
    """Same policy decisions as the reference, and every cached page and slot holds its prefix's KV."""
    h = lambda k: hash_of_key(k, ref.ps, cache.extra_key)  # noqa: E731
    assert [cache._hash_of[p] for p in cache._lru] == [h(k) for k in ref.lru], "GPU LRU order differs"
    assert set(cache._page_of) == {h(k) for k in ref.registered()}, "GPU cached prefixes differ"
    assert cache.num_available == ref.available()
    for key in ref.registered():
        assert dev.gpu[cache._page_of[h(key)]] == key, "a cached GPU page holds another prefix's KV"
    for key in ref.host:
        assert dev.host[cache.host.slot_of(h(key))] == key, "a host slot holds another prefix's KV"
    if cache.host is not None:
        host_order = [cache.host._hash_of[s] for s in cache.host._lru]
        assert host_order == [h(k) for k in ref.host], "host LRU order differs"
    for rid, table in ref.tables.items():
        assert len(cache.pages(rid)) == len(table)
        assert cache.num_hashed_pages(rid) == len(ref.chains[rid])


def random_run(seed, *, num_pages=12, page_size=2, host_capacity=0, checkpoints=False, ops=300):
    """Random admissions, decode growth, releases and checkpoints, checked after every operation."""
    from moetier.engine.kv_host_tier import KVHostTier
    from moetier.engine.pages import PagePool

    rng = random.Random(seed)
    host = KVHostTier(host_capacity) if host_capacity else None
    cache = PrefixCache(PagePool(num_pages), page_size, extra_key="m", host=host, checkpoints=checkpoints)
    ref, dev = ReferenceCache(num_pages, page_size, host_capacity, checkpoints), FakeDevice()
    bases = [[rng.randrange(1, 5) for _ in range(10)] for _ in range(3)]
    tokens: dict[str, list[int]] = {}
    hits = host_hits = 0
    for op in range(ops):
        kind = rng.choice(["admit", "admit", "grow", "release", "checkpoint"])
        if kind == "admit" or not tokens:
            rid = f"r{op}"
            toks = bases[rng.randrange(3)][:rng.randrange(1, 11)] + [rng.randrange(1, 5)
                                                                    for _ in range(rng.randrange(0, 4))]
            hit, want = cache.match(toks), ref.match(toks)
            assert hit.num_tokens == len(want) * page_size < len(toks)
            assert [p is not None for p in hit.gpu_pages] == [g for _, g in want]
            need = -(-len(toks) // page_size) - hit.num_pages
            ok = cache.can_acquire(hit, need)
            assert ok == ref.can_acquire(want, need)
            if ok:
                pages = cache.acquire(rid, hit) + cache.allocate(rid, need)
                ref.acquire(rid, want)
                ref.allocate(rid, need)
                dev.run(cache.take_copies())
                ref.pinned.clear()
                keys = keys_of(toks, page_size, len(pages))
                for i in range(hit.num_pages):
                    assert dev.gpu[pages[i]] == keys[i], "a hit page holds another prefix's KV"
                for i in range(hit.num_pages, len(pages)):
                    dev.gpu[pages[i]] = keys[i]  # computed this step
                cache.insert(rid, toks, len(toks))
                ref.insert(rid, toks, len(toks))
                tokens[rid] = toks
                hits += hit.num_tokens
                host_hits += hit.num_host_pages
        elif kind == "grow":
            rid = rng.choice(sorted(tokens))
            toks = tokens[rid]
            grown = [rng.randrange(1, 5) for _ in range(rng.randrange(1, 4))]
            toks += grown
            need = -(-len(toks) // page_size) - len(cache.pages(rid))
            if cache.can_allocate(need):
                cache.allocate(rid, need)
                ref.allocate(rid, need)
                dev.run(cache.take_copies())
                ref.pinned.clear()
                pages = cache.pages(rid)
                for i, key in enumerate(keys_of(toks, page_size, len(pages))):
                    if i >= cache.num_hashed_pages(rid):
                        dev.gpu[pages[i]] = key
                cache.insert(rid, toks, len(toks))
                ref.insert(rid, toks, len(toks))
            else:
                del toks[-len(grown):]  # no room: the request keeps its length
        elif kind == "release":
            rid = rng.choice(sorted(tokens))
            cache.release(rid)
            ref.release(rid)
            del tokens[rid]
        elif checkpoints:
            rid = rng.choice(sorted(tokens))
            n = cache.num_hashed_pages(rid)
            if n:
                at = rng.randrange(1, n + 1) * page_size
                assert cache.record_checkpoint(rid, at, op) == ref.record_checkpoint(rid, at, op)
        dev.run(cache.take_copies())
        ref.pinned.clear()
        cache.check()
        assert_same_state(cache, ref, dev)
        assert sorted(cache.take_dropped_checkpoints()) == sorted(ref.dropped)
        ref.dropped = []
    m = cache.metrics_dict()
    assert m["prefix_cache_hits"] == hits
    return hits, host_hits
