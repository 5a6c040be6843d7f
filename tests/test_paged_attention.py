"""The Triton paged-attention kernel against paged_attention_reference: in Triton's CPU interpreter
(a subprocess running paged_attention_interpreter.py) and, marked `gpu`, on CUDA at Qwen3-30B sizes,
including a decode step captured in a CUDA graph."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")

SCRIPT = Path(__file__).with_name("paged_attention_interpreter.py")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

# Qwen3-30B-A3B attention: 32 query heads, 4 kv heads, head_dim 128
HQ, HKV, D, PAGE = 32, 4, 128, 16
DECODE = [(1, c) for c in (1, 37, 500, 1023, 1024, 2049, 3001, 4000)]


def helpers():
    # the script's helpers, imported without running it (it sets TRITON_INTERPRET only as __main__)
    spec = importlib.util.spec_from_file_location("paged_attention_interpreter", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_paged_attention_matches_reference_in_the_interpreter():
    root = str(Path(__file__).parents[1])
    env = {**os.environ, "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}
    p = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, timeout=600, env=env)
    assert p.returncode == 0, p.stdout + p.stderr
    lines = p.stdout.splitlines()
    assert sum(line.startswith(("case", "edge")) for line in lines) == 28, p.stdout
    assert lines[-1].startswith("paged_attention ok"), p.stdout


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("num_splits", [None, 1, 5])
@pytest.mark.parametrize("step", ["decode", "mixed"])
@pytest.mark.gpu
@needs_cuda
def test_gpu_matches_reference(step, num_splits, dtype):
    from moetier.layers.attention import paged_attention_reference
    from moetier.layers.paged_attention_triton import paged_attention_triton

    h = helpers()
    specs = DECODE + [(300, 1000)] if step == "mixed" else DECODE
    q, k_cache, v_cache, batch = h.make_case(specs, HQ, HKV, D, PAGE, dtype, seed=7, device="cuda")
    ref = paged_attention_reference(q, k_cache, v_cache, batch)
    out = torch.full_like(q, float("nan"))
    paged_attention_triton(q, k_cache, v_cache, batch, num_splits=num_splits, out=out)
    assert not out.isnan().any()
    err = h.rel_err(out, ref)
    assert err <= h.TOL[dtype], err
    if dtype == torch.bfloat16:
        exact = paged_attention_reference(q.double(), k_cache.double(), v_cache.double(), batch)
        assert h.rel_err(out, exact) <= 1.25 * h.rel_err(ref, exact)


@pytest.mark.gpu
@needs_cuda
def test_gpu_decode_replays_in_a_cuda_graph():
    """Capture one decode step, then replay it with new q/k/v, page tables and context lengths
    written in place: the replay equals an eager call on the same contents, bit for bit."""
    from moetier.layers.attention import AttnBatch, paged_attention_reference
    from moetier.layers.paged_attention_triton import paged_attention_triton

    h = helpers()
    grow = 9  # tokens each sequence gains before the replay; pages reserved for them up front
    q, k_cache, v_cache, batch = h.make_case(DECODE, HQ, HKV, D, PAGE, torch.bfloat16, seed=1,
                                             device="cuda", reserve=grow)
    eager = paged_attention_triton(q, k_cache, v_cache, batch)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compile and warm up off the capture
        paged_attention_triton(q, k_cache, v_cache, batch)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = paged_attention_triton(q, k_cache, v_cache, batch)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(static_out, eager)

    longer = [(1, ctx + grow) for _, ctx in DECODE]
    q2, k2, v2, batch2 = h.make_case(longer, HQ, HKV, D, PAGE, torch.bfloat16, seed=2, device="cuda")
    assert k2.shape == k_cache.shape and batch2.page_table.shape == batch.page_table.shape
    for dst, src in ((q, q2), (k_cache, k2), (v_cache, v2), (batch.seq_lens, batch2.seq_lens),
                     (batch.page_table, batch2.page_table), (batch.query_start, batch2.query_start)):
        dst.copy_(src)
    graph.replay()
    # eager on the same buffers, with the host lists of the new step
    now = AttnBatch(batch.positions, batch.slot_mapping, batch.query_start, batch.seq_lens, batch.page_table,
                    batch2.query_start_host, batch2.seq_lens_host, batch2.max_query_len)
    want = paged_attention_triton(q, k_cache, v_cache, now)
    torch.cuda.synchronize()
    assert torch.equal(static_out, want)
    err = h.rel_err(static_out, paged_attention_reference(q, k_cache, v_cache, now))
    assert err <= h.TOL[torch.bfloat16], err


@pytest.mark.parametrize("hq,hkv,dim", [(HQ, HKV, D), (16, 16, 64), (64, 4, 256), (12, 2, 96)])
def test_variant_runs_cover_every_step(hq, hkv, dim):
    """compile_variants' launches reach every specialization a step can: _attn's (its blocks, split
    or not) for any longest chunk, and _combine's split count for any grid."""
    from moetier.layers.paged_attention_triton import MAX_SPLITS, _blocks, default_num_splits, variant_runs

    import triton

    gp, bd = triton.next_power_of_2(hq // hkv), max(16, triton.next_power_of_2(dim))

    def spec(q_len: int, splits: int) -> tuple:
        return (*_blocks(q_len, gp, bd), splits > 1)

    runs = variant_runs(hq, hkv, dim)
    warmed = {spec(q, s) for q, s in runs}
    combines = {s for _, s in runs if s > 1}
    counts = {default_num_splits(p, torch.device("cpu")) for p in range(1, 600)} | {1 << i for i in range(7)}
    assert max(counts) <= MAX_SPLITS
    for q_len in range(1, 700):
        for s in counts:
            assert spec(q_len, s) in warmed, (q_len, s)
            assert s == 1 or s in combines, s
