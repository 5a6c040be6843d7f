"""glm5_next's decode kernels in Triton's interpreter on the CPU, each against its torch reference.
Run as a script (TRITON_INTERPRET must be set before triton is imported); test_kda.py does that in a
subprocess.

  - mHC's fused weights (layers/mhc_triton.py) against HyperConnection's torch ops: post, comb and
    the collapsed input within float32 tolerance, at hc_mult 4 and 2, H not a multiple of the block,
    scales large enough that the sigmoids and the softmax are far from flat (so a wrong row order or
    a missing Sinkhorn round shows); above MAX_ROWS tokens too (_mhc_project's tiles).
  - KDA's prefill conv (layers/kda_conv_triton.conv_prefill) against kda_reference.causal_conv:
    several token blocks, fewer tokens than the state keeps, fresh and carried states, bfloat16.
  - mHC's fused expand (layers/mhc_triton.expand_fused) against layers/mhc.expand's torch form, float32
    and bfloat16 (loosely: the interpreter truncates casts to bfloat16), at hc_mult 4 and 2, H not a
    multiple of the block.
  - KDA's gated output norm (layers/fused.gated_rms_norm) against kda.gated_rms_norm, float32 and
    bfloat16, a head width not a power of two.
  - KDA's l2 norm of q and k before the chunked prefill (layers/l2norm_triton.py) against
    kda_reference.l2_normalize, float32 and bfloat16, a strided input, a zero row, a head width not
    a power of two, rows not a multiple of the block.
  - KDA's forget gate (layers/fused.kda_forget_gate) against kda.log_decay, bounded and softplus
    (inputs past the softplus's threshold of 20 included), channels not a multiple of the block.
  - the decode conv over the state pool (layers/kda_conv_triton.py) against
    kda_reference.causal_conv_step on the gathered states: outputs within float32 tolerance, the
    slots' states shifted in place exactly, a row at position 0 starting from zeros, other slots
    untouched; float32 and bfloat16 pools, channels not a multiple of the block.
  - the KDA decode step through our fla-core wrapper (layers/kda_cuda.kda_decode_slots): each row reads
    and writes its own slot of the pool in place; the other slots stay untouched; o and the new
    states within float32 tolerance of kda_reference.kda_step; and the recurrent prefill of short
    sequences through the same wrapper (kda_prefill_slot on a view of a pool row, kda_prefill_varlen
    with recurrent=True). Skipped (said so on stdout) where fla-core is not installed.
"""

from __future__ import annotations

import importlib.util
import os

os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402

from moetier.layers.mhc import HyperConnection  # noqa: E402
from moetier.layers.mhc_triton import MAX_ROWS, mhc_weights_fused  # noqa: E402

TOL = 1e-5  # float32, relative to the norm


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


def check_mhc(n: int, s: int, h: int, iters: int, g: torch.Generator, dtype: torch.dtype = torch.float32) -> None:
    hc = HyperConnection(h, s, iters, 1e-6, 1e-5, dtype, "cpu")
    with torch.no_grad():
        hc.fn.copy_(torch.randn(hc.fn.shape, generator=g) * 0.5)
        hc.base.copy_(torch.randn(hc.base.shape, generator=g))
        hc.scale.copy_(torch.tensor([1.5, 0.7, 2.0]))
    streams = torch.randn(n, s, h, generator=g).to(dtype)
    want = hc.weights(streams)  # on the CPU: the torch ops
    got = mhc_weights_fused(streams, hc.fn, hc.base, hc.scale, iters, hc.hc_eps, hc.norm_eps)
    # bfloat16: the same products (exact in float32) summed in another order; the collapse is rounded
    # to bfloat16 (the interpreter truncates), one step of it apart at most
    tol = TOL if dtype == torch.float32 else 2e-2
    for name, a, b in zip(("post", "comb", "collapsed"), got, want):
        assert a.shape == b.shape and a.dtype == b.dtype, (name, a.shape, b.shape, a.dtype, b.dtype)
        assert rel(a, b) <= tol, (name, n, s, h, rel(a, b))
    assert got[1].std() > 0.05, "the comb came out flat: the check could not tell rows or rounds apart"
    print(f"mhc n={n} S={s} H={h} iters={iters} {dtype}: ok")


