"""The scheduler with the prefix cache on, driven with fake runner outputs: a hit skips the cached
pages' prefill, shared prefixes are held once, eviction and preemption under memory pressure keep
the refcounts whole (PrefixCache.check() after every step), evictions go to the host tier and come
back as copies in the step record, prompt log-probs take no hit, and state checkpoints sit on page
boundaries the scheduler chose."""

from __future__ import annotations

from dataclasses import dataclass

from moetier.engine.kv_host_tier import KVHostTier
from moetier.engine.pages import PagePool
from moetier.engine.prefix_cache import PrefixCache
from moetier.engine.request import Request
from moetier.engine.scheduler import Scheduler
from moetier.sampling_params import SamplingParams

PAGE = 4


def req(rid, prompt, max_tokens=3, params=None):
    return Request(rid, list(prompt), params or SamplingParams(max_tokens=max_tokens, ignore_eos=True), seed=7)


def sched(num_pages=64, host=0, **kw) -> Scheduler:
    pages = PagePool(num_pages)
    cache = PrefixCache(pages, PAGE, host=KVHostTier(host) if host else None)
    return Scheduler(pages, PAGE, cache=cache, **kw)


def run(s: Scheduler, token=9):
    """Every step until done -> the step records; check() after each."""
    steps = []
    while s.has_unfinished():
        out = s.schedule()
        steps.append((out, out.step()))
        s.update(out, {q.request.id: token for q in out.seqs if q.sample}, set())
        s.check()
    return steps


def test_a_hit_skips_the_prefill_of_the_cached_pages():
    s = sched(max_num_tokens=64)
    prompt = list(range(1, 11))  # 2 full pages + 2 tokens
    s.add(req("a", prompt))
    run(s)
    assert s.cache.num_in_use == 0 and s.cache.num_evictable == 3  # a's prompt and output pages stay cached
    b = req("b", prompt + [50, 51])
    s.add(b)
    out = s.schedule()
    (seq,) = out.seqs
    assert (seq.start, seq.num_tokens, seq.num_cached) == (8, 4, 8)  # pages 0-1 hit; never the last token
    assert b.pages[:2] == s.cache.pages("b")[:2] and b.num_cached_tokens == 8
    m = s.cache.metrics_dict()
    assert m["prefix_cache_hits"] == 8 and m["prefix_cache_queries"] == 10 + 12
    s.update(out, {"b": 9}, set())
    s.check()


def test_shared_prefix_pages_are_held_once_and_released_tail_first():
    s = sched(max_num_tokens=64)
    system = list(range(100, 116))  # 4 pages
    s.add(req("warm", system + [1]))
    run(s)
    for i in range(3):
        s.add(req(f"r{i}", system + [i, i + 1, i + 2]))
    out = s.schedule()
    tables = [q.request.pages for q in out.seqs]
    assert all(t[:4] == tables[0][:4] for t in tables) and all(q.start == 16 for q in out.seqs)
    assert s.cache.num_in_use == 4 + 3  # four shared pages and one tail page each
    s.update(out, {q.request.id: 9 for q in out.seqs}, set())
    s.check()
    run(s)
    assert s.cache.num_in_use == 0


def test_eviction_and_preemption_under_memory_pressure_keep_refcounts_whole():
    s = sched(num_pages=10, max_num_tokens=16)
    common = list(range(200, 212))
    for i in range(5):
        s.add(req(f"r{i}", common + [i] * (3 + i), max_tokens=6))
    steps = run(s)
    assert sum(len(out.preempted) for out, _ in steps) > 0
    assert s.cache.metrics.evictions > 0 and s.cache.metrics.hits > 0
    assert s.cache.num_in_use == 0


def test_evicted_pages_go_to_the_host_and_come_back_as_copies():
    s = sched(num_pages=6, host=16, max_num_tokens=64)
    a = list(range(1, 14))  # 3 full pages
    s.add(req("a", a, max_tokens=1))
    run(s)
    s.add(req("other", list(range(500, 520)), max_tokens=1))  # 5 pages: evicts a's cached pages
    steps = run(s)
    assert steps[0][1].copies_to_host and not steps[0][1].copies_to_gpu
    s.add(req("b", a + [7], max_tokens=1))
    out, record = run(s)[0]
    assert record.copies_to_gpu and out.seqs[0].start == 12
    host_slots = {slot for _, slot in steps[0][1].copies_to_host}
    assert {slot for slot, _ in record.copies_to_gpu} <= host_slots
    assert s.cache.metrics.hits == 12 and 0 < s.cache.metrics.host_hits <= 12  # some may still be on the GPU


