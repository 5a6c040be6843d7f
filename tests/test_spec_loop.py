"""The pieces composed the way the step loop will call them (docs/speculative.md "what the lead
wires"), for one sequence on the CPU: MTP drafting (models/mtp.py, chained on its one layer) or
n-gram drafting (spec/ngram.py), verification of k + 1 tokens in one target forward, greedy
acceptance (spec/verify.py), and KV "rollback" by rewriting: rows past the accepted tokens are left
and overwritten by the next step, never read (attention reads seq_len rows). The output must equal
plain greedy decoding token for token."""

from __future__ import annotations

import torch

from moetier.layers.attention import make_batch
from moetier.spec.ngram import propose
from moetier.spec.verify import greedy_accept
from tests.test_mtp import _ours, hf_mtp_checkpoint

PAGE = 4


def _plain(model, prompt: list[int], n: int) -> list[int]:
    kv = model.kv_spec().allocate(16, PAGE, model.dtype, model.device)
    pages = list(range(kv.num_pages))
    ids, out, done = torch.tensor(prompt), [], 0
    while len(out) < n:
        hidden = model.forward(ids, make_batch([(done, len(ids), pages)], PAGE, "cpu"), kv)
        done += len(ids)
        out.append(int(model.logits(hidden[-1:]).argmax()))
        ids = torch.tensor(out[-1:])
    return out


def _speculative(model, prompt: list[int], n: int, k: int, method: str, log: list | None = None
                 ) -> tuple[list[int], int]:
    """-> (tokens, target forwards after the prefill); log: each step's drafts appended."""
    kv = model.kv_spec().allocate(16, PAGE, model.dtype, model.device)
    pages = list(range(kv.num_pages))

    def batch(start: int, count: int):
        return make_batch([(start, count, pages)], PAGE, "cpu")

    t = len(prompt)
    hidden = model.forward(torch.tensor(prompt), batch(0, t), kv)
    out = [int(model.logits(hidden[-1:]).argmax())]
    # rows the MTP layer catches up on: (token after position p, target hidden of p) for p from `base`
    base, next_ids, rows = 0, prompt[1:] + out, hidden
    steps = 0
    while len(out) < n:
        done = t + len(out) - 1  # target KV rows written and valid: every token but the last emitted
        if method == "mtp":
            logits, h = model.draft(torch.tensor(next_ids), rows, batch(base, len(next_ids)), kv)
            draft = [int(logits[-1].argmax())]
            for j in range(1, k):  # chained on the one MTP layer, one position on (its row rewritten later)
                logits, h = model.draft(torch.tensor(draft[-1:]), h[-1:], batch(done + j, 1), kv, depth=j)
                draft.append(int(logits[-1].argmax()))
        else:
            draft = propose(prompt + out, k, 1, 3)
        if log is not None:
            log.append(list(draft))
        # fixed shape: k + 1 tokens verified whatever the draft's length; padding rows write KV rows that
        # the next step overwrites before anything reads them
        padded = draft + [0] * (k - len(draft))
        hidden = model.forward(torch.tensor(out[-1:] + padded), batch(done, k + 1), kv)
        steps += 1
        accepted, tokens = greedy_accept(torch.tensor([padded]), torch.tensor([len(draft)]),
                                         model.logits(hidden)[None])
        a = int(accepted[0])
        emitted = tokens[0, :a + 1].tolist()
        out += emitted
        base, next_ids, rows = done, emitted, hidden[:a + 1]
    return out[:n], steps


def test_mtp_and_ngram_speculation_equal_plain_greedy(tmp_path):
    path, _, _ = hf_mtp_checkpoint(tmp_path / "m", "tiny-dsv3", 11)
    model = _ours(path)
    prompt = torch.randint(0, 512, (9,), generator=torch.Generator().manual_seed(11)).tolist()
    n = 24
    want = _plain(model, prompt, n)
    for k in (1, 3):
        got, _ = _speculative(model, prompt, n, k, "mtp")
        assert got == want, k
    # n-gram drafts: greedy on random weights falls into runs (189 189 189 ...), so drafts are kept and
    # the loop takes fewer target steps than tokens (random MTP weights keep none: no such check there)
    loop = prompt[:4] * 4
    want = _plain(model, loop, n)
    got, steps = _speculative(model, loop, n, 3, "ngram")
    assert got == want
    assert steps <= n - 5  # 23 tokens after the prefill's in 19 target steps at this seed
