"""The DeepSeek-V3 family's parts against transformers' modules and plain-torch references: YaRN,
the grouped sigmoid router, MLA over the paged latent cache (absorbed against expanded), the DSA
indexer; the configs' errors; MTP layers skipped; make-checkpoint, the random bed and the plan."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from moetier import presets
from moetier.models.registry import config_from_dict
from moetier.errors import ConfigError
from moetier.layers.attention import make_batch
from moetier.layers.dsa_indexer import DsaIndexer
from moetier.layers.kv_cache import MlaKVSpec
from moetier.layers.mla_attention import MlaAttention
from moetier.layers.rotary import rope_cos_sin
from moetier.layers.router import grouped_route_reference
from tests.conftest import hf_mla_model


@pytest.mark.parametrize("preset", ["deepseek-v3", "tiny-dsv3", "glm-5"])
def test_rotary_and_softmax_scale_match_transformers(preset):
    cfg = presets.preset(preset, layers=None if preset.startswith("tiny") else 4)
    ref = hf_mla_model("tiny-dsv3", 0) if preset == "tiny-dsv3" else None
    import transformers

    d = cfg.to_hf_dict()
    hf_cfg = getattr(transformers, d.pop("architectures")[0].removesuffix("ForCausalLM") + "Config")(
        **{k: v for k, v in d.items() if k != "model_type"})
    mod = transformers.models.deepseek_v3.modeling_deepseek_v3
    rot = mod.DeepseekV3RotaryEmbedding(hf_cfg)
    assert torch.equal(cfg.inv_freq(), rot.inv_freq)
    assert cfg.rope_attention_factor == rot.attention_scaling
    assert cfg.softmax_scale == mod.yarn_apply_mscale(hf_cfg.rope_parameters, cfg.qk_head_dim ** -0.5)
    if preset == "deepseek-v3":  # factor 40, mscale = mscale_all_dim = 1: scale (0.1 ln 40 + 1)^2 / sqrt(192)
        assert cfg.rope_type == "yarn" and abs(cfg.softmax_scale * 192 ** 0.5 - 1.8738) < 1e-4
    if ref is not None:  # tiny-dsv3: mscale != mscale_all_dim, so cos and sin are scaled too
        assert cfg.rope_attention_factor != 1.0
        assert ref.model.layers[0].self_attn.scaling == cfg.softmax_scale


def test_grouped_router_matches_transformers():
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
        DeepseekV3TopkRouter,
    )

    ref = DeepseekV3TopkRouter(hf_mla_model("tiny-dsv3", 0).config)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        ref.weight.normal_(0, 0.5, generator=g)
        ref.e_score_correction_bias.uniform_(-0.1, 0.1, generator=g)
    x = torch.randn(64, ref.hidden_dim, generator=g)
    _, want_w, want_ids = ref(x)
    logits = F.linear(x, ref.weight)
    ids, w = grouped_route_reference(logits, ref.e_score_correction_bias, ref.top_k, ref.num_group, ref.topk_group,
                                     ref.norm_topk_prob, ref.routed_scaling_factor)
    # the same picks; ours listed largest weight first (layers/router.py), transformers' in top-k's order
    mine, theirs = ids.argsort(-1), want_ids.argsort(-1)
    assert torch.equal(ids.gather(1, mine), want_ids.gather(1, theirs))
    torch.testing.assert_close(w.gather(1, mine), want_w.gather(1, theirs), rtol=1e-6, atol=0)
    assert bool((w[:, :-1] >= w[:, 1:]).all())


def test_group_limit_and_bias_by_hand():
    # 8 experts in 4 groups of 2, keep 2 groups, top-2. sigmoid scores:
    # .953 .018 | .500 .622 | .731 .711 | .881 .622 -> group sums .97, 1.12, 1.44, 1.50: expert 0,
    # the best single score, is dropped with its group.
    logits = torch.tensor([[3.0, -4.0, 0.0, 0.5, 1.0, 0.9, 2.0, 0.5]])
    ids, w = grouped_route_reference(logits, torch.zeros(8), 2, 4, 2, renormalize=False, scaling=2.0)
    assert sorted(ids[0].tolist()) == [4, 6]
    torch.testing.assert_close(w[0].sort().values, 2.0 * torch.sigmoid(torch.tensor([1.0, 2.0])))
    # a bias of 0.5 on expert 2 lifts its group (1.62) over group 2 and expert 2 (1.0) over expert 6
    # for the choice; the weights stay the unbiased scores
    bias = torch.tensor([0.0, 0.0, 0.5, 0.0, 0.0, 0.0, 0.0, 0.0])
    ids, w = grouped_route_reference(logits, bias, 2, 4, 2, renormalize=False, scaling=1.0)
    assert sorted(ids[0].tolist()) == [2, 6]
    torch.testing.assert_close(w[0].sort().values, torch.sigmoid(torch.tensor([0.0, 2.0])))
    ids, w = grouped_route_reference(logits, bias, 2, 1, 1, renormalize=True, scaling=1.0)
    assert sorted(ids[0].tolist()) == [0, 2]  # one group: the plain biased top-2, renormalised
    torch.testing.assert_close(w.sum(), torch.tensor(1.0))


def test_grouped_router_kernel_in_the_interpreter():
    pytest.importorskip("triton")
    from tests.interpreter import run_script

    assert "grouped router ok: 56 cases" in run_script("router_interpreter.py")


def expanded_mla(attn: MlaAttention, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Plain MLA without absorption, one sequence from position 0: keys and values expanded per head."""
    t = x.shape[0]
    _, q, rows = attn.project(x, cos, sin)  # q absorbed: recompute q_nope below
    qf = F.linear(rms_q(attn, x), attn.q_b) if attn.q_proj is None else F.linear(x, attn.q_proj)
    q_nope = qf.view(t, attn.hq, -1)[..., : attn.nope]
    c, k_pe = rows.split([attn.r, attn.rope], dim=-1)
    k = torch.cat([torch.einsum("sr,hdr->shd", c, attn.w_uk), k_pe[:, None].expand(t, attn.hq, attn.rope)], -1)
    v = torch.einsum("sr,hvr->shv", c, attn.w_uv)
    qq = torch.cat([q_nope, q[..., attn.r:]], -1)
    scores = torch.einsum("thd,shd->hts", qq, k) * attn.scale
    scores = scores.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
    out = torch.einsum("hts,shv->thv", scores.softmax(-1), v)
    return F.linear(out.reshape(t, -1), attn.o)


