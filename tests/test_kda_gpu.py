"""GPU tests of glm5_next's kernels (marked `gpu`, skipped without CUDA), each against its torch
reference: KDA prefill and decode through fla-core (layers/kda_cuda.py) and the decode conv over the
slots (layers/kda_conv_triton.py), both decode steps replayed from CUDA graphs over state slots
that change between replays; the fused mHC weights (layers/mhc_triton.py) at GLM-5.3-Flash's width;
the graph-safe kpool selection.

fla's chunked kernels use tensor-core dots (TF32 for float32 inputs), so the KDA bounds are those of
bf16-level rounding; each test also checks that a wrong input (a lost carried state) fails the bound."""

from __future__ import annotations

import pytest
import torch

from moetier.layers.kda_reference import kda_chunked, kda_step
from tests.test_gpu import capture
from tests.test_glm5_next_decode import assert_compact_with_tails
from tests.test_parity import rel_err

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
fla = pytest.importorskip("fla", reason="fla-core is not installed (pip install fla-core==0.6.0)") \
    if torch.cuda.is_available() else None

H, DK, DV = 4, 128, 128  # GLM-5.3-Flash's head size; fewer heads


def kda_inputs(t: int, seed: int, dtype: torch.dtype):
    g = torch.Generator().manual_seed(seed)
    q, k = torch.randn(t, H, DK, generator=g), torch.randn(t, H, DK, generator=g)
    v = torch.randn(t, H, DV, generator=g)
    gate = -5 * torch.sigmoid(torch.randn(t, H, DK, generator=g))  # the lower-bounded forget gate
    beta = torch.rand(t, H, generator=g)
    return [x.to(dtype) for x in (q, k, v)] + [gate, beta.to(dtype)]


@pytest.mark.parametrize("recurrent", [False, True])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 5e-3), (torch.bfloat16, 2e-2)])
def test_prefill_varlen_with_carried_states_matches_the_reference(dtype, tol, recurrent):
    from moetier.layers.kda_cuda import kda_prefill_varlen

    lens = [130, 7, 1, 64, 200]  # past a chunk, short, one token, exactly a chunk
    q, k, v, gate, beta = kda_inputs(sum(lens), 1, dtype)
    g = torch.Generator().manual_seed(2)
    initial = torch.randn(len(lens), H, DK, DV, generator=g) * 0.3
    initial[1] = 0  # a fresh sequence
    starts = [0]
    for n in lens:
        starts.append(starts[-1] + n)
    o, final = kda_prefill_varlen(*(x.cuda() for x in (q, k, v, gate, beta)), initial.cuda(), starts, recurrent)
    assert o.dtype == v.dtype and final.dtype == torch.float32
    for i, (a, b) in enumerate(zip(starts, starts[1:])):
        want_o, want_s = kda_chunked(q[a:b].float(), k[a:b].float(), v[a:b].float(), gate[a:b], beta[a:b].float(),
                                     initial[i])
        assert rel_err(o[a:b].float().cpu(), want_o) <= tol, (i, rel_err(o[a:b].float().cpu(), want_o))
        assert rel_err(final[i].cpu(), want_s) <= tol, (i, rel_err(final[i].cpu(), want_s))
        if i in (0, 2):  # the carried state matters: from zeros the outputs are far off
            lost = kda_chunked(q[a:b].float(), k[a:b].float(), v[a:b].float(), gate[a:b], beta[a:b].float(),
                               torch.zeros_like(initial[i]))[0]
            assert rel_err(o[a:b].float().cpu(), lost) > 5 * tol


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("t", [1, 5, 64])
def test_prefill_on_a_slot_view_updates_it_in_place(t, dtype, tol):
    """One short sequence on a view of its pool row (a prefix hit's tail): the outputs and the row's
    new state are the reference's from the row's old state; the other rows stay as they were."""
    from moetier.layers.kda_cuda import kda_prefill_slot

    g = torch.Generator().manual_seed(t)
    pool = (torch.randn(5, H, DK, DV, generator=g) * 0.3).cuda()
    before = pool.clone()
    q, k, v, gate, beta = kda_inputs(t, 20 + t, dtype)
    o = kda_prefill_slot(*(x.cuda() for x in (q, k, v, gate, beta)), pool[2:3])
    want_o, want_s = kda_chunked(q.float(), k.float(), v.float(), gate, beta.float(), before[2].cpu())
    assert o.dtype == v.dtype and o.shape == (t, H, DV)
    assert rel_err(o.float().cpu(), want_o) <= tol and rel_err(pool[2].cpu(), want_s) <= tol
    assert torch.equal(pool[[0, 1, 3, 4]], before[[0, 1, 3, 4]])
    lost = kda_chunked(q.float(), k.float(), v.float(), gate, beta.float(), torch.zeros_like(before[2].cpu()))[0]
    assert rel_err(o[:4].float().cpu(), lost[:4]) > 5 * tol  # the carried state matters (it decays)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
