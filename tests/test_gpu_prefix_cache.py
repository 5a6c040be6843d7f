"""The prefix cache on CUDA; skipped without it. The host tier's copies run non_blocking on a side
stream (engine/kv_moves.py) into memory pinned at exact size, each layer's compute waiting for its own
copies only; outputs with the cache and a host tier
that pages round-trip through equal outputs without the cache (bf16 on the Triton kernels: greedy
tokens equal, the hit's suffix prefilled in other chunks), and a decode step with the cache on
carries no copies and replays its CUDA graph."""

from __future__ import annotations

import pytest
import torch

from moetier.engine.llm import LLM
from moetier.sampling_params import SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def prompts(n: int, system: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    head = torch.randint(0, 440, (system,), generator=g).tolist()
    return [head + torch.randint(0, 440, (5 + i,), generator=g).tolist() for i in range(n)]


def tokens(llm: LLM, groups) -> list[list[int]]:
    out = []
    for group in groups:
        out += [o.outputs[0].token_ids for o in llm.generate(group, SamplingParams(max_tokens=8, ignore_eos=True))]
        llm.scheduler.check()
    return out


def test_host_tier_round_trip_on_cuda():
    ps = prompts(4, 64, seed=1)
    groups = [ps[:1], prompts(1, 120, seed=2), ps[1:]]  # the second evicts the first's pages to the host
    engine = dict(device="cuda", dtype="float32", page_size=16, kv_tokens=160, max_num_tokens=64)
    want = tokens(LLM(None, enable_prefix_caching=False, **engine), groups)
    llm = LLM(None, kv_host_bytes=8 << 20, **engine)
    moves = llm.runner.moves
    assert moves.stream is not None and moves.host_bytes <= 8 << 20 and moves._hooked  # per-layer waits
    assert tokens(llm, groups) == want
    m = llm.metrics()
    assert m["kv_host_pages_to_host"] > 0 and m["kv_host_hits"] > 0 and m["prefix_cache_hits"] >= 3 * 64


def test_decode_with_the_cache_replays_graphs():
    llm = LLM(None, device="cuda", dtype="bfloat16")
    p = prompts(2, 48, seed=3)
    llm.generate(p[:1], SamplingParams(max_tokens=4, ignore_eos=True))
    before = llm.runner.graph_steps
    out = llm.generate(p[1:], SamplingParams(max_tokens=16, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 16 and llm.runner.graph_steps - before >= 14
    assert llm.metrics()["prefix_cache_hits"] == 48


def test_page_copy_kernel_equals_the_runs_copy_on_cuda():
    """The host tier's scattered pages (a churned pool and tier: runs of one or two pages) through the
    kernel, into registered host memory and back, equal the copy along runs, bit for bit."""
    import random

    from moetier.engine.kv_moves import KVMoves
    from moetier.engine.step import StepInput
    from moetier.layers.kv_cache import GqaKVCache

    rng = random.Random(0)
    moves = []
    for _ in range(2):
        kv = GqaKVCache(3, num_pages=48, page_size=16, num_kv_heads=2, head_dim=64, dtype=torch.bfloat16,
                        device="cuda")
        g = torch.Generator(device="cuda").manual_seed(0)
        for t in kv.page_tensors():
            t.copy_(torch.randn(t.shape, generator=g, device="cuda"))
        m = KVMoves(kv, host_slots=40)
        for h in m.host:
            h.fill_(3)
        moves.append(m)
    evicted = rng.sample(range(48), 30)
    up = list(zip(evicted, rng.sample(range(40), 30)))
    used = {s for _, s in up}
    kept = [p for p in range(48) if p not in evicted]
    down = list(zip(rng.sample([s for s in range(40) if s not in used], 9), evicted[:5] + kept[:4]))
    step = StepInput(seqs=[], copies_to_host=up, copies_to_gpu=down)
    want, got = moves
    want._copy(step)  # the torch copy along runs (the CPU's path)
    got.before(step)  # the kernels on the copy stream, the compute stream joined after them
    torch.cuda.synchronize()
    for a, b in zip(want.device_tensors + want.host, got.device_tensors + got.host, strict=True):
        assert torch.equal(a, b)
    assert [len(rows) for rows in got._word_rows.values()] == [2, 2, 2]  # K and V of three layers
