"""KDA's q/k l2 norm before the chunked prefill: ours (layers/l2norm_triton.py, one fixed configuration)
against fla-core's l2norm_fwd (autotuned per 65,536-row bucket, timed after its tuning), at 64 heads of
128 and two step sizes, with GB/s (read + write) and the largest difference between the two. CUDA and
fla-core needed (the device's wheels: scripts/h200_stages.sh).

    python scripts/kda_l2norm_bench.py
"""

from __future__ import annotations

import torch
import triton
from fla.modules.norm.l2norm import l2norm_fwd

from moetier.layers.kda_reference import L2_EPS
from moetier.layers.l2norm_triton import l2norm_rows

for tokens in (512, 8192):
    x = torch.randn(tokens, 64, 128, dtype=torch.bfloat16, device="cuda")
    ours = triton.testing.do_bench(lambda: l2norm_rows(x, L2_EPS), rep=200)  # ms
    theirs = triton.testing.do_bench(lambda: l2norm_fwd(x, L2_EPS), rep=200)
    gb = 2 * x.numel() * x.element_size() / 1e9
    diff = (l2norm_rows(x, L2_EPS).float() - l2norm_fwd(x, L2_EPS)[0].float()).abs().max().item()
    print(f"l2norm {tokens} tokens x 64 heads: ours {ours * 1e3:.1f} us ({gb / ours * 1e3:.0f} GB/s), "
          f"fla {theirs * 1e3:.1f} us ({gb / theirs * 1e3:.0f} GB/s); max diff {diff:.3g}")
