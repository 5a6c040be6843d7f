"""Dense 4-bit projections kept as stored (issue 30, dense_weights "keep", layers/packed4_linear.py):
the torch reference for nvfp4, int4 and int4-g32, the Triton kernels in the interpreter, which weights
each model keeps, nvfp4 / int4 checkpoints of qwen3_moe and deepseek_v3 loaded with "keep" against
"dequantize" (on the CPU both run the format's dequantize + F.linear: the same logits, bit for bit),
the loaded bytes against the plan's, exclusions, tensor-parallel shards, the one-line refusals."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from moetier.errors import MoetierError
from moetier.layers.packed4_linear import Packed4Weight, nbytes
from moetier.layers.quant_linear import WEIGHTS, linear
from moetier.quant import int4, nvfp4
from tests.test_fp8_checkpoint import logits_of
from tests.test_fp8_linear import aligned  # noqa: F401 (a fixture: the block-aligned tiny preset)

QUANTS = ("nvfp4", "int4", "int4-g32", "int4-asym", "int4-g32-asym")
FORMATS = [("nvfp4", None), ("nvfp4", "compressed-tensors"), ("int4", None), ("int4-g32", None), ("int4-asym", None)]


def packed(quant: str, n: int, k: int, seed: int = 0) -> Packed4Weight:
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.05
    out = Packed4Weight(n, k, "cpu", quant)
    if quant == "nvfp4":  # two parts with their own tensor scales, as a fused q and k
        out.rows(0, n // 2).copy_(*nvfp4.quantize(w[: n // 2]), "w")
        out.rows(n // 2, n).copy_(*nvfp4.quantize(4 * w[n // 2:]), "w")
    else:  # asymmetric: the zero codes third
        codes, scale, *zero = int4.quantize(w + 0.01, out.group, out.zero is not None)
        out.rows().copy_(codes, scale, None, "w", *zero)
    return out


@pytest.mark.parametrize("quant", QUANTS)
def test_linear_is_the_formats_dequantize_then_f_linear_on_the_cpu(quant):
    w = packed(quant, 200, 328)
    x = torch.randn(2, 3, 328).to(torch.bfloat16)
    b = torch.randn(200).to(torch.bfloat16)
    if quant == "nvfp4":
        ref = torch.cat([nvfp4.dequantize(w.codes[:100], w.scale[:100], w.scale_2[0], torch.bfloat16),
                         nvfp4.dequantize(w.codes[100:], w.scale[100:], w.scale_2[100], torch.bfloat16)])
        assert w.scale_2[0] != w.scale_2[100]
    else:
        ref = int4.dequantize(w.codes, w.scale, torch.bfloat16, w.group, zero=w.zero)
        assert (w.zero is None) == (quant in ("int4", "int4-g32"))
    assert torch.equal(w.dequantize(torch.bfloat16), ref)
    want = F.linear(x, ref, b)
    assert torch.equal(linear(x, w, b), want) and torch.equal(w.reference(x, b), want)
    held = sum(p.numel() * p.element_size() for p in w.parameters())
    assert held == nbytes(quant, 200, 328) == w.rows().nbytes and w.shape == (200, 328)
    assert all(not p.requires_grad for p in w.parameters())


def test_rows_cut_anywhere_and_tensor_parallel_k_keeps_groups_whole():
    w = Packed4Weight(200, 64, "cpu", "nvfp4")
    r = w.rows(72, 136)
    assert r.codes.shape == (64, 32) and r.scale.shape == (64, 4) and r.scale_2.shape == (64,) and r.owner is w
    assert Packed4Weight.fits("int4", 64, 256, (32, 32), True, False)  # row parts: always
    assert not Packed4Weight.fits("int4", 64, 7, (64,), False, False)  # odd K: stays in the model dtype
    assert Packed4Weight.fits("int4-g32", 64, 96, (64,), False, True)  # a rank's 96 columns: 3 whole groups
    with pytest.raises(MoetierError, match="cut its groups of 128; use --dense-weights dequantize") as e:
        Packed4Weight.fits("int4", 64, 96, (64,), False, True)
    assert "\n" not in str(e.value)


def test_kernels_in_the_interpreter():
    pytest.importorskip("triton")
    from tests.interpreter import run_script

    out = run_script("packed4_linear_interpreter.py")
    lines = [line for line in out.splitlines() if line.startswith("q4_mm ") and " split=" in line]
    assert len(lines) == 40 and all(f"q4_mm {q} " in out for q in QUANTS[:4])
    assert any("split=1" in line for line in lines) and any("split=3" in line for line in lines)
    assert sum("bias=True" in line for line in lines) == 16 and sum(" m=64 " in line for line in lines) == 8
    assert "q4_mm refuses bad input" in out and out.count("dequantize ") == 8 and out.count(" exact") >= 8
    # NOTE: a row alone against the same row in a batch: within tolerance in the interpreter (tests/
    # interpreter.py), bit-equal for the very same launch
    assert sum("rows_alone=exact" in line for line in lines) == 8, out
    assert sum("rows_alone_err=" in line for line in lines) == 32, out


def kept_names(model) -> set[str]:
    return {n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, WEIGHTS)}


def test_which_weights_are_kept_4bit():
    import dataclasses

    from moetier import presets
    from moetier.config import with_dense
    from moetier.layers.mlp import SwigluMLP
    from moetier.models.registry import model_class
    from moetier.parallel import Parallel
    from moetier.quant.quant_config import example

    def kept(preset, quant):
        cfg = with_dense(dataclasses.replace(presets.preset(preset), quant=quant, quant_config=example(quant)), "keep")
        return kept_names(model_class(cfg)(cfg, torch.bfloat16, "meta"))

    for quant in QUANTS:
        assert kept("tiny", quant) == {"qkv", "o"}  # no 128-row rule: tiny's 64-row k fuses too
        assert kept("tiny-dsv3", quant) == {"q_a", "q_b", "kv_a", "o", "w13", "w2"}  # kv_b stays (W_UK, W_UV)
    tp2 = Parallel(1, 2, 2)
    mlp = SwigluMLP(64, 192, torch.bfloat16, "meta", tp2, "int4-g32")  # 96 columns per rank
    assert isinstance(mlp.w13, Packed4Weight) and isinstance(mlp.w2, Packed4Weight)
    with pytest.raises(MoetierError, match="groups of 128"):
        SwigluMLP(64, 192, torch.bfloat16, "meta", tp2, "int4")


def ckpt(tmp_path, preset, dtype, fmt, **kw):
    from moetier.checkpoint.writer import make_checkpoint

    return make_checkpoint(tmp_path / f"{preset}-{dtype}-{fmt}", preset, seed=2, dtype=dtype, format=fmt, **kw)


def load_both(path, dtype="bfloat16"):
    from moetier.checkpoint.loader import load_model
    from moetier.plan.residents import dense_weights

    out = {}
    for mode in ("dequantize", "keep"):
        cfg, model, report = load_model(path, dtype=dtype, dense_weights=mode)
        plan = dense_weights(cfg, getattr(torch, dtype))
        assert plan.embedding_and_head + plan.layers == report.dense_bytes, mode  # the plan's count is exact
        out[mode] = (cfg, model, report, plan)
    return out


@pytest.mark.parametrize("dtype,fmt", FORMATS)
@pytest.mark.parametrize("preset", ["tiny", "tiny-dsv3"])
def test_kept_4bit_loads_to_the_same_logits_in_fewer_bytes(tmp_path, preset, dtype, fmt):
    path = ckpt(tmp_path, preset, dtype, fmt, fused_experts=preset == "tiny-dsv3")
    both = load_both(path)
    prompt = torch.tensor([3, 1, 4, 1, 5, 9])
    (cfg, a, ra, pa), (_, b, rb, pb) = both["dequantize"], both["keep"]
    la, lb = logits_of(a, prompt), logits_of(b, prompt)
    assert torch.equal(la, lb) and torch.equal(la.argmax(-1), lb.argmax(-1))
    assert kept_names(a) == set() and kept_names(b) == ({"qkv", "o"} if preset == "tiny" else
                                                         {"q_a", "q_b", "kv_a", "o", "w13", "w2"})
    assert rb.dense_bytes < ra.dense_bytes and ra.dense_bytes - rb.dense_bytes == pa.layers - pb.layers
    assert f"kept in {dtype}" in rb.notes[0] and pb.transient > 0 == pa.transient
    if preset == "tiny" and dtype == "nvfp4":  # q, k and v quantized apart: each part's tensor scale kept
        assert len(set(b.layers[0].attn.qkv.scale_2.tolist())) == 3


@pytest.mark.parametrize("dtype", ["nvfp4", "int4"])
def test_engine_generates_the_same_tokens(tmp_path, dtype):
    from moetier import LLM, SamplingParams

    path = ckpt(tmp_path, "tiny", dtype, None)
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    toks = {}
    for mode in ("dequantize", "keep"):
        llm = LLM(path, device="cpu", dtype="bfloat16", dense_weights=mode, kv_tokens=256)
        assert kept_names(llm.model) == ({"qkv", "o"} if mode == "keep" else set())
        toks[mode] = [o.outputs[0].token_ids for o in llm.generate([[5, 6, 7], [9, 10, 11, 12]], params)]
        llm.close()
    assert toks["keep"] == toks["dequantize"] and all(len(t) == 6 for t in toks["keep"])


def test_tensor_parallel_kept_4bit_matches_one_process(tmp_path, aligned):  # noqa: F811
    """Two ranks over gloo, each loading its rows (qkv, w13) and K groups (o, w2) of the codes and
    scales: the logits of one process (fp32 tolerance: the split GEMMs sum in another order)."""
    from moetier import LLM
    from tests.test_tp import ENGINE, close_enough, logits_of as tp_logits

    path = ckpt(tmp_path, aligned, "nvfp4", None)
    one = LLM(path, dtype="float32", dense_weights="keep", **ENGINE)
    ref = tp_logits(one)
    llm = LLM(path, dtype="float32", dense_weights="keep", tensor_parallel_size=2, **ENGINE)
    try:
        assert kept_names(llm.model) == {"qkv", "o", "w13", "w2"}
        assert llm.model.layers[0].attn.o.codes.shape == (256, 64)  # [H, (Hq D / 2) / 2]: half of K, two a byte
        for got, want in zip(tp_logits(llm), ref):
            close_enough(got, want)
    finally:
        llm.close()


def test_excluded_modules_stay_in_the_model_dtype(tmp_path):
    """Attention left unquantized by exclude_modules: with "keep" it is a model-dtype parameter (plan
    and load agree), the rest stays 4-bit, the logits equal "dequantize"'s; a weight stored in bf16 that
    the config does not exclude is refused in one line before anything is read."""
    from safetensors.torch import load_file, save_file

    from moetier.checkpoint.loader import load_model

    path = ckpt(tmp_path, "tiny-dsv3", "nvfp4", None)
    cfg = json.loads((path / "config.json").read_text())
    cfg["quantization_config"]["exclude_modules"] += ["model.layers.*.self_attn*"]
    (path / "config.json").write_text(json.dumps(cfg))
    f = path / "model.safetensors"
    t = load_file(f)
    for w in [n for n in t if ".self_attn." in n and t[n].dtype == torch.uint8]:
        t[w] = nvfp4.dequantize(t[w], t.pop(w + "_scale"), t.pop(w + "_scale_2"), torch.bfloat16)
    save_file(t, f)
    both = load_both(path)
    model = both["keep"][1]
    assert kept_names(model) == {"w13", "w2"} and isinstance(model.layers[0].attn.o, torch.nn.Parameter)
    assert torch.equal(logits_of(model, torch.arange(2, 8), 2), logits_of(both["dequantize"][1], torch.arange(2, 8), 2))
    cfg["quantization_config"]["exclude_modules"].remove("model.layers.*.self_attn*")
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(MoetierError, match=r"is BF16, not nvfp4 codes, but the model keeps it nvfp4") as e:
        load_model(path, dense_weights="keep")
    assert "\n" not in str(e.value)


def test_plan_counts_kept_4bit_bytes():
    import dataclasses

    from moetier import presets
    from moetier.config import with_dense
    from moetier.plan.memory import PlanRequest, count
    from moetier.quant.quant_config import example

    q = dataclasses.replace(presets.preset("qwen3-30b-a3b", dtype="bfloat16"), quant="nvfp4",
                            quant_config=example("nvfp4"))
    plans = {m: count(PlanRequest(with_dense(q, m), torch.bfloat16, "cuda")) for m in ("dequantize", "keep")}
    dense = {m: next(i for i in p.device if i.name == "dense: decoder layers") for m, p in plans.items()}
    # 48 layers: qkv [5120, 2048] and o [2048, 4096] in bf16 against codes (K/2 a row), e4m3 scales
    # (K/16 a row) and a float32 tensor scale a row
    held = nbytes("nvfp4", 5120, 2048) + nbytes("nvfp4", 2048, 4096)
    assert held == 5120 * (1024 + 128 + 4) + 2048 * (2048 + 256 + 4)
    assert dense["dequantize"].bytes - dense["keep"].bytes == 48 * (2 * (5120 * 2048 + 2048 * 4096) - held)
    assert "nvfp4 projections kept" in dense["keep"].note and plans["keep"].request["dense_quant"] == "nvfp4"
    act = {m: next(i for i in p.device if i.name.startswith("activations")).bytes for m, p in plans.items()}
    assert act["keep"] > act["dequantize"]  # the prefill path's dequantized qkv is counted


def test_random_bed_keeps_4bit_dense_weights():
    from moetier import presets
    from moetier.checkpoint.random_bed import random_bed

    cfg = presets.preset("tiny")
    beds = {keep: random_bed(cfg, seed=1, device="cpu", dtype=torch.bfloat16, quant="int4", keep_dense=keep)
            for keep in (False, True)}
    assert kept_names(beds[True].model) == {"qkv", "o"} and kept_names(beds[False].model) == set()
    assert beds[True].dense_bytes < beds[False].dense_bytes and beds[True].dense_params == beds[False].dense_params
    o = beds[True].model.layers[0].attn.o
    assert o.dequantize(torch.float32).abs().max() > 0  # filled by int4's own rule


@pytest.mark.parametrize("quant", QUANTS)
@pytest.mark.parametrize("k,n", [(2048, 5120), (4096, 2048)])  # Qwen3-30B-A3B's qkv and o
@pytest.mark.parametrize("m", [1, 8, 512])
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_kernel_at_qwen3_shapes(m, k, n, quant):
    from tests.test_fp8_linear import kernel_holds

    kernel_holds(packed(quant, n, k, seed=m + n).to("cuda"),
                 torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to("cuda", torch.bfloat16))
