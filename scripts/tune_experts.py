"""Times the expert kernel at decode on the GPU: the grouped GEMM (grouped_gemm.py) over a sweep of
block sizes, tuned kernel by kernel (gate_up with the default down, then down with the best gate_up), for bf16, FP8
and 4-bit (nvfp4, int4, int4-g32: quant/packed4.py) rows of a preset's layer (default Qwen3-30B),
resident rows, random routing, CUDA-graph replayed (20 calls on different ids per replay, so the
50 MB L2 holds little). One token on FP8 or 4-bit rows runs the GEMV (fp8_gemv.py, q4_gemv.py): its
own blocks are swept there instead. Prints us per call and GB/s of distinct rows read; writes JSON.

    python scripts/tune_experts.py OUT.json [--dtypes bf16,fp8,nvfp4,int4] [--tokens 1,8,32,64]
        [--preset qwen3-30b-a3b]

The winners go into experts/kernels/gemm_config.GemmConfig by hand (gate_up/down, fp8_*, q4_*: one
pair for all 4-bit formats; *_gemv_* for one token), with the JSON under bench/results/.
"""

from __future__ import annotations

import argparse
import json

import torch

from moetier.bench.common import GB, record, time_graph
from moetier.checkpoint.random_bed import fill_4bit_rows, fill_fp8_rows
from moetier.experts.kernels.gemm_config import SWEEP, GemmConfig
from moetier.experts.kernels.grouped_gemm import BLOCK_M, GemmScratch, _experts, grouped_expert_mlp
from moetier.experts.shape import RowLayout
from moetier.presets import moe_shape

CALLS = 20
FP8_SWEEP = [(16, 128, 4), (32, 128, 2), (32, 128, 4), (32, 128, 8), (64, 64, 4), (64, 128, 4), (64, 128, 8),
             (128, 64, 4), (128, 128, 4), (128, 128, 8)]  # K tiles past 128 gather a scale per element: slow
Q4_SWEEP = [*SWEEP, (32, 128, 8), (64, 128, 8), (16, 128, 4), (128, 128, 4)]  # any BLOCK_K: a scale per element
GEMV_SWEEP = [(16, 512, 4), (8, 512, 4), (16, 256, 4), (32, 256, 4), (32, 512, 4), (8, 1024, 4), (16, 1024, 4),
              (16, 512, 8), (16, 128, 4), (64, 128, 4)]


