"""N-gram drafting (prompt lookup, vLLM's method "ngram"): a sequence's next tokens are guessed by
finding its last n tokens earlier in the sequence (prompt and output so far) and proposing what
followed them there. Works for any model; costs no forward pass. Plain CPU bookkeeping over the
scheduler's token lists (numpy, vectorised over the sequence), run between steps.

Rule: for n from prompt_lookup_max down to prompt_lookup_min, the most recent earlier occurrence of
the last n tokens wins (longest suffix first, then latest); the draft is the up to k tokens after
it (fewer where the sequence ends first). No match: no draft (k = 0 for that sequence).
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


def propose(tokens: list[int] | np.ndarray, k: int, n_min: int = 1, n_max: int = 3) -> list[int]:
    """Up to k draft tokens for one sequence."""
    t = np.asarray(tokens, dtype=np.int64)
    size = len(t)
    for n in range(min(n_max, size - 1), n_min - 1, -1):
        suffix = t[size - n:]
        # windows starting at 0 .. size - n - 1: every occurrence but the suffix itself
        windows = sliding_window_view(t[:size - 1], n)
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        if len(hits):
            start = int(hits[-1]) + n
            return t[start:start + k].tolist()
    return []


def propose_batch(sequences: list[list[int]], k: int, n_min: int = 1, n_max: int = 3
                  ) -> tuple[np.ndarray, np.ndarray]:
    """(draft [B, k] int64 padded with 0, draft_lens [B] int64), the shapes spec/verify.py takes."""
    draft = np.zeros((len(sequences), k), dtype=np.int64)
    lens = np.zeros(len(sequences), dtype=np.int64)
    for i, seq in enumerate(sequences):
        d = propose(seq, k, n_min, n_max)
        draft[i, :len(d)] = d
        lens[i] = len(d)
    return draft, lens
