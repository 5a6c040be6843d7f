"""Runs the grouped sigmoid router kernel (moetier.layers.router_triton) in Triton's interpreter on
the CPU against grouped_route_reference: ids equal and in the same order, largest weight first
(scores are distinct and no two groups tie), weights to float32 rounding of sigmoid.

Run as a script (TRITON_INTERPRET must be set before triton is imported); test_mla.py does that in
a subprocess.
"""

from __future__ import annotations

import os
import sys

os.environ["TRITON_INTERPRET"] = "1"

import torch

from moetier.layers.router import grouped_route_reference
from moetier.layers.router_triton import route_grouped


def check(t: int, e: int, k: int, n_group: int, topk_group: int, renorm: bool, out_dtype: torch.dtype,
          g: torch.Generator) -> None:
    # a permutation of distinct logits per row: no two experts (or group sums) tie
    logits = torch.stack([(torch.randperm(e, generator=g).float() - e / 2) / (e / 8) for _ in range(t)])
    bias = torch.randn(e, generator=g) * 0.05
    want_ids, want_w = grouped_route_reference(logits, bias, k, n_group, topk_group, renorm, 2.5)
    got_ids, got_w = route_grouped(logits, bias, k, n_group, topk_group, renorm, 2.5, out_dtype)
    what = f"T={t} E={e} k={k} groups {topk_group}/{n_group} renorm={renorm} {out_dtype}"
    # in the same order, largest weight first (every router's: layers/router.py): a replayed trace
    # pairs its experts with the weights by position
    assert torch.equal(got_ids, want_ids), (what, got_ids, want_ids)
    assert bool((want_w[:, :-1] >= want_w[:, 1:]).all()), (what, want_w)
    torch.testing.assert_close(got_w.float(), want_w.to(out_dtype).float(),
                               rtol=1e-6 if out_dtype == torch.float32 else 1e-2, atol=0, msg=what)


if __name__ == "__main__":
    g = torch.Generator().manual_seed(0)
    n = 0
    for t in (1, 5):
        for e, k, n_group, topk_group in ((256, 8, 8, 4), (256, 8, 1, 1), (16, 4, 4, 2), (64, 6, 8, 3), (8, 2, 4, 1), (288, 8, 1, 1), (12, 3, 1, 1)):
            for renorm in (False, True):
                for out_dtype in (torch.float32, torch.bfloat16):
                    check(t, e, k, n_group, topk_group, renorm, out_dtype, g)
                    n += 1
    print(f"grouped router ok: {n} cases")
    sys.exit(0)
