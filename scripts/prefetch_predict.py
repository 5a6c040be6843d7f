"""Next-layer expert prediction on the embedded model's held-out text, on the CPU (issue 33's prefetch,
"measure both"): how well layer l+1's experts can be named before layer l+1 routes. Real routing
needs trained weights, so this runs tiny-stdlib (4 MoE layers, 32 experts, top-4) over the held-out
files (held_out.txt, read from this Python's standard library, as scripts/spec_heldout.py does).

Predictors of layer l+1's experts, each naming k' of them (k' = k and 2k):
  router@moe-in     layer l+1's router on layer l's MoE input (layer l's post-attention norm): known
                    when layer l's experts start, so a fill could overlap all of layer l's expert work
  router@layer-out  layer l+1's router on the residual leaving layer l, normed by layer l+1's
                    post-attention norm (layer l+1's attention skipped): known only after layer l
  transition        the most frequent (layer l expert -> layer l+1 expert) successors of this token's
                    layer-l experts, counted on the first half of the tokens
  popular           layer l+1's most used experts on the first half
  previous          the previous token's experts at layer l+1 (same file)
Scored on the second half of the tokens: recall = predicted among the k real / k, precision =
predicted among the k real / k'. Under a cache what counts is the misses: the engine's slot cache
(experts/cache/slots.py, --policy, default lfru as the engine's) of half the experts per layer (--slots),
one token a step, warmed on the first half, gives each predictor's miss recall (the misses it names /
the misses) and the rows it would fill in vain per token (named, not held, not used). And with the
prefetch in the cache (`<name> prefetched`): before each token routes, its named experts are taken in
(SlotCache.warm, as a step that asks for them), then the token routes: (misses left per token, rows
filled per token: prefetched plus missed), against the same cache without prefetch (its misses per
token, every one a fill).

    python scripts/prefetch_predict.py --out bench/results/cpu-prefetch-predict.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from moetier.default_model import held_out_files
from moetier.engine.llm import LLM
from moetier.experts.cache.slots import MISSES, OVERFLOW, SlotCache, policy_for
from moetier.layers.norm import rms_norm
from moetier.sampling_params import SamplingParams


def capture(llm: LLM, prompts: list[list[int]]) -> dict[str, list[torch.Tensor]]:
    """Per MoE layer l, over every prompt token in order: the routed ids [N, k], the MoE input [N, H]
    and the residual leaving the layer [N, H] (each prompt prefilled in one step)."""
    layers = llm.model.layers
    got = {"ids": [[] for _ in layers], "moe_in": [[] for _ in layers], "out": [[] for _ in layers]}

    def on_layer(i):
        def hook(module, args, result):
            x, delta = result
            got["out"][i].append((x + delta).float())
        return hook

    def on_mlp(i):
        def hook(module, args, result):
            h = args[0]
            got["moe_in"][i].append(h.float())
            got["ids"][i].append(module.router(h)[0])
        return hook

    handles = [layer.register_forward_hook(on_layer(i)) for i, layer in enumerate(layers)]
    handles += [layer.mlp.register_forward_hook(on_mlp(i)) for i, layer in enumerate(layers)]
    try:
        for p in prompts:
            llm.generate([p], SamplingParams(max_tokens=1))
    finally:
        for h in handles:
            h.remove()
    return {key: [torch.cat(v) for v in per] for key, per in got.items()}


def scores(pred: torch.Tensor, real: torch.Tensor) -> tuple[float, float]:
    """pred [N, k'], real [N, k] expert ids -> (recall, precision) over the N tokens."""
    hit = (pred[:, :, None] == real[:, None, :]).any(-1).sum().item()
    return hit / real.numel(), hit / pred.numel()


def cache_run(ids: torch.Tensor, num_experts: int, slots: int, policy: str, start: int,
              pred: torch.Tensor | None = None) -> tuple[list[set[int]], float, float]:
    """The engine's slot cache (experts/cache/slots.SlotCache, `policy`) of `slots` slots stepping through
    ids [N, k] one token a step (decode at batch 1). Tokens i >= start first take in pred[i - start]
    (SlotCache.warm: what a prefetch would fill) when pred is given. -> (the experts held before each
    token i >= start routes, after its prefetch; misses left per token; rows filled per token, prefetched
    plus missed, overflow included)."""
    cache = SlotCache(num_experts, slots, "cpu", policy_for(policy, slots, ids.shape[1]))
    held, left, filled = [], 0, 0
    for i, row in enumerate(ids):
        if i >= start and pred is not None:
            filled += int(cache.warm(pred[i - start].tolist()).count)
        if i >= start:
            held.append(set((cache.expert_slot >= 0).nonzero().flatten().tolist()))
        before = cache.stats.clone()
        cache.step_reference(row[None])
        if i >= start:
            d = (cache.stats - before).tolist()
            left += d[MISSES] + d[OVERFLOW]
            filled += d[MISSES] + d[OVERFLOW]
    n = ids.shape[0] - start
    return held, left / n, filled / n


def miss_scores(pred: torch.Tensor, real: torch.Tensor, held: list[set[int]]) -> tuple[float, float]:
    """-> (the misses named / the misses, rows filled in vain per token: named, not held, not used)."""
    named = missed = vain = 0
    for p, r, h in zip(pred.tolist(), real.tolist(), held):
        misses = set(r) - h
        missed += len(misses)
        named += len(misses & set(p))
        vain += len(set(p) - h - set(r))
    return named / max(missed, 1), vain / len(held)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--files", type=int, default=11, help="held-out files (11 in all)")
    ap.add_argument("--prompt-len", type=int, default=512, help="tokens read from the start of each file")
    ap.add_argument("--slots", type=int, default=None, help="slots per layer (default: half the experts)")
    ap.add_argument("--policy", choices=["lru", "lfru"], default="lfru", help="the slot cache's victim order")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    llm = LLM(None, device="cpu", dtype="float32", max_num_tokens=args.prompt_len)
    files = held_out_files(args.files)
    prompts = [llm.tokenizer.encode(f.read_text(encoding="utf-8"))[:args.prompt_len] for f in files]
    starts = torch.tensor([0] + [len(p) for p in prompts]).cumsum(0)[:-1]  # each file's first token
    got = capture(llm, prompts)
    n, k = got["ids"][0].shape
    e = llm.model.cfg.num_experts
    half = n // 2
    slots = args.slots or e // 2
    first = torch.zeros(n, dtype=torch.bool)
    first[starts] = True
    rows = []
    for layer in range(len(llm.model.layers) - 1):
        nxt = llm.model.layers[layer + 1]
        real = got["ids"][layer + 1][half:]
        logits = {
            "router@moe-in": got["moe_in"][layer][half:] @ nxt.mlp.router.weight.float().t(),
            "router@layer-out": rms_norm(got["out"][layer][half:], nxt.post_norm.float(), nxt.eps)
            @ nxt.mlp.router.weight.float().t(),
        }
        # transition counts: C[a, b] = tokens of the first half routed to a at this layer and b at the next
        cur, nx = got["ids"][layer][:half], got["ids"][layer + 1][:half]
        counts = torch.zeros(e, e)
        counts.index_put_((cur[:, :, None].expand(-1, k, k).reshape(-1), nx[:, None, :].expand(-1, k, k).reshape(-1)),
                          torch.ones(half * k * k), accumulate=True)
        logits["transition"] = counts[got["ids"][layer][half:]].sum(1)
        logits["popular"] = torch.bincount(nx.reshape(-1), minlength=e).float().expand(n - half, e)
        prev = torch.roll(got["ids"][layer + 1], 1, 0)[half:]  # the previous token's, same file only
        held, base_left, _ = cache_run(got["ids"][layer + 1], e, slots, args.policy, half)
        for kk in (k, 2 * k):
            row = {"layer": int(llm.model.cfg.moe_layers[layer + 1]), "k_pred": kk, "misses_per_token": base_left}
            for name, lg in logits.items():
                pred = lg.topk(kk, dim=-1).indices
                row[name] = scores(pred, real)
                row[name + " misses"] = miss_scores(pred, real, held)
                if name != "popular":
                    row[name + " prefetched"] = cache_run(got["ids"][layer + 1], e, slots, args.policy, half, pred)[1:]
            keep = ~first[half:]
            if kk == k:  # the previous token names k experts only
                row["previous"] = scores(prev[keep], real[keep])
            rows.append(row)
    out = {"model": "tiny-stdlib", "files": [f.name for f in files], "tokens": n, "scored_tokens": n - half,
           "experts": e, "top_k": k, "slots": slots, "policy": args.policy,
           "metric": "(recall, precision) of layer l+1's experts; '<name> misses': (miss recall, rows filled in "
                     "vain per token) under the slot cache; '<name> prefetched': (misses left per token, rows "
                     "filled per token) with the named rows taken in first", "rows": rows}
    text = json.dumps(out, indent=1)
    print(text)
    if args.out is not None:
        args.out.write_text(text + "\n")
    print(f"{'layer':>5} {'k_pred':>6} " + " ".join(f"{m:>18}" for m in
          ("router@moe-in", "router@layer-out", "transition", "popular", "previous")))
    for r in rows:
        cells = [f"{r[m][0]:.2f}/{r[m][1]:.2f}" if m in r else "-" for m in
                 ("router@moe-in", "router@layer-out", "transition", "popular", "previous")]
        print(f"{r['layer']:>5} {r['k_pred']:>6} " + " ".join(f"{c:>18}" for c in cells))
    print(f"under a {args.policy} cache of {slots} slots: misses per token, then per predictor (miss recall / rows "
          "filled in vain per token)")
    for r in rows:
        cells = [f"{r[m + ' misses'][0]:.2f}/{r[m + ' misses'][1]:.2f}" for m in
                 ("router@moe-in", "router@layer-out", "transition", "popular")]
        print(f"{r['layer']:>5} {r['k_pred']:>6} {r['misses_per_token']:>6.2f} " + " ".join(f"{c:>18}" for c in cells))
    print("with the prefetch in the cache: misses per token without it, then per predictor (misses left / rows filled "
          "per token)")
    for r in rows:
        cells = [f"{r[m + ' prefetched'][0]:.2f}/{r[m + ' prefetched'][1]:.2f}" for m in
                 ("router@moe-in", "router@layer-out", "transition")]
        print(f"{r['layer']:>5} {r['k_pred']:>6} {r['misses_per_token']:>6.2f} " + " ".join(f"{c:>18}" for c in cells))


if __name__ == "__main__":
    main()
