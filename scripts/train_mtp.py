"""The MTP layer of tiny-stdlib (`python scripts/train_tiny.py --mtp`): one multi-token-prediction
layer in DeepSeek-V3's shape (models/mtp.py) trained on the frozen base, on CPU, for a wall-clock
budget, and written into the checkpoint the way DeepSeek-V3 stores its MTP layer (layer index
num_hidden_layers, `num_nextn_predict_layers: 1` in config.json). The base's tensors are copied
byte for byte from the checkpoint it reads, so every figure and golden output of the base holds.

The layer is transformers' generic MtpModel (modeling_layers.py) over Qwen3MoeDecoderLayer, the same
module tests/test_mtp_tiny_stdlib.py checks moetier's draft logits against. Row i pairs token t_{i+1} with the
base's final hidden state h_i (after its norm: what the engine hands the MTP layer) and is trained
to give the base's own distribution at position i + 1 (KL to the base's logits there, which the
base's forward over the window yields for free): greedy speculation keeps a draft exactly when it
is the base's argmax, not the corpus' next token. The engine chains the layer for k > 1 (the draft
and the h' after the shared norm, one position on); with --mtp-depths 2 the second half of the
budget trains that chain too (step_losses: depth 2 reads depth 1's KV rows, as the engine's chained
step reads the rows its catch-up wrote). Both depths from the first step learnt far slower (after
100 steps, depth-1 agreement 0.06 against 0.37), hence depth 1 alone first.

The layer starts from transformers' own initialisation (normal, std initializer_range). A warm
start from the base's last layer (eh_proj [I | I], the base's final norm as the head's) was tried
and lost: after 120 steps, held-out KL 2.06 and agreement 0.26 against 1.61 and 0.36 from scratch.
"""

from __future__ import annotations

import json
import math
import shlex
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import save_file

README_MARK = "\n## MTP layer\n"


def build(base, seed: int):
    """The MtpModel over the frozen base, its layer initialised as transformers initialises it."""
    from transformers.modeling_layers import MtpModel

    base.requires_grad_(False)
    before = base.model.embed_tokens.weight.clone()
    base.config.num_mtp_layers = 1
    torch.manual_seed(seed)
    mtp = MtpModel(base, 1)
    layer = mtp.layers[0]
    # MtpModel shares the base's embedding and head; its post_init must not have touched them
    assert torch.equal(before, base.model.embed_tokens.weight), "MtpModel re-initialised the base's embedding"
    layer.requires_grad_(True)
    return mtp


def chain_mask(rows: int) -> torch.Tensor:
    """[2R - 1, 2R - 1] bool, True where a query row attends: depth-1 rows 0 .. R-1 (position p)
    causally among themselves; depth-2 row R + i (position i + 1) to the depth-1 rows at positions
    <= i and to itself, as the engine's chained draft reads the KV rows its catch-up wrote."""
    q, k = torch.arange(2 * rows - 1)[:, None], torch.arange(2 * rows - 1)[None]
    at = torch.where(q < rows, q, q - rows)
    return ((k < rows) & (k <= at)) | (k == q)