@dataclass
class WithPromptLogprobs(SamplingParams):
    prompt_logprobs: int | None = 0  # what the eval gate's requests carry (another branch adds it)


def test_a_request_for_prompt_logprobs_takes_no_hit():
    s = sched(max_num_tokens=64)
    prompt = list(range(1, 11))
    s.add(req("a", prompt))
    run(s)
    s.add(req("b", prompt, params=WithPromptLogprobs(max_tokens=1)))
    out = s.schedule()
    assert out.seqs[0].start == 0 and out.seqs[0].num_tokens == 10


def test_state_checkpoints_on_page_boundaries_and_hits_resume_from_them():
    pages = PagePool(64)
    s = Scheduler(pages, PAGE, max_num_tokens=7, max_num_seqs=2, states=PagePool(2),
                  cache=PrefixCache(pages, PAGE), checkpoints=PagePool(4))
    prompt = list(range(1, 15))  # 14 tokens: chunks 0-4, 4-8, 8-12 (budget 7 cut to pages), then 12-14
    s.add(req("a", prompt, max_tokens=2))
    steps = run(s)
    chunks = [(q.start, q.num_tokens, q.save_checkpoint >= 0) for out, _ in steps for q in out.seqs]
    assert chunks[:4] == [(0, 4, True), (4, 4, True), (8, 4, True), (12, 2, False)]
    assert s.checkpoints.num_used == 3  # one per boundary, kept while the boundary's page is cached
    s.add(req("b", prompt + [3, 4, 5]))
    out = s.schedule()
    (seq,) = out.seqs
    assert seq.start == 12 and seq.restore_checkpoint >= 0 and seq.record().restore_checkpoint == seq.restore_checkpoint
    s.update(out, {"b": 1} if seq.sample else {}, set())
    s.check()
    run(s)
    assert s.cache.num_in_use == 0 and s.states.num_used == 0


def test_a_full_checkpoint_pool_reuses_the_least_recently_used():
    """One checkpoint for a prompt of three boundaries: each save takes the oldest back, so the latest
    boundary keeps it and a later hit resumes there."""
    pages = PagePool(64)
    s = Scheduler(pages, PAGE, max_num_tokens=4, max_num_seqs=1, states=PagePool(1),
                  cache=PrefixCache(pages, PAGE), checkpoints=PagePool(1))
    prompt = list(range(1, 15))
    s.add(req("a", prompt, max_tokens=1))
    steps = run(s)
    saves = [q.save_checkpoint for out, _ in steps for q in out.seqs if q.save_checkpoint >= 0]
    assert saves == [0, 0, 0] and s.cache.checkpoint_ids() == {0}
    s.add(req("b", prompt + [3]))
    (seq,) = s.schedule().seqs
    assert seq.start == 12 and seq.restore_checkpoint == 0



def test_a_shared_prefix_without_a_checkpoint_gets_one_where_the_requests_diverge():
    """Requests over one prefix with their own suffixes, each prompt one chunk: the first leaves a
    checkpoint only at its prompt's end; the second finds the prefix's KV but no state there, so its
    first chunk ends at the prefix's last page and saves one; the third resumes from it."""
    pages = PagePool(64)
    s = Scheduler(pages, PAGE, max_num_tokens=64, max_num_seqs=2, states=PagePool(2),
                  cache=PrefixCache(pages, PAGE), checkpoints=PagePool(4))
    prefix = list(range(1, 13))  # three pages
    s.add(req("a", prefix + [20, 21, 22, 23, 24], max_tokens=1))
    chunks = [(q.start, q.num_tokens) for out, _ in run(s) for q in out.seqs]
    assert chunks[0] == (0, 16)  # one chunk, cut back to its last page boundary (16 of 17 tokens)
    s.add(req("b", prefix + [30, 31, 32, 33, 34], max_tokens=1))
    out = s.schedule()
    (seq,) = out.seqs
    assert (seq.start, seq.num_tokens, seq.restore_checkpoint) == (0, 12, -1) and seq.save_checkpoint >= 0
    s.update(out, {}, set())
    s.check()
    run(s)
    s.add(req("c", prefix + [40, 41, 42, 43, 44], max_tokens=1))
    (seq,) = s.schedule().seqs
    assert seq.start == 12 and seq.restore_checkpoint >= 0


def test_copy_runs_group_consecutive_pages_and_slots():
    from moetier.engine.kv_moves import runs

    assert runs([(3, 7), (4, 8), (5, 9), (9, 2), (10, 4), (11, 5)]) == [(3, 7, 3), (9, 2, 1), (10, 4, 2)]
    assert runs([]) == []
