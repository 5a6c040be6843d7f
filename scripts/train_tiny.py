#!/usr/bin/env python3
"""Train a tiny qwen3_moe on the Python standard library, on CPU, for a wall-clock budget.

A dev tool, not part of the engine: it uses transformers' Qwen3MoeForCausalLM so the checkpoint is
exactly what transformers writes, and moetier's built-in tokenizer so no tokenizer download is needed.

    python scripts/train_tiny.py --out moetier/assets/tiny-stdlib --minutes 13
    python scripts/train_tiny.py --bench          # tokens/s of each experts implementation, then exit
    python scripts/train_tiny.py --mtp --minutes 5 --lr 1e-3   # the MTP layer on the frozen base (train_mtp.py)
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import sys
import sysconfig
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # works from a checkout without installing
from moetier.tokenizer import Tokenizer  # noqa: E402
from moetier.tokenizer.synthetic import write_tokenizer  # noqa: E402

# Test suites and IDLE are skipped (not library code); encodings/ is skipped because it is mostly
# gencodec-generated mapping tables that would spend a sixth of the budget on '\x80' lines.
SKIP_DIRS = {"test", "tests", "idle_test", "idlelib", "encodings", "site-packages", "__pycache__"}
MAX_FILE_BYTES = 200_000
HELD_OUT_EVERY = 50
SEQ = 256

MODEL = dict(
    vocab_size=448, hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=2, head_dim=32, moe_intermediate_size=64, num_experts=32, num_experts_per_tok=4,
    norm_topk_prob=True, tie_word_embeddings=True, max_position_embeddings=4096, rms_norm_eps=1e-6,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, decoder_sparse_step=1,
    mlp_only_layers=[], output_router_logits=True, router_aux_loss_coef=0.01,
)


def corpus(root: Path) -> tuple[list[Path], list[Path]]:
    files = [p for p in sorted(root.rglob("*.py"))
             if not SKIP_DIRS & set(p.relative_to(root).parts[:-1]) and p.stat().st_size <= MAX_FILE_BYTES]
    held = [p for i, p in enumerate(files) if i % HELD_OUT_EVERY == 0]
    return [p for i, p in enumerate(files) if i % HELD_OUT_EVERY != 0], held


def encode(tok: Tokenizer, files: list[Path], sep: int) -> tuple[torch.Tensor, int]:
    ids: list[int] = []
    nbytes = 0
    for p in files:
        text = p.read_text(encoding="utf-8", errors="replace")
        nbytes += len(text.encode("utf-8"))
        ids += tok.encode(text) + [sep]  # the separator teaches the model where a file ends
    return torch.tensor(ids, dtype=torch.long), nbytes


def windows(stream: torch.Tensor) -> torch.Tensor:
    n = (len(stream) - 1) // SEQ
    return torch.stack([stream[i * SEQ: i * SEQ + SEQ + 1] for i in range(n)])


def balance_loss(router_logits: tuple[torch.Tensor, ...], k: int) -> torch.Tensor:
    # Switch-style f.P per layer, averaged. transformers' load_balancing_loss_func sums the counts of
    # expert e over all layers before balancing, so one layer could collapse while another compensates;
    # routing traces need every layer balanced on its own.
    losses = []
    for logits in router_logits:
        probs = logits.float().softmax(-1)
        picked = F.one_hot(probs.topk(k, -1).indices, probs.shape[-1]).sum(1).float()
        losses.append(probs.shape[-1] * (picked.mean(0) / k * probs.mean(0)).sum())
    return torch.stack(losses).mean()


@torch.no_grad()
def evaluate(model, wins: torch.Tensor, batch: int, k: int) -> tuple[float, list[torch.Tensor]]:
    model.eval()
    total, count = 0.0, 0
    loads = [torch.zeros(model.config.num_experts) for _ in range(model.config.num_hidden_layers)]
    for i in range(0, len(wins), batch):
        w = wins[i:i + batch]
        out = model(input_ids=w[:, :-1], output_router_logits=True)
        total += F.cross_entropy(out.logits.float().flatten(0, 1), w[:, 1:].flatten(), reduction="sum").item()
        count += w[:, 1:].numel()
        for load, logits in zip(loads, out.router_logits):
            load += torch.bincount(logits.topk(k, -1).indices.flatten(), minlength=len(load)).float()
    model.train()
    return total / count, [load / load.sum() for load in loads]


def make_model(impl: str, seed: int, **overrides):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
    torch.manual_seed(seed)
    cfg = Qwen3MoeConfig(**{**MODEL, **overrides}, experts_implementation=impl, attn_implementation="sdpa")
    return Qwen3MoeForCausalLM(cfg)


def bench(batch: int) -> None:
    # On a 2-core Xeon (torch 2.13 CPU, batch 16): grouped_mm ~10-12k tok/s, eager ~9k, batched_mm ~0.1k
    # (it runs every expert on every token); bf16 autocast was no faster, so training stays in fp32.
    x = torch.randint(0, MODEL["vocab_size"], (batch, SEQ + 1))
    for impl in ("eager", "grouped_mm", "batched_mm"):
        model = make_model(impl, 0)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        for step in range(6):
            if step == 2:  # the first steps pay for allocation and lazy init
                t0 = time.time()
            out = model(input_ids=x[:, :-1], labels=x[:, 1:])
            out.loss.backward()
            opt.step()
            opt.zero_grad()
        print(f"{impl:12s} {4 * batch * SEQ / (time.time() - t0):8.0f} tok/s", flush=True)


def lr_at(step: int, progress: float, peak: float, warmup: int) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))  # floor at 10% of peak


class Schedule:
    """The training loop's clock and data: iterating yields batches of windows [B, SEQ + 1] in a fresh
    random order each epoch, with every optimizer group's lr set for the step (lr_at) and `step`
    already counting it, until the budget is spent (--steps, or --minutes of wall-clock time).

    With a time budget the cosine runs on elapsed time rather than steps: this 2-core machine is shared,
    and in a trial steps ran 10x slower for a minute while another job held the cores, which would make
    a step count fixed from early timings overrun the budget by as much."""

    def __init__(self, args, wins: torch.Tensor, opt: torch.optim.Optimizer):
        self.args, self.wins, self.opt = args, wins, opt
        self.gen = torch.Generator().manual_seed(args.seed)
        self.order, self.pos, self.epoch, self.step = torch.randperm(len(wins), generator=self.gen), 0, 0, 0
        self.t0 = time.time()

    def progress(self) -> float:
        a = self.args
        return self.step / a.steps if a.steps else (time.time() - self.t0) / (a.minutes * 60)

    def elapsed(self) -> float:
        return time.time() - self.t0

    def epochs(self) -> float:
        return self.epoch + self.pos / len(self.order)

    def __iter__(self):
        a = self.args
        self.t0 = time.time()
        while self.progress() < 1.0:
            if self.pos + a.batch > len(self.order):
                self.order, self.pos = torch.randperm(len(self.wins), generator=self.gen), 0
                self.epoch += 1
            w = self.wins[self.order[self.pos:self.pos + a.batch]]
            self.pos += a.batch
            for g in self.opt.param_groups:
                g["lr"] = lr_at(self.step, self.progress(), a.lr, a.warmup)
            self.step += 1
            yield w


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=Path("moetier/assets/tiny-stdlib"))
    ap.add_argument("--stdlib", type=Path, default=Path(sysconfig.get_paths()["stdlib"]))
    ap.add_argument("--minutes", type=float, default=12.0, help="training wall-clock budget")
    ap.add_argument("--steps", type=int, help="fixed step count and a step-based schedule (overrides --minutes)")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--log-every", type=int, default=25)
    ap.add_argument("--experts-impl", default="grouped_mm", choices=["eager", "grouped_mm", "batched_mm"])
    ap.add_argument("--bench", action="store_true")
    ap.add_argument("--mtp", action="store_true",
                    help="train only an MTP layer on the frozen model in --out and add it there (train_mtp.py)")
    ap.add_argument("--mtp-depths", type=int, choices=[1, 2], default=2,
                    help="--mtp: train the layer alone (1) or also chained on its own output (2, as it drafts for k > 1)")
    ap.add_argument("--eval-windows", type=int, default=64, help="--mtp: held-out windows probed before training")
    ap.add_argument("--threads", type=int, default=2,
                    help="CPU threads; 1 where other jobs share the cores (two threads on two busy cores ran about 20x slower)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.bench:
        return bench(args.batch)
    if args.mtp:
        import train_mtp
        return train_mtp.main(args)

    t_start = time.time()
    args.out.mkdir(parents=True, exist_ok=True)
    write_tokenizer(args.out)
    tok = Tokenizer.from_dir(args.out)
    eot, im_end = tok.token_id("<|endoftext|>"), tok.token_id("<|im_end|>")
    assert tok.vocab_size == MODEL["vocab_size"], (tok.vocab_size, MODEL["vocab_size"])
    train_files, held_files = corpus(args.stdlib)
    (args.out / "held_out.txt").write_text(
        "".join(f"{p.relative_to(args.stdlib)}\n" for p in held_files), encoding="utf-8")
    train_stream, train_bytes = encode(tok, train_files, eot)
    held_stream, held_bytes = encode(tok, held_files, eot)
    train_w, held_w = windows(train_stream), windows(held_stream)
    train_probe = train_w[torch.randperm(len(train_w), generator=torch.Generator().manual_seed(1))[:len(held_w)]]
    print(f"corpus: {len(train_files)} train files {train_bytes} B {len(train_stream)} tok, "
          f"{len(held_files)} held-out files {held_bytes} B {len(held_stream)} tok "
          f"({time.time() - t_start:.0f}s)", flush=True)

    model = make_model(args.experts_impl, args.seed, eos_token_id=im_end, pad_token_id=eot, bos_token_id=None)
    k, coef = model.config.num_experts_per_tok, model.config.router_aux_loss_coef
    n_params = sum(p.numel() for p in model.parameters())
    print(f"params {n_params}, experts impl {model.config._experts_implementation}", flush=True)
    decay = [p for p in model.parameters() if p.dim() >= 2]  # no decay on norm gains
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                             {"params": [p for p in model.parameters() if p.dim() < 2], "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95))
    recent: list[float] = []
    sched = Schedule(args, train_w, opt)
    for w in sched:
        out = model(input_ids=w[:, :-1], output_router_logits=True)
        ce = F.cross_entropy(out.logits.float().flatten(0, 1), w[:, 1:].flatten())
        aux = balance_loss(out.router_logits, k)
        (ce + coef * aux).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        recent = (recent + [ce.item()])[-50:]
        step, el = sched.step, sched.elapsed()
        if step % args.log_every == 0:
            print(f"step {step} ({sched.progress():.1%}) ep {sched.epoch} ce {ce.item():.4f} avg50 {sum(recent) / len(recent):.4f} "
                  f"aux {aux.item():.3f} lr {opt.param_groups[0]['lr']:.2e} "
                  f"{step * args.batch * SEQ / el:.0f} tok/s {el:.0f}s", flush=True)
    train_seconds, step = sched.elapsed(), sched.step
    tokens = step * args.batch * SEQ

    held_fp32, _ = evaluate(model, held_w, 32, k)
    model.to(torch.bfloat16)  # evaluate what is saved, not the fp32 master weights
    held_bf16, loads = evaluate(model, held_w, 32, k)
    train_bf16, _ = evaluate(model, train_probe, 32, k)
    bpb = lambda nats, n_tok, n_b: nats * n_tok / n_b / math.log(2)  # noqa: E731
    print(f"held-out ce fp32 {held_fp32:.4f} bf16 {held_bf16:.4f}; train-probe ce bf16 {train_bf16:.4f}", flush=True)

    model.save_pretrained(args.out, max_shard_size="50MB")  # one file; the generation_config it writes is replaced
    (args.out / "generation_config.json").write_text(
        json.dumps({"eos_token_id": [im_end, eot], "pad_token_id": eot, "do_sample": False}, indent=2) + "\n")
    weights = sum(f.stat().st_size for f in args.out.glob("*.safetensors"))
    cmd = " ".join(shlex.quote(a) for a in ["python", "scripts/train_tiny.py", *sys.argv[1:]])
    load_rows = "\n".join(f"| {i} | {l.min().item() * len(l):.2f} | {l.max().item() * len(l):.2f} |"
                          for i, l in enumerate(loads))
    cfg_json = json.dumps({k_: v for k_, v in MODEL.items()}, indent=1)
    (args.out / "README.md").write_text(f"""# tiny-stdlib