def rms_q(attn, x):
    from moetier.layers.norm import rms_norm

    return rms_norm(F.linear(x, attn.q_a), attn.q_a_norm, 1e-6)


@pytest.mark.parametrize("q_lora,rope", [(24, 8), (0, 8), (24, 0)])
def test_absorbed_latent_attention_equals_expanded(q_lora, rope):
    """Prefill in two chunks over 4-token pages, through the absorbed path, against plain MLA with
    expanded keys and values; qk_rope_head_dim 0 (no position part) included."""
    torch.manual_seed(0)
    h, hq, r, nope, v = 32, 3, 16, 12, 10
    attn = MlaAttention(0, h, hq, q_lora, r, nope, rope, v, False, (nope + rope) ** -0.5, True, torch.float32, "cpu")
    for p in attn.parameters():
        p.data.normal_(0, 0.3)
    x = torch.randn(11, h)
    inv = 1.0 / (10000 ** (torch.arange(0, rope, 2).float() / max(rope, 1)))
    cos, sin = rope_cos_sin(torch.arange(11), inv, torch.float32)
    kv = MlaKVSpec(1, r, rope).allocate(4, 4, torch.float32, "cpu")
    pages = [2, 0, 3]
    out = []
    for a, b in ((0, 7), (7, 11)):
        batch = make_batch([(a, b - a, pages)], 4, "cpu")
        out.append(attn(x[a:b], cos[a:b], sin[a:b], batch, kv)[0])
    torch.testing.assert_close(torch.cat(out), expanded_mla(attn, x, cos, sin), rtol=1e-5, atol=1e-6)
    assert kv.latent[0, 1].abs().sum() == 0  # page 1 is not the sequence's


