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


def test_make_batch_equals_a_loop_over_tokens():
    """make_batch's numpy form against the per-token loop it replaced: decode rows, prefill chunks
    and a chunk after a cached prefix in one step; and a page table too short for the context refused."""
    page = 4
    seqs = [(9, 1, [7, 3, 11]), (0, 10, [2, 5, 8]), (4, 6, [1, 9, 12]), (0, 1, [4])]
    batch = make_batch(seqs, page, "cpu", state_slots=[3, 0, 2, 1])
    positions, slots, starts, width = [], [], [0], max(len(p) for _, _, p in seqs)
    table = torch.zeros(len(seqs), width, dtype=torch.int32)
    for i, (done, new, pages) in enumerate(seqs):
        positions += list(range(done, done + new))
        slots += [pages[p // page] * page + p % page for p in range(done, done + new)]
        starts.append(starts[-1] + new)
        table[i, : len(pages)] = torch.tensor(pages, dtype=torch.int32)
    assert batch.positions.tolist() == positions and batch.positions.dtype == torch.int64
    assert batch.slot_mapping.tolist() == slots and batch.slot_mapping.dtype == torch.int64
    assert batch.query_start.tolist() == batch.query_start_host == starts and batch.query_start.dtype == torch.int32
    assert batch.seq_lens_host == [10, 10, 10, 1] and batch.seq_lens.dtype == torch.int32
    assert torch.equal(batch.page_table, table) and batch.max_query_len == 10
    assert batch.state_slots.tolist() == [3, 0, 2, 1]
    with pytest.raises(ValueError, match="page table is shorter"):
        make_batch([(8, 1, [0, 1])], page, "cpu")
