"""Times the Triton MLA decode kernel (layers/latent_attention_triton.py) on CUDA at GLM-5's shape
(Hq 64, kv_lora_rank 512, rope 64, bf16) for decode batches and context lengths, dense and with DSA
top-k, each call replayed from a CUDA graph (the mode the engine ships). Prints a table of us per
call and GB/s of latent rows read, next to two baselines measured in the same run: a device copy
(the HBM ceiling, read + write bytes) and the same attention in plain torch over a contiguous
(unpaged) latent, dense rows only. Writes the rows as JSON to --out.

    python scripts/bench_latent_attention.py --out bench/results/h200-latent-attention.json [--sweep]

The kernel's tiles come from tile_config unless --block-h / --block-n (or --sweep) say otherwise;
the key splits from default_num_splits unless --splits (a list: every count is timed).

--prefill N times a DSA prefill step instead: one sequence of N tokens, each with its own top-k row
as GLM-5.3-Flash's kpool indexer writes them (--kpool consecutive keys a pick, the tail of the
token's own pool after them), at --rope P (0 for GLM-5.3-Flash); --sweep then times PREFILL_SWEEP's
(block_h, block_n, warps, stages, prefetch), each row's output against the default tiles' row.

    python scripts/bench_latent_attention.py --out x.json --prefill 8192 --rope 0 --sweep
"""

from __future__ import annotations

import argparse
import statistics
import sys
from itertools import product

import torch

HQ, R, P = 64, 512, 64
DEVICE = "cuda"  # a module constant so that tests can run the loop on the CPU under the interpreter
CALLS = 20  # calls per graph: one replay's launch gap spread over many kernels
SWEEP = [(16, 16), (16, 32), (32, 16), (32, 32), (64, 16), (64, 32)]  # (block_h, block_n) for --sweep
# (block_h, block_n, num_warps, num_stages, prefetch) for --prefill --sweep
PREFILL_SWEEP = [(64, 32, 8, 2, False), (64, 32, 8, 2, True), (64, 32, 8, 3, True), (64, 64, 8, 2, False),
                 (64, 64, 8, 2, True), (32, 64, 8, 2, False), (32, 64, 8, 2, True), (32, 32, 8, 2, True),
                 (16, 32, 4, 2, False), (16, 32, 4, 2, True)]


