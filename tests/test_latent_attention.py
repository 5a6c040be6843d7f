"""The Triton latent-attention (MLA) kernel against latent_attention_reference: in Triton's CPU
interpreter (a subprocess running latent_attention_interpreter.py) and, marked `gpu`, on CUDA at
GLM-5 / DeepSeek-V3 sizes (R 512, P 64, bf16), with and without DSA top-k, including a decode step
captured in a CUDA graph."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")

from tests.interpreter import run_script  # noqa: E402

SCRIPT = Path(__file__).with_name("latent_attention_interpreter.py")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

R, P, K = 512, 64, 2048  # GLM-5: kv_lora_rank 512, qk_rope_head_dim 64, index_topk 2048
DECODE = [(1, c) for c in (1, 37, 500, 2049, 4000, 8192)]


def helpers():
    # the script's helpers, imported without running it (it sets TRITON_INTERPRET only as __main__)
    spec = importlib.util.spec_from_file_location("latent_attention_interpreter", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_latent_attention_matches_reference_in_the_interpreter():
    lines = run_script("latent_attention_interpreter.py").splitlines()
    assert sum(line.startswith("case") for line in lines) == len(helpers().CASES), lines
    assert lines[-1].startswith("latent_attention ok"), lines


def test_bad_inputs_are_named():
    from moetier.layers.attention import make_batch
    from moetier.layers.latent_attention_triton import latent_attention_triton

    batch = make_batch([(0, 3, [2]), (4, 1, [0, 1])], page_size=4, device="cpu")
    q, latent = torch.randn(4, 2, 24), torch.randn(3, 4, 24)
    cases = [
        (dict(q=q, latent=torch.randn(3, 4, 20)), "latent rows are 20 wide"),
        (dict(q=q, latent=torch.randn(3, 6, 24)), "page_size 6 is not a power of two"),
        (dict(q=q, latent=latent.bfloat16()), "differ"),
        (dict(q=q, latent=latent, kv_lora_rank=30), "kv_lora_rank 30 does not fit"),
        (dict(q=q, latent=latent, topk=torch.zeros(3, 8, dtype=torch.int32)), "topk (3, 8) must be"),
        (dict(q=q, latent=latent, topk=torch.zeros(4, 8)), "integer positions"),
        (dict(q=q, latent=latent, out=torch.empty(4, 2, 24)), "out (4, 2, 24)"),
        (dict(q=q, latent=latent, block_h=24), "block_h 24"),
    ]
    for kwargs, message in cases:
        kwargs = {"batch": batch, "scale": 0.1, "kv_lora_rank": 16, **kwargs}
        with pytest.raises(AssertionError, match=message.replace("(", r"\(").replace(")", r"\)")):
            latent_attention_triton(**kwargs)


@pytest.mark.parametrize("hq,max_q,dsa,dtype", [
    (64, 1, False, torch.bfloat16), (64, 1, True, torch.bfloat16), (16, 1, False, torch.bfloat16),
    (128, 1, True, torch.bfloat16), (64, 300, False, torch.bfloat16), (16, 300, False, torch.bfloat16),
    (64, 300, True, torch.bfloat16),
    (16, 1, False, torch.float32), (16, 40, False, torch.float32)])
def test_default_tiles_compile_for_h200_without_spills(hq, max_q, dsa, dtype):
    """The launch's default tiles at GLM-5's R 512, P 64, compiled for sm_90a here (no GPU needed):
    they must compile, fit shared memory, and not spill (a spill in the key loop costs more than the
    latent bytes it would save) — except DSA's 64 x 32 tiles, which spill a few hundred bytes and still
    measured fastest on the H200 (bench/results/h200-latent-attention-sweep-c7a7c27.json: 122 us
    against 150 us for the spill-free 64 x 16 at batch 32, K 2048), and DSA prefill's 64 x 64 tiles with
    the prefetch walk, which spill some 700 bytes and measured 1.3x faster than 64 x 32 at 8,192 tokens
    (bench/results/h100-mla-prefill-2bb9d81/)."""
    from moetier.layers import latent_attention_triton as lat
    from tests.triton_aot import compile_sm90, ptxas

    if ptxas() is None:
        pytest.skip("this triton wheel ships no ptxas")
    block_h, block_t, block_n, warps, stages, prefetch = lat.tile_config(hq, R, max_q, dsa, dtype)
    elem = "bf16" if dtype == torch.bfloat16 else "fp32"
    splits = 16
    consts = dict(HQ=hq, R=R, P=P, BLOCK_H=block_h, BLOCK_T=block_t, BLOCK_N=block_n, BLOCK_R=R, BLOCK_P=P,
                  PAGE_SIZE=64, SPLIT=splits > 1, TOPK=dsa, INTERPRET=False,
                  PRECISION="ieee" if dtype == torch.float32 else "tf32", UPCAST=False,
                  PREFETCH=prefetch)
    ptr = {"q_ptr": elem, "latent_ptr": elem, "o_ptr": "fp32", "lse_ptr": "fp32"}
    fn = lat._mla
    runtime = [a for i, a in enumerate(fn.arg_names) if i not in fn.constexprs]
    sig = {a: f"*{ptr.get(a, 'i32')}" if a.endswith("_ptr") else "fp32" if a == "qk_scale" else "i32"
           for a in runtime}
    # what the launcher sees divisible by 16: the pointers and the strides of 16-aligned rows (not the
    # strides it leaves unspecialized: they follow the step)
    unspecialized = {"stride_pt", "stride_tk"}
    aligned = [a for a in runtime if a.endswith("_ptr") or (a.startswith("stride_") and a not in unspecialized)]
    got = compile_sm90(fn, sig, consts, aligned, warps, stages)
    spill_ok = 512 if dsa and (block_h, block_n) == (64, 32) else 1024 if dsa and (block_h, block_n) == (64, 64) else 0
    assert got.spill_bytes <= spill_ok and got.shared <= 227 * 1024, (block_h, block_t, block_n, warps, got)
    for num_splits in (5, 64):
        pad, block_c, cwarps = lat.combine_config(num_splits, R)
        sig = {"o_part_ptr": "*fp32", "lse_ptr": "*fp32", "out_ptr": f"*{elem}", "num_splits": "i32",
               "stride_ps": "i32", "stride_lses": "i32", "stride_on": "i32", "stride_oh": "i32"}
        got = compile_sm90(lat._combine, sig, dict(HQ=hq, R=R, SPLITS_PAD=pad, BLOCK_C=block_c),
                           [a for a in sig if a != "num_splits"], cwarps, 1)
        assert got.spill_bytes == 0, (num_splits, got)


@pytest.mark.parametrize("dsa", [False, True])
@pytest.mark.parametrize("num_splits", [None, 5])
@pytest.mark.parametrize("step", ["decode", "mixed"])
@pytest.mark.parametrize("hq,page", [(16, 64), (64, 16), (128, 64)])
@pytest.mark.gpu
@needs_cuda
def test_gpu_matches_reference(hq, page, step, num_splits, dsa):
    from moetier.layers.latent_attention import latent_attention, latent_attention_reference
    from moetier.layers.latent_attention_triton import latent_attention_triton

    h = helpers()
    specs = DECODE + [(300, 1000)] if step == "mixed" else DECODE
    q, latent, batch, topk, scale = h.make_case(specs, hq, R, P, page, torch.bfloat16, seed=7, device="cuda",
                                                topk_k=K if dsa else None)
    ref = latent_attention_reference(q, latent, batch, scale, R, topk)
    out = torch.full((q.shape[0], hq, R), float("nan"), dtype=q.dtype, device="cuda")
    latent_attention_triton(q, latent, batch, scale, R, topk=topk, out=out, num_splits=num_splits)
    assert not out.isnan().any()
    err = h.rel_err(out, ref)
    assert err <= h.TOL[torch.bfloat16], err
    exact = latent_attention_reference(q.double(), latent.double(), batch, scale, R, topk)
    assert h.rel_err(out, exact) <= 1.25 * h.rel_err(ref, exact)
    if num_splits is None:  # the CUDA dispatch is this kernel
        assert torch.equal(latent_attention(q, latent, batch, scale, R, topk), out)


@pytest.mark.parametrize("block_h,block_n,warps,stages,prefetch", [
    (16, 16, None, None, False), (16, 32, None, None, False), (32, 32, None, None, False),
    (64, 16, None, None, False), (64, 32, None, None, False), (64, 32, 8, 3, True), (64, 64, 8, 2, True),
    (32, 64, 8, 2, False), (16, 32, 4, 2, True)])
@pytest.mark.parametrize("dsa", [False, True])
@pytest.mark.gpu
@needs_cuda
def test_gpu_tuning_knobs_keep_the_result(block_h, block_n, warps, stages, prefetch, dsa):
    """The tiles the benchmark can pick (--block-h, --block-n, and its prefill sweep's warps,
    stages and prefetch) on a mixed step at Hq 64."""
    from moetier.layers.latent_attention import latent_attention_reference
    from moetier.layers.latent_attention_triton import latent_attention_triton

    h = helpers()
    specs = [(1, 4000), (1, 300), (64, 2500)]
    q, latent, batch, topk, scale = h.make_case(specs, 64, R, P, 64, torch.bfloat16, seed=5, device="cuda",
                                                topk_k=K if dsa else None)
    got = latent_attention_triton(q, latent, batch, scale, R, topk=topk, block_h=block_h, block_n=block_n,
                                  num_warps=warps, num_stages=stages, prefetch=prefetch)
    err = h.rel_err(got, latent_attention_reference(q, latent, batch, scale, R, topk))
    assert err <= h.TOL[torch.bfloat16], err


@pytest.mark.parametrize("dsa", [False, True])
@pytest.mark.gpu
@needs_cuda
def test_gpu_float32_matches_reference(dsa):
    from moetier.layers.latent_attention import latent_attention_reference
    from moetier.layers.latent_attention_triton import latent_attention_triton

    h = helpers()
    specs = [(1, 3000), (40, 2100), (1, 17)]
    q, latent, batch, topk, scale = h.make_case(specs, 16, R, P, 16, torch.float32, seed=3, device="cuda",
                                                topk_k=K if dsa else None)
    err = h.rel_err(latent_attention_triton(q, latent, batch, scale, R, topk=topk),
                    latent_attention_reference(q, latent, batch, scale, R, topk))
    assert err <= h.TOL[torch.float32], err


@pytest.mark.parametrize("dsa", [False, True])
@pytest.mark.gpu
@needs_cuda
def test_gpu_decode_replays_in_a_cuda_graph(dsa):
    """Capture one decode step with the host lengths at the page table's capacity (as
    engine/graphs.py does), then replay it with new q, latent, page tables, context lengths and top-k
    rows written in place: the replay equals an eager call on the same contents, bit for bit."""
    from moetier.layers.attention import AttnBatch
    from moetier.layers.latent_attention import latent_attention_reference
    from moetier.layers.latent_attention_triton import latent_attention_triton

    h = helpers()
    hq, page, grow = 64, 64, 9  # grow: tokens each sequence gains before the replay, pages reserved
    q, latent, batch, topk, scale = h.make_case(DECODE, hq, R, P, page, torch.bfloat16, seed=1, device="cuda",
                                                reserve=grow, topk_k=K if dsa else None)
    capacity = batch.page_table.shape[1] * page
    captured = AttnBatch(batch.positions, batch.slot_mapping, batch.query_start, batch.seq_lens, batch.page_table,
                         batch.query_start_host, [capacity] * batch.num_seqs, 1)
    eager = latent_attention_triton(q, latent, captured, scale, R, topk=topk)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compile and warm up off the capture
        latent_attention_triton(q, latent, captured, scale, R, topk=topk)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = latent_attention_triton(q, latent, captured, scale, R, topk=topk)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(static_out, eager)

    longer = [(1, ctx + grow) for _, ctx in DECODE]
    q2, latent2, batch2, topk2, _ = h.make_case(longer, hq, R, P, page, torch.bfloat16, seed=2, device="cuda",
                                                topk_k=K if dsa else None)
    assert latent2.shape == latent.shape and batch2.page_table.shape == batch.page_table.shape
    pairs = [(q, q2), (latent, latent2), (batch.seq_lens, batch2.seq_lens), (batch.page_table, batch2.page_table)]
    for dst, src in pairs + ([(topk, topk2)] if dsa else []):
        dst.copy_(src)
    graph.replay()
    want = latent_attention_triton(q, latent, captured, scale, R, topk=topk)  # same host ints as the capture
    torch.cuda.synchronize()
    assert torch.equal(static_out, want)
    now = AttnBatch(batch.positions, batch.slot_mapping, batch.query_start, batch.seq_lens, batch.page_table,
                    batch2.query_start_host, batch2.seq_lens_host, 1)
    err = h.rel_err(static_out, latent_attention_reference(q, latent, now, scale, R, topk))
    assert err <= h.TOL[torch.bfloat16], err


BENCH_ON_CPU = """
import sys
sys.path.insert(0, "scripts")
import bench_latent_attention as bench
bench.DEVICE = "cpu"
bench.graph_us = lambda fn, reps=10: (fn(), 1.0)[1]  # run each call once; no CUDA graph on the CPU
bench.copy_gbps = lambda: 1.0
sys.argv = ["bench", "--out", sys.argv[1], "--batches", "2", "--contexts", "40", "--topk", "32", "--page", "16",
            "--splits", "2"]
