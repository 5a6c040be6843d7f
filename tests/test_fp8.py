"""FP8 experts (issue 13): the block rule, the FP8 row layout, the CPU backends over FP8 rows, the
grouped GEMM on FP8 rows in Triton's interpreter, the memory plan's row bytes, the benchmarks' FP8
rows. Checkpoints: test_fp8_checkpoint.py; CUDA: test_fp8_gpu.py."""

from __future__ import annotations

import torch
import pytest

from moetier.experts.backends import ResidentExperts, SlotExperts, UvaExperts
from moetier.experts.reference import combine, expert_pairs, row_fetch
from moetier.experts.shape import RowLayout
from moetier.experts.cache.store import HostStore
from moetier.quant import fp8_block as fp8


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def random_fp8_rows(layout: RowLayout, e: int, g: torch.Generator, std: float = 0.05) -> tuple[torch.Tensor, dict]:
    """FP8 rows of e random experts (each projection quantized by the block rule) and the
    unquantized weights they came from."""
    rows = torch.zeros(e, layout.numel, dtype=torch.uint8)
    h, i = layout.hidden, layout.inter
    src = {p: torch.randn(e, *shape, generator=g) * std
           for p, shape in (("gate", (i, h)), ("up", (i, h)), ("down", (h, i)))}
    for p, w in src.items():
        # a few blocks of very different magnitude: per-block scales must keep each block's precision
        w[:, :min(w.shape[1], 128), :min(w.shape[2], 128)] *= 40.0
        q, s = fp8.quantize(w)
        layout.part(rows, p).copy_(q)
        layout.part(rows, p + "_scale").copy_(s)
    return rows, src


# -- the block rule ----------------------------------------------------------------------------------

@pytest.mark.parametrize("shape", [(256, 384), (200, 72), (72, 200), (1, 1), (3, 130, 129)])
def test_quantize_round_trip(shape):
    g = torch.Generator().manual_seed(sum(shape))
    w = torch.randn(*shape, generator=g)
    w[..., :1, :1] = 0.0
    q, s = fp8.quantize(w)
    assert q.dtype == fp8.FP8 and q.shape == w.shape
    assert s.dtype == torch.float32 and tuple(s.shape) == fp8.scale_shape(shape)
    back = fp8.dequantize(q, s)
    # e4m3 has 3 mantissa bits: each element within half an ulp, 2**-4 of its magnitude (relative),
    # or of the block's smallest normal, 2**-6 * scale (absolute)
    tol = 2**-4 * w.abs() + fp8._expand(s, *shape[-2:]) * 2**-6
    assert bool(((back - w).abs() <= tol).all())
    # re-quantizing the dequantized weights is exact: the same bits and the same scales
    q2, s2 = fp8.quantize(back)
    assert torch.equal(s2, s) and torch.equal(q2.view(torch.uint8), q.view(torch.uint8))


def test_ragged_blocks_have_their_own_scale():
    # hidden 200 (blocks 128 + 72), inter 72 (one ragged block): each block's scale is its own amax / 448
    w = torch.zeros(200, 72)
    w[:128] = 1.0
    w[128:] = 0.01
    w[5, 3] = 7.0
    w[150, 0] = -0.5
    q, s = fp8.quantize(w)
    assert s.shape == (2, 1)
    assert s[0, 0].item() == pytest.approx(7.0 / 448) and s[1, 0].item() == pytest.approx(0.5 / 448)
    assert fp8.dequantize(q, s)[150, 0].item() == pytest.approx(-0.5, rel=2**-4)
    assert fp8.dequantize(q, s, torch.bfloat16).dtype == torch.bfloat16


def test_zero_block_and_bad_scale():
    q, s = fp8.quantize(torch.zeros(130, 10))
    assert torch.equal(s, torch.ones(2, 1)) and not q.float().any()
    with pytest.raises(ValueError, match=r"128 x 128 blocks need \[2, 1\]"):
        fp8.dequantize(q, torch.ones(1, 1))


def test_quant_config_problems():
    assert fp8.quant_problems(dict(fp8.QUANT_CONFIG)) == []
    assert "weight_block_size" in fp8.quant_problems({**fp8.QUANT_CONFIG, "weight_block_size": [64, 64]})[0]
    assert "only \"fp8\"" in fp8.quant_problems({"quant_method": "awq"})[0]


