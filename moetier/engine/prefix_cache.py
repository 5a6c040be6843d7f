"""Automatic prefix caching over the KV pages of a PagePool: plain CPU bookkeeping (no torch).

A full page is known by a hash chain: page i's hash covers the hash of page i-1, its page_size token
ids and an extra key (model, LoRA or other salt), so equal hashes mean equal prefixes. Hashes are
SHA-256 over fixed-width little-endian bytes: stable across processes and machines (Python's hash()
is salted per process), which a worker of a parallel engine and a later host-tier lookup rely on.

Every page of the pool is in exactly one of three states:
    empty      on the pool's free list, no content worth keeping
    in use     held by one or more requests (refcount = number of page tables it is in); a cached
               page can be shared by every request whose prompt starts with its prefix
    evictable  refcount 0 but its hash is still registered: a later match can take it back
Pages are taken from the empty ones first; only when none is left are evictable pages evicted, least
recently used first (a request's pages are released tail first, so its prefix outlives its tail).
An in-use page is never evicted, so a request whose cached prefix is evicted elsewhere keeps its own.
Evicted pages go to the host tier (kv_host_tier.py) when there is one, else their content is dropped.

A match never covers the whole prompt: at least the last token is computed, so the step has logits
to sample from. For models with recurrent state (linear attention) the KV alone cannot resume a
prompt: the engine records state checkpoints at page boundaries (an opaque id per hash), and match
stops at the last boundary that has one.

One step's flow, as the scheduler drives it (integration plan in docs/prefix-cache.md):
    hit = cache.match(tokens); cache.can_acquire(hit, n)   admission test, nothing taken yet
    cache.acquire(rid, hit); cache.allocate(rid, n)         the page table: hit pages, then new ones
    ... step runs, tokens computed ...
    cache.insert(rid, tokens, num_computed)                 newly full pages become matchable
    cache.release(rid)                                      finish or preemption
    cache.take_copies()                                     the host<->GPU copies of this step
"""

from __future__ import annotations

import hashlib
import struct
from collections import Counter, OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from moetier.engine.kv_host_tier import CopyPlan, KVHostTier
from moetier.engine.pages import PagePool

OWNER = "<prefix-cache>"  # the pool's owner of every page this manager hands out or keeps
ROOT_HASH = hashlib.sha256(b"moetier prefix cache").digest()  # the parent of page 0


class PageBytes:
    """token_ids as little-endian int64 bytes, packed once: page i's hash input is a slice, not a
    struct.pack of its ids (which took half of a 4,000-token prompt's hashing, in the step's schedule)."""

    def __init__(self, token_ids: Sequence[int], page_size: int, extra_key: bytes):
        self.data = np.asarray(token_ids, dtype="<i8").tobytes()
        self.step = 8 * page_size
        self.key = struct.pack("<I", len(extra_key)) + extra_key

    def hash(self, parent: bytes, i: int) -> bytes:
        """The hash of full page i (tokens i * page_size .. (i + 1) * page_size - 1) after parent:
        SHA-256 over parent, the length-prefixed extra key and the page's ids."""
        h = hashlib.sha256(parent)
        h.update(self.key)
        h.update(self.data[i * self.step:(i + 1) * self.step])
        return h.digest()


