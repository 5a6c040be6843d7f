"""Prefix caching through the engine on the CPU, tiny models: outputs with the cache equal outputs
without it. Bit for bit where both runs compute the same thing (every chunk one page, one request at
a time: the hit's suffix runs the chunks the uncached run runs after the same KV); elsewhere the
cached run prefills its suffix as another chunking than the uncached run (other matrix shapes, so
BLAS may sum in another order): greedy tokens equal and logprobs within 1e-4. Also the host tier's
round trip, preemption and eviction under memory pressure, and batches over shared prefixes."""

from __future__ import annotations

import pytest
import torch

from moetier.engine.llm import LLM
from moetier.sampling_params import SamplingParams

TOL = 1e-4  # float32 logprobs of one token, two chunkings of the same prefill


def prompts(n: int, system: int = 40, tail: int = 7, seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    head = torch.randint(0, 440, (system,), generator=g).tolist()
    return [head + torch.randint(0, 440, (tail + i,), generator=g).tolist() for i in range(n)]


def greedy(n: int = 6) -> SamplingParams:
    return SamplingParams(max_tokens=n, ignore_eos=True, logprobs=0)


def run(llm: LLM, groups: list[list[list[int]]]) -> list[tuple[list[int], list[float]]]:
    """Each group as one batch, groups one after the other -> per prompt (tokens, logprobs)."""
    out = []
    llm.preemptions = 0
    for group in groups:
        for o in llm.generate(group, greedy()):
            c = o.outputs[0]
            out.append((c.token_ids, [lp for lp, _ in c.logprobs]))
            llm.preemptions += o.metrics["preemptions"]
        llm.scheduler.check()
    return out


def compare(got, want, exact: bool) -> None:
    for (gt, gl), (wt, wl) in zip(got, want, strict=True):
        assert gt == wt
        if exact:
            assert gl == wl
        else:
            assert max(abs(a - b) for a, b in zip(gl, wl)) <= TOL


def pair(model, groups, **engine):
    """The same traffic with the prefix cache off and on -> (off, on, the engine with it on)."""
    plain = {k: v for k, v in engine.items() if k != "kv_host_bytes"}  # a host tier needs the cache
    off = LLM(model, dtype="float32", device="cpu", enable_prefix_caching=False, **plain)
    want = run(off, groups)
    on = LLM(model, dtype="float32", device="cpu", **engine)
    return want, run(on, groups), on


def test_aligned_chunks_hit_bit_for_bit():
    groups = [[p] for p in prompts(3)]  # the second and third find the first's 2 pages of 16
    want, got, llm = pair(None, groups, page_size=16, max_num_tokens=16, max_num_seqs=1)
    compare(got, want, exact=True)
    m = llm.metrics()
    assert m["prefix_cache_hits"] == 2 * 32 and m["prefix_cache_hit_rate"] > 0


def test_batch_over_shared_prefixes_equals_uncached():
    ps = prompts(5)
    groups = [ps[:1], ps[1:]]  # one request warms the cache, then four share its prefix in one batch
    want, got, llm = pair(None, groups, page_size=8)
    compare(got, want, exact=False)
    assert llm.metrics()["prefix_cache_hits"] == 4 * 40
    assert llm.scheduler.cache.num_in_use == 0 and llm.scheduler.cache.num_evictable > 0


def test_host_tier_round_trip_and_preemption_under_pressure():
    """A pool of 12 pages of 8 for five requests of 47-51 tokens plus 6: pages are evicted (to the host
    tier) and requests preempted; the prefix comes back from the host on later hits."""
    ps = prompts(5)
    groups = [ps[:1], [prompts(1, system=60, seed=9)[0]], ps[1:]]
    want, got, llm = pair(None, groups, page_size=8, kv_tokens=96, max_num_tokens=32, kv_host_bytes=64 << 20)
    compare(got, want, exact=False)
    m = llm.metrics()
    assert m["kv_host_pages_to_host"] > 0 and m["kv_host_hits"] > 0 and m["kv_host_bytes_to_gpu"] > 0
    assert m["prefix_cache_evictions"] > 0 and llm.preemptions > 0
    llm.scheduler.check()


@pytest.mark.parametrize("preset", ["tiny-glm5"])
def test_mla_latents_and_indexer_keys_hit(tmp_path, preset):
    """MLA latent pages and the DSA indexer's keys, read back from the cache (and the host tier)."""
    from moetier.checkpoint.writer import make_checkpoint

    path = make_checkpoint(tmp_path / preset, preset, seed=2, dtype="float32")
    ps = prompts(3)
    groups = [ps[:1], [prompts(1, system=60, seed=9)[0]], ps[1:]]
    want, got, llm = pair(path, groups, page_size=8, kv_tokens=128, kv_host_bytes=16 << 20)
    compare(got, want, exact=False)
    m = llm.metrics()
    assert m["prefix_cache_hits"] >= 2 * 40 and m["kv_host_pages_to_host"] > 0


@pytest.fixture(scope="module")
def glm5_next(tmp_path_factory):
    from tests.conftest import hf_glm5_next_checkpoint

    return hf_glm5_next_checkpoint(tmp_path_factory.mktemp("glm5next") / "ckpt", seed=2)[0]


def test_linear_attention_resumes_from_state_checkpoints(glm5_next):
    """glm5_next (KDA layers next to MLA): a hit resumes from the state saved at a page boundary the
    scheduler chose; the uncached run chunks the same way (chunks of one page), so the tokens and
    logprobs match bit for bit."""
    path = glm5_next
    groups = [[p] for p in prompts(3)]
    want, got, llm = pair(path, groups, page_size=8, max_num_tokens=8, max_num_seqs=8)  # 8 checkpoints
    compare(got, want, exact=True)
    m = llm.metrics()
    assert m["prefix_cache_hits"] == 2 * 40  # the 5 pages of the shared prefix, each with its checkpoint
    assert llm.scheduler.checkpoints.check() is None and llm.scheduler.states.num_used == 0


def test_linear_attention_hits_in_a_batch_under_pressure(glm5_next):
    path = glm5_next
    ps = prompts(4)
    want, got, llm = pair(path, [ps[:1], ps[1:]], page_size=8, kv_tokens=160, max_num_tokens=24)
    compare(got, want, exact=False)
    assert llm.metrics()["prefix_cache_hits"] > 0


def test_large_steps_are_counted():
    """LLM.metrics' large_steps: steps above decode_tokens (the large-step expert path), their tokens;
    a 100-token prompt in chunks of 48 with decode_tokens 16: two large steps of 48, then a chunk of 4
    and four one-token decode steps, none large."""
    llm = LLM(None, dtype="float32", device="cpu", decode_tokens=16, max_num_tokens=48, max_num_seqs=1)
    llm.generate([list(range(5, 105))], SamplingParams(max_tokens=5, ignore_eos=True))
    m = llm.metrics()
    assert (m["large_steps"], m["large_step_tokens"]) == (2, 96), m
    assert 0 < m["large_step_seconds"] < m["step_seconds"]  # the decode steps took time too
    assert m["steps"] == 3 + 4
