"""Issue 33's FP8 LM head question, timed before anything is built: the LM head at decode sizes as
bf16 (cuBLAS, what runs today) against the same weight quantized to block-scaled FP8 (quant/fp8_block)
through the weight-only FP8 decode kernel (layers/fp8_linear_triton.fp8_mm), each replayed from a CUDA
graph as a decode step replays it, with the logits' relative error against bf16 (max |fp8 - bf16| over
max |bf16|) and the argmax agreement on random inputs. CUDA only. Run from the repository root:

    python scripts/lm_head_fp8_bench.py OUT.json
"""

from __future__ import annotations

import json
import sys

import torch
import torch.nn.functional as F

from moetier.layers.fp8_linear_triton import fp8_mm
from moetier.quant.fp8_block import quantize

SHAPES = (("qwen3-30b-a3b", 151936, 2048), ("glm-5.3-flash", 154880, 4096))  # vocabulary, hidden


def graph_us(fn, reps: int = 50) -> tuple[float, torch.Tensor]:
    """Microseconds a replay of fn's graph takes (mean of reps back to back), and its output."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up: compile, size workspaces
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    for _ in range(5):
        graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / reps * 1e3, out


def main() -> None:
    if len(sys.argv) != 2 or not torch.cuda.is_available():
        print("error: usage: python scripts/lm_head_fp8_bench.py OUT.json (needs CUDA)", file=sys.stderr)
        sys.exit(2)
    torch.manual_seed(0)
    rows = []
    for name, vocab, hidden in SHAPES:
        w = (torch.randn(vocab, hidden, device="cuda") * 0.02).bfloat16()
        q, scale = quantize(w.float())
        for m in (1, 8, 32):
            x = torch.randn(m, hidden, device="cuda").bfloat16()
            t16, y16 = graph_us(lambda: F.linear(x, w))
            t8, y8 = graph_us(lambda: fp8_mm(x, q, scale))
            ref = y16.float()
            row = {"model": name, "vocab": vocab, "hidden": hidden, "tokens": m, "bf16_us": t16, "fp8_us": t8,
                   "bf16_GBps": vocab * hidden * 2 / t16 / 1e3, "fp8_GBps": (q.numel() + scale.numel() * 4) / t8 / 1e3,
                   "rel_err": float((y8.float() - ref).abs().max() / ref.abs().max()),
                   "argmax_same": float((y8.argmax(-1) == y16.argmax(-1)).float().mean())}
            rows.append(row)
            print(json.dumps(row), flush=True)
    with open(sys.argv[1], "w") as f:
        json.dump({"command": "python " + " ".join(sys.argv), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