def check_expand(n: int, s: int, h: int, dtype: torch.dtype, g: torch.Generator) -> None:
    from moetier.layers.mhc import expand
    from moetier.layers.mhc_triton import expand_fused

    out, streams = torch.randn(n, h, generator=g).to(dtype), torch.randn(n, s, h, generator=g).to(dtype)
    post, comb = 2 * torch.rand(n, s, generator=g), torch.rand(n, s, s, generator=g)
    want, got = expand(out, post, comb, streams), expand_fused(out, post, comb, streams)  # torch form on the CPU
    assert got.dtype == want.dtype and got.shape == want.shape
    # bfloat16: the interpreter's casts to bfloat16 truncate (the GPU's round to nearest), so here the
    # three roundings may each lose up to one step; tests/test_kda_gpu.py checks the roundings themselves
    assert rel(got, want) <= (TOL if dtype == torch.float32 else 2e-2), rel(got, want)
    print(f"mhc expand n={n} S={s} H={h} {dtype}: ok")


def check_gated_norm(dtype: torch.dtype, g: torch.Generator) -> None:
    from moetier.layers.fused import gated_rms_norm as fused_norm
    from moetier.layers.kda import gated_rms_norm

    x, gate = torch.randn(3, 2, 96, generator=g).to(dtype), (3 * torch.randn(3, 2, 96, generator=g)).to(dtype)
    weight = torch.randn(96, generator=g).to(dtype)
    want, got = gated_rms_norm(x, gate, weight, 1e-5), fused_norm(x, gate, weight, 1e-5)
    assert got.dtype == want.dtype and got.shape == want.shape
    assert rel(got, want) <= (TOL if dtype == torch.float32 else 1e-2), rel(got, want)
    print(f"kda gated norm {dtype}: ok")


def check_l2norm(d: int, dtype: torch.dtype, g: torch.Generator) -> None:
    from moetier.layers.kda_reference import L2_EPS, l2_normalize
    from moetier.layers.l2norm_triton import l2norm_rows

    x = (4 * torch.randn(37, 3, d, generator=g)).to(dtype)  # 111 rows: not a multiple of the block
    x[5, 1] = 0  # a zero row: eps keeps it finite (zeros out)
    want, got = l2_normalize(x.float()).to(dtype), l2norm_rows(x[:, :2], L2_EPS)  # a strided view
    assert got.dtype == dtype and got.shape == (37, 2, d) and got.is_contiguous()
    assert rel(got, want[:, :2]) <= (TOL if dtype == torch.float32 else 1e-2), rel(got, want[:, :2])
    assert torch.equal(got[5, 1], torch.zeros(d, dtype=dtype))
    print(f"kda l2norm D={d} {dtype}: ok")


def check_forget_gate(lower_bound: float | None, g: torch.Generator) -> None:
    from moetier.layers.fused import kda_forget_gate
    from moetier.layers.kda import log_decay

    heads, d = 3, 400  # 1,200 channels: two blocks, the second partial
    low = (torch.randn(2, heads * d, generator=g) * 12).to(torch.bfloat16)
    dt_bias, a_log = torch.randn(heads * d, generator=g), torch.randn(heads, generator=g)
    want, got = log_decay(low, dt_bias, a_log, lower_bound), kda_forget_gate(low, dt_bias, a_log, lower_bound)
    assert got.dtype == want.dtype == torch.float32 and got.shape == want.shape
    assert rel(got, want) <= TOL, rel(got, want)
    print(f"kda forget gate lower_bound={lower_bound}: ok")