# -- the row layout ----------------------------------------------------------------------------------

def test_fp8_row_layout_offsets_and_views():
    lay = RowLayout(200, 72, "fp8")
    n_i, n_h = 1, 2
    assert (lay.n_inter, lay.n_hidden) == (n_i, n_h)
    w_bytes = 3 * 72 * 200  # 43200, a multiple of 16: no padding before the scales
    assert lay.s13_offset == w_bytes and lay.s2_offset == w_bytes + 4 * 2 * n_i * n_h
    assert lay.numel == 43232  # scales end at 43224: 8 bytes pad the row to a multiple of 16
    assert lay.row_bytes(torch.bfloat16) == lay.numel and lay.row_dtype(torch.bfloat16) == torch.uint8
    odd = RowLayout(36, 5, "fp8")  # 540 weight bytes -> scales at 544, 12 scale bytes -> row 560
    assert (odd.s13_offset, odd.s2_offset, odd.numel) == (544, 552, 560)
    # against bf16: half the weight bytes plus the scales
    bf = RowLayout(2048, 768)
    q = RowLayout(2048, 768, "fp8")
    assert q.row_bytes(torch.bfloat16) == bf.row_bytes(torch.bfloat16) // 2 + 4 * 3 * 6 * 16

    rows = torch.zeros(3, lay.numel, dtype=torch.uint8)
    gate = lay.part(rows, "gate", 1)
    assert gate.dtype == fp8.FP8 and gate.shape == (72, 200)
    gate.copy_(torch.full((72, 200), 2.0).to(fp8.FP8))
    lay.part(rows, "up", 1).copy_(torch.full((72, 200), -1.0).to(fp8.FP8))
    lay.part(rows, "down", 1).copy_(torch.full((200, 72), 0.5).to(fp8.FP8))
    lay.part(rows, "gate_scale", 1).fill_(3.0)
    lay.part(rows, "up_scale", 1).fill_(5.0)
    lay.part(rows, "down_scale", 1).copy_(torch.tensor([[7.0], [11.0]]))
    assert lay.part(rows, "down_scale").shape == (3, n_h, n_i)
    w13, w2 = lay.weights(rows[1:2], torch.float32)
    assert bool((w13[0, :72] == 6.0).all()) and bool((w13[0, 72:] == -5.0).all())
    assert bool((w2[0, :128] == 3.5).all()) and bool((w2[0, 128:] == 5.5).all())
    assert not rows[0].any() and not rows[2].any()  # views never spill into a neighbour row
    assert not rows[1, 3 * 72 * 200 - 0:lay.s13_offset].any()
    with pytest.raises(ValueError, match="multiple of 128"):
        lay.part(rows, "gate_up_scale", 0)
    fused = RowLayout(64, 128, "fp8")
    r = torch.zeros(2, fused.numel, dtype=torch.uint8)
    fused.part(r, "gate_up_scale").copy_(torch.tensor([1.0, 2.0]).view(1, 2, 1).expand(2, 2, 1))
    assert fused.part(r, "gate_scale", 1).item() == 1.0 and fused.part(r, "up_scale", 1).item() == 2.0
    with pytest.raises(ValueError, match="no block scales"):
        RowLayout(8, 8).part(torch.zeros(1, 192), "down_scale", 0)


def test_host_store_holds_fp8_bytes_exactly():
    lay = RowLayout(200, 72, "fp8")
    store = HostStore([0, 1], 5, lay, torch.bfloat16, pin=False)
    assert store.rows(0).dtype == torch.uint8 and store.rows(0).shape == (5, lay.numel)
    assert store.report()["requested_bytes"] == 2 * 5 * lay.numel
    bf = HostStore([0, 1], 5, RowLayout(200, 72), torch.bfloat16, pin=False)
    assert bf.report()["requested_bytes"] == 2 * 5 * 3 * 200 * 72 * 2


