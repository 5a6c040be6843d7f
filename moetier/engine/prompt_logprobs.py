"""Prompt log-probabilities (vLLM's `prompt_logprobs`, what `echo` and every log-likelihood score
reads), taken from the prefill step's own forward pass: the hidden states that the step computes for
its prompt positions go through the model's LM head, the same `model.logits` that gives the sampled
token's logits. No second forward pass; a chunked prefill scores each chunk in its own step.

Position j's logits predict prompt token j + 1, so a chunk that starts at `start` scores tokens
start + 1 ... (step.SeqStep.prompt_targets names them). The prompt's last position predicts the first
output token, which is sampled, not scored: a decode step never has anything to score, and graph
replays (one-token steps that sample) never reach this code.
"""

from __future__ import annotations

import torch

from moetier.engine.step import PromptLogprob, SeqStep
from moetier.layers.sampler import token_logprobs

# positions whose logits exist at once: [PIECE, V] float32 (600 MiB at a vocabulary of 152k), so a
# prefill chunk of 8k tokens never holds all its logits together
PIECE = 1024


def prompt_logprobs(model, hidden: torch.Tensor, query_start: list[int], seqs: list[SeqStep]
                    ) -> dict[str, tuple[int, list[PromptLogprob]]]:
    """hidden [N, H]: the step's last hidden states, sequence i's rows from query_start[i].
    -> request id -> (position of the first token scored, [(logprob, rank, [(alternative id, logprob)])])
    for the sequences with prompt targets; {} (no work, no host read) when none has any.
    NOTE: one host read for the whole step, only in steps that score a prompt."""
    asking = [(i, s) for i, s in enumerate(seqs) if s.prompt_targets]
    if not asking:
        return {}
    dev = hidden.device
    rows = torch.tensor([query_start[i] + j for i, s in asking for j in range(len(s.prompt_targets))], device=dev)
    targets = torch.tensor([t for _, s in asking for t in s.prompt_targets], device=dev)
    k = max(s.params.prompt_logprobs for _, s in asking)
    parts = []
    for a in range(0, len(rows), PIECE):
        logits = model.logits(hidden[rows[a:a + PIECE]])
        tg = targets[a:a + PIECE]
        chosen, top, top_ids = token_logprobs(logits, tg, k)
        # rank 1: the most likely token; log-softmax keeps each row's order, so the logits rank it
        rank = (logits > logits.gather(1, tg[:, None])).sum(1) + 1
        parts.append(torch.cat([chosen.double()[:, None], rank.double()[:, None], top.double(),
                                top_ids.double()], 1))
    host = torch.cat(parts).tolist()
    out, r = {}, 0
    for _, s in asking:
        n, want = len(s.prompt_targets), s.params.prompt_logprobs
        out[s.request_id] = (s.start + 1, [
            (row[0], int(row[1]), [(int(i), v) for v, i in zip(row[2:2 + want], row[2 + k:2 + k + want])])
            for row in host[r:r + n]])
        r += n
    return out
