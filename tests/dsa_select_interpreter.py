"""Runs the DSA indexer's decode scoring kernel (layers/dsa_select_triton.py) in Triton's interpreter on
the CPU against its torch form (layers/dsa_indexer.key_scores_fixed, topk_positions). Run as a script
(TRITON_INTERPRET must be set before triton is imported); test_mla.py does that in a subprocess. Each
case, decode rows over shuffled pages (a sequence without a token among them):

  - key_scores: -inf exactly where the torch form masks (keys after the token's position), the
    others within float32 rounding (exact products, sums in another order);
  - the whole selection (positive scores: no near ties) equal to the torch form's, entry for entry.
Heads and channels not powers of two (padded), a window wider than the context, a narrow page table
(a column view of a wider one, as a decode graph's bucket), top-k wider than the window; and verify
steps: several rows a sequence (k + 1 positions, fewer for some, none for one).
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402

from moetier.layers import dsa_select_triton as kernels  # noqa: E402
from moetier.layers.dsa_indexer import key_scores_fixed, topk_positions  # noqa: E402
from tests.interpreter import DECODE_SEQS, VERIFY_SEQS, decode_rows  # noqa: E402

TOL = 1e-5  # float32 sums in another order


def case(seqs, page, d, hi, topk, dtype, seed, narrow: bool = False) -> str:
    g = torch.Generator().manual_seed(seed)
    index_k, _, batch, q, w = decode_rows(seqs, page, d, d, hi, dtype, g, narrow)
    n = batch.num_tokens
    want = key_scores_fixed(q, w, index_k, batch, 0.3)
    got = kernels.key_scores(q, w, index_k, batch, 0.3)
    inf = float("-inf")
    assert got.shape == want.shape and torch.equal(got == inf, want == inf), (got, want)
    live = want != inf
    err = ((got[live] - want[live]).abs() / want[live].abs()).max().item()
    assert err <= TOL, (seqs, dtype, err)
    picked = topk_positions(got, topk)
    assert torch.equal(picked, topk_positions(want, topk)), (picked, seqs)
    return (f"dsa_select n={n} rows={batch.max_query_len} S={got.shape[1]} d={d} hi={hi} topk={topk} "
            f"{str(dtype)[6:]} "
            f"scores_err={err:.1e} whole=equal{' narrow-table' if narrow else ''}")


def main() -> None:
    seqs = DECODE_SEQS
    lines = []
    for dtype in (torch.float32, torch.bfloat16):
        lines.append(case(seqs, 4, 8, 3, 5, dtype, seed=1))
        lines.append(case(seqs, 4, 24, 10, 64, dtype, seed=2))  # top-k wider than every window
    lines.append(case(seqs, 8, 16, 9, 6, torch.bfloat16, seed=3, narrow=True))
    lines.append(case(VERIFY_SEQS, 4, 24, 10, 7, torch.bfloat16, seed=4))
    lines.append(case(VERIFY_SEQS, 4, 16, 9, 5, torch.float32, seed=5, narrow=True))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
