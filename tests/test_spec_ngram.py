"""spec/ngram.py: prompt-lookup drafting, longest suffix first, latest occurrence, padded batch."""

from __future__ import annotations

import numpy as np

from moetier.spec.ngram import propose, propose_batch


def test_the_longest_suffix_wins_then_the_latest_occurrence():
    seq = [1, 2, 3, 9, 9, 7, 2, 3, 4, 5, 6, 1, 2, 3]
    # suffix (1, 2, 3) occurs at 0: proposes what followed it there
    assert propose(seq, 3, 1, 3) == [9, 9, 7]
    # with n <= 2: (2, 3) occurs at 1 and 6; the latest (6) wins
    assert propose(seq, 3, 1, 2) == [4, 5, 6]


def test_short_matches_end_of_sequence_and_no_match():
    assert propose([5, 6, 7, 5, 6], 4, 1, 3) == [7, 5, 6]  # the run reaches the end: 3 tokens, not 4
    assert propose([1, 2, 3, 4], 2, 1, 3) == []  # 4 never occurred before
    assert propose([1, 2, 3, 4], 2, 2, 3) == []
    assert propose([8], 2) == [] and propose([], 2) == []
    assert propose([4, 4, 4], 2, 1, 1) == [4]  # the latest occurrence overlaps the suffix


def test_min_length_is_respected():
    seq = [1, 2, 9, 3, 2]  # only a 1-gram (2) recurs
    assert propose(seq, 2, 1, 3) == [9, 3]
    assert propose(seq, 2, 2, 3) == []


def test_batch_pads_and_counts():
    draft, lens = propose_batch([[1, 2, 1], [3, 4], [7, 8, 9, 7, 8]], 3, 1, 2)
    assert lens.tolist() == [2, 0, 3]  # [0]: 2, 1 follow the first 1; [2]: 9, 7, 8 follow the first (7, 8)
    assert draft.dtype == np.int64 and draft.shape == (3, 3)
    assert draft[0].tolist() == [2, 1, 0] and draft[1].tolist() == [0, 0, 0] and draft[2].tolist() == [9, 7, 8]


def test_against_a_plain_loop():
    rng = np.random.default_rng(0)
    for _ in range(200):
        seq = rng.integers(0, 4, int(rng.integers(1, 30))).tolist()
        want = []
        for n in range(min(3, len(seq) - 1), 0, -1):
            suffix = seq[len(seq) - n:]
            starts = [s for s in range(len(seq) - n) if seq[s:s + n] == suffix]
            if starts:
                want = seq[starts[-1] + n:starts[-1] + n + 4]
                break
        assert propose(seq, 4, 1, 3) == want, seq