def test_decode_over_slots_replays_from_a_graph(dtype, tol):
    """Three steps of one captured graph, the slots buffer rewritten in place between replays (as the
    decode graphs do): every row reads and writes its own slot, padding rows share the spare one, the
    other slots stay as they were."""
    from moetier.layers.kda_cuda import kda_decode_slots

    b, slots = 4, 9
    g = torch.Generator().manual_seed(3)
    pool = (torch.randn(slots, H, DK, DV, generator=g) * 0.3).cuda()
    static = [x.cuda() for x in kda_inputs(b, 4, dtype)]
    rows = torch.zeros(b, dtype=torch.int64, device="cuda")
    graph, out = capture(lambda: kda_decode_slots(*static, pool, rows))
    for step, picked in enumerate(([5, 0, 2, 8], [2, 5, 8, 8], [7, 3, 1, 8])):  # 8: the spare slot
        new = kda_inputs(b, 10 + step, dtype)
        for s, x in zip(static, new):
            s.copy_(x)
        rows.copy_(torch.tensor(picked))
        live = [i for i, p in enumerate(picked) if p != slots - 1]
        before = pool.clone()
        want_o, want_s = kda_step(*(x.float() for x in new[:3]), new[3], new[4].float(), before[rows].cpu())
        graph.replay()
        torch.cuda.synchronize()
        assert rel_err(out[live].float().cpu(), want_o[live]) <= tol
        assert rel_err(pool[rows[live]].cpu(), want_s[live]) <= tol
        rest = [i for i in range(slots) if i not in picked]
        assert torch.equal(pool[rest], before[rest])


# float32: the sigmoids, softmax and Sinkhorn amplify the projection's reassociation (logits about 10)
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("n", [1, 8, 33, 65, 512])  # above 64 (mhc_triton.MAX_ROWS): _mhc_project
def test_fused_mhc_matches_the_torch_ops_and_captures(n, dtype, tol):
    from moetier.layers.mhc import HyperConnection
    from moetier.layers.mhc_triton import mhc_weights_fused

    hidden, s = 4096, 4
    g = torch.Generator().manual_seed(n)
    hc = HyperConnection(hidden, s, 20, 1e-6, 1e-5, dtype, "cpu")
    with torch.no_grad():
        hc.fn.copy_(torch.randn(hc.fn.shape, generator=g) * 0.02)
        hc.base.copy_(torch.randn(hc.base.shape, generator=g))
        hc.scale.copy_(torch.tensor([1.0, 1.0, 4.0]))
    streams = torch.randn(n, s, hidden, generator=g).to(dtype)
    want = hc.weights(streams)  # the CPU: the torch ops
    hc = hc.cuda()
    x = streams.cuda()
    graph, got = capture(lambda: mhc_weights_fused(x, hc.fn, hc.base, hc.scale, 20, hc.hc_eps, hc.norm_eps))
    x.copy_(streams.cuda())
    graph.replay()
    for name, a, b in zip(("post", "comb", "collapsed"), got, want):
        err = rel_err(a.float().cpu(), b.float())
        assert a.dtype == b.dtype and err <= tol, (name, err)
    assert want[1].std() > 0.05  # the comb is not flat: rows and Sinkhorn rounds can be told apart


