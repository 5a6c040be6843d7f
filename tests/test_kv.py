from __future__ import annotations

import pytest
import torch

from moetier.layers.attention import paged_attention_reference, write_kv
from moetier.engine.pages import PagePool
from moetier.layers.attention import make_batch
from moetier.layers.kv_cache import GqaKVCache
from moetier.layers.attention import causal_attention


def test_page_pool_allocates_frees_and_checks():
    pool = PagePool(10)
    a = pool.allocate(4, "a")
    b = pool.allocate(6, "b")
    assert sorted(a + b) == list(range(10)) and not pool.can_allocate(1)
    pool.check()
    with pytest.raises(RuntimeError, match="owned by 'a', not 'b'"):
        pool.free(a[:1], "b")
    pool.free(a, "a")
    assert pool.num_free == 4 and pool.num_used == 6 and pool.usage() == 0.6
    pool.check()
    with pytest.raises(RuntimeError, match="call can_allocate first"):
        pool.allocate(5, "c")
    pool._free.append(b[0])  # corrupt: a page both free and owned
    with pytest.raises(AssertionError, match="both free and owned"):
        pool.check()


def test_paged_attention_equals_contiguous():
    """Three sequences in one step (a decode token, a prefill chunk continuing a prompt, a fresh
    prompt) over shuffled pages give exactly what a contiguous cache gives."""
    g = torch.Generator().manual_seed(0)
    hq, hkv, d, page = 6, 2, 16, 4
    kv = GqaKVCache(1, 32, page, hkv, d, torch.float32, "cpu")
    order = torch.randperm(32, generator=g).tolist()
    done, new = [9, 5, 0], [1, 7, 6]
    pages = [order[0:3], order[3:6], order[6:8]]
    full_k = [torch.randn(dn + nw, hkv, d, generator=g) for dn, nw in zip(done, new)]
    full_v = [torch.randn(dn + nw, hkv, d, generator=g) for dn, nw in zip(done, new)]
    # keys of earlier steps are already in the pages
    past = make_batch([(0, dn, p) for dn, p in zip(done, pages) if dn], page, "cpu")
    write_kv(kv.k[0], kv.v[0], torch.cat([k[:dn] for k, dn in zip(full_k, done) if dn]),
             torch.cat([v[:dn] for v, dn in zip(full_v, done) if dn]), past.slot_mapping)
    batch = make_batch(list(zip(done, new, pages)), page, "cpu")
    write_kv(kv.k[0], kv.v[0], torch.cat([k[dn:] for k, dn in zip(full_k, done)]),
             torch.cat([v[dn:] for v, dn in zip(full_v, done)]), batch.slot_mapping)
    q = torch.randn(sum(new), hq, d, generator=g)
    got = paged_attention_reference(q, kv.k[0], kv.v[0], batch)
    qs = batch.query_start_host
    for i in range(3):
        want = causal_attention(q[qs[i]:qs[i + 1]], full_k[i], full_v[i], done[i])
        assert torch.equal(got[qs[i]:qs[i + 1]], want)
    assert batch.positions.tolist() == [9, *range(5, 12), *range(0, 6)]