# -- the CPU backends over FP8 rows -----------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_backends_bit_exact_on_fp8_rows(dtype):
    g = torch.Generator().manual_seed(7)
    e, k = 12, 3
    lay = RowLayout(200, 72, "fp8")
    rows, src = random_fp8_rows(lay, e, g)
    resident = ResidentExperts(rows, lay, k, decode_tokens=8)
    uva = UvaExperts(rows, lay, k, decode_tokens=8)
    slots = SlotExperts(rows, lay, k, num_slots=4, decode_tokens=8)
    for step in range(12):
        t = 1 + step % 5 if step != 7 else 11  # step 7 bypasses the cache (prefill)
        x = torch.randn(t, lay.hidden, generator=g).to(dtype)
        ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
        w = torch.rand(t, k, generator=g).to(dtype)
        want = resident.forward(x, ids, w)
        assert torch.equal(uva.forward(x, ids, w), want)
        assert torch.equal(slots.forward(x, ids, w), want)
        slots.cache.check()
        if step == 0:  # the FP8 path computes what the unquantized weights compute, within FP8 rounding
            exact = combine(expert_pairs(x.double(), ids, lambda key: (
                torch.cat([src["gate"][key], src["up"][key]]).double(), src["down"][key].double())), w.double())
            assert rel_err(want, exact) < 0.08
    assert slots.stats()["misses"] > 0 and slots.stats()["bypassed"] == 1
    assert slots.nbytes() == {"device": 4 * lay.numel, "host": e * lay.numel}


def test_row_fetch_dequantizes_in_the_hidden_dtype():
    g = torch.Generator().manual_seed(1)
    lay = RowLayout(64, 40, "fp8")
    rows, _ = random_fp8_rows(lay, 2, g)
    w13, w2 = row_fetch(rows, lay, torch.bfloat16)(1)
    assert w13.dtype == w2.dtype == torch.bfloat16 and w13.shape == (80, 64) and w2.shape == (64, 40)
    gate = fp8.dequantize(lay.part(rows, "gate", 1), lay.part(rows, "gate_scale", 1), torch.bfloat16)
    assert torch.equal(w13[:40], gate)


def test_fp8_grouped_kernels_in_the_interpreter():
    pytest.importorskip("triton")
    from tests.interpreter import run_script

    out = run_script("fp8_interpreter.py")
    lines = [line for line in out.splitlines() if line.startswith("fp8 decode") or line.startswith("fp8 large")]
    # 4 cases x 2 dtypes x (decode, large), then 4 wide-k
    assert len(lines) == 20 and sum("wide-k" in line for line in lines) == 4, out
    assert "fp8 refuses BLOCK_K 96" in out and "fp8 rows copied" in out


def test_memory_plan_counts_fp8_rows_exactly():
    import dataclasses

    from moetier import presets
    from moetier.plan import residents
    from moetier.plan.memory import PlanRequest, count

    bf = presets.preset("qwen3-30b-a3b", dtype="bfloat16")
    q = dataclasses.replace(bf, quant="fp8", quant_config=dict(fp8.QUANT_CONFIG))
    # Qwen3-30B-A3B: 3*768*2048 weight bytes, scales 4 * (2*6*16 + 16*6) = 1152, no padding
    assert residents.row_bytes(q.moe_shape, torch.bfloat16) == 4_718_592 + 1_152
    assert residents.row_bytes(bf.moe_shape, torch.bfloat16) == 9_437_184

    def store(cfg):
        plan = count(PlanRequest(cfg, torch.bfloat16, "cuda", backend="slots",
                                 slots_per_layer={layer: 64 for layer in cfg.moe_layers}))
        host = next(i for i in plan.host if i.name.startswith("expert store"))
        dev = next(i for i in plan.device if i.name.startswith("routed experts"))
        return host, dev

    (h_q, d_q), (h_bf, d_bf) = store(q), store(bf)
    assert f"{48 * 128 * 4_719_744:,} B" in h_q.note and f"{48 * 128 * 9_437_184:,} B" in h_bf.note
    assert d_q.bytes < 0.51 * d_bf.bytes and "4,719,744 B rows" in d_q.note