@pytest.mark.parametrize("n", [256, 2048])
def test_mhc_projection_is_exact_per_token(n):
    # every token's R projections against float64: bf16 products are exact and the sums float32, so a
    # token is off by float32 rounding at most; the norm-wide checks above cannot see a few wrong rows
    # (with its loads software-pipelined, a few tokens of each call came out up to 8% off on the H100)
    from moetier.layers.mhc_triton import projected

    sh, r = 4 * 4096, 24
    g = torch.Generator().manual_seed(0)
    fn = (torch.randn(r, sh, generator=g) * 0.02).to(torch.bfloat16)
    x = torch.randn(n, sh, generator=g).to(torch.bfloat16)
    part, sq, _ = projected(x.cuda(), fn.cuda(), r, 32)
    want = x.double() @ fn.double().T  # [n, R]
    got = part.sum(1)[:, :r].double().cpu()
    err = (got - want).abs().max(1).values / want.abs().max(1).values
    assert err.max() < 1e-5, (int(err.argmax()), float(err.max()))
    sq_want = (x.double() ** 2).sum(1)
    assert ((sq.sum(1).double().cpu() - sq_want).abs() / sq_want).max() < 1e-5


def test_fixed_kpool_selection_captures_and_equals_the_reference():
    from moetier.layers.attention import make_batch
    from moetier.layers.kpool_indexer import select_pools_fixed, select_pools_reference

    g = torch.Generator().manual_seed(8)
    d, kpool, topk = 8, 2, 4
    index_k = torch.rand(14, 4, 2 * d, generator=g).cuda()
    ape = torch.rand(kpool, d, generator=g).cuda()
    batch = make_batch([(9, 1, [3, 7, 1]), (13, 1, [5, 11, 4, 9]), (2, 1, [6, 8]), (6, 1, [2, 10])], 4, "cuda")
    q, w = torch.rand(4, 3, d, generator=g).cuda(), torch.rand(4, 3, generator=g).cuda()
    graph, got = capture(lambda: select_pools_fixed(q, w, index_k, ape, batch, topk, kpool, 0.3))
    graph.replay()
    want = select_pools_reference(q, w, index_k, ape, batch, topk, kpool, 0.3)
    assert torch.equal(got.sort(-1).values, want.sort(-1).values)
    assert_compact_with_tails(got.cpu(), want.cpu(), batch.positions, kpool)


def test_kpool_selection_kernels_capture_and_equal_the_torch_form():
    """select_pools_cuda (two Triton launches around topk) at GLM-5.3-Flash's indexer shape (32 heads of
    128, kpool 16, top 2,048) over shuffled pages: the graph's replay equals the torch form's tokens;
    the scores within float32 rounding."""
    from moetier.layers.attention import make_batch
    from moetier.layers.kpool_indexer import pool_scores_fixed, select_pools_cuda, select_pools_fixed
    from moetier.layers.kpool_select_triton import pool_scores

    g = torch.Generator().manual_seed(11)
    d, hi, kpool, topk, page = 128, 32, 16, 2048, 64
    pages = torch.randperm(200, generator=g).tolist()
    seqs = [(4200, 1, pages[:66]), (37, 1, pages[66:67]), (900, 1, pages[67:82]), (15, 1, pages[82:83])]
    batch = make_batch(seqs, page, "cuda")
    index_k = torch.randn(200, page, 2 * d, generator=g).bfloat16().cuda()
    ape = torch.randn(kpool, d, generator=g).bfloat16().cuda()
    q = torch.randn(4, hi, d, generator=g).bfloat16().cuda()
    w = torch.randn(4, hi, generator=g).cuda()
    want = pool_scores_fixed(q, w, index_k, ape, batch, kpool, 0.088)
    got = pool_scores(q, w, index_k, ape, batch, kpool, 0.088)
    live = want > torch.finfo(torch.float32).min
    assert torch.equal(live, got > torch.finfo(torch.float32).min)
    assert ((got - want).abs()[live] / want.abs().max()).max() < 1e-5
    graph, tokens = capture(lambda: select_pools_cuda(q, w, index_k, ape, batch, topk, kpool, 0.088))
    graph.replay()
    ref = select_pools_fixed(q, w, index_k, ape, batch, topk, kpool, 0.088)
    assert torch.equal(tokens.sort(-1).values, ref.sort(-1).values)
    assert_compact_with_tails(tokens.cpu(), ref.cpu(), batch.positions, kpool)