def test_indexer_matches_transformers():
    from transformers.models.glm_moe_dsa.modeling_glm_moe_dsa import (
        GlmMoeDsaIndexer,
        GlmMoeDsaRotaryEmbedding,
    )

    hf_cfg = hf_mla_model("tiny-glm5", 0).config
    ref = GlmMoeDsaIndexer(hf_cfg, 0).eval()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in ref.parameters():
            p.normal_(0, 0.3, generator=g)
    ours = DsaIndexer(0, hf_cfg.hidden_size, hf_cfg.q_lora_rank, hf_cfg.index_n_heads, hf_cfg.index_head_dim,
                      hf_cfg.qk_rope_head_dim, hf_cfg.index_topk, torch.float32, "cpu")
    with torch.no_grad():
        ours.wq_b.copy_(ref.wq_b.weight), ours.wk.copy_(ref.wk.weight), ours.weights_proj.copy_(ref.weights_proj.weight)
        ours.k_norm.copy_(ref.k_norm.weight), ours.k_norm_bias.copy_(ref.k_norm.bias)
    t = 20
    x, q_resid = torch.randn(t, hf_cfg.hidden_size, generator=g), torch.randn(t, hf_cfg.q_lora_rank, generator=g)
    pos = torch.arange(t)
    cos, sin = GlmMoeDsaRotaryEmbedding(hf_cfg)(x, pos[None])
    mask = torch.ones(t, t, dtype=torch.bool).tril()[None]
    with torch.no_grad():
        want = ref(x[None], q_resid[None], (cos, sin), mask, pos[None])[0]  # [T, min(topk, T)]
    kv = MlaKVSpec(1, 8, 16, hf_cfg.index_head_dim, (0,)).allocate(8, 4, torch.float32, "cpu")
    got = ours(x, q_resid, cos[0], sin[0], make_batch([(0, t, [5, 1, 7, 0, 2])], 4, "cpu"), kv)
    assert got.shape == (t, hf_cfg.index_topk) and got.dtype == torch.int32
    for i in range(t):
        chosen = {j for j in got[i].tolist() if j >= 0}
        assert chosen == {j for j in want[i].tolist() if j <= i}, f"token {i}"
        assert len(chosen) == min(i + 1, hf_cfg.index_topk)


def test_config_errors_are_listed_together():
    d = presets.preset_dict("tiny-glm5")
    d.update(n_group=3, topk_group=5, indexer_types=["shared", "full"], num_key_value_heads=2,
             rope_parameters={"rope_type": "longrope", "rope_theta": 1e4}, scoring_func="softmax",
             mlp_layer_types=["dense", "sparse"], q_lora_rank=None)
    with pytest.raises(ConfigError) as e:
        config_from_dict(d, "tiny-glm5 config.json")
    msg = str(e.value)
    for want in ("does not split into n_group 3", "topk_group 5 is larger than n_group 3", "indexer_types must list",
                 "num_key_value_heads 2", "rope type 'longrope'", "scoring_func 'softmax'",
                 "mlp_layer_types must list", "q_lora_rank is required"):
        assert want in msg, want
    assert "(8 problems)" in msg


def test_mtp_layers_are_known_and_skipped(tmp_path):
    """A published checkpoint's MTP layer (model.layers.{num_hidden_layers}.*) loads without being
    called unexpected and changes nothing; a stray tensor is still reported."""
    from safetensors.torch import load_file, save_file

    from moetier.checkpoint.loader import load_model
    from moetier.checkpoint.writer import make_checkpoint
    from moetier.errors import CheckpointError
    from tests.helpers import Sequence

    path = make_checkpoint(tmp_path / "a", "tiny-dsv3", seed=1, dtype="float32")
    tensors = load_file(path / "model.safetensors")
    cfg = json.loads((path / "config.json").read_text())
    cfg["num_nextn_predict_layers"] = 1
    (path / "config.json").write_text(json.dumps(cfg))
    n, h = cfg["num_hidden_layers"], cfg["hidden_size"]
    mtp = {f"model.layers.{n}.eh_proj.weight": torch.ones(h, 2 * h),
           f"model.layers.{n}.self_attn.kv_b_proj.weight": tensors["model.layers.1.self_attn.kv_b_proj.weight"] + 1,
           f"model.layers.{n}.mlp.experts.3.up_proj.weight": tensors["model.layers.1.mlp.experts.3.up_proj.weight"] + 1,
           f"model.layers.{n}.shared_head.head.weight": tensors["lm_head.weight"] + 1}
    save_file({**tensors, **mtp}, path / "model.safetensors")
    _, model, _ = load_model(path)
    ids = torch.arange(3, 20)
    logits = model.logits(Sequence(model, 32).forward(ids))
    save_file(tensors, path / "model.safetensors")
    _, plain, _ = load_model(path)
    assert torch.equal(logits, plain.logits(Sequence(plain, 32).forward(ids)))
    save_file({**tensors, f"model.layers.{n}.mystery.weight": torch.ones(3)}, path / "model.safetensors")
    with pytest.raises(CheckpointError, match="unexpected tensor model.layers.3.mystery.weight"):
        load_model(path)


