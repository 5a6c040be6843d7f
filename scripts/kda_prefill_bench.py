"""One KDA layer's prefill step at GLM-5.3-Flash's shape (64 heads of 128, hidden 4096, bf16), one
sequence after a 4,096-token context with T new tokens, by the kernel that runs it (layers/kda.py):
fla's recurrent kernel on a view of the sequence's slot, or the chunked kernel (varlen, its state
gathered and scattered by index). Each row times the whole layer back to back, as an eager step
runs it (the host's launches and its waits for the stream included: ms per call over 20 calls, the
median of 5 such runs), and checks its output against the chunked row of the same T.

    python scripts/kda_prefill_bench.py [OUT.json] [--tokens 2,16,32,64,128,256]

The default kernel choice (RECURRENT_TOKENS in layers/kda_cuda.py) is the crossover this measures.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

import moetier.layers.kda as kda_module
from moetier.bench.common import record
from moetier.layers.attention import make_batch
from moetier.layers.kda import KdaAttention
from moetier.layers.state_cache import KdaStateCache, KdaStateSpec

HEADS, D, HIDDEN, CONTEXT, PAGE = 64, 128, 4096, 4096, 16


def layer_and_state() -> tuple[KdaAttention, KdaStateCache]:
    torch.manual_seed(0)
    attn = KdaAttention(0, HIDDEN, HEADS, D, 4, -5.0, 1e-5, torch.bfloat16, "cuda")
    with torch.no_grad():
        for p in attn.parameters():
            p.copy_(torch.randn_like(p, dtype=torch.float32).mul_(0.02).to(p.dtype))
        attn.A_log.uniform_(-1, 1)
    state = KdaStateCache(KdaStateSpec((0,), 3 * HEADS * D, 4, HEADS, D, D), 4, torch.bfloat16, "cuda")
    return attn, state


def run(attn, state, tokens: int, threshold: int, calls: int = 20) -> tuple[float, torch.Tensor]:
    """-> (median ms per call of `calls` back-to-back layer steps, the first call's output)."""
    kda_module.RECURRENT_TOKENS = threshold
    pages = list(range((CONTEXT + tokens + PAGE - 1) // PAGE))
    batch = make_batch([(CONTEXT, tokens, pages)], PAGE, "cuda", [1])
    x = torch.randn(tokens, HIDDEN, generator=torch.Generator().manual_seed(tokens)).to("cuda", torch.bfloat16)
    g = torch.Generator().manual_seed(1)
    start = [torch.randn(t[0, 1].shape, generator=g).cuda() * 0.1 for t in (state.recurrent, state.conv)]

    def reset():  # the sequence's carried state, as the context left it
        state.recurrent[0, 1].copy_(start[0])
        state.conv[0, 1].copy_(start[1])

    with torch.inference_mode():
        reset()
        first = attn(x, batch, state).clone()
        runs = []
        for _ in range(5):
            reset()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(calls):
                attn(x, batch, state)
            torch.cuda.synchronize()
            runs.append((time.perf_counter() - t0) * 1e3 / calls)
    return statistics.median(runs), first


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", nargs="?", help="write the record here (JSON)")
    ap.add_argument("--tokens", default="2,16,32,64,128,256", help="new tokens per step, comma-separated")
    args = ap.parse_args()
    try:
        sizes = [int(t) for t in args.tokens.split(",")]
    except ValueError:
        ap.error(f"--tokens takes comma-separated integers, got {args.tokens!r}")
    if min(sizes) < 2:  # one new token after a context is a decode step, which takes neither kernel
        ap.error(f"--tokens are prefill steps of at least 2 tokens, got {args.tokens!r}")
    if args.out and Path(args.out).is_dir():
        ap.error(f"OUT is a file to write, got the directory {args.out}")
    attn, state = layer_and_state()
    rows = []
    for tokens in sizes:
        chunk_ms, want = run(attn, state, tokens, 0)
        rec_ms, got = run(attn, state, tokens, 1 << 30)
        diff = ((got.float() - want.float()).norm() / want.float().norm()).item()
        rows.append({"tokens": tokens, "chunked_ms": round(chunk_ms, 3), "recurrent_ms": round(rec_ms, 3),
                     "recurrent_rel_diff": diff})
        print(f"T={tokens:5d}: chunked {chunk_ms:7.3f} ms, recurrent {rec_ms:7.3f} ms per layer step "
              f"({chunk_ms / rec_ms:.2f}x); recurrent vs chunked output rel diff {diff:.2e}", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(record("kda_prefill", {"heads": HEADS, "head_dim": D, "hidden": HIDDEN, "context": CONTEXT,
                                             "rows": rows}), f, indent=1)


if __name__ == "__main__":
    main()
