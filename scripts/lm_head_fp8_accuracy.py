"""Issue 33's FP8 LM head question, its accuracy side on a trained model (CPU): the embedded
tiny-stdlib model's prompt log-probabilities over its held-out files (docs/tiny-stdlib.md) with its own
head, then with the head's weight quantized to block-scaled FP8 (quant/fp8_block) and dequantized, which
is the weight-only FP8 kernel's math (layers/fp8_linear.py: fp32(q) * scale rounded once). A tied head
is replaced alone: the embedding keeps its weights. Reports the perplexity of both, how often the
top-1 token agrees, and the largest change of a token's log-probability. The timing side is
scripts/lm_head_fp8_bench.py (CUDA).

    python scripts/lm_head_fp8_accuracy.py OUT.json [--files 11] [--prompt-len 512]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch

from moetier.bench.common import record
from moetier.default_model import held_out_files
from moetier.engine.llm import LLM
from moetier.quant.fp8_block import dequantize, quantize
from moetier.sampling_params import SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--files", type=int, default=11, help="held-out files to score (11 in all)")
    ap.add_argument("--prompt-len", type=int, default=512, help="tokens scored from the start of each file")
    args = ap.parse_args()
    if args.files < 1 or args.prompt_len < 2:
        print("error: --files takes at least 1 and --prompt-len at least 2", file=sys.stderr)
        sys.exit(2)
    llm = LLM(None, device="cpu")
    files = held_out_files(args.files)
    prompts = [llm.tokenizer.encode(f.read_text(encoding="utf-8", errors="replace"))[:args.prompt_len] for f in files]
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=1)
    plain = llm.generate(prompts, params)
    head = llm.model.lm_head.detach().clone()
    q, scale = quantize(head.float())
    llm.model.lm_head = torch.nn.Parameter(dequantize(q, scale, head.dtype), requires_grad=False)
    fp8 = llm.generate(prompts, params)
    nll = [0.0, 0.0]
    same = n = 0
    worst = 0.0
    for a, b in zip(plain, fp8):
        for pa, pb in zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:]):  # (logprob, rank, [(top-1 id, lp)])
            nll[0] -= pa[0]
            nll[1] -= pb[0]
            same += pa[2][0][0] == pb[2][0][0]
            worst = max(worst, abs(pa[0] - pb[0]))
            n += 1
    err = ((llm.model.lm_head.float() - head.float()).norm() / head.float().norm()).item()
    result = {"files": len(prompts), "tokens_scored": n, "head": list(head.shape), "head_dtype": str(head.dtype),
              "tied": llm.cfg.tie_word_embeddings, "weight_rel_err": err, "ppl": math.exp(nll[0] / n),
              "ppl_fp8_head": math.exp(nll[1] / n), "top1_same": same / n, "max_abs_logprob_change": worst}
    Path(args.out).write_text(json.dumps(record("lm-head-fp8-accuracy", result), indent=1))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