def graph_us(fn, reps: int = 10) -> float:
    """Median microseconds of one fn() call, CALLS of them captured back to back in a CUDA graph."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compile, size workspaces
        fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(CALLS):
            fn()
    graph.replay()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / CALLS)
    return statistics.median(times)


def copy_gbps() -> float:
    a = torch.empty(2**30 // 2, dtype=torch.bfloat16, device=DEVICE)
    b = torch.empty_like(a)
    us = graph_us(lambda: b.copy_(a))
    return 2 * a.numel() * a.element_size() / us / 1e3


def decode_case(batch: int, ctx: int, page: int, k: int | None, g: torch.Generator, p: int = P):
    """q [B, Hq, R+P], latent pool over shuffled pages, a decode AttnBatch at context ctx, and topk
    [B, K] (distinct random positions; -1 past the context when ctx < K) or None."""
    from moetier.layers.attention import AttnBatch

    device = DEVICE
    per_seq = -(-ctx // page)
    pages = torch.randperm(batch * per_seq + 1, generator=g, device=device).to(torch.int32)
    table = pages[: batch * per_seq].view(batch, per_seq).contiguous()
    latent = torch.randn(batch * per_seq + 1, page, R + p, generator=g, device=device).bfloat16()
    q = torch.randn(batch, HQ, R + p, generator=g, device=device).bfloat16()
    lens = torch.full((batch,), ctx, dtype=torch.int32, device=device)
    starts = torch.arange(batch + 1, dtype=torch.int32, device=device)
    pos = torch.full((batch,), ctx - 1, dtype=torch.int64, device=device)
    attn = AttnBatch(pos, pos, starts, lens, table, list(range(batch + 1)), [ctx] * batch, 1)
    topk = None
    if k:
        order = torch.rand(batch, ctx, generator=g, device=device).argsort(dim=1).to(torch.int32)
        topk = torch.full((batch, k), -1, dtype=torch.int32, device=device)
        topk[:, : min(k, ctx)] = order[:, :k]
    return q, latent, attn, topk


def kpool_rows(batch, pages: int, page: int, topk: int, kpool: int, g: torch.Generator) -> torch.Tensor:
    """[tokens, topk + kpool - 1] int32 top-k rows of batch's one sequence, as the kpool indexer writes
    them (kpool_indexer.select_pools_reference itself, over random index keys, queries and head
    weights at a small indexer width: only the rows' shape matters here)."""
    from moetier.layers.kpool_indexer import select_pools_reference

    heads, d = 4, 16
    n = batch.num_tokens
    index_k = torch.randn(pages, page, 2 * d, generator=g, device=DEVICE).bfloat16()
    q = torch.randn(n, heads, d, generator=g, device=DEVICE).bfloat16()
    w = torch.rand(n, heads, generator=g, device=DEVICE)
    ape = torch.randn(kpool, d, generator=g, device=DEVICE).bfloat16()
    return select_pools_reference(q, w, index_k, ape, batch, topk, kpool, d ** -0.5)


def prefill_rows(args, g: torch.Generator, p: int) -> list[dict]:
    """--prefill: one DSA prefill step of args.prefill tokens, timed for the default tiles and (--sweep)
    each of PREFILL_SWEEP, every row checked against the default's output."""
    from moetier.layers.attention import make_batch
    from moetier.layers.latent_attention_triton import latent_attention_triton, tile_config

    n = args.prefill
    pages = -(-n // args.page)
    latent = torch.randn(pages, args.page, R + p, generator=g, device=DEVICE).bfloat16()
    q = torch.randn(n, HQ, R + p, generator=g, device=DEVICE).bfloat16()
    table = torch.randperm(pages, generator=g, device=DEVICE).tolist()
    batch = make_batch([(0, n, table)], args.page, DEVICE)
    topk = kpool_rows(batch, pages, args.page, args.topk, args.kpool, g)
    flops = int((topk >= 0).sum()) * HQ * 2 * (2 * R + p)  # S over R + P, P.V over R, per walked entry
    scale = (256 + p) ** -0.5
    default = tile_config(HQ, R, n, True, q.dtype)
    configs = [None] + (PREFILL_SWEEP if args.sweep else [])
    rows, want = [], None
    print(f"prefill {n} tokens, Hq {HQ} R {R} P {p}, top-k rows {topk.shape[1]} wide (kpool {args.kpool}), "
          f"default tiles {default}")
    for cfg in configs:
        bh, bn, warps, stages, ahead = cfg or (default[0], default[2], default[3], default[4], default[5])
        out = torch.empty(n, HQ, R, dtype=q.dtype, device=DEVICE)
        us = graph_us(lambda: latent_attention_triton(q, latent, batch, scale, R, topk=topk, out=out, block_h=bh,
                                                      block_n=bn, num_warps=warps, num_stages=stages,
                                                      prefetch=ahead), reps=5)
        want = out.clone() if want is None else want
        diff = ((out.float() - want.float()).abs().max() / want.float().abs().max()).item()
        row = dict(mode="prefill", tokens=n, rope=p, kpool=args.kpool, topk=args.topk, block_h=bh, block_n=bn,
                   num_warps=warps, num_stages=stages, prefetch=ahead, default=cfg is None, us=round(us, 1),
                   flops=flops, tflops=round(flops / us / 1e6, 1), rel_diff_vs_default=diff)
        assert diff <= 1e-2, f"{cfg}: output differs from the default tiles' by {diff:.2e}"
        rows.append(row)
        print(f"{'default' if cfg is None else ''!s:>8} {bh:>3}x{bn:<3} w{warps} s{stages} prefetch {ahead!s:5} "
              f"{us / 1e3:9.3f} ms {row['tflops']:7.1f} TFLOP/s  diff {diff:.1e}", flush=True)
    return rows


def torch_dense(q: torch.Tensor, rows: torch.Tensor, scale: float):
    """The baseline: q [B, Hq, R+P] against contiguous rows [B, ctx, R+P] in three torch ops."""
    def run():
        s = torch.matmul(q, rows.transpose(1, 2)).float() * scale  # [B, Hq, ctx]
        return torch.matmul(torch.softmax(s, dim=-1).to(q.dtype), rows[:, :, :R])
    return run


def decode_rows(args, g: torch.Generator, p: int) -> list[dict]:
    """The decode rows: every batch x context, dense and with DSA top-k, for each tile and split count."""
    import triton

    from moetier.layers.latent_attention_triton import default_num_splits, latent_attention_triton, tile_config

    scale = (128 + p) ** -0.5  # GLM-5's qk_head_dim (nope 128 + rope 64); any value times the same
    print(f"{'batch':>5} {'ctx':>6} {'topk':>5} {'tiles':>7} {'splits':>6} {'us':>8} {'GB/s':>7} {'torch us':>9}")
    configs = SWEEP if args.sweep else [(args.block_h, args.block_n)]
    split_counts = [int(x) for x in args.splits.split(",")] if args.splits else [None]
    rows = []
    for batch in (int(b) for b in args.batches.split(",")):
        for ctx in (int(c) for c in args.contexts.split(",")):
            for k in (None, args.topk):
                q, latent, attn, topk = decode_case(batch, ctx, args.page, k, g, p)
                out = torch.empty(batch, HQ, R, dtype=q.dtype, device=DEVICE)
                keys = min(ctx, k) if k else ctx
                nbytes = batch * keys * (R + p) * latent.element_size()
                torch_us = None
                if k is None:
                    contiguous = latent[attn.page_table.long()].flatten(1, 2)[:, :ctx].contiguous()
                    torch_us = round(graph_us(torch_dense(q, contiguous, scale)), 2)
                    del contiguous
                for (want_h, want_n), splits in product(configs, split_counts):
                    block_h, _, block_n, _, _, _ = tile_config(HQ, R, 1, k is not None, q.dtype, want_h, want_n)
                    splits = splits or default_num_splits(batch * triton.cdiv(HQ, block_h), keys, q.device)
                    us = graph_us(lambda: latent_attention_triton(q, latent, attn, scale, R, topk=topk, out=out,
                                                                  num_splits=splits, block_h=block_h,
                                                                  block_n=block_n, prefetch=args.prefetch))
                    row = dict(batch=batch, ctx=ctx, topk=k, block_h=block_h, block_n=block_n, splits=splits,
                               prefetch=args.prefetch, us=round(us, 2), gbps=round(nbytes / us / 1e3, 1),
                               latent_bytes=nbytes, torch_us=torch_us)
                    rows.append(row)
                    print(f"{batch:>5} {ctx:>6} {k or '-':>5} {f'{block_h}x{block_n}':>7} {splits:>6} {us:>8.1f} "
                          f"{row['gbps']:>7.0f} {torch_us if torch_us is not None else '-'!s:>9}")
                del q, latent, attn, topk, out
                torch.cuda.empty_cache()
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="JSON file to write")
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--contexts", default="1024,4096,16384")
    ap.add_argument("--topk", type=int, default=2048, help="DSA entries per token (rows with and without)")
    ap.add_argument("--page", type=int, default=64)
    ap.add_argument("--splits", default=None, help="num_splits to time, comma-separated (default: the kernel's choice)")
    ap.add_argument("--block-h", type=int, default=None)
    ap.add_argument("--block-n", type=int, default=None)
    ap.add_argument("--sweep", action="store_true", help=f"time every (block_h, block_n) of {SWEEP}")
    ap.add_argument("--prefill", type=int, default=0, help="tokens of a DSA prefill step to time instead of decode")
    ap.add_argument("--kpool", type=int, default=16, help="keys a --prefill pick covers (GLM-5.3-Flash's index_kpool)")
    ap.add_argument("--rope", type=int, default=P, help="rope dims of a latent row (0: GLM-5.3-Flash's NoPE)")
    ap.add_argument("--prefetch", action="store_true", help="decode rows with each tile's rows resolved a tile ahead")
    args = ap.parse_args()
    bad = (f"--prefill {args.prefill}: give a token count >= 0" if args.prefill < 0 else
           f"--kpool {args.kpool}: give a positive key count" if args.kpool < 1 else
           f"--topk {args.topk} must be a positive multiple of --kpool {args.kpool}"
           if args.prefill and (args.topk < 1 or args.topk % args.kpool) else
           f"--rope {args.rope}: give a width >= 0" if args.rope < 0 else
           f"--page {args.page}: give a power of two" if args.page < 1 or args.page & (args.page - 1) else None)
    if bad:
        print(f"error: {bad}", file=sys.stderr)
        return 2
    if DEVICE == "cuda" and not torch.cuda.is_available():
        print("bench_latent_attention: needs a CUDA device; none is visible", file=sys.stderr)
        return 2

    from moetier.bench.common import commit, machine, write_json

    g = torch.Generator(device=DEVICE).manual_seed(0)
    ceiling = copy_gbps()
    print(f"device copy: {ceiling:.0f} GB/s (read + write); Hq {HQ} R {R} P {args.rope} bf16, page {args.page}")
    rows = prefill_rows(args, g, args.rope) if args.prefill else decode_rows(args, g, args.rope)
    write_json(args.out, {"benchmark": "latent_attention", "machine": machine(), "commit": commit(),
                          "command": " ".join(["python", *sys.argv]), "copy_gbps": round(ceiling, 1),
                          "shape": {"hq": HQ, "kv_lora_rank": R, "rope_dim": args.rope, "dtype": "bfloat16",
                                    "page_size": args.page},
                          "rows": rows})
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
