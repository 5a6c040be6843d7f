"""Write the shipped offline evaluation tasks of the embedded model (moetier/eval/tasks/tiny_stdlib):
lm-eval task YAMLs over local JSON-lines files, cut from the 11 standard-library files that the model
was held out from (moetier/assets/tiny-stdlib/held_out.txt; scripts/train_tiny.py never trained on
them).

    python scripts/make_eval_tasks.py [--stdlib /root/.pyenv/versions/3.11.7/lib/python3.11]

- next_line.jsonl: a file's preceding lines (whole lines; with the target line at most CONTEXT
  tokens) and the next line's newline and indentation but its last space; the target is the rest
  of that line, from that space (greedy, exact match). The cut falls where the tokenizer splits the
  text (`\n       ` then ` return`), so the prompt's tokens are those of the file.
- choose_line.jsonl: the same contexts; four choices, the true line and three other lines of the
  same file with the same indentation (log-likelihood, accuracy).
- perplexity.jsonl: each held-out file whole (rolling log-likelihood: lm-eval's windows).

Deterministic (a seeded random.Random): rerunning writes the same files. CONTEXT keeps every
prompt inside the 256-token windows the model was trained on.
"""

from __future__ import annotations

import argparse
import json
import random
import sysconfig
from pathlib import Path

from moetier.default_model import default_model_dir
from moetier.tokenizer import Tokenizer

OUT = Path(__file__).parents[1] / "moetier" / "eval" / "tasks" / "tiny_stdlib"
CONTEXT = 192  # tokens of context at most (the model was trained on windows of 256)
DOCS = 200  # documents per line task
SEED = 0


def line_docs(files: dict[str, str], tok: Tokenizer, rng: random.Random) -> list[dict]:
    """Candidate (context, line) pairs over every file, then DOCS of them drawn at random."""
    cands = []
    for name, text in files.items():
        lines = text.split("\n")
        by_indent: dict[str, list[str]] = {}
        for line in lines:
            if line.strip():
                by_indent.setdefault(indent_of(line), []).append(line.strip())
        for i, line in enumerate(lines):
            body = line.strip()
            if i < 4 or len(body) < 4:
                continue
            others = sorted(set(by_indent[indent_of(line)]) - {body})
            if len(others) < 3:
                continue
            cands.append((name, lines, i, others))
    docs = []
    for name, lines, i, others in rng.sample(cands, DOCS):
        ctx_lines = []
        for prev in reversed(lines[:i]):  # whole lines back from the target, while they fit
            if len(tok.encode("\n".join([prev] + ctx_lines) + "\n" + lines[i])) > CONTEXT:
                break
            ctx_lines.insert(0, prev)
        # the context stops where the tokenizer splits the line: `\n` and the indentation but its last
        # space, which the line's first word carries (` return`), as in the training text's tokens
        indent = indent_of(lines[i])
        context = "\n".join(ctx_lines) + "\n" + indent[:-1]
        target = indent[-1:] + lines[i].strip()
        choices = [indent[-1:] + c for c in rng.sample(others, 3)] + [target]
        rng.shuffle(choices)
        docs.append({"file": name, "line": i + 1, "context": context, "target": target, "choices": choices,
                     "label": choices.index(target)})
    return docs


def indent_of(line: str) -> str:
    return line[:len(line) - len(line.lstrip())]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--stdlib", type=Path, default=Path(sysconfig.get_paths()["stdlib"]))
    args = ap.parse_args()
    model = default_model_dir()
    names = (model / "held_out.txt").read_text().split()
    files = {n: (args.stdlib / n).read_text(encoding="utf-8") for n in names}
    tok = Tokenizer.from_dir(model)
    docs = line_docs(files, tok, random.Random(SEED))
    OUT.mkdir(parents=True, exist_ok=True)
    with open(OUT / "next_line.jsonl", "w", encoding="utf-8") as f:
        for d in docs:
            f.write(json.dumps({k: d[k] for k in ("file", "line", "context", "target")}) + "\n")
    with open(OUT / "choose_line.jsonl", "w", encoding="utf-8") as f:
        for d in docs:
            f.write(json.dumps({k: d[k] for k in ("file", "line", "context", "choices", "label")}) + "\n")
    with open(OUT / "perplexity.jsonl", "w", encoding="utf-8") as f:
        for n, text in files.items():
            f.write(json.dumps({"file": n, "text": text}) + "\n")
    tokens = sum(len(tok.encode(t)) for t in files.values())
    print(f"wrote {OUT}: {len(docs)} line documents, {len(files)} files ({sum(map(len, files.values())):,} "
          f"characters, {tokens:,} tokens)")


if __name__ == "__main__":
    main()
