"""Runs the kpool indexer's decode-selection kernels (layers/kpool_select_triton.py) in Triton's
interpreter on the CPU against their torch form (layers/kpool_indexer.pool_scores_fixed,
pool_tokens_fixed, select_pools_fixed). Run as a script (TRITON_INTERPRET must be set before triton
is imported); test_glm5_next_decode.py does that in a subprocess. Each case, decode rows over
shuffled pages (a sequence without a token among them):

  - pool_scores: the masked pools exactly where the torch form masks them, the others within float32
    rounding (the pool keys round alike, to nearest even, in bf16 too);
  - pool_tokens on the topk of the kernel's own scores: equal, entry for entry, to the torch form's
    tokens from the same scores (the same topk, so no tie can part them);
  - the whole selection against select_pools_fixed (positive scores, so no near ties): the same tokens.
Heads and channels not powers of two (padded), kpool 2, 3 and 4, a window shorter than a pool; and
verify steps: several rows a sequence (k + 1 positions, fewer for some, none for one).
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402

from moetier.layers import kpool_select_triton as kernels  # noqa: E402
from moetier.layers.kpool_indexer import (pool_scores_fixed, pool_tokens_fixed, select_pools_cuda,  # noqa: E402
                                          select_pools_fixed)
from tests.interpreter import DECODE_SEQS, VERIFY_SEQS, decode_rows  # noqa: E402

TOL = 1e-5  # float32 sums in another order; the bf16 pool keys equal (both round to nearest even)


def case(seqs, page, d, hi, kpool, topk, dtype, seed, narrow: bool = False) -> str:
    """narrow: the page table a column view of a wider one (a decode graph's narrow context bucket,
    engine/graphs.py), its rows strided by the wide table's width, the extra columns other pages."""
    g = torch.Generator().manual_seed(seed)
    index_k, ape, batch, q, w = decode_rows(seqs, page, 2 * d, d, hi, dtype, g, narrow, ape=kpool)
    n = batch.num_tokens
    want = pool_scores_fixed(q, w, index_k, ape, batch, kpool, 0.3)
    got = kernels.pool_scores(q, w, index_k, ape, batch, kpool, 0.3)
    low = torch.finfo(torch.float32).min
    assert got.shape == want.shape and torch.equal(got == low, want == low), (got, want)
    live = want != low
    err = ((got[live] - want[live]).abs() / want[live].abs()).max().item() if live.any() else 0.0
    assert err <= TOL, (seqs, dtype, err)
    select = min(topk // kpool, got.shape[1])
    picked = got.topk(select, dim=-1).indices if select else None
    tokens = kernels.pool_tokens(picked, batch.positions, kpool, topk + kpool - 1)
    assert torch.equal(tokens, pool_tokens_fixed(got, batch.positions, topk, kpool)), (tokens, got)
    whole = select_pools_cuda(q, w, index_k, ape, batch, topk, kpool, 0.3)
    assert torch.equal(whole, select_pools_fixed(q, w, index_k, ape, batch, topk, kpool, 0.3)), seqs
    return (f"kpool_select n={n} rows={batch.max_query_len} P={got.shape[1]} d={d} hi={hi} kpool={kpool} "
            f"{str(dtype)[6:]} "
            f"scores_err={err:.1e} tokens=exact whole=equal")


def main() -> None:
    lines = []
    seqs = DECODE_SEQS
    for dtype in (torch.float32, torch.bfloat16):
        lines.append(case(seqs, 4, 8, 3, 2, 4, dtype, seed=1))  # 2 pools picked of up to 15
        lines.append(case(seqs, 4, 24, 5, 4, 32, dtype, seed=2))  # every visible pool picked
    lines.append(case([(1, 1, [0]), (0, 1, [1])], 4, 16, 16, 4, 8, torch.float32, seed=3))  # no complete pool
    lines.append(case(seqs, 4, 8, 9, 3, 6, torch.bfloat16, seed=4))  # kpool 3: padded pool lanes
    lines.append(case(VERIFY_SEQS, 4, 24, 5, 4, 8, torch.bfloat16, seed=6))
    lines.append(case(seqs, 4, 8, 3, 2, 4, torch.float32, seed=5, narrow=True) + " narrow-table")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