def step_losses(base, mtp, w: torch.Tensor, router: list, chain: bool
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """w [B, S + 1] -> (KL to the base: depth 1 at position i + 1, plus depth 2 at i + 2 when chain,
    the MTP router's balance loss, argmax agreement with the base at depth 1 [B * (S - 1)] and at
    depth 2 [B * (S - 2)] (None without chain): the greedy acceptance per position, teacher-forced).

    Depth 1, row i: (t_{i+1}, h_i) at position i. Depth 2, row i: (t_{i+2}, h'_i, depth 1's output
    after the shared norm) at position i + 1, attending to depth 1's rows (chain_mask); t_{i+2} is
    the corpus token, the one the base's distribution at i + 2 was computed after."""
    from train_tiny import balance_loss

    ids = w[:, :-1]
    with torch.no_grad():
        hid = base.model(input_ids=ids).last_hidden_state  # [B, S, H], after the final norm
        teacher = base.lm_head(hid[:, 1:]).float().log_softmax(-1)  # [B, S-1, V]: the base at i + 1
    layer, rows = mtp.layers[0], ids.shape[1] - 1

    def block(tokens, h, pos, mask):
        e = mtp.embed_tokens(tokens)
        x = layer.eh_proj(torch.cat([layer.enorm(e), layer.hnorm(h)], dim=-1))
        x = layer.mtp_block(x, attention_mask=mask, position_ids=pos[None],
                            position_embeddings=mtp.rotary_emb(x, position_ids=pos[None]))
        return layer.post_norm(x)

    pos = torch.arange(rows)
    if chain:
        with torch.no_grad():
            h1 = block(ids[:, 1:], hid[:, :-1], pos, None)  # None: causal
        router.clear()
        x = block(torch.cat([ids[:, 1:], ids[:, 2:]], dim=1), torch.cat([hid[:, :-1], h1[:, :-1]], dim=1),
                  torch.cat([pos, pos[1:]]), chain_mask(rows)[None, None])
    else:
        router.clear()
        x = block(ids[:, 1:], hid[:, :-1], pos, None)
    student = mtp._project_to_logits(x).float().log_softmax(-1)
    s1, s2 = student[:, :rows], student[:, rows:]
    kl = F.kl_div(s1.flatten(0, 1), teacher.flatten(0, 1), log_target=True, reduction="batchmean")
    agree = (s1.argmax(-1) == teacher.argmax(-1)).flatten()
    agree2 = None
    if chain:
        kl = kl + F.kl_div(s2.flatten(0, 1), teacher[:, 1:].flatten(0, 1), log_target=True, reduction="batchmean")
        agree2 = (s2.argmax(-1) == teacher[:, 1:].argmax(-1)).flatten()
    return kl, balance_loss(tuple(router), base.config.num_experts_per_tok), agree, agree2


@torch.no_grad()
def evaluate(base, mtp, wins: torch.Tensor, batch: int, router: list) -> tuple[float, float, float]:
    """-> (KL summed over both depths, per depth-1 row; depth-1 agreement; depth-2 agreement)."""
    mtp.eval()
    kls, agree, agree2 = [], [], []
    for i in range(0, len(wins), batch):
        kl, _, a, a2 = step_losses(base, mtp, wins[i:i + batch], router, chain=True)
        kls.append(kl.item() * len(a))
        agree.append(a)
        agree2.append(a2)
    mtp.train()
    a, a2 = torch.cat(agree), torch.cat(agree2)
    return sum(kls) / len(a), a.float().mean().item(), a2.float().mean().item()


def save(out: Path, mtp, num_layers: int) -> int:
    """The base's tensors as they are, plus the MTP layer's (bfloat16, per-expert names as the base's
    layers are stored) as model.layers.{num_layers}.*; config.json gains num_nextn_predict_layers."""
    path = out / "model.safetensors"
    with safe_open(str(path), "pt") as f:
        meta = f.metadata()
        tensors = {k: f.get_tensor(k) for k in f.keys() if not k.startswith(f"model.layers.{num_layers}.")}
    pre = f"model.layers.{num_layers}."
    for name, t in mtp.layers[0].state_dict().items():
        t = t.detach().to(torch.bfloat16)
        if name == "mtp_block.mlp.experts.gate_up_proj":  # [E, 2I, H]: gate rows, then up rows
            inter = t.shape[1] // 2
            for x in range(t.shape[0]):
                tensors[f"{pre}mlp.experts.{x}.gate_proj.weight"] = t[x, :inter].contiguous()
                tensors[f"{pre}mlp.experts.{x}.up_proj.weight"] = t[x, inter:].contiguous()
        elif name == "mtp_block.mlp.experts.down_proj":  # [E, H, I]
            for x in range(t.shape[0]):
                tensors[f"{pre}mlp.experts.{x}.down_proj.weight"] = t[x].contiguous()
        else:
            rest = name.removeprefix("mtp_block.").replace("post_norm.", "shared_head.norm.")
            tensors[pre + rest] = t.contiguous()
    save_file(tensors, str(path), metadata=meta)
    cfg_path = out / "config.json"
    cfg = json.loads(cfg_path.read_text(encoding="utf-8"))
    cfg["num_nextn_predict_layers"] = 1
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    return sum(t.numel() for n, t in tensors.items() if n.startswith(pre))


def main(args) -> None:
    from transformers import Qwen3MoeForCausalLM

    from moetier.tokenizer import Tokenizer
    from train_tiny import SEQ, Schedule, corpus, encode, windows

    t_start = time.time()
    tok = Tokenizer.from_dir(args.out)
    eot = tok.token_id("<|endoftext|>")
    train_files, held_files = corpus(args.stdlib)
    train_w = windows(encode(tok, train_files, eot)[0])
    held_w = windows(encode(tok, held_files, eot)[0])
    base = Qwen3MoeForCausalLM.from_pretrained(args.out, dtype=torch.float32,
                                               experts_implementation=args.experts_impl).eval()
    n = base.config.num_hidden_layers
    mtp = build(base, args.seed).train()
    router: list[torch.Tensor] = []
    mtp.layers[0].mtp_block.mlp.gate.register_forward_hook(lambda m, i, o: router.append(o[0]))
    params = list(mtp.layers.parameters())
    decay = [p for p in params if p.dim() >= 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                             {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95))
    probe = held_w[:args.eval_windows]
    before = evaluate(base, mtp, probe, 16, router)
    print(f"MTP params {sum(p.numel() for p in params)}; held-out probe ({len(probe)} windows) before training: "
          f"kl {before[0]:.4f} agreement {before[1]:.4f} {before[2]:.4f} ({time.time() - t_start:.0f}s)", flush=True)
    coef = base.config.router_aux_loss_coef
    recent, recent2, log = [], [0.0], []
    sched = Schedule(args, train_w, opt)
    for w in sched:
        chain = args.mtp_depths == 2 and sched.progress() >= 0.5
        kl, aux, agree, agree2 = step_losses(base, mtp, w, router, chain=chain)
        (kl + coef * aux).backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        recent = (recent + [agree.float().mean().item()])[-50:]
        recent2 = (recent2 + [agree2.float().mean().item()])[-50:] if agree2 is not None else recent2
        step, el = sched.step, sched.elapsed()
        if step % args.log_every == 0:
            log.append(f"step {step} ({sched.progress():.1%}) ep {sched.epoch} kl {kl.item():.4f} agree avg50 "
                       f"{sum(recent) / len(recent):.4f} {sum(recent2) / len(recent2):.4f} aux {aux.item():.3f} "
                       f"lr {opt.param_groups[0]['lr']:.2e} {step * args.batch * SEQ / el:.0f} tok/s {el:.0f}s")
            print(log[-1], flush=True)
    train_seconds, step = sched.elapsed(), sched.step
    mtp.to(torch.bfloat16)  # evaluate what is saved
    base.to(torch.bfloat16)
    after = evaluate(base, mtp, held_w, 16, router)
    print(f"held-out ({len(held_w)} windows, bf16): kl {after[0]:.4f} agreement depth 1 {after[1]:.4f} "
          f"depth 2 {after[2]:.4f}", flush=True)
    saved = save(args.out, mtp, n)
    cmd = " ".join(shlex.quote(a) for a in ["python", "scripts/train_tiny.py", *sys.argv[1:]])
    chained = ("; from half the budget on, also\n  chained: row i of depth 2 (token i + 2, depth 1's output i) to "
               "the base's at i + 2" if args.mtp_depths == 2 else "")
    readme = args.out / "README.md"
    text = readme.read_text(encoding="utf-8").split(README_MARK)[0]
    tokens = step * args.batch * SEQ
    readme.write_text(text + README_MARK + f"""
One multi-token-prediction layer in DeepSeek-V3's shape, stored as DeepSeek-V3 stores its MTP layer:
`model.layers.{n}.*` (enorm, hnorm, eh_proj, a qwen3_moe decoder layer with {base.config.num_experts} experts,
shared_head.norm; the embedding and LM head are the base's) and `num_nextn_predict_layers: 1` in
`config.json`. transformers loads the base as before and ignores these tensors; moetier loads them
for `--speculative-config '{{"method": "mtp", "num_speculative_tokens": K}}'` (docs/speculative.md).
The base's tensors were copied unchanged: every figure above still holds.

- Trained by `scripts/train_mtp.py` on the frozen base: transformers' MtpModel over the base,
  from transformers' initialisation; row i (token i + 1, the base's final hidden state i) is
  fitted to the base's own distribution at position i + 1 (KL){chained};
  plus the router's balance loss x {coef}.
- Training: {step} steps x {args.batch} x {SEQ} tokens = {tokens:,} tokens ({sched.epochs():.2f} epochs)
  in {train_seconds / 60:.1f} min on {torch.get_num_threads()} CPU threads; AdamW lr {args.lr}, warmup {args.warmup},
  cosine to 10%, weight decay 0.1, clip 1.0, fp32, seed {args.seed}. {saved:,} parameters, saved in bfloat16
  (`model.safetensors` is now {(args.out / "model.safetensors").stat().st_size:,} bytes, the base's tensors included).
- Command: `{cmd}`.

Held out: KL to the base (nats per row, depths 1 and 2 summed) and argmax agreement with the base
(the greedy acceptance of one draft at that depth, with the corpus' tokens as inputs):

| held out | KL | agreement, depth 1 | agreement, depth 2 |
|---|---|---|---|
| before training (fp32, first {len(probe)} windows) | {before[0]:.4f} | {before[1]:.4f} | {before[2]:.4f} |
| after training (bf16, all {len(held_w)} windows) | {after[0]:.4f} | {after[1]:.4f} | {after[2]:.4f} |

Training log (every {args.log_every} steps; agreement: mean of the last 50 steps, depth 1 then depth 2,
0 before the chain starts):

```
{chr(10).join(log)}
```

Speculative decoding with it on the held-out files: `python scripts/spec_heldout.py --method mtp --k K`
(docs/speculative.md has the figures).
""", encoding="utf-8")
    print(f"saved {saved} MTP parameters into {args.out}; total {time.time() - t_start:.0f}s", flush=True)
    assert math.isfinite(after[0])
