"""Record the routing of a model on held-out text: a learned trace.

    python scripts/record_heldout.py --model moetier/assets/tiny-stdlib --text held_out.txt \
        --out data/traces/tiny-stdlib-heldout.mtrace --tokens 16384

The text is cut into windows of --window tokens; each window is one request that reads the window
(teacher-forced routing of real text: every token's experts) and generates one token. Windows run
one after another, so the trace is one stream in text order.
"""

from __future__ import annotations

import argparse

from moetier.engine import LLM
from moetier.sampling_params import SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--text", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--window", type=int, default=1024)
    args = ap.parse_args()
    llm = LLM(args.model, device="cpu", record_trace=args.out, max_num_tokens=args.window,
              trace_meta={"source": f"held-out text {args.text}", "window": args.window})
    ids = llm.tokenizer.encode(open(args.text, encoding="utf-8").read())[: args.tokens]
    for start in range(0, len(ids) - 1, args.window):
        window = ids[start:start + args.window]
        llm.generate([window], SamplingParams(max_tokens=1, ignore_eos=True))
    llm.close()
    print(f"recorded {len(ids)} tokens of {args.text} into {args.out}")


if __name__ == "__main__":
    main()
