"""Runs the Triton latent-attention (MLA) kernel in Triton's interpreter on the CPU against the torch
reference (latent_attention_reference).

Run as a script: TRITON_INTERPRET is set before triton is imported, so this module imports no
triton at the top; test_latent_attention.py runs it in a subprocess and imports `make_case` for the
GPU tests. Every case is one step (decode tokens, prefill chunks, idle sequences) over pages taken
from a shuffled pool, with fresh random inputs; shapes are tiny (R 16-32, P 0-8) because the
interpreter runs every program in numpy.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time

if __name__ == "__main__":  # before anything imports triton; importers (the GPU tests) keep the compiler
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402

from moetier.layers.attention import AttnBatch  # noqa: E402
from moetier.layers.latent_attention import latent_attention_reference, write_latent  # noqa: E402

# Tolerances only (tests/interpreter.py on the interpreter's tl.dot). bfloat16: the reference and the
# kernel round their probabilities to bf16 at different points of the sum.
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


def make_topk(specs, k: int, g: torch.Generator) -> torch.Tensor:
    """[N, K] int32 rows for the step's tokens as the selections make them (every valid entry within a
    row's first pos + 1 columns, which is where the kernel's walk stops): min(K, pos + 1) distinct
    causal positions in random order, -1 after them; where room is left, one of them replaced by a
    position after the token (still inside the context: the kernel must drop it, as the reference
    does) and, on odd positions, another by -1 (a hole inside the walk)."""
    rows = []
    for q_len, ctx in specs:
        for pos in range(ctx - q_len, ctx):
            picked = torch.randperm(pos + 1, generator=g)[:k].tolist()
            if len(picked) < k and pos + 1 < ctx:
                picked[int(torch.randint(len(picked), (1,), generator=g))] = int(torch.randint(pos + 1, ctx, (1,),
                                                                                             generator=g))
                if pos % 2 and len(picked) > 1:
                    picked[int(torch.randint(len(picked), (1,), generator=g))] = -1
            rows.append(picked + [-1] * (k - len(picked)))
    return torch.tensor(rows, dtype=torch.int32).reshape(len(rows), k)


def make_case(specs, hq, r, p, page_size, dtype, seed, device="cpu", reserve=0, spare_pages=3, topk_k=None,
              strided_q=False):
    """specs: [(q_len, ctx)] per sequence (ctx = context after the step, q_len <= ctx). Pages come
    from a shuffled pool; reserve: more tokens of pages per sequence (room for later steps).
    -> q [N, Hq, R + P], latent [pages, page_size, R + P], AttnBatch, topk [N, K] or None, scale."""
    g = torch.Generator().manual_seed(seed)
    need = [(ctx + reserve + page_size - 1) // page_size for _, ctx in specs]
    num_pages = sum(need) + spare_pages
    pool = torch.randperm(num_pages, generator=g).tolist()
    page_table = torch.zeros(len(specs), max(need) + 1, dtype=torch.int32)
    for i, n in enumerate(need):
        page_table[i, :n] = torch.tensor(pool[:n], dtype=torch.int32)
        pool = pool[n:]
    # the whole pool random (old tokens and junk alike), then this step's rows through write_latent
    latent = torch.randn(num_pages, page_size, r + p, generator=g).to(dtype)
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
    write_latent(latent, torch.randn(n, r + p, generator=g).to(dtype), slots)
    if strided_q:  # q as a slice of a wider projection: head stride > R + P
        q = torch.randn(n, hq, r + p + 8, generator=g).to(dtype)[:, :, : r + p]
    else:
        q = torch.randn(n, hq, r + p, generator=g).to(dtype)
    topk = make_topk(specs, topk_k, g).to(device) if topk_k else None
    batch = AttnBatch(
        positions=pos.to(device), slot_mapping=slots.to(device),
        query_start=torch.tensor(query_start, dtype=torch.int32, device=device),
        seq_lens=torch.tensor([ctx for _, ctx in specs], dtype=torch.int32, device=device),
        page_table=page_table.to(device), query_start_host=query_start,
        seq_lens_host=[ctx for _, ctx in specs], max_query_len=max(q for q, _ in specs))
    return q.to(device), latent.to(device), batch, topk, (r + p) ** -0.5


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


def check(specs, hq, r, p, page_size, dtype, seed, num_splits=None, topk_k=None, strided_q=False,
          topk_dtype=torch.int32) -> float:
    from moetier.layers.latent_attention_triton import latent_attention_triton

    q, latent, batch, topk, scale = make_case(specs, hq, r, p, page_size, dtype, seed, topk_k=topk_k,
                                              strided_q=strided_q)
    topk = topk.to(topk_dtype) if topk is not None else None
    ref = latent_attention_reference(q, latent, batch, scale, r, topk)
    if topk is not None and any(ctx > topk_k for _, ctx in specs):  # the selection must matter here
        assert rel_err(latent_attention_reference(q, latent, batch, scale, r), ref) > 0.05
    out = torch.full((q.shape[0], hq, r), float("nan"), dtype=dtype)
    with poisoned_empty():
        got = latent_attention_triton(q, latent, batch, scale, r, topk=topk, out=out, num_splits=num_splits)
    assert got is out and got.dtype == dtype
    assert not got.isnan().any(), f"unwritten rows {got.isnan().any(-1).any(-1).nonzero().flatten().tolist()}"
    err = rel_err(got, ref)
    assert err <= TOL[dtype], (specs, hq, r, p, page_size, dtype, num_splits, topk_k, err)
    # the rows resolved a tile ahead (prefetch) change when loads issue, not what is summed
    ahead = latent_attention_triton(q, latent, batch, scale, r, topk=topk, num_splits=num_splits, prefetch=True)
    assert torch.equal(ahead, got), (specs, rel_err(ahead, got))
    return err


F32, BF16 = torch.float32, torch.bfloat16
DECODE = [(1, 5), (1, 37), (1, 70)]
MIXED = [(1, 30), (21, 50), (0, 9), (1, 3)]
# (specs, Hq, R, P, page_size, dtype, num_splits, topk K, strided q)
CASES = [
    (DECODE, 4, 16, 8, 8, F32, None, None, False),  # decode batch across pages; None is 1 on the CPU
    (DECODE, 4, 16, 8, 8, BF16, 3, None, False),
    (DECODE, 20, 16, 8, 4, F32, 4, None, False),  # two head blocks, the second 4 of 16 live
    (MIXED, 4, 16, 8, 8, F32, 1, None, False),  # a prefill chunk, an idle sequence, decode tokens
    (MIXED, 4, 16, 8, 16, BF16, 2, None, True),
    ([(40, 40), (1, 1)], 2, 16, 8, 16, F32, 3, None, False),  # fresh prefill over 10 query blocks
    (MIXED, 4, 32, 0, 8, F32, 2, None, False),  # P = 0
    (DECODE, 4, 24, 8, 8, F32, 2, None, False),  # R not a power of two
    ([(1, 5), (1, 16), (1, 17), (1, 60)], 4, 16, 8, 8, F32, None, 16, False),  # DSA: ctx < K, = K, > K
    ([(1, 5), (1, 16), (1, 17), (1, 60)], 4, 16, 8, 4, BF16, 3, 16, False),
    ([(12, 40), (1, 9), (0, 5), (1, 33)], 4, 16, 8, 8, F32, 2, 16, True),  # DSA in a mixed step
    ([(1, 7), (1, 45)], 4, 32, 0, 8, BF16, 2, 8, False),  # DSA with P = 0
    # GLM-5's R 512, P 64: the combine in two column chunks; prefill tiles of 2 tokens; DSA with 16
    # splits of 64 entries, 14 of them empty
    ([(1, 40), (1, 300)], 16, 512, 64, 16, BF16, 16, None, False),
    ([(5, 40), (1, 9)], 4, 512, 64, 64, F32, 2, None, False),
    ([(1, 300), (1, 20)], 16, 512, 64, 16, BF16, 16, 64, False),
]
TOPK_INT64 = {10}  # cases whose topk comes as int64 (the indexer's torch.topk indices, uncast)


def main() -> None:
    assert os.environ.get("TRITON_INTERPRET") == "1"
    t0 = time.time()
    worst = {F32: 0.0, BF16: 0.0}
    for i, (specs, hq, r, p, page, dtype, splits, k, strided) in enumerate(CASES):
        err = check(specs, hq, r, p, page, dtype, seed=i, num_splits=splits, topk_k=k, strided_q=strided,
                    topk_dtype=torch.int64 if i in TOPK_INT64 else torch.int32)
        worst[dtype] = max(worst[dtype], err)
        print(f"case {i}: Hq {hq} R {r} P {p} page {page} {str(dtype)[6:]} splits {splits} topk {k} "
              f"specs {specs} rel err {err:.2e}")
    print(f"latent_attention ok: {len(CASES)} cases, worst rel err fp32 {worst[F32]:.2e} "
          f"bf16 {worst[BF16]:.2e}, {time.time() - t0:.1f}s")


if __name__ == "__main__":
    main()
    sys.exit(0)