A {n_params:,}-parameter `qwen3_moe` ({MODEL['num_experts']} experts, top-{k} per layer) trained from
scratch by `scripts/train_tiny.py` on the Python {sys.version.split()[0]} standard library sources.
Sample generations and a judgement of them: `docs/tiny-stdlib.md` in the moetier repository.

- Corpus: `{args.stdlib}/**/*.py`, sorted, minus directories {sorted(SKIP_DIRS)} and files over
  {MAX_FILE_BYTES} bytes; every {HELD_OUT_EVERY}th file is held out (listed in `held_out.txt`).
  Train: {len(train_files)} files, {train_bytes:,} bytes, {len(train_stream):,} tokens.
  Held out: {len(held_files)} files, {held_bytes:,} bytes, {len(held_stream):,} tokens.
- Tokenizer: moetier's built-in byte-level BPE (`moetier.tokenizer.synthetic.write_tokenizer`), {tok.vocab_size} ids;
  files are joined with `<|endoftext|>`.
- Training: {step} steps x {args.batch} x {SEQ} tokens = {tokens:,} tokens ({tokens / len(train_stream):.2f}
  epochs) in {train_seconds / 60:.1f} min on {torch.get_num_threads()} CPU threads; AdamW lr {args.lr}, warmup
  {args.warmup}, cosine to 10%, weight decay 0.1, clip 1.0, per-layer load-balancing loss x {coef},
  experts implementation `{args.experts_impl}`, fp32, seed {args.seed}. Saved in bfloat16.
- Command: `{cmd}`. {"" if args.steps else f"The schedule followed wall-clock time, so a rerun differs in step count; `--steps {step}` runs the same number of steps on a step-based schedule of the same shape."}

| loss (nats/token, bf16 weights) | value | bits/byte |
|---|---|---|
| held out | {held_bf16:.4f} | {bpb(held_bf16, len(held_stream), held_bytes):.3f} |
| train (sample of {len(train_probe)} seen windows) | {train_bf16:.4f} | {bpb(train_bf16, len(train_stream), train_bytes):.3f} |
| train, mean of last 50 steps (fp32) | {sum(recent) / len(recent):.4f} | |
| held out, fp32 weights before saving | {held_fp32:.4f} | |

Expert load on the held-out set, as a multiple of uniform (1.00 = 1/{MODEL['num_experts']} of the picks):

| layer | least used | most used |
|---|---|---|
{load_rows}

Weights: {weights:,} bytes. Config:

```json
{cfg_json}
```
""", encoding="utf-8")
    print(f"saved {args.out}: {weights} bytes of weights; total {time.time() - t_start:.0f}s", flush=True)


if __name__ == "__main__":
    main()