def hash_chain(token_ids: Sequence[int], page_size: int, extra_key: bytes = b"") -> list[bytes]:
    """Hashes of the full pages of token_ids, page 0 first (a partial last page has none)."""
    out, parent, pages = [], ROOT_HASH, PageBytes(token_ids, page_size, extra_key)
    for i in range(len(token_ids) // page_size):
        parent = pages.hash(parent, i)
        out.append(parent)
    return out


@dataclass
class PrefixHit:
    """What match found: per hit page (chain order) its hash and GPU page, None where the page is on
    the host tier and acquire must bring it back. Nothing is held until acquire."""

    hashes: list[bytes] = field(default_factory=list)
    gpu_pages: list[int | None] = field(default_factory=list)
    num_tokens: int = 0  # tokens the hit covers: their prefill is skipped
    num_query_tokens: int = 0  # tokens matched against
    checkpoint: int | None = None  # the state checkpoint at the hit's end (checkpointed models)
    # checkpointed models: tokens of cached KV pages before the cut back to the last checkpoint; a
    # request with more of them than num_tokens ends its first chunk there and saves the missing
    # checkpoint, so the next request over the same prefix resumes from it (engine/scheduler.py)
    kv_tokens: int = 0

    @property
    def num_pages(self) -> int:
        return len(self.hashes)

    @property
    def num_host_pages(self) -> int:
        return sum(p is None for p in self.gpu_pages)


@dataclass
class PrefixCacheMetrics:
    queries: int = 0  # tokens of the requests admitted (vLLM's prefix_cache_queries)
    hits: int = 0  # of those, tokens found cached on either tier (vLLM's prefix_cache_hits)
    host_hits: int = 0  # of the hits, tokens brought back from the host tier
    evictions: int = 0  # pages evicted from the GPU tier


class PrefixCache:
    """Refcounted, hash-keyed pages over `pool`. With enabled=False it is only the page tables and
    refcounts (no match, no insert), so the scheduler has one path for both settings."""

    def __init__(self, pool: PagePool, page_size: int, *, extra_key: bytes | str = b"",
                 host: KVHostTier | None = None, checkpoints: bool = False, enabled: bool = True):
        if page_size < 1:
            raise ValueError(f"page_size must be positive, got {page_size}")
        self.pool, self.page_size, self.host = pool, page_size, host
        self.extra_key = extra_key.encode() if isinstance(extra_key, str) else bytes(extra_key)
        self.checkpoints, self.enabled = checkpoints, enabled
        self._pages_of: dict[str, list[int]] = {}  # request -> its page table
        self._chain: dict[str, list[bytes]] = {}  # request -> hashes of its full pages, in order
        self._refs: dict[int, int] = {}  # in-use page -> number of page tables holding it
        self._hash_of: dict[int, bytes] = {}  # registered page -> its hash
        self._page_of: dict[bytes, int] = {}  # hash -> its registered GPU page
        self._lru: OrderedDict[int, None] = OrderedDict()  # evictable pages, least recently used first
        self._checkpoint_of: dict[bytes, int] = {}  # hash of a boundary's page -> state checkpoint id
        self._dropped_checkpoints: list[int] = []
        self.metrics = PrefixCacheMetrics()

    # ---- queries -------------------------------------------------------------------------------

    @property
    def num_available(self) -> int:
        """Pages allocate() can hand out now: the empty ones and the evictable ones."""
        return self.pool.num_free + len(self._lru)

    @property
    def num_in_use(self) -> int:
        """Pages held by running requests (a shared page counts once): the pool's real usage."""
        return len(self._refs)

    @property
    def num_evictable(self) -> int:
        return len(self._lru)

    def can_allocate(self, n: int) -> bool:
        return n <= self.num_available

    def can_acquire(self, hit: PrefixHit, num_new_pages: int) -> bool:
        """Whether acquire(hit) then allocate(num_new_pages) fits: host hits need fresh pages, and the
        evictable pages the hit itself takes are no longer available."""
        taken = sum(p is not None and p in self._lru for p in hit.gpu_pages)
        return hit.num_host_pages + num_new_pages <= self.num_available - taken

    def pages(self, request_id: str) -> list[int]:
        return self._pages_of.get(request_id, [])

    def num_hashed_pages(self, request_id: str) -> int:
        """Full pages of the request already hashed: insert() has work once num_computed passes the next
        page boundary."""
        return len(self._chain.get(request_id, ()))

    def match(self, token_ids: Sequence[int]) -> PrefixHit:
        """The longest cached prefix of whole pages, GPU tier first, then the host tier, never all of
        token_ids; for checkpointed models cut back to the last page boundary with a checkpoint."""
        hit = PrefixHit(num_query_tokens=len(token_ids))
        if not self.enabled:
            return hit
        ps, parent, data = self.page_size, ROOT_HASH, PageBytes(token_ids, self.page_size, self.extra_key)
        for i in range((len(token_ids) - 1) // ps):
            h = data.hash(parent, i)
            page = self._page_of.get(h)
            if page is None and (self.host is None or h not in self.host):
                break
            hit.hashes.append(h)
            hit.gpu_pages.append(page)
            parent = h
        hit.kv_tokens = len(hit.hashes) * ps
        if self.checkpoints:
            keep = max((i + 1 for i, h in enumerate(hit.hashes) if h in self._checkpoint_of), default=0)
            del hit.hashes[keep:], hit.gpu_pages[keep:]
            hit.checkpoint = self._checkpoint_of[hit.hashes[-1]] if keep else None
        hit.num_tokens = len(hit.hashes) * ps
        return hit

    # ---- a request's pages ---------------------------------------------------------------------

    def acquire(self, request_id: str, hit: PrefixHit) -> list[int]:
        """Start request_id's page table with the hit (from match, nothing changed since): shared GPU
        pages get a reference, host pages get fresh GPU pages and a planned copy. Counts the query."""
        if request_id in self._pages_of:
            raise RuntimeError(f"request {request_id!r} already holds pages; release it first")
        if not all(self._page_of.get(h) == p if p is not None else
                   h not in self._page_of and self.host is not None and h in self.host
                   for h, p in zip(hit.hashes, hit.gpu_pages)):
            raise RuntimeError("the hit is stale (pages moved since match); match again")
        if not self.can_acquire(hit, 0):
            raise RuntimeError("the hit's host pages do not fit; call can_acquire first")
        for p in hit.gpu_pages:
            if p is not None:
                self._ref(p)
        host_hashes = [h for h, p in zip(hit.hashes, hit.gpu_pages) if p is None]
        if host_hashes:
            self.host.pin(host_hashes)  # the evictions below may write to the host: not over these
        fresh = iter(self._take(len(host_hashes)))
        pages = []
        for h, p in zip(hit.hashes, hit.gpu_pages):
            if p is None:
                p = next(fresh)
                self.host.load(h, p)
                self._hash_of[p], self._page_of[h] = h, p
            pages.append(p)
        self._pages_of[request_id], self._chain[request_id] = pages, list(hit.hashes)
        self.metrics.queries += hit.num_query_tokens
        self.metrics.hits += hit.num_tokens
        self.metrics.host_hits += len(host_hashes) * self.page_size
        return list(pages)

    def allocate(self, request_id: str, n: int) -> list[int]:
        """n new pages at the end of request_id's page table, evicting cached pages only if needed."""
        pages = self._take(n)
        self._pages_of.setdefault(request_id, []).extend(pages)
        self._chain.setdefault(request_id, [])
        return pages

    def insert(self, request_id: str, token_ids: Sequence[int], num_computed: int) -> int:
        """Hash the request's pages that became full (num_computed tokens of token_ids have their KV in
        its pages; only the slices of new full pages are read) and register them unless another page
        already holds the same hash (then this one stays private). Returns the pages registered."""
        if not self.enabled:
            return 0
        chain, pages, ps = self._chain[request_id], self._pages_of[request_id], self.page_size
        full = min(num_computed, len(token_ids)) // ps
        if full > len(pages):
            raise RuntimeError(f"request {request_id!r}: {full} full pages computed but {len(pages)} held")
        parent, registered, done = chain[-1] if chain else ROOT_HASH, 0, len(chain)
        data = PageBytes(token_ids[done * ps:full * ps], ps, self.extra_key)  # only the new full pages
        for i in range(done, full):
            parent = data.hash(parent, i - done)
            chain.append(parent)
            if parent not in self._page_of:
                self._hash_of[pages[i]], self._page_of[parent] = parent, pages[i]
                registered += 1
        return registered

    def release(self, request_id: str) -> None:
        """The request finished or was preempted: references down, tail first; hashed pages stay
        cached (evictable), the rest go back to the pool."""
        pages = self._pages_of.pop(request_id, [])
        self._chain.pop(request_id, None)
        for p in reversed(pages):
            refs = self._refs[p] - 1
            if refs:
                self._refs[p] = refs
                continue
            del self._refs[p]
            if self.host is not None and self.host.is_loading(p):
                self.host.cancel_load(p)  # its content never arrived: the host copy stays the only one
                del self._page_of[self._hash_of.pop(p)]
            if p in self._hash_of:
                self._lru[p] = None
            else:
                self.pool.free([p], OWNER)

    def evict(self, n: int) -> list[int]:
        """Evict up to n evictable pages, least recently used first, to the host tier if any; their ids
        go back to the pool's free list and are returned."""
        victims = []
        while len(victims) < n and self._lru:
            p, _ = self._lru.popitem(last=False)
            h = self._hash_of.pop(p)
            del self._page_of[h]
            victims.append((h, p))
        if self.host is not None:
            self.host.store_many(victims)
        for h, _ in victims:
            if self.host is None or h not in self.host:
                self._drop_checkpoint(h)
        out = [p for _, p in victims]
        if self.host is not None:
            for h in self.host.take_dropped():
                if h not in self._page_of and h not in self.host:  # it may have come back this call
                    self._drop_checkpoint(h)
        self.pool.free(out, OWNER)
        self.metrics.evictions += len(out)
        return out

    def _take(self, n: int) -> list[int]:
        if not self.can_allocate(n):
            raise RuntimeError(f"asked for {n} pages with {self.num_available} available; "
                               "call can_allocate first")
        if n > self.pool.num_free:
            self.evict(n - self.pool.num_free)
        pages = self.pool.allocate(n, OWNER)
        for p in pages:
            self._refs[p] = 1
        return pages

    def _ref(self, page: int) -> None:
        if page in self._lru:
            del self._lru[page]
            self._refs[page] = 1
        else:
            self._refs[page] += 1

    # ---- state checkpoints (linear-attention models) -------------------------------------------

    def record_checkpoint(self, request_id: str, num_tokens: int, checkpoint_id: int) -> int | None:
        """The engine saved request_id's recurrent state after num_tokens (a page boundary the request
        has hashed). Returns the checkpoint id the cache keeps for that boundary (an earlier one if it
        had one), or None when the boundary's KV is cached nowhere; the engine frees the id it gave
        whenever the answer is not that id."""
        ps, chain = self.page_size, self._chain.get(request_id, [])
        if num_tokens < ps or num_tokens % ps or num_tokens // ps > len(chain):
            raise ValueError(f"a checkpoint at {num_tokens} tokens is not a hashed page boundary of "
                             f"{request_id!r} ({len(chain)} pages of {ps} tokens hashed)")
        h = chain[num_tokens // ps - 1]
        if h not in self._page_of and (self.host is None or h not in self.host):
            return None
        return self._checkpoint_of.setdefault(h, checkpoint_id)

    def checkpoint_ids(self) -> set[int]:
        """The checkpoint ids some cached boundary keeps."""
        return set(self._checkpoint_of.values())

    def forget_checkpoint(self, checkpoint_id: int) -> None:
        """The engine takes checkpoint_id back to save another boundary into it (its pool is full): the
        boundary that held it keeps none."""
        for h in [h for h, c in self._checkpoint_of.items() if c == checkpoint_id]:
            del self._checkpoint_of[h]

    def _drop_checkpoint(self, page_hash_: bytes) -> None:
        ckpt = self._checkpoint_of.pop(page_hash_, None)
        if ckpt is not None:
            self._dropped_checkpoints.append(ckpt)

    def take_dropped_checkpoints(self) -> list[int]:
        """Checkpoint ids whose boundary left every tier since the last call: the engine frees them."""
        out, self._dropped_checkpoints = self._dropped_checkpoints, []
        return out

    # ---- per step ------------------------------------------------------------------------------

    def take_copies(self) -> CopyPlan:
        """The host<->GPU copies planned since the last call; the step that follows must run them."""
        return self.host.take_copies() if self.host is not None else CopyPlan()

    def metrics_dict(self, page_bytes: int | None = None) -> dict[str, int | float | None]:
        """Counters since start; the hit rate in tokens (None before any query); with page_bytes (one
        page over all layers) the host tier's bytes moved each way."""
        m = self.metrics
        out = {"prefix_cache_queries": m.queries, "prefix_cache_hits": m.hits,
               "prefix_cache_hit_rate": m.hits / m.queries if m.queries else None,
               "prefix_cache_evictions": m.evictions, "kv_host_hits": m.host_hits,
               "kv_host_pages_total": 0 if self.host is None else self.host.capacity}
        if self.host is not None:
            out |= self.host.metrics.as_dict()
            if page_bytes is not None:
                out["kv_host_bytes_to_host"] = self.host.metrics.pages_to_host * page_bytes
                out["kv_host_bytes_to_gpu"] = self.host.metrics.pages_to_gpu * page_bytes
        return out

    def check(self) -> None:
        """empty + evictable + in use == total; refcounts equal holders; hash maps inverse."""
        self.pool.check()
        lru, refs = self._lru.keys(), self._refs.keys()
        assert not lru & refs, "a page is both evictable and in use"
        assert self.pool.num_used == len(lru) + len(refs), "the pool's used pages are not ours"
        assert self.pool.num_free + len(lru) + len(refs) == self.pool.num_pages, "pages went missing"
        assert all(p in self._hash_of for p in lru), "an evictable page has no hash"
        holders = Counter(p for pages in self._pages_of.values() for p in pages)
        assert holders == Counter(self._refs), "refcounts differ from the page tables"
        for rid, pages in self._pages_of.items():
            assert len(set(pages)) == len(pages), f"{rid} holds a page twice"
            assert len(self._chain[rid]) <= len(pages), f"{rid} has hashes for pages it does not hold"
        assert len(self._hash_of) == len(self._page_of), "the hash and page maps differ in size"
        assert all(self._page_of[h] == p for p, h in self._hash_of.items()), "hash maps are not inverse"
        assert self._hash_of.keys() <= lru | refs, "a registered page is empty"
        cached = self._page_of.keys() | (self.host.hashes() if self.host is not None else set())
        assert self._checkpoint_of.keys() <= cached, "a checkpoint outlived its page"
        if self.host is not None:
            self.host.check()