def test_bench_decode_runs_fp8_rows_beside_bf16_on_cpu(tmp_path):
    """The decode benchmark's rows for both expert formats in one record (on the CPU: tiny shape,
    float32 compute); FP8 rows move and read fewer expert bytes and agree with their own resident."""
    from moetier import presets
    from moetier.bench import decode
    from moetier.cli.bench_common import parse_dtypes
    from moetier.checkpoint.random_bed import random_bed
    from moetier.errors import MoetierError
    from moetier.traces.format import write_trace
    from moetier.traces.synth import SynthParams, meta_of, synthesize

    assert parse_dtypes("bf16,fp8") == ["bf16", "fp8"]
    for bad in ("fp4", "bf16,bf16", ""):
        with pytest.raises(MoetierError, match="--dtype"):
            parse_dtypes(bad)
    cfg = presets.preset("tiny")
    trace = tmp_path / "t.mtrace"
    p = SynthParams(experts=cfg.num_experts, top_k=cfg.top_k, layers=cfg.num_layers, tokens=256, skew=1.2, seed=3)
    write_trace(trace, synthesize(p), meta_of(p))
    beds = {"bf16": random_bed(cfg, seed=1, device="cpu", dtype=torch.float32),
            "fp8": random_bed(cfg, seed=1, device="cpu", dtype=torch.float32, quant="fp8")}
    args = {"tokens": 4, "warmup": 2, "prompt_len": 5, "hf_tokens": 2, "policy": "lfru", "decode_tokens": 16, "seed": 0}
    data = decode.run(cfg, str(trace), [0.5], [1], ["resident", "uva", "slots"], args,
                      bw={"hbm_GBps": 100.0, "link_GBps": 10.0}, dtypes=("bf16", "fp8"), beds=beds)
    rows = data["rows"]
    assert [(r["dtype"], r["backend"]) for r in rows] == [
        (d, b) for d in ("float32", "fp8") for b in ("resident", "uva", "slots")]
    eq = data["greedy_tokens_equal_to_resident"]
    assert set(eq) == {"uva/b1", "slots@0.5/b1", "uva/b1/fp8", "slots@0.5/b1/fp8"} and all(eq.values())
    fp8_row = data["config"]["by_dtype"]["fp8"]["row_bytes"]
    assert fp8_row == beds["fp8"].cfg.moe_shape.layout.numel == 3 * 128 * 64 + 16  # 12 scale bytes, 4 pad
    uva = {r["dtype"]: r for r in rows if r["backend"] == "uva"}
    assert uva["fp8"]["link_bytes_per_step"] < 0.3 * uva["float32"]["link_bytes_per_step"]  # 1 byte vs 4
    assert "fp8" in decode.table(rows)


def test_bench_layer_table_shows_fp8_rows():
    pytest.importorskip("triton")
    from moetier.bench.layer import table

    links = {"h2d_copy_engine_GBps": 55.0, "d2d_GBps": 4000.0}
    row = {"row": "slots 85%", "ms": 0.1, "bound_ms": 0.05, "fill_GBps": 40.0, "fill_experts_per_s": 8475.0}
    fills = [{"rows": 1, "kernel_ms": 0.1, "kernel_GBps": 47.2, "kernel_experts_per_s": 10000.0,
              "copy_engine_ms": 0.2, "copy_engine_GBps": 23.6, "copy_engine_experts_per_s": 5000.0},
             {"rows": 0, "kernel_ms": 0.003}]
    shape = {"hidden": 2048, "inter": 768, "experts": 128, "top_k": 8, "slots": 64, "row_bytes": 4_719_744,
             "dtype": "fp8"}
    text = table({"shapes": {"qwen3-30b-a3b fp8": {"links": links, "shape": shape, "rows": [row], "fills": fills,
                                                    "prefill_crossover": []}}})
    assert "qwen3-30b-a3b fp8: fp8" in text and "8475" in text and "10000 experts/s" in text


def test_every_backend_takes_fp8_rows():
    from moetier.experts.placement import ExpertOptions
    from moetier.experts.shape import MoeShape

    shape = MoeShape(8, 2, 64, 32, quant="fp8")  # hybrid too: its host kernels read FP8 rows (test_host_ext.py)
    assert ExpertOptions("hybrid").problems(shape, [0]) == []
    assert ExpertOptions("slots", slots=4).problems(shape, [0]) == []
