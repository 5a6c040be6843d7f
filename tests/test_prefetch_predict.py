"""The scoring of scripts/prefetch_predict.py (docs/prefetch.md's figures): recall and precision of
named experts, what an LRU holds before each token, and the misses a prediction names, on hand-made
routing whose answers are counted by hand."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch

spec = importlib.util.spec_from_file_location("prefetch_predict",
                                              Path(__file__).parents[1] / "scripts" / "prefetch_predict.py")
pp = importlib.util.module_from_spec(spec)
spec.loader.exec_module(pp)


def test_recall_and_precision_count_named_real_experts():
    real = torch.tensor([[0, 1], [2, 3]])
    pred = torch.tensor([[1, 5, 6, 7], [2, 3, 4, 0]])  # 1 of token 0's, both of token 1's
    assert pp.scores(pred, real) == (3 / 4, 3 / 8)


def test_lru_holds_the_most_recent_experts_and_misses_are_scored_against_it():
    ids = torch.tensor([[0, 1], [2, 0], [3, 1], [0, 2]])
    held = pp.lru_held(ids, slots=3, start=2)
    # before token 2: 1, 2, 0 used, in that order of recency; before token 3: 3 and 1 push out 2
    assert held == [{0, 1, 2}, {0, 1, 3}]
    # token 2 misses 3 (1 is held); token 3 misses 2 (0 is held)
    pred = torch.tensor([[3, 4], [5, 6]])
    recall, vain = pp.miss_scores(pred, ids[2:], held)
    assert recall == 1 / 2  # 3 named, 2 not
    assert vain == (1 + 2) / 2  # 4 at token 2; 5 and 6 at token 3


def test_prefetched_rows_enter_the_lru_before_the_token_routes():
    ids = torch.tensor([[0, 1], [2, 3], [0, 2]])
    # slots 2; token 1 takes in 2 first (0, 1 held: 0 goes), then routes 2 (hit) and 3 (miss); token 2
    # takes in 0 (a fill; 2 goes), then routes 0 (hit) and 2 (a miss: 3 and 0 are held)
    left, filled = pp.with_prefetch(ids, torch.tensor([[2], [0]]), slots=2, start=1)
    assert (left, filled) == ((1 + 1) / 2, (2 + 2) / 2)
