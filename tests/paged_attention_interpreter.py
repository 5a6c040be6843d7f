"""Runs the Triton paged-attention kernel in Triton's interpreter on the CPU against the torch
reference (paged_attention_reference).

Run as a script: TRITON_INTERPRET is set before triton is imported, so this module imports no
triton at the top; test_paged_attention.py runs it in a subprocess and imports `make_case` for the
GPU tests. Every case is a mixed step (decode tokens and prefill chunks of several sequences) over
pages taken from a shuffled pool, with fresh random inputs.
"""

from __future__ import annotations

import contextlib
import os
import random
import sys
import time

if __name__ == "__main__":  # before anything imports triton; importers (the GPU tests) keep the compiler
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402

from moetier.layers.attention import AttnBatch, paged_attention_reference, write_kv  # noqa: E402

# Tolerances only: the interpreter's tl.dot is numpy's BLAS matmul, whose last bits depend on the
# CPU's kernel (tests/interpreter.py). bfloat16: the reference rounds scores and probabilities to
# bf16, the kernel its probabilities (about 5e-3 each from exact at these sizes); the interpreter
# also truncates float32 -> bf16 where the GPU rounds to nearest, so only the GPU test holds the
# kernel to "as close to exact as the reference".
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}


def make_case(specs, hq, hkv, dim, page_size, dtype, seed, device="cpu", reserve=0, spare_pages=3,
              strided_q=False):
    """specs: [(q_len, ctx)] per sequence (ctx = context after the step, q_len <= ctx). Pages come
    from a shuffled pool, reserve more tokens of pages per sequence (room for later steps).
    -> q [N, Hq, D], k_cache, v_cache [P, page_size, Hkv, D], AttnBatch; all on `device`."""
    g = torch.Generator().manual_seed(seed)
    need = [(ctx + reserve + page_size - 1) // page_size for _, ctx in specs]
    num_pages = sum(need) + spare_pages
    pool = torch.randperm(num_pages, generator=g).tolist()
    page_table = torch.zeros(len(specs), max(need) + 1, dtype=torch.int32)
    for i, n in enumerate(need):
        page_table[i, :n] = torch.tensor(pool[:n], dtype=torch.int32)
        pool = pool[n:]
    # the whole pool random (old tokens and junk alike), then this step's tokens through write_kv
    k_cache = torch.randn(num_pages, page_size, hkv, dim, generator=g).to(dtype)
    v_cache = torch.randn(num_pages, page_size, hkv, dim, generator=g).to(dtype)
    query_start, positions = [0], []
    for q_len, ctx in specs:
        assert 0 <= q_len <= ctx
        query_start.append(query_start[-1] + q_len)
        positions += range(ctx - q_len, ctx)
    seq_of = [i for i, (q_len, _) in enumerate(specs) for _ in range(q_len)]
    pos = torch.tensor(positions, dtype=torch.int64)
    seq_idx = torch.tensor(seq_of, dtype=torch.int64)
    slots = page_table[seq_idx, pos // page_size].long() * page_size + pos % page_size
    n = query_start[-1]
    write_kv(k_cache, v_cache, torch.randn(n, hkv, dim, generator=g).to(dtype),
             torch.randn(n, hkv, dim, generator=g).to(dtype), slots)
    if strided_q:  # q as a slice of a fused qkv projection: row stride > Hq * D
        q = torch.randn(n, hq + 2 * hkv, dim, generator=g).to(dtype)[:, :hq]
    else:
        q = torch.randn(n, hq, dim, generator=g).to(dtype)
    batch = AttnBatch(
        positions=pos.to(device), slot_mapping=slots.to(device),
        query_start=torch.tensor(query_start, dtype=torch.int32, device=device),
        seq_lens=torch.tensor([ctx for _, ctx in specs], dtype=torch.int32, device=device),
        page_table=page_table.to(device), query_start_host=query_start,
        seq_lens_host=[ctx for _, ctx in specs], max_query_len=max(q for q, _ in specs))
    return q.to(device), k_cache.to(device), v_cache.to(device), batch


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


@contextlib.contextmanager
def poisoned_empty():
    """torch.empty returns NaN-filled float tensors: unwritten output rows or split partials show."""
    empty = torch.empty

    def nan_empty(*args, **kwargs):
        t = empty(*args, **kwargs)
        return t.fill_(float("nan")) if t.is_floating_point() else t

    torch.empty = nan_empty
    try:
        yield
    finally:
        torch.empty = empty


def check(specs, hq, hkv, dim, page_size, dtype, seed, num_splits=None, strided_q=False) -> float:
    from moetier.layers.paged_attention_triton import paged_attention_triton

    q, k_cache, v_cache, batch = make_case(specs, hq, hkv, dim, page_size, dtype, seed, strided_q=strided_q)
    ref = paged_attention_reference(q, k_cache, v_cache, batch)
    out = torch.full(q.shape, float("nan"), dtype=dtype)
    with poisoned_empty():
        got = paged_attention_triton(q, k_cache, v_cache, batch, num_splits=num_splits, out=out)
    assert got is out and got.dtype == dtype
    assert not got.isnan().any(), f"unwritten rows {got.isnan().any(-1).any(-1).nonzero().flatten().tolist()}"
    err = rel_err(got, ref)
    assert err <= TOL[dtype], (specs, hq, hkv, dim, page_size, dtype, num_splits, err)
    return err


def random_specs(rng: random.Random, page_size: int, decode_only: bool) -> list[tuple[int, int]]:
    specs = []
    for _ in range(rng.randint(2, 4)):
        q_len = 1 if decode_only or rng.random() < 0.5 else rng.randint(7, 40)
        ctx = q_len + rng.randint(0, 140)
        if ctx % page_size == 0:  # context lengths off the page boundary
            ctx += rng.randint(1, page_size - 1)
        specs.append((q_len, ctx))
    return specs


def main() -> None:
    assert os.environ.get("TRITON_INTERPRET") == "1"
    t0 = time.time()
    rng = random.Random(1234)
    heads = [(2, 2), (4, 2), (8, 2), (6, 1)]  # GQA ratios 1, 2, 4, 6
    dims, pages, dtypes = [16, 24, 32, 64], [4, 8, 16], [torch.float32, torch.bfloat16]
    worst = {dtype: 0.0 for dtype in dtypes}
    count = 0
    for i in range(24):
        hq, hkv = heads[i % 4]
        dim, page_size, dtype = dims[(i // 4) % 4], pages[i % 3], dtypes[(i // 2) % 2]
        decode_only = i % 5 == 0
        num_splits = [None, 1, 3, 4][(i // 3) % 4]  # None is 1 on the CPU
        specs = random_specs(rng, page_size, decode_only)
        err = check(specs, hq, hkv, dim, page_size, dtype, seed=i, num_splits=num_splits, strided_q=i % 7 == 3)
        worst[dtype] = max(worst[dtype], err)
        count += 1
        print(f"case {i}: Hq {hq} Hkv {hkv} D {dim} page {page_size} {str(dtype)[6:]} splits {num_splits} "
              f"specs {specs} rel err {err:.2e}")
    # edges: fresh prefill (ctx == q_len), a chunk longer than one query block, an idle sequence
    # (q_len 0), a single decode token at context 1, and a context across many small pages
    edges = [([(40, 40), (1, 1)], 6, 1, 24, 4, torch.float32, 2),
             ([(33, 200), (0, 17), (1, 64)], 8, 2, 32, 16, torch.bfloat16, 3),
             ([(1, 1)], 4, 1, 16, 16, torch.float32, 1),
             ([(1, 517), (1, 3)], 8, 1, 64, 4, torch.bfloat16, 5)]
    for j, (specs, hq, hkv, dim, page_size, dtype, splits) in enumerate(edges):
        err = check(specs, hq, hkv, dim, page_size, dtype, seed=100 + j, num_splits=splits)
        worst[dtype] = max(worst[dtype], err)
        count += 1
        print(f"edge {j}: specs {specs} rel err {err:.2e}")
    print(f"paged_attention ok: {count} cases, worst rel err fp32 {worst[torch.float32]:.2e} "
          f"bf16 {worst[torch.bfloat16]:.2e}, {time.time() - t0:.1f}s")


if __name__ == "__main__":
    main()
    sys.exit(0)