@pytest.mark.parametrize("n", [1, 8, 64])
def test_decode_gates_kernel_equals_the_torch_ops_and_captures(n):
    """layers/kda_gates_triton at GLM-5.3-Flash's KDA shape (64 heads of 128, lower bound -5), bf16: gate
    within one bf16 rounding of the batched GEMM's, g within what that moves, beta equal; the same from
    a graph's replay."""
    from moetier.layers.fused import kda_forget_gate
    from moetier.layers.kda_gates_triton import kda_gates

    g_ = torch.Generator().manual_seed(n)
    heads, d = 64, 128
    inner = heads * d
    proj = torch.randn(n, 3 * inner + 2 * d + heads, generator=g_).bfloat16().cuda()
    up = (torch.randn(2, inner, d, generator=g_) * d ** -0.5).bfloat16().cuda()
    dt_bias, a_log = torch.randn(inner, generator=g_).cuda(), (torch.randn(heads, generator=g_) * 0.5).cuda()
    low = proj[:, 3 * inner: 3 * inner + 2 * d].reshape(n, 2, d).transpose(0, 1)
    want_up = torch.bmm(low, up.transpose(1, 2))
    want_g = kda_forget_gate(want_up[0], dt_bias, a_log, -5.0)
    graph, (g, gate, beta) = capture(lambda: kda_gates(proj, up, dt_bias, a_log, -5.0, inner))
    graph.replay()
    assert rel_err(gate, want_up[1]) < 1e-3 and rel_err(g, want_g) < 1e-3
    assert torch.equal(beta, torch.sigmoid(proj[:, 3 * inner + 2 * d:]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_conv_over_slots_replays_from_a_graph(dtype):
    from moetier.layers.kda_conv_triton import conv_step_slots
    from moetier.layers.kda_reference import causal_conv_step

    b, c, w, slots = 4, 3 * H * DK, 4, 7
    g = torch.Generator().manual_seed(9)
    pool = torch.randn(slots, c, w - 1, generator=g).to(dtype).cuda()
    weight = torch.randn(c, 1, w, generator=g).cuda()
    qkv = torch.zeros(b, 2 * c, dtype=dtype, device="cuda")
    rows, pos = torch.zeros(b, dtype=torch.int64, device="cuda"), torch.zeros(b, dtype=torch.int64, device="cuda")
    graph, out = capture(lambda: conv_step_slots(qkv[:, :c], pool, weight, rows, pos))
    for picked, at in (([5, 0, 2, 6], [9, 0, 4, 0]), ([2, 5, 1, 6], [5, 10, 0, 0])):  # 6: the spare slot
        qkv.copy_(torch.randn(b, 2 * c, generator=g).to(dtype))
        rows.copy_(torch.tensor(picked)), pos.copy_(torch.tensor(at))
        before = pool.clone()
        live = (pos > 0)[:, None, None].to(dtype)
        want, want_state = causal_conv_step(qkv[:, :c], before[rows] * live, weight)
        graph.replay()
        torch.cuda.synchronize()
        real = [i for i, p in enumerate(picked) if p != slots - 1]
        torch.testing.assert_close(out[real], want[real], rtol=1e-5 if dtype == torch.float32 else 1e-2, atol=1e-5)
        assert torch.equal(pool[rows[real]], want_state[real])
        rest = [i for i in range(slots) if i not in picked]
        assert torch.equal(pool[rest], before[rest])
