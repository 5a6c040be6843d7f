"""Times the Triton MLA decode kernel (layers/latent_attention_triton.py) on CUDA at GLM-5's shape
(Hq 64, kv_lora_rank 512, rope 64, bf16) for decode batches and context lengths, dense and with DSA
top-k, each call replayed from a CUDA graph (the mode the engine ships). Prints a table of us per
call and GB/s of latent rows read, next to two baselines measured in the same run: a device copy
(the HBM ceiling, read + write bytes) and the same attention in plain torch over a contiguous
(unpaged) latent, dense rows only. Writes the rows as JSON to --out.

    python scripts/bench_latent_attention.py --out bench/results/h200-latent-attention.json [--sweep]

The kernel's tiles come from tile_config unless --block-h / --block-n (or --sweep) say otherwise;
the key splits from default_num_splits unless --splits (a list: every count is timed).
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


def decode_case(batch: int, ctx: int, page: int, k: int | None, g: torch.Generator):
    """q [B, Hq, R+P], latent pool over shuffled pages, a decode AttnBatch at context ctx, and topk
    [B, K] (distinct random positions; -1 past the context when ctx < K) or None."""
    from moetier.layers.attention import AttnBatch

    device = DEVICE
    per_seq = -(-ctx // page)
    pages = torch.randperm(batch * per_seq + 1, generator=g, device=device).to(torch.int32)
    table = pages[: batch * per_seq].view(batch, per_seq).contiguous()
    latent = torch.randn(batch * per_seq + 1, page, R + P, generator=g, device=device).bfloat16()
    q = torch.randn(batch, HQ, R + P, generator=g, device=device).bfloat16()
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


def torch_dense(q: torch.Tensor, rows: torch.Tensor, scale: float):
    """The baseline: q [B, Hq, R+P] against contiguous rows [B, ctx, R+P] in three torch ops."""
    def run():
        s = torch.matmul(q, rows.transpose(1, 2)).float() * scale  # [B, Hq, ctx]
        return torch.matmul(torch.softmax(s, dim=-1).to(q.dtype), rows[:, :, :R])
    return run


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
    args = ap.parse_args()
    if DEVICE == "cuda" and not torch.cuda.is_available():
        print("bench_latent_attention: needs a CUDA device; none is visible", file=sys.stderr)
        return 2

    import triton

    from moetier.bench.common import commit, machine, write_json
    from moetier.layers.latent_attention_triton import default_num_splits, latent_attention_triton, tile_config

    scale = (128 + P) ** -0.5  # GLM-5's qk_head_dim (nope 128 + rope 64); any value times the same
    g = torch.Generator(device=DEVICE).manual_seed(0)
    ceiling = copy_gbps()
    print(f"device copy: {ceiling:.0f} GB/s (read + write); Hq {HQ} R {R} P {P} bf16, page {args.page}")
    print(f"{'batch':>5} {'ctx':>6} {'topk':>5} {'tiles':>7} {'splits':>6} {'us':>8} {'GB/s':>7} {'torch us':>9}")
    configs = SWEEP if args.sweep else [(args.block_h, args.block_n)]
    split_counts = [int(x) for x in args.splits.split(",")] if args.splits else [None]
    rows = []
    for batch in (int(b) for b in args.batches.split(",")):
        for ctx in (int(c) for c in args.contexts.split(",")):
            for k in (None, args.topk):
                q, latent, attn, topk = decode_case(batch, ctx, args.page, k, g)
                out = torch.empty(batch, HQ, R, dtype=q.dtype, device=DEVICE)
                keys = min(ctx, k) if k else ctx
                nbytes = batch * keys * (R + P) * latent.element_size()
                torch_us = None
                if k is None:
                    contiguous = latent[attn.page_table.long()].flatten(1, 2)[:, :ctx].contiguous()
                    torch_us = round(graph_us(torch_dense(q, contiguous, scale)), 2)
                    del contiguous
                for (want_h, want_n), splits in product(configs, split_counts):
                    block_h, _, block_n, _, _ = tile_config(HQ, R, 1, k is not None, q.dtype, want_h, want_n)
                    splits = splits or default_num_splits(batch * triton.cdiv(HQ, block_h), keys, q.device)
                    us = graph_us(lambda: latent_attention_triton(q, latent, attn, scale, R, topk=topk, out=out,
                                                                  num_splits=splits, block_h=block_h,
                                                                  block_n=block_n))
                    row = dict(batch=batch, ctx=ctx, topk=k, block_h=block_h, block_n=block_n, splits=splits,
                               us=round(us, 2), gbps=round(nbytes / us / 1e3, 1), latent_bytes=nbytes,
                               torch_us=torch_us)
                    rows.append(row)
                    print(f"{batch:>5} {ctx:>6} {k or '-':>5} {f'{block_h}x{block_n}':>7} {splits:>6} {us:>8.1f} "
                          f"{row['gbps']:>7.0f} {torch_us if torch_us is not None else '-'!s:>9}")
                del q, latent, attn, topk, out
                torch.cuda.empty_cache()
    write_json(args.out, {"benchmark": "latent_attention", "machine": machine(), "commit": commit(),
                          "command": " ".join(["python", *sys.argv]), "copy_gbps": round(ceiling, 1),
                          "shape": {"hq": HQ, "kv_lora_rank": R, "rope_dim": P, "dtype": "bfloat16",
                                    "page_size": args.page},
                          "rows": rows})
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
