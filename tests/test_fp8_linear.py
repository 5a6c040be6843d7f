"""FP8 dense projections (issue 13, layers/fp8_linear.py): the torch reference, the Triton kernels in
the interpreter, which weights each model holds in FP8 (and which fall back), the loader and the
engine with dense_weights "keep" against "dequantize" (on the CPU both run dequantize + F.linear, so
they agree bit for bit), the memory plan's exact bytes, the random bed and the decode benchmark's
fp8-dense rows; on CUDA (marked gpu) the kernel at Qwen3-30B shapes and greedy generation."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from moetier.layers.fp8_linear import Fp8Weight, fusable
from moetier.layers.quant_linear import linear
from moetier.quant import fp8_block as fp8

from tests.test_fp8_checkpoint import RAGGED, logits_of

# test_fp8_checkpoint's ragged shape made block-aligned: qkv rows q 256 | k 256 | v 256 and a dense
# layer of I 256 put every fused part on scale blocks, so qkv, o, w13 and w2 are all held in FP8
# (and under tensor parallelism 2 each rank's parts are 128 rows: still on the blocks).
ALIGNED = {**RAGGED, "hidden_size": 256, "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 2,
           "num_key_value_heads": 2, "head_dim": 128, "moe_intermediate_size": 64}


@pytest.fixture
def aligned(monkeypatch):
    from moetier import presets

    monkeypatch.setitem(presets._TINY, "tiny-aligned", ALIGNED)
    return "tiny-aligned"


def fp8_weight(n: int, k: int, seed: int = 0) -> Fp8Weight:
    w = Fp8Weight(n, k, "cpu")
    w.rows().copy_(*fp8.quantize(torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.05), "w")
    return w


def test_linear_is_dequantize_then_f_linear_on_the_cpu():
    w = fp8_weight(200, 328)
    x = torch.randn(2, 3, 328).to(torch.bfloat16)
    b = torch.randn(200).to(torch.bfloat16)
    want = F.linear(x, fp8.dequantize(w.q, w.scale, torch.bfloat16), b)
    assert torch.equal(linear(x, w, b), want) and torch.equal(w.reference(x, b), want)
    plain = torch.randn(200, 328).to(torch.bfloat16)
    assert torch.equal(linear(x, plain), F.linear(x, plain))
    assert w.q.dtype == fp8.FP8 and w.scale.shape == (2, 3) and w.shape == (200, 328)


def test_fused_rows_cut_only_on_scale_blocks():
    w = Fp8Weight(384, 64, "cpu")
    assert w.rows(128, 384).q.shape == (256, 64) and w.rows(128, 384).scale.shape == (2, 1)
    assert w.rows(256, 384).scale.shape == (1, 1)
    w2 = Fp8Weight(300, 64, "cpu")
    assert w2.rows(256, 300).scale.shape == (1, 1)  # the ragged last part: its own block row
    with pytest.raises(ValueError, match="dequantized at load"):
        w.rows(0, 64)
    assert fusable((256, 128, 128)) and fusable((128, 72)) and not fusable((64, 64))
    assert not fusable((128, 72), whole=True)  # each part split again (tensor parallelism): all aligned


def test_kernels_in_the_interpreter():
    pytest.importorskip("triton")
    from tests.interpreter import run_script

    out = run_script("fp8_linear_interpreter.py")
    lines = [line for line in out.splitlines() if line.startswith("fp8_mm m=")]
    assert len(lines) == 10 and any("split=1" in line for line in lines) and any("split=3" in line for line in lines)
    assert "fp8_mm refuses bad input" in out and out.count("dequantize n=") == 2
    # NOTE: a row alone against the same row in a batch: within tolerance here (the interpreter's
    # tl.dot sums in its BLAS kernel's order, tests/interpreter.py), bit-equal only for the very same
    # launch; on the GPU test_kernel_at_qwen3_shapes holds the compiled kernel to bit-equality
    assert sum("rows_alone=exact" in line for line in lines) == 2, out
    assert sum("rows_alone_err=" in line for line in lines) == 8, out


def test_which_weights_are_held_in_fp8(aligned):
    import dataclasses

    from moetier import presets
    from moetier.config import with_dense
    from moetier.layers.mlp import SwigluMLP
    from moetier.models.registry import model_class
    from moetier.parallel import Parallel

    def held(preset):
        cfg = with_dense(dataclasses.replace(presets.preset(preset), quant="fp8"), "keep")
        model = model_class(cfg)(cfg, torch.bfloat16, "meta")
        return {n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, Fp8Weight)}

    assert held(aligned) == {"qkv", "o", "w13", "w2"}
    assert held("tiny") == {"o"}  # q 128 | k 64 | v 64: k ends off a block, qkv is dequantized
    assert held("tiny-dsv3") == {"q_a", "q_b", "kv_a", "o", "w13", "w2"}  # kv_b stays (W_UK, W_UV)
    # tensor parallelism: each rank's columns must start on a block too
    assert isinstance(SwigluMLP(64, 512, torch.bfloat16, "meta", Parallel(0, 2, 2), "fp8").w2, Fp8Weight)
    mlp = SwigluMLP(64, 384, torch.bfloat16, "meta", Parallel(1, 2, 2), "fp8")  # 192 columns per rank
    assert not isinstance(mlp.w13, Fp8Weight) and not isinstance(mlp.w2, Fp8Weight)


def test_tensor_parallel_shard_of_a_scale_grid():
    from moetier.checkpoint.loader import shard
    from moetier.errors import MoetierError
    from moetier.models.base import Weight
    from moetier.parallel import Parallel

    w = Weight("o_proj.weight", (256, 512), split=1)
    grid = torch.arange(8.0).view(2, 4)
    assert torch.equal(shard(grid, w, Parallel(1, 2, 2), fp8.BLOCK), grid[:, 2:])
    with pytest.raises(MoetierError, match="scale blocks"):
        shard(grid[:, :2], Weight("x", (256, 256), split=1), Parallel(0, 4, 4), fp8.BLOCK)


def fp8_ckpt(tmp_path, preset):
    from moetier.checkpoint.writer import make_checkpoint

    return make_checkpoint(tmp_path / f"{preset}-fp8", preset, seed=0, dtype="fp8")


@pytest.mark.parametrize("preset", ["tiny-aligned", "tiny", "tiny-dsv3"])
def test_kept_fp8_loads_to_the_same_logits_in_fewer_bytes(tmp_path, aligned, preset):
    from moetier.checkpoint.loader import load_model
    from moetier.plan.residents import dense_weights

    path = fp8_ckpt(tmp_path, preset)
    out = {}
    for mode in ("dequantize", "keep"):
        cfg, model, report = load_model(path, dtype="bfloat16", dense_weights=mode)
        out[mode] = (logits_of(model, torch.tensor([3, 1, 4, 1, 5])), report)
        dense = dense_weights(cfg, torch.bfloat16)  # the plan's count: exact, scales included
        assert dense.embedding_and_head + dense.layers == report.dense_bytes
    (a, ra), (b, rb) = out["dequantize"], out["keep"]
    assert torch.equal(a, b)
    assert rb.dense_bytes < ra.dense_bytes and "kept in fp8" in rb.notes[0]


def test_keep_is_refused_clearly(tiny_ckpt):
    from moetier.checkpoint.loader import load_model
    from moetier.engine.config import EngineConfig
    from moetier.errors import MoetierError

    with pytest.raises(MoetierError, match="--dense-weights keep") as e:
        load_model(tiny_ckpt, dense_weights="keep")  # a float32 checkpoint: nothing to keep
    assert "\n" not in str(e.value)
    with pytest.raises(MoetierError, match="dense_weights"):
        EngineConfig.of(dense_weights="fp8")  # the old value of the FP8-only option


def test_engine_generates_the_same_tokens(tmp_path, aligned):
    from moetier import LLM, SamplingParams

    path = fp8_ckpt(tmp_path, aligned)
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    toks = {}
    for mode in ("dequantize", "keep"):
        llm = LLM(path, device="cpu", dtype="bfloat16", dense_weights=mode, kv_tokens=256)
        toks[mode] = llm.generate([[5, 6, 7]], params)[0].outputs[0].token_ids
        llm.close()
    assert toks["keep"] == toks["dequantize"] and len(toks["keep"]) == 6


def test_tensor_parallel_kept_fp8_matches_one_process(tmp_path, aligned):
    """Two ranks over gloo, each loading its rows and columns of the FP8 weights and of their scale
    grids: the logits of one process (fp32 tolerance: the split GEMMs sum in another order)."""
    from moetier import LLM
    from tests.test_tp import ENGINE, close_enough, logits_of as tp_logits

    path = fp8_ckpt(tmp_path, aligned)
    one = LLM(path, dtype="float32", dense_weights="keep", **ENGINE)
    ref = tp_logits(one)
    llm = LLM(path, dtype="float32", dense_weights="keep", tensor_parallel_size=2, **ENGINE)
    try:
        assert {n.rsplit(".", 1)[-1] for n, m in llm.model.named_modules() if isinstance(m, Fp8Weight)} == {
            "qkv", "o", "w13", "w2"}
        assert llm.model.layers[1].mlp.w13.scale.shape == (2, 2)  # [gate_r; up_r] of 128 rows each
        for got, want in zip(tp_logits(llm), ref):
            close_enough(got, want)
    finally:
        llm.close()


def test_plan_counts_kept_fp8_bytes(aligned):
    import dataclasses

    from moetier import presets
    from moetier.config import with_dense
    from moetier.plan.memory import PlanRequest, count

    q = dataclasses.replace(presets.preset("qwen3-30b-a3b", dtype="bfloat16"), quant="fp8")
    plans = {m: count(PlanRequest(with_dense(q, m), torch.bfloat16, "cuda")) for m in ("dequantize", "keep")}
    dense = {m: next(i for i in p.device if i.name == "dense: decoder layers") for m, p in plans.items()}
    # 48 layers: qkv [5120, 2048] and o [2048, 4096] in 1 byte plus float32 scales [40, 16] and [16, 32]
    saved = 48 * (5120 * 2048 + 2048 * 4096 - 4 * (40 * 16 + 16 * 32))
    assert dense["dequantize"].bytes - dense["keep"].bytes == saved
    assert "fp8 projections kept" in dense["keep"].note and plans["keep"].request["dense_quant"] == "fp8"
    act = {m: next(i for i in p.device if i.name.startswith("activations")).bytes for m, p in plans.items()}
    assert act["keep"] > act["dequantize"]  # the prefill path's dequantized qkv (21 MB) is counted


@pytest.mark.parametrize("quant", ["fp8", "nvfp4"])
def test_bench_decode_runs_kept_dense_rows_beside_dequantized_dense(tmp_path, aligned, quant):
    """<format>-dense rows (--dense-weights keep: the dense projections in the experts' format) beside
    the format's own rows: fewer dense bytes, the same parameters, greedy tokens equal to their resident
    row, the kept-over-dequantized ratio reported."""
    from moetier import presets
    from moetier.bench import decode
    from moetier.cli.bench_common import WEIGHT_DTYPES, parse_dtypes
    from moetier.checkpoint.random_bed import random_bed
    from moetier.traces.format import write_trace
    from moetier.traces.synth import SynthParams, meta_of, synthesize

    kept = f"{quant}-dense"
    assert parse_dtypes(f"{quant},{kept}", WEIGHT_DTYPES) == [quant, kept]
    cfg = presets.preset(aligned)
    trace = tmp_path / "t.mtrace"
    p = SynthParams(experts=cfg.num_experts, top_k=cfg.top_k, layers=cfg.num_layers, tokens=64, skew=1.2, seed=3)
    write_trace(trace, synthesize(p), meta_of(p))
    beds = {d: random_bed(cfg, seed=1, device="cpu", dtype=torch.bfloat16, quant=quant, keep_dense=d == kept)
            for d in (quant, kept)}
    assert [decode.bed_dtype(b) for b in beds.values()] == [quant, kept]
    assert beds[kept].dense_bytes < beds[quant].dense_bytes
    assert beds[kept].dense_params == beds[quant].dense_params
    args = {"tokens": 2, "warmup": 1, "prompt_len": 3, "hf_tokens": 1, "policy": "lfru", "decode_tokens": 16, "seed": 0}
    data = decode.run(cfg, str(trace), [0.5], [1], ["resident", "slots"], args,
                      bw={"hbm_GBps": 100.0, "link_GBps": 10.0}, dtypes=(quant, kept), beds=beds)
    assert [r["dtype"] for r in data["rows"]] == [quant, quant, kept, kept]
    assert set(data["greedy_tokens_equal_to_resident"]) == {f"slots@0.5/b1/{quant}", f"slots@0.5/b1/{kept}"}
    assert all(data["greedy_tokens_equal_to_resident"].values())
    assert any(line.startswith(f"{kept}/{quant} resident b1") for line in decode.ratios(data["rows"]))


# -- CUDA ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("k,n", [(2048, 5120), (4096, 2048)])  # Qwen3-30B-A3B's qkv and o
@pytest.mark.parametrize("m", [1, 8, 512])
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_kernel_at_qwen3_shapes(m, k, n):
    g = torch.Generator("cuda").manual_seed(m + n)
    w = Fp8Weight(n, k, "cuda")
    w.rows().copy_(*fp8.quantize(torch.randn(n, k, generator=g, device="cuda") * 0.02), "w")
    kernel_holds(w, torch.randn(m, k, generator=g, device="cuda").to(torch.bfloat16))


def kernel_holds(w, x: torch.Tensor) -> None:
    """A kept weight's CUDA paths (layers/param.KeptWeight.linear) on x [M, K] bf16: within bf16 of the
    reference; up to 64 rows the decode kernel deterministic, a row's bits independent of its batch,
    the same under graph replay; above, the kernel-dequantized transient the reference's, then cuBLAS."""
    y = linear(x, w)
    ref = x.double() @ w.dequantize(torch.bfloat16).double().T
    assert ((y.double() - ref).norm() / ref.norm()).item() < 1e-2
    m = x.shape[0]
    if m <= 64:
        assert torch.equal(linear(x, w), y)
        assert all(torch.equal(linear(x[i:i + 1], w)[0], y[i]) for i in range(min(m, 8)))
        graph, static = torch.cuda.CUDAGraph(), x.clone()
        linear(static, w)  # compile outside the capture
        with torch.cuda.graph(graph):
            out = linear(static, w)
        static.copy_(x)
        graph.replay()
        assert torch.equal(out, y)
    else:
        assert torch.equal(w.dequantize_cuda(torch.bfloat16), w.dequantize(torch.bfloat16))
        assert torch.equal(y, F.linear(x, w.dequantize(torch.bfloat16)))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_greedy_generation_with_kept_fp8_on_cuda(tmp_path, aligned):
    """Graph-replayed decode with FP8 dense equals its eager run bit for bit (same kernels, a row's
    bits independent of the batch); against dequantized dense (cuBLAS) only the rounding differs."""
    from moetier import LLM, SamplingParams

    path = fp8_ckpt(tmp_path, aligned)
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    toks = {}
    for mode, graphs in (("keep", True), ("keep", False), ("dequantize", True)):
        llm = LLM(path, device="cuda", dtype="bfloat16", dense_weights=mode, cuda_graphs=graphs, kv_tokens=512)
        assert sum(isinstance(m, Fp8Weight) for m in llm.model.modules()) == (6 if mode == "keep" else 0)
        outs = llm.generate([[5, 6, 7], [9, 10, 11, 12]], params)  # decode at batch 2
        toks[mode, graphs] = [o.outputs[0].token_ids for o in outs]
        assert (llm.runner.graph_steps > 0) == graphs
        llm.close()
    assert toks["keep", True] == toks["keep", False]
    assert [t[0] for t in toks["keep", True]] == [t[0] for t in toks["dequantize", True]], toks