@pytest.mark.parametrize("preset", ["tiny-glm5", "tiny-dsv3-plain"])
def test_make_checkpoint_loads_and_generates(tmp_path, preset):
    from moetier.checkpoint.random_bed import random_bed, use_backend
    from moetier.checkpoint.writer import make_checkpoint
    from moetier.engine.llm import LLM
    from moetier.sampling_params import SamplingParams
    from tests.helpers import Sequence

    path = make_checkpoint(tmp_path / preset, preset, seed=2, dtype="float32")
    out = LLM(path, device="cpu").generate([[5, 6, 7] * 7], SamplingParams(max_tokens=6, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 6
    bed = random_bed(presets.preset(preset), device="cpu", dtype=torch.float32)
    use_backend(bed, "resident")
    hidden = Sequence(bed.model, 32).forward(torch.arange(1, 25))
    assert torch.isfinite(bed.model.logits(hidden)).all()


def test_plan_counts_the_latent_cache():
    """glm-5's KV per token is the latent (kv_lora 512 + rope 64) and the indexer key (128) of every
    layer: 78 x (576 + 128) x 2 B in bf16, about 1/47 of full K and V heads (64 x (256 + 256) x 2 B)."""
    from moetier.plan.memory import _kv_bytes_per_token

    cfg = presets.preset("glm-5")
    per_token = _kv_bytes_per_token(cfg, torch.bfloat16)
    assert per_token == 78 * (512 + 64 + 128) * 2
    assert 40 * per_token < 78 * 64 * (256 + 256) * 2
    assert cfg.moe_layers == list(range(3, 78)) and len(cfg.index_layers) == 78
    assert 7.0e11 < cfg.num_parameters() < 8.0e11
    dsv3 = presets.preset("deepseek-v3")
    assert 6.6e11 < dsv3.num_parameters() < 6.8e11  # 671B without the MTP layer


@pytest.mark.parametrize("preset", ["tiny-glm5", "tiny-dsv3-plain"])
def test_plan_dense_bytes_are_what_the_model_allocates(preset):
    """The plan's dense weights (checkpoint list, float32 gates included) equal the model's bytes."""
    from moetier.models.registry import model_class
    from moetier.plan.residents import dense_weights

    cfg = presets.preset(preset)
    model = model_class(cfg)(cfg, torch.bfloat16, "cpu")
    dense = dense_weights(cfg, torch.bfloat16)
    assert dense.embedding_and_head + dense.layers == sum(p.numel() * p.element_size() for p in model.parameters())
    assert sum(p.numel() for p in model.parameters()) + cfg.num_experts * 3 * cfg.hidden_size * (
        cfg.moe_intermediate_size * len(cfg.moe_layers)) == cfg.num_parameters()


def test_plan_cli_for_glm5():
    from typer.testing import CliRunner

    from moetier.cli.app import app

    r = CliRunner().invoke(app, ["plan", "--preset", "glm-5", "--layers", "8", "--gpu-memory", "139GiB",
                                 "--host-memory", "500GiB", "--max-model-len", "8192"])
    assert r.exit_code == 0, r.output
    assert "11,264 B/token" in r.output and "glm_moe_dsa, 8 layers (5 MoE)" in r.output


def test_latent_attention_reads_only_the_chosen_positions():
    """topk rows: -1 entries are ignored, positions past the token are never read, and a token
    attends over exactly the listed causal keys."""
    from moetier.layers.latent_attention import latent_attention_reference

    g = torch.Generator().manual_seed(3)
    r, p, hq = 8, 4, 2
    latent = torch.randn(3, 4, r + p, generator=g)
    batch = make_batch([(6, 2, [1, 2])], 4, "cpu")  # positions 6 and 7 of an 8-token sequence
    q = torch.randn(2, hq, r + p, generator=g)
    topk = torch.tensor([[0, 5, 7, -1], [3, -1, -1, -1]], dtype=torch.int32)  # 7 is past token 0 (position 6)
    got = latent_attention_reference(q, latent, batch, 0.3, r, topk)
    rows = latent[[1, 2]].flatten(0, 1)
    for n, keys in ((0, [0, 5]), (1, [3])):
        probs = (torch.einsum("hd,sd->hs", q[n], rows[keys]) * 0.3).softmax(-1)
        torch.testing.assert_close(got[n], probs @ rows[keys, :r])


def test_fixed_shape_selection_equals_the_reference():
    """The graph-safe torch form (the decode kernel's oracle) picks what the reference picks, on a mixed batch
    over shared, shuffled pages; scores kept positive so that no two tie."""
    from moetier.layers.dsa_indexer import key_scores_fixed, select_topk_reference, topk_positions

    g = torch.Generator().manual_seed(4)
    index_k = torch.rand(12, 4, 16, generator=g)
    batch = make_batch([(9, 1, [3, 7, 1]), (0, 6, [0, 2]), (13, 1, [5, 11, 4, 9]), (2, 3, [6, 8])], 4, "cpu")
    n = batch.num_tokens
    q, w = torch.rand(n, 3, 16, generator=g), torch.rand(n, 3, generator=g)
    want = select_topk_reference(q, w, index_k, batch, 5, 0.25)
    got = topk_positions(key_scores_fixed(q, w, index_k, batch, 0.25), 5)
    assert torch.equal(got.sort(-1).values, want.sort(-1).values)
    assert (want == -1).any() and (want[:, -1] >= 0).any()  # both short and full rows were checked


def test_scoring_kernel_in_the_interpreter():
    """The CUDA decode and verify scoring kernel (layers/dsa_select_triton.py) under Triton's interpreter
    against key_scores_fixed and its topk (tests/dsa_select_interpreter.py)."""
    pytest.importorskip("triton")
    from tests.interpreter import run_script

    out = run_script("dsa_select_interpreter.py")
    lines = [line for line in out.splitlines() if line.startswith("dsa_select ")]
    assert len(lines) == 7 and all("whole=equal" in line for line in lines), out
    assert any("bfloat16" in line and "narrow-table" in line for line in lines), out
    assert sum(" rows=4 " in line for line in lines) == 2, out  # verify steps: k + 1 = 4 rows at most


def test_decode_scoring_kernel_compiles_for_h200_without_spills():
    """The scoring kernel at GLM-5's indexer shape (32 heads of 128, pages of 64), compiled for sm_90a
    here (no GPU needed): it must compile and not spill."""
    pytest.importorskip("triton")
    from moetier.layers import dsa_select_triton as kernels
    from tests.triton_aot import compile_sm90, ptxas

    if ptxas() is None:
        pytest.skip("this triton wheel ships no ptxas")
    fn = kernels._key_scores
    runtime = [a for i, a in enumerate(fn.arg_names) if i not in fn.constexprs]
    ptr = {"q_ptr": "bf16", "w_ptr": "fp32", "k_ptr": "bf16", "pos_ptr": "i64", "query_start_ptr": "i32",
           "page_table_ptr": "i32", "out_ptr": "fp32"}
    sig = {a: f"*{ptr[a]}" if a.endswith("_ptr") else "fp32" if a == "scale" else "i32" for a in runtime}
    consts = dict(HI=32, D=128, PAGE=64, HI_B=32, D_B=128, H_CHUNK=kernels.H_CHUNK, BLOCK_S=kernels.BLOCK_S)
    got = compile_sm90(fn, sig, consts, [a for a in runtime if a.endswith("_ptr")], kernels.NUM_WARPS, 1)
    assert got.spill_bytes == 0 and got.registers <= 128, got


def test_references_in_query_chunks_equal_one_pass(monkeypatch):
    """A long prefill runs the references in runs of queries (scores within a byte budget); runs of 3
    tokens give what one pass gives."""
    import moetier.layers.dsa_indexer as di
    import moetier.layers.latent_attention as la
    from moetier.layers.attention import query_chunks

    g = torch.Generator().manual_seed(6)
    latent, index_k = torch.randn(6, 4, 12, generator=g), torch.rand(6, 4, 16, generator=g)
    batch = make_batch([(3, 9, [4, 0, 5]), (0, 1, [2])], 4, "cpu")
    q, qi, w = torch.randn(10, 2, 12, generator=g), torch.rand(10, 3, 16, generator=g), torch.rand(10, 3, generator=g)
    topk = di.select_topk_reference(qi, w, index_k, batch, 5, 0.25)
    want = la.latent_attention_reference(q, latent, batch, 0.3, 8, topk)
    small = lambda a, b, row_bytes: query_chunks(a, b, row_bytes, budget=3 * row_bytes)
    monkeypatch.setattr(di, "query_chunks", small)
    monkeypatch.setattr(la, "query_chunks", small)
    assert len(small(0, 9, 100)) == 3
    assert torch.equal(di.select_topk_reference(qi, w, index_k, batch, 5, 0.25), topk)
    torch.testing.assert_close(la.latent_attention_reference(q, latent, batch, 0.3, 8, topk), want)


def test_fused_expert_layout_loads_the_same_model(tmp_path):
    """transformers 5.24's save_pretrained writes per-expert names (tests/test_mla_parity.py loads
    them); a checkpoint with fused mlp.experts.gate_up_proj / down_proj loads to the same model."""
    from moetier.checkpoint.loader import load_model
    from moetier.checkpoint.writer import make_checkpoint
    from tests.helpers import Sequence

    ids = torch.arange(3, 30)
    logits = []
    for fused in (False, True):
        path = make_checkpoint(tmp_path / str(fused), "tiny-dsv3", seed=3, dtype="float32", fused_experts=fused)
        _, model, _ = load_model(path)
        logits.append(model.logits(Sequence(model, 32).forward(ids)))
    assert torch.equal(*logits)