def check_conv(dtype: torch.dtype, g: torch.Generator) -> None:
    from moetier.layers.kda_conv_triton import conv_step_slots
    from moetier.layers.kda_reference import causal_conv_step

    b, c, w, slots = 3, 300, 4, 5
    qkv = torch.randn(b, 2 * c, generator=g).to(dtype)[:, :c]  # strided rows, as the projection's split
    pool = torch.randn(slots, c, w - 1, generator=g).to(dtype)
    weight = torch.randn(c, 1, w, generator=g)
    rows, pos = torch.tensor([4, 0, 2]), torch.tensor([7, 0, 3])
    before = pool.clone()
    state = before[rows] * (pos > 0)[:, None, None].to(dtype)
    want, want_state = causal_conv_step(qkv, state, weight)
    got = conv_step_slots(qkv, pool, weight, rows, pos)
    assert got.dtype == dtype and rel(got, want) <= (TOL if dtype == torch.float32 else 1e-2), rel(got, want)
    assert torch.equal(pool[rows], want_state)
    assert torch.equal(pool[[1, 3]], before[[1, 3]])
    print(f"conv step over slots {dtype}: ok")


def check_conv_prefill(t: int, fresh: bool, dtype: torch.dtype, g: torch.Generator) -> None:
    from moetier.layers.kda_conv_triton import conv_prefill
    from moetier.layers.kda_reference import causal_conv

    c, w = 300, 4  # three channel blocks, the last partial
    x = torch.randn(t, 2 * c, generator=g).to(dtype)[:, :c]  # strided rows, as the projection's split
    state = torch.randn(c, w - 1, generator=g).to(dtype)
    weight = torch.randn(c, 1, w, generator=g)
    want, want_state = causal_conv(x, torch.zeros_like(state) if fresh else state.clone(), weight)
    before = state.clone()
    got = conv_prefill(x, state, weight, fresh)
    assert got.dtype == dtype and got.shape == want.shape
    assert rel(got, want) <= (TOL if dtype == torch.float32 else 1e-2), rel(got, want)
    assert torch.equal(state, want_state), (t, fresh)
    # into planes of c / 3 channels at rows [2, 2 + t) of a longer buffer (the layer's q, k, v planes)
    planes = torch.zeros(3, t + 5, c // 3, dtype=dtype)
    assert conv_prefill(x, before, weight, fresh, out=planes[:, 2:2 + t]).data_ptr() == planes[:, 2:].data_ptr()
    assert torch.equal(planes[:, 2:2 + t].permute(1, 0, 2).reshape(t, c), got) and torch.equal(before, state)
    assert not planes[:, :2].any() and not planes[:, 2 + t:].any()
    print(f"conv prefill T={t} fresh={fresh} {dtype}: ok")


def check_kda_decode(g: torch.Generator) -> None:
    from moetier.layers.kda_cuda import kda_decode_slots
    from moetier.layers.kda_reference import kda_step

    b, heads, dk, dv, slots = 3, 2, 16, 16, 6
    q, k = torch.randn(b, heads, dk, generator=g), torch.randn(b, heads, dk, generator=g)
    v = torch.randn(b, heads, dv, generator=g)
    gate = -torch.rand(b, heads, dk, generator=g) * 2
    beta = torch.rand(b, heads, generator=g)
    pool = torch.randn(slots, heads, dk, dv, generator=g)
    rows = torch.tensor([4, 0, 2])
    before = pool.clone()
    want_o, want_s = kda_step(q, k, v, gate, beta, pool[rows].clone())
    o = kda_decode_slots(q, k, v, gate, beta, pool, rows)
    assert rel(o, want_o) <= TOL and rel(pool[rows], want_s) <= TOL, (rel(o, want_o), rel(pool[rows], want_s))
    others = [i for i in range(slots) if i not in rows.tolist()]
    assert torch.equal(pool[others], before[others])
    print("kda decode (fla fused_recurrent over state slots): ok")


def check_kda_short_prefill(g: torch.Generator) -> None:
    """The recurrent prefill of short sequences (layers/kda_cuda.py): one sequence on a view of its
    pool row, updated in place, and two sequences in one varlen launch from gathered states."""
    from moetier.layers.kda_cuda import kda_prefill_slot, kda_prefill_varlen
    from moetier.layers.kda_reference import kda_chunked

    heads, dk, dv, t = 2, 16, 16, 7
    q, k = torch.randn(t, heads, dk, generator=g), torch.randn(t, heads, dk, generator=g)
    v = torch.randn(t, heads, dv, generator=g)
    gate = -torch.rand(t, heads, dk, generator=g) * 2
    beta = torch.rand(t, heads, generator=g)
    pool = torch.randn(4, heads, dk, dv, generator=g)
    before = pool.clone()
    want_o, want_s = kda_chunked(q, k, v, gate, beta, before[2])
    o = kda_prefill_slot(q, k, v, gate, beta, pool[2:3])
    assert rel(o, want_o) <= TOL and rel(pool[2], want_s) <= TOL, (rel(o, want_o), rel(pool[2], want_s))
    assert torch.equal(pool[[0, 1, 3]], before[[0, 1, 3]])
    o, final = kda_prefill_varlen(q, k, v, gate, beta, before[[1, 3]], [0, 3, t], recurrent=True)
    for i, (a, b) in enumerate(((0, 3), (3, t))):
        want_o, want_s = kda_chunked(q[a:b], k[a:b], v[a:b], gate[a:b], beta[a:b], before[[1, 3][i]])
        assert rel(o[a:b], want_o) <= TOL and rel(final[i], want_s) <= TOL, i
    print("kda short prefill (fla fused_recurrent on a slot view, varlen): ok")


if __name__ == "__main__":
    g = torch.Generator().manual_seed(0)
    check_mhc(3, 4, 200, 20, g)
    check_mhc(1, 4, 64, 1, g)
    check_mhc(2, 2, 300, 5, g)
    check_mhc(1, 4, 2100, 3, g)  # 33 programs of two column blocks each: a split not a power of two
    # above MAX_ROWS, _mhc_project: two token blocks (the second partial); S*H 2,120 in two column chunks
    # (the second partial, not a multiple of the loop's block), bfloat16 through the tensor-core dot; S 2
    # (R 8, padded to tl.dot's 16)
    check_mhc(MAX_ROWS + 6, 4, 200, 20, g)
    check_mhc(MAX_ROWS + 6, 4, 530, 20, g)
    check_mhc(MAX_ROWS + 6, 4, 530, 20, g, torch.bfloat16)
    check_mhc(MAX_ROWS + 1, 2, 300, 5, g)
    check_expand(3, 4, 300, torch.float32, g)
    check_expand(2, 2, 520, torch.bfloat16, g)
    check_expand(1, 4, 4096, torch.bfloat16, g)
    # conv prefill: two token blocks and a partial one; fewer tokens than the state keeps; bfloat16
    check_conv_prefill(70, False, torch.float32, g)
    check_conv_prefill(7, True, torch.float32, g)
    check_conv_prefill(2, False, torch.float32, g)
    check_conv_prefill(2, True, torch.float32, g)
    check_conv_prefill(40, False, torch.bfloat16, g)
    check_gated_norm(torch.float32, g)
    check_gated_norm(torch.bfloat16, g)
    check_forget_gate(-5.0, g)
    check_forget_gate(None, g)
    check_l2norm(128, torch.float32, g)
    check_l2norm(96, torch.bfloat16, g)
    check_conv(torch.float32, g)
    check_conv(torch.bfloat16, g)
    if importlib.util.find_spec("fla") is None:
        print("kda decode: skipped (fla-core is not installed)")
    else:
        check_kda_decode(g)
        check_kda_short_prefill(g)