sys.exit(bench.main())
"""


def bench_rows_on_cpu(script: str, tmp_path: Path) -> list[dict]:
    """Runs a BENCH_ON_CPU-style script (the benchmark under TRITON_INTERPRET, its timer stubbed) in a
    subprocess and returns the rows of its JSON."""
    import json
    import os
    import subprocess
    import sys

    root = Path(__file__).parents[1]
    out = tmp_path / "bench.json"
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(root)}
    p = subprocess.run([sys.executable, "-c", script, str(out)], capture_output=True, text=True, timeout=600,
                       cwd=root, env=env)
    assert p.returncode == 0, p.stdout + p.stderr
    return json.loads(out.read_text())["rows"]


PREFILL_ON_CPU = """
import sys
sys.path.insert(0, "scripts")
import bench_latent_attention as bench
bench.DEVICE = "cpu"
bench.HQ, bench.R = 16, 32
bench.graph_us = lambda fn, reps=10: (fn(), 1.0)[1]
bench.copy_gbps = lambda: 1.0
bench.PREFILL_SWEEP = [(16, 16, 4, 2, True), (16, 32, 4, 1, False)]
sys.argv = ["bench", "--out", sys.argv[1], "--prefill", "70", "--topk", "32", "--kpool", "4", "--page", "16",
            "--rope", "0", "--sweep"]
