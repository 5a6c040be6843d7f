"""The fused layer kernels (moetier.layers.fused) against the plain-torch code they replace: in
Triton's interpreter on the CPU (a subprocess running fused_interpreter.py), and, marked `gpu`, on
CUDA at Qwen3-30B-A3B sizes, inside a captured CUDA graph, and through the whole model; and on CUDA at
GLM-5.3-Flash's sizes, glm5_next's one-launch forms: the models' RMSNorm (norm.model_rms_norm), KDA's
gated output norm and forget gate, the MLPs' SwiGLU, and mHC's expand (layers/mhc_triton.py), each
against its torch form on the GPU."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from tests.interpreter import run_script  # noqa: E402

H, HQ, HKV, D, E, K, EPS = 2048, 32, 4, 128, 128, 8, 1e-6
BF16_ULP = 2**-7


def gpu(test):
    return pytest.mark.gpu(pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")(test))


def test_fused_kernels_match_references_in_the_interpreter():
    out = run_script("fused_interpreter.py")
    assert "fused kernels ok" in out


def near(got: torch.Tensor, want: torch.Tensor, ulps: float = 2) -> None:
    # bfloat16: within `ulps` ulps of the tensor's largest value (rotary sums cancel).
    assert got.dtype == want.dtype and got.shape == want.shape
    got, want = got.float(), want.float()
    torch.testing.assert_close(got, want, rtol=0, atol=ulps * BF16_ULP * want.abs().max().item())


def ref_rms_norm(x, weight, eps, residual=None):
    from moetier.layers.norm import rms_norm

    s = x if residual is None else x + residual
    return rms_norm(s, weight, eps), s


def qk_inputs(t: int, g: torch.Generator, pages: int = 64, page_size: int = 16):
    from moetier.layers.rotary import rope_cos_sin, rope_inv_freq

    bf = dict(dtype=torch.bfloat16, device="cuda")
    qkv = torch.randn(t, (HQ + 2 * HKV) * D, generator=g).to(**bf)
    q_norm, k_norm = (torch.rand(2, D, generator=g) + 0.5).to(**bf)
    positions = torch.randint(0, 32768, (t,), generator=g).cuda()
    cos, sin = rope_cos_sin(positions, rope_inv_freq(D, 1e6).cuda(), torch.bfloat16)
    slots = torch.randperm(pages * page_size, generator=g)[:t].cuda()
    k_cache = torch.randn(pages, page_size, HKV, D, generator=g).to(**bf)
    return qkv, q_norm, k_norm, cos, sin, k_cache, torch.randn_like(k_cache), slots


def router_logits(t: int, g: torch.Generator) -> torch.Tensor:
    # Distinct in every row even in bfloat16 (multiples of 1/16 up to 16 are exact there).
    return torch.stack([(torch.randperm(E, generator=g) - E // 2).float() / 16 for _ in range(t)]).to(
        torch.bfloat16).cuda()


@gpu
@pytest.mark.parametrize("t", [1, 8, 300])
def test_rms_norm_on_gpu(t):
    from moetier.layers import fused

    g = torch.Generator().manual_seed(t)
    x, r = (torch.randn(2, t, H, generator=g) * 4).to(torch.bfloat16).cuda()
    w = (torch.rand(H, generator=g) + 0.5).to(torch.bfloat16).cuda()
    y, s = fused.rms_norm(x, w, EPS, r)
    want_y, want_s = ref_rms_norm(x, w, EPS, r)
    assert torch.equal(s, want_s)
    near(y, want_y, ulps=1)
    near(fused.rms_norm(x, w, EPS)[0], ref_rms_norm(x, w, EPS)[0], ulps=1)


@gpu
@pytest.mark.parametrize("t", [1, 8, 300])
def test_glm5_next_one_launch_forms_round_as_their_torch_forms(t):
    from moetier.activation import silu_mul
    from moetier.layers import fused
    from moetier.layers.kda import gated_rms_norm, log_decay
    from moetier.layers.mhc import expand
    from moetier.layers.mhc_triton import expand_fused
    from moetier.layers.norm import model_rms_norm, rms_norm

    g = torch.Generator().manual_seed(t)
    bf = torch.bfloat16
    x = (torch.randn(t, 4096 + 576, generator=g) * 4).to(bf).cuda()
    w = (torch.rand(4096, generator=g) + 0.5).to(bf).cuda()
    near(model_rms_norm(x[:, :4096], w, EPS), rms_norm(x[:, :4096], w, EPS), ulps=1)  # rows with a stride
    o, gate = torch.randn(t, 32, 128, generator=g).to(bf).cuda(), (3 * torch.randn(t, 32, 128, generator=g)).to(bf).cuda()
    wn = torch.randn(128, generator=g).to(bf).cuda()
    near(fused.gated_rms_norm(o, gate, wn, EPS), gated_rms_norm(o, gate, wn, EPS), ulps=1)
    low = (torch.randn(t, 32 * 128, generator=g) * 12).to(bf).cuda()
    dt_bias, a_log = torch.randn(32 * 128, generator=g).cuda(), torch.randn(32, generator=g).cuda()
    gate_up = (torch.randn(t, 2 * 1536, generator=g) * 6).to(bf).cuda()
    for limit in (None, 7.0):
        near(fused.silu_mul(gate_up, limit), silu_mul(gate_up, limit), ulps=1)
    for bound in (-5.0, None):
        want = log_decay(low, dt_bias, a_log, bound)
        torch.testing.assert_close(fused.kda_forget_gate(low, dt_bias, a_log, bound), want, rtol=1e-5, atol=1e-6)
    out, streams = torch.randn(t, 4096, generator=g).to(bf).cuda(), torch.randn(t, 4, 4096, generator=g).to(bf).cuda()
    post, comb = (2 * torch.rand(t, 4, generator=g)).cuda(), torch.rand(t, 4, 4, generator=g).cuda()
    got = expand_fused(out, post, comb, streams)
    want = post.to(bf).unsqueeze(-1) * out.unsqueeze(-2) + torch.matmul(comb.to(bf).transpose(-1, -2), streams)
    near(got, want, ulps=1)  # the same roundings; the four-term sum's order may move one step
    assert torch.equal(expand(out, post, comb, streams), got)  # expand takes the kernel on CUDA


@gpu
@pytest.mark.parametrize("t", [1, 8, 300])
def test_qk_norm_rope_kv_on_gpu(t):
    from moetier.layers import fused
    from moetier.layers.gqa_attention import qk_norm_rope_kv_reference

    qkv, qn, kn, cos, sin, kc, vc, slots = qk_inputs(t, torch.Generator().manual_seed(t))
    want_k, want_v, got_k, got_v = kc.clone(), vc.clone(), kc.clone(), vc.clone()
    want_q = qk_norm_rope_kv_reference(qkv, qn, kn, cos, sin, want_k, want_v, slots, HQ, HKV, EPS)
    got_q = fused.qk_norm_rope_kv(qkv, qn, kn, cos, sin, got_k, got_v, slots, HQ, HKV, EPS)
    near(got_q, want_q)
    near(got_k, want_k)
    assert torch.equal(got_v, want_v)


@gpu
@pytest.mark.parametrize("renorm", [False, True])
@pytest.mark.parametrize("t", [1, 8, 300])
def test_route_on_gpu(t, renorm):
    from moetier.layers import fused
    from moetier.layers.router import route_reference

    g = torch.Generator().manual_seed(t)
    for logits in (router_logits(t, g), torch.randn(t, E, generator=g).cuda()):
        want_ids, want_w = route_reference(logits, K, renorm)
        got_ids, got_w = fused.route_topk(logits, K, renorm)
        assert torch.equal(got_ids, want_ids)
        if logits.dtype == torch.float32:
            torch.testing.assert_close(got_w, want_w, rtol=1e-5, atol=1e-7)
        else:
            near(got_w, want_w, ulps=1)


@gpu
def test_graph_replay_equals_eager():
    """The three kernels captured in one graph, replayed on new inputs: bit-equal to eager."""
    from moetier.layers import fused

    g = torch.Generator().manual_seed(0)
    t = 4
    static = [qk_inputs(t, g) for _ in range(2)]  # [0]: captured on, [1]: replayed with
    x = [(torch.randn(2, t, H, generator=g)).to(torch.bfloat16).cuda() for _ in range(2)]
    w = (torch.rand(H, generator=g) + 0.5).to(torch.bfloat16).cuda()
    logits = [router_logits(t, g) for _ in range(2)]

    def step(qk, xr, lg):
        y, s = fused.rms_norm(xr[0], w, EPS, xr[1])
        q = fused.qk_norm_rope_kv(*qk, HQ, HKV, EPS)
        return (y, s, q, *fused.route_topk(lg, K, True))

    eager_caches = (static[1][5].clone(), static[1][6].clone())
    eager = step((*static[1][:5], *eager_caches, static[1][7]), x[1], logits[1])
    step(static[0], x[0], logits[0])  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = step(static[0], x[0], logits[0])
    for dst, src in zip((*static[0], x[0], logits[0]), (*static[1], x[1], logits[1])):
        dst.copy_(src)
    graph.replay()
    torch.cuda.synchronize()
    for got, want in zip(outs, eager):
        assert torch.equal(got, want)
    assert torch.equal(static[0][5], eager_caches[0]) and torch.equal(static[0][6], eager_caches[1])


@gpu
def test_model_forward_fused_equals_plain_torch_on_gpu(tiny_ckpt, monkeypatch):
    """The whole model on CUDA in float32: prefill and decode steps with the fused kernels against
    the same model with them swapped for their references."""
    from tests.helpers import Sequence
    from moetier.checkpoint.loader import load_model
    from moetier.layers import fused
    from moetier.layers.gqa_attention import qk_norm_rope_kv_reference
    from moetier.layers.router import route_reference

    _, model, _ = load_model(tiny_ckpt, dtype="float32", device="cuda")
    ids = torch.arange(3, 40)

    def run():
        seq = Sequence(model, 64)
        hidden = [seq.forward(ids[:30])] + [seq.forward(ids[i:i + 1]) for i in range(30, 37)]
        return torch.cat(hidden)

    got = run()
    monkeypatch.setattr(fused, "rms_norm", ref_rms_norm)
    monkeypatch.setattr(fused, "qk_norm_rope_kv", qk_norm_rope_kv_reference)
    monkeypatch.setattr(fused, "route_topk", route_reference)
    torch.testing.assert_close(got, run(), rtol=1e-4, atol=1e-4)

