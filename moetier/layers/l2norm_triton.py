"""KDA's l2 normalisation of q and k before fla-core's chunked prefill kernels, in one Triton kernel
compiled once per head width:

    y[r, :] = x[r, :] / sqrt(sum_d x[r, d]^2 + eps)      per row of D channels, in float32, stored
                                                          in x's dtype

kda_reference.l2_normalize is the oracle (the same eps, added rather than a max, as fla-core's
l2norm_fwd, which chunk_kda runs when asked to normalise "in the kernel").

Why our own: fla-core's l2norm_fwd autotunes 25 configurations per bucket of 65,536 rows (its key NB =
cdiv(rows, 65,536)). At 64 heads a prefill step reaches a new bucket every 1,024 tokens, so serving
met a new bucket whenever a step grew past the sizes seen before, and every request in that step
waited seconds while 25 kernels compiled and were timed (docs/prefix-cache.md, "A stall in
glm5_next's prefill"). Here the row count is not specialized and the configuration is fixed: one
compile, at the engine's warm-up step (engine/warmup.py). Decode never comes here: fla's recurrent
step normalises inside its own kernel.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_ROWS = 16  # rows a program: 16 x 128 channels, 4 warps


@triton.jit(do_not_specialize=["rows"])
def _l2norm_kernel(x_ptr, y_ptr, rows, eps, D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_ROWS: tl.constexpr):
    r = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    d = tl.arange(0, BLOCK_D)
    m = (r < rows)[:, None] & (d < D)[None, :]
    offs = r[:, None] * D + d[None, :]
    x = tl.load(x_ptr + offs, mask=m, other=0.0).to(tl.float32)
    rstd = 1 / tl.sqrt(tl.sum(x * x, 1) + eps)
    tl.store(y_ptr + offs, (x * rstd[:, None]).to(y_ptr.dtype.element_ty), mask=m)


def l2norm_rows(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x: [..., D] on CUDA -> y of x's shape and dtype, contiguous: each row of D l2-normalised."""
    x = x.contiguous()
    d = x.shape[-1]
    rows = x.numel() // d if d else 0
    y = torch.empty_like(x)
    if rows:
        grid = (triton.cdiv(rows, BLOCK_ROWS),)
        _l2norm_kernel[grid](x, y, rows, eps, D=d, BLOCK_D=triton.next_power_of_2(d), BLOCK_ROWS=BLOCK_ROWS,
                             num_warps=4)
    return y