sys.exit(bench.main())
"""


def test_bench_prefill_sweep_runs_in_the_interpreter(tmp_path):
    """--prefill --sweep on the CPU: kpool rows (each token's picks, then its own pool's tail), the
    default tiles' row and each swept row, checked against the default's output."""
    rows = bench_rows_on_cpu(PREFILL_ON_CPU, tmp_path)
    assert [(r["default"], r["block_h"], r["block_n"], r["prefetch"]) for r in rows] == \
        [(True, 16, 64, True), (False, 16, 16, True), (False, 16, 32, False)], rows
    assert all(r["rel_diff_vs_default"] <= 1e-2 and r["tokens"] == 70 for r in rows), rows
    # walked entries: token s sees its complete pools (at most 32 / 4 of them, 4 keys each) and its own
    # pool's (s + 1) % 4 keys; 16 heads x 2 x (2 x 32) flops each
    walked = sum(4 * min(8, (s + 1) // 4) + (s + 1) % 4 for s in range(70))
    assert all(r["flops"] == walked * 16 * 128 for r in rows), rows


def test_bench_loop_runs_in_the_interpreter(tmp_path):
    """The benchmark's cases, calls and JSON, on the CPU: the kernel under TRITON_INTERPRET and the
    timer replaced, so only the CUDA timing is left to the GPU run."""
    rows = bench_rows_on_cpu(BENCH_ON_CPU, tmp_path)
    assert [(r["batch"], r["ctx"], r["topk"]) for r in rows] == [(2, 40, None), (2, 40, 32)], rows
    # 2 sequences x 40 (dense) or min(40, 32) (DSA) rows of 576 bf16, timed at the stub's 1 us
    assert [r["latent_bytes"] for r in rows] == [2 * 40 * 1152, 2 * 32 * 1152]
    assert rows[0]["torch_us"] == 1.0 and rows[1]["torch_us"] is None
    assert [(r["block_h"], r["block_n"], r["splits"]) for r in rows] == [(64, 32, 2)] * 2


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without CUDA")
def test_bench_refuses_without_cuda(tmp_path):
    import subprocess
    import sys

    root = Path(__file__).parents[1]
    out = tmp_path / "bench.json"
    p = subprocess.run([sys.executable, str(root / "scripts" / "bench_latent_attention.py"), "--out", str(out)],
                       capture_output=True, text=True, timeout=120, cwd=root)
    assert p.returncode == 2 and "needs a CUDA device" in p.stderr, p.stdout + p.stderr
    assert not out.exists()


@pytest.mark.parametrize("args,message", [
    (["--prefill", "-1"], "--prefill -1"), (["--prefill", "64", "--kpool", "0"], "--kpool 0"),
    (["--prefill", "64", "--topk", "40", "--kpool", "16"], "multiple of --kpool 16"),
    (["--rope", "-8"], "--rope -8"), (["--page", "48"], "--page 48")])
def test_bench_refuses_nonsense_options(tmp_path, args, message):
    """One line and exit 2 before any CUDA check, for the options' nonsense values."""
    import subprocess
    import sys

    root = Path(__file__).parents[1]
    out = tmp_path / "bench.json"
    p = subprocess.run([sys.executable, str(root / "scripts" / "bench_latent_attention.py"), "--out", str(out), *args],
                       capture_output=True, text=True, timeout=120, cwd=root)
    assert p.returncode == 2 and p.stderr.strip().startswith("error: ") and message in p.stderr, p.stderr
    assert "Traceback" not in p.stderr and len(p.stderr.strip().splitlines()) == 1 and not out.exists()


@pytest.mark.parametrize("hq", [16, 32, 64, 128])
@pytest.mark.parametrize("dsa", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_variant_runs_cover_every_step(hq, dsa, dtype):
    """compile_variants' launches reach every specialization a step can: _mla's (its tiles, the
    top-k walk or not, split or not) for any longest chunk, _combine's for any default split count."""
    from moetier.layers import latent_attention_triton as lat

    def spec(q_len: int, topk: bool, splits: int) -> tuple:
        return lat.tile_config(hq, R, q_len, topk, dtype), topk, splits > 1

    runs = lat.variant_runs(hq, R, dtype, dsa)
    warmed = {spec(*run) for run in runs}
    combines = {lat.combine_config(s, R) for _, _, s in runs if s > 1}
    for q_len in range(1, 400):
        for topk in (False, True) if dsa else (False,):
            for splits in (1, 2, 3, 7, 64):
                assert spec(q_len, topk, splits) in warmed, (q_len, topk, splits)
    assert {lat.combine_config(s, R) for s in range(2, lat.MAX_SPLITS + 1)} <= combines