def rows_for(quant: str | None, layout: RowLayout, e: int) -> torch.Tensor:
    if quant is None:
        return (torch.randn(e, layout.numel, device="cuda") * 0.02).to(torch.bfloat16)
    rows = torch.zeros(e, layout.numel, dtype=torch.uint8, device="cuda")
    g = torch.Generator("cuda").manual_seed(0)
    for a in range(0, e, 16):
        (fill_fp8_rows if quant == "fp8" else fill_4bit_rows)(rows[a:a + 16], layout, g)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--dtypes", default="bf16,fp8")
    ap.add_argument("--tokens", default="1,8,32,64")
    ap.add_argument("--preset", default="qwen3-30b-a3b", help="the layer shape: a preset name (moetier.presets)")
    args = ap.parse_args()
    s = moe_shape(args.preset)
    h, i, e, k = s.hidden, s.inter, s.num_experts, s.top_k
    g = torch.Generator(device="cuda").manual_seed(0)
    results, best = [], {}
    for dt in args.dtypes.split(","):
        quant = None if dt == "bf16" else dt
        layout = RowLayout(h, i, quant)
        rows = rows_for(quant, layout, e)
        row_bytes = layout.row_bytes(torch.bfloat16)
        sweep = {"fp8": FP8_SWEEP, None: SWEEP}.get(quant, Q4_SWEEP)
        for t in (int(x) for x in args.tokens.split(",")):
            ids = torch.stack([torch.rand(t, e, device="cuda", generator=g).argsort(-1)[:, :k] for _ in range(CALLS)])
            distinct = sum(int(c.unique().numel()) for c in ids) / CALLS
            x = torch.randn(t, h, device="cuda").to(torch.bfloat16)
            w = torch.rand(t, k, device="cuda").to(torch.bfloat16)
            out_t = torch.empty(t, h, dtype=torch.bfloat16, device="cuda")
            scratch = GemmScratch.make(t * k, h, i, torch.device("cuda"))
            ids32 = ids.int()

            def timed(name, call, cfg=None):
                try:
                    ms = time_graph(call) / CALLS
                except Exception as exc:  # a config Triton cannot compile
                    print(f"{dt} T={t} {name} {cfg}: {type(exc).__name__}: {str(exc)[:120]}")
                    return float("inf")
                gbs = distinct * row_bytes / GB / (ms / 1e3)
                results.append({"dtype": dt, "tokens": t, "kernel": name, "config": cfg, "ms": ms,
                                "distinct_rows": distinct, "GBps_distinct": gbs})
                print(f"{dt:8s} T={t:3d} {name:8s} {str(cfg):28s} {ms * 1e3:8.1f} us  {gbs:7.0f} GB/s", flush=True)
                return ms

            def grouped(cfg: GemmConfig):
                def call():
                    for n in range(CALLS):
                        grouped_expert_mlp(x, ids32[n], ids[n], w, rows, rows, h, i, scratch, out_t, cfg, quant)
                return call

            def grouped_at_one(cfg: GemmConfig):  # the grouped GEMM at one token: the path the GEMV replaces
                gu_b, dn_b = cfg.decode_blocks(quant)

                def call():
                    for n in range(CALLS):
                        _experts(x, ids32[n], ids[n], w, rows, rows, h, i, scratch.one_order, scratch.one_end,
                                 scratch.one_order, k, scratch.h, scratch.y, out_t, BLOCK_M, gu_b, dn_b, listed=False,
                                 quant=quant)
                return call

            default = GemmConfig()
            gemv = t == 1 and quant is not None  # one token on FP8 or 4-bit rows runs the GEMV, not the grouped blocks
            base = timed("default", grouped(default), default.gemv_blocks(quant) if gemv else default.decode_blocks(quant))
            if gemv:
                timed("grouped", grouped_at_one(default), default.decode_blocks(quant))
                gu = {c: timed("gemv_gu", grouped(default.with_gemv(quant, gate_up=c)), c) for c in GEMV_SWEEP}
                bgu = min(gu, key=gu.get)
                dn = {c: timed("gemv_dn", grouped(default.with_gemv(quant, bgu, c)), c) for c in GEMV_SWEEP}
                bdn = min(dn, key=dn.get)
                best[f"{dt} T={t} gemv"] = {"gate_up": bgu, "down": bdn, "ms": dn[bdn], "default_ms": base}
            else:
                gu = {c: timed("gate_up", grouped(default.with_decode(quant, gate_up=c)), c) for c in sweep}
                bgu = min(gu, key=gu.get)
                dn = {c: timed("down", grouped(default.with_decode(quant, bgu, c)), c) for c in sweep}
                bdn = min(dn, key=dn.get)
                best[f"{dt} T={t}"] = {"gate_up": bgu, "down": bdn, "ms": dn[bdn], "default_ms": base}
            save(args.out, s, results, best)  # after every token count: a capped run keeps what finished
    print("\nbest per dtype and tokens (us per call, default -> tuned):")
    for key, b in best.items():
        print(f"  {key:10s} gate_up {str(b['gate_up']):16s} down {str(b['down']):16s} "
              f"{b['default_ms'] * 1e3:7.1f} -> {b['ms'] * 1e3:7.1f} us")


def save(path: str, shape, results: list, best: dict) -> None:
    with open(path, "w") as f:
        json.dump(record("tune-experts", {"shape": shape, "results": results, "best": best}), f, indent=2,
                  default=str)


if __name__ == "__main__":
    main()
