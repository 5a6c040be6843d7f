"""Acceptance of speculative decoding on the embedded model's held-out text, on the CPU (issue 35's
CPU measure): n-gram drafting, or the MTP layer tiny-stdlib ships (scripts/train_mtp.py). The
held-out files (held_out.txt names them, docs/tiny-stdlib.md) are read from this Python's standard
library; each prompt is the start of one file, decoded alone with --speculative-config (the method,
k fixed) and without.

Greedy (the default): the outputs must be equal, and the record gives the tokens per target step
after the prefill. --temperature T > 0: sampled decoding (seed = the file's index), whose outputs
follow the target's distribution but are not the plain run's tokens, so only the acceptance is
recorded; with --method mtp, --argmax-drafts drafts the MTP layer's argmax instead of a draw from its
distribution (what the engine did before drafts from q: the comparison's baseline, this script only).

    python scripts/spec_heldout.py --method mtp --k 2 --prompts 8 --prompt-len 256 --tokens 64
    python scripts/spec_heldout.py --method mtp --k 2 --temperature 1.0 [--argmax-drafts]
"""

from __future__ import annotations

import argparse
import json
import sysconfig

from moetier.default_model import held_out_files
from moetier.engine.llm import LLM
from moetier.engine.spec_step import MtpDrafter
from moetier.sampling_params import SamplingParams


def argmax_drafts() -> None:
    """Every MTP draft the argmax, sampled requests too, its q one-hot (a deterministic draft: kept
    with probability p(x)): the baseline of --argmax-drafts."""
    import torch

    def pick(logits, chains, live, depth, probs):
        best = logits.argmax(dim=-1)
        probs.append((live, torch.nn.functional.one_hot(best, logits.shape[-1]).float()))
        return best
    MtpDrafter._pick = staticmethod(pick)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--method", choices=["ngram", "mtp"], default="ngram")
    ap.add_argument("--k", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=11, help="held-out files to use (11 in all)")
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--argmax-drafts", action="store_true")
    args = ap.parse_args()
    if args.argmax_drafts:
        argmax_drafts()
    spec = {"method": args.method, "num_speculative_tokens": args.k, "expert_aware_k": False}
    plain, llm = LLM(None, device="cpu"), LLM(None, device="cpu", speculative_config=spec)
    files = held_out_files(args.prompts)
    sampled = args.temperature > 0
    rows, equal = [], None if sampled else True
    for i, f in enumerate(files):
        params = SamplingParams(max_tokens=args.tokens, ignore_eos=True, temperature=args.temperature, seed=i)
        prompt = plain.tokenizer.encode(f.read_text(encoding="utf-8"))[:args.prompt_len]
        steps0 = llm.steps
        got = llm.generate([prompt], params)[0].outputs[0].token_ids
        if not sampled:
            equal &= got == plain.generate([prompt], params)[0].outputs[0].token_ids
        decode_steps = llm.steps - steps0 - 1  # the prefill samples the first token
        rows.append({"file": f.name, "tokens_per_target_step": (len(got) - 1) / decode_steps})
    m = llm.metrics()
    mean = sum(r["tokens_per_target_step"] for r in rows) / len(rows)
    print(json.dumps({"method": args.method, "k": args.k, "temperature": args.temperature,
                      "argmax_drafts": args.argmax_drafts, "stdlib": sysconfig.get_paths()["stdlib"],
                      "files": len(files),
                      "equal_to_plain": equal, "mean_tokens_per_target_step": mean,
                      "acceptance_rate": m["spec_decode_acceptance_rate"],
                      "mean_acceptance_length": m["spec_decode_mean_acceptance_length"],
                      "accepted_per_pos": m["spec_decode_num_accepted_tokens_per_pos"], "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
