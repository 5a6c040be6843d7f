"""Runs the fused layer kernels (moetier.models.fused) in Triton's interpreter on the CPU against
the plain-torch code they replace. Float32 must agree to rounding, bfloat16 to a few ulps (only the
order of the float32 reductions differs). Router ids must be equal.

Run as a script (TRITON_INTERPRET must be set before triton is imported); test_fused.py does that
in a subprocess.

NOTE: the exact checks here (residual sums, the v cache, router ids) involve no tl.dot: they are copies,
one add, and a top-k over distinct values, so they hold under any BLAS; the rest is held to tolerances.
"""

from __future__ import annotations

import os
import sys

os.environ["TRITON_INTERPRET"] = "1"

import numpy as np  # noqa: E402
import torch  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.runtime import interpreter  # noqa: E402

from moetier.layers import fused  # noqa: E402
from moetier.layers.norm import rms_norm
from moetier.layers.rotary import rope_cos_sin, rope_inv_freq  # noqa: E402
from moetier.layers.gqa_attention import qk_norm_rope_kv_reference
from moetier.layers.router import route_reference  # noqa: E402

EPS = 1e-6


def _round_to_bfloat16(cast_impl):
    # The interpreter truncates float32 -> bfloat16; compiled Triton, like torch, rounds to nearest
    # even. Without this every bfloat16 result would be off by up to an ulp per rounding step.
    def cast(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            bits = torch.from_numpy(np.ascontiguousarray(src.data)).to(torch.bfloat16).view(torch.int16)
            return interpreter.TensorHandle(bits.numpy().view(np.uint16), dst_type.scalar)
        return cast_impl(self, src, dst_type)
    return cast


interpreter.InterpreterBuilder.cast_impl = _round_to_bfloat16(interpreter.InterpreterBuilder.cast_impl)


def close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """Float32: 1e-5 relative. Bfloat16: within 2 ulps of the tensor's largest value (rotary sums
    cancel, so an element's own ulp is too tight) and 0.4% in norm."""
    assert got.dtype == want.dtype and got.shape == want.shape, (what, got.dtype, got.shape, want.shape)
    fp32 = want.dtype == torch.float32
    got, want = got.float(), want.float()
    scale = want.abs().max().item()
    tol = dict(rtol=1e-5, atol=1e-6 * scale) if fp32 else dict(rtol=0, atol=2**-6 * scale)
    torch.testing.assert_close(got, want, **tol, msg=lambda m: f"{what}: {m}")
    rel = ((got - want).norm() / want.norm()).item()
    assert rel < (1e-5 if fp32 else 4e-3), (what, rel)


def check_rms_norm(t: int, h: int, dtype: torch.dtype, g: torch.Generator) -> None:
    x = (torch.randn(t, h, generator=g) * 3).to(dtype)
    r = torch.randn(t, h, generator=g).to(dtype)
    w = (torch.rand(h, generator=g) + 0.5).to(dtype)
    y, s = fused.rms_norm(x, w, EPS)
    assert s is x
    close(y, rms_norm(x, w, EPS), f"rms_norm {t}x{h} {dtype}")
    y, s = fused.rms_norm(x, w, EPS, residual=r)
    assert torch.equal(s, x + r), "the residual sum must be torch's add"
    close(y, rms_norm(x + r, w, EPS), f"add_rms_norm {t}x{h} {dtype}")
    wide = torch.randn(t, h + 5, generator=g).to(dtype)[:, 2:h + 2]  # row stride != H
    close(fused.rms_norm(wide, w, EPS)[0], rms_norm(wide, w, EPS), f"strided rms_norm {t}x{h} {dtype}")


def check_qk(t: int, hq: int, hkv: int, d: int, dtype: torch.dtype, g: torch.Generator) -> None:
    pages, page_size = 7, 4
    qkv = (torch.randn(t, (hq + 2 * hkv) * d, generator=g) * 2).to(dtype)
    q_norm = (torch.rand(d, generator=g) + 0.5).to(dtype)
    k_norm = (torch.rand(d, generator=g) + 0.5).to(dtype)
    positions = torch.randint(0, 4096, (t,), generator=g)
    cos, sin = rope_cos_sin(positions, rope_inv_freq(d, 1e6), dtype)
    slots = torch.randperm(pages * page_size, generator=g)[:t]  # scattered over pages and offsets
    caches = [torch.randn(pages, page_size, hkv, d, generator=g).to(dtype) for _ in range(2)]
    want_k, want_v = caches[0].clone(), caches[1].clone()
    got_k, got_v = caches[0].clone(), caches[1].clone()
    args = (q_norm, k_norm, cos, sin)
    want_q = qk_norm_rope_kv_reference(qkv, *args, want_k, want_v, slots, hq, hkv, EPS)
    got_q = fused.qk_norm_rope_kv(qkv, *args, got_k, got_v, slots, hq, hkv, EPS)
    what = f"qk_norm_rope_kv T={t} {hq}:{hkv} D={d} {dtype}"
    close(got_q, want_q, what + " q")
    close(got_k, want_k, what + " k cache")
    assert torch.equal(got_v, want_v), what + " v cache"
    untouched = torch.ones(pages * page_size, dtype=torch.bool)
    untouched[slots] = False
    assert torch.equal(got_k.view(-1, hkv, d)[untouched], caches[0].view(-1, hkv, d)[untouched]), what


def distinct_logits(t: int, e: int, dtype: torch.dtype, g: torch.Generator) -> torch.Tensor:
    # Distinct in every row even in bfloat16 (multiples of 1/16 up to 16 are exact there).
    return torch.stack([(torch.randperm(e, generator=g) - e // 2).float() / 16 for _ in range(t)]).to(dtype)


def check_route(t: int, e: int, k: int, renorm: bool, dtype: torch.dtype, g: torch.Generator) -> None:
    logits = distinct_logits(t, e, dtype, g) if dtype == torch.bfloat16 else torch.randn(t, e, generator=g) * 2
    want_ids, want_w = route_reference(logits, k, renorm)
    got_ids, got_w = fused.route_topk(logits, k, renorm)
    what = f"route T={t} E={e} k={k} renorm={renorm} {dtype}"
    assert got_ids.dtype == torch.int64 and torch.equal(got_ids, want_ids), (what, got_ids, want_ids)
    close(got_w, want_w, what)


def check_silu_mul(t: int, i: int, limit: float | None, dtype: torch.dtype, g: torch.Generator) -> None:
    from moetier.activation import silu_mul

    gate_up = (torch.randn(t, 2 * i, generator=g) * 6).to(dtype)
    close(fused.silu_mul(gate_up, limit), silu_mul(gate_up, limit), f"silu_mul t={t} i={i} limit={limit} {dtype}")


def check_expand(t: int, s: int, h: int, dtype: torch.dtype, g: torch.Generator) -> None:
    # mHC's expand (layers/mhc_triton.py), here for the bfloat16 roundings the interpreter otherwise truncates
    from moetier.layers.mhc import expand
    from moetier.layers.mhc_triton import expand_fused

    out, streams = torch.randn(t, h, generator=g).to(dtype), torch.randn(t, s, h, generator=g).to(dtype)
    post, comb = 2 * torch.rand(t, s, generator=g), torch.rand(t, s, s, generator=g)
    close(expand_fused(out, post, comb, streams), expand(out, post, comb, streams), f"mhc expand t={t} s={s} h={h}")


if __name__ == "__main__":
    g = torch.Generator().manual_seed(0)
    n = 0
    for dtype in (torch.float32, torch.bfloat16):
        for t in (1, 3, 17):
            for h in (37, 64, 2048):
                check_rms_norm(t, h, dtype, g)
                n += 1
            for hq, hkv, d in ((4, 2, 64), (32, 4, 128), (4, 2, 128)):
                check_qk(t, hq, hkv, d, dtype, g)
                n += 1
        for t in (1, 3, 17):
            for e, k in ((8, 2), (32, 4), (128, 8), (256, 8), (128, 2), (256, 4)):
                for renorm in (False, True):
                    check_route(t, e, k, renorm, dtype, g)
                    n += 1
        for t, i, limit in ((1, 37, None), (3, 1100, 7.0), (17, 64, 7.0)):
            check_silu_mul(t, i, limit, dtype, g)
            n += 1
        for t, s_, h in ((1, 4, 300), (3, 2, 1000)):
            check_expand(t, s_, h, dtype, g)
            n += 1
    print(f"fused kernels ok: {n} cases")
    sys.exit(0)
