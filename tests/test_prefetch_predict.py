"""The scoring of scripts/prefetch_predict.py (docs/prefetch.md's figures): recall and precision of
named experts, what the engine's slot cache holds before each token, the misses a prediction names and
a prefetch's effect, on hand-made routing whose answers are counted by hand (LRU, one token a step)."""

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


def test_the_cache_holds_what_it_last_used_and_misses_are_scored_against_it():
    ids = torch.tensor([[0, 1], [2, 0], [3, 1], [0, 2]])
    held, left, filled = pp.cache_run(ids, 4, slots=3, policy="lru", start=2)
    # token 2 misses 3 and evicts 0 (0 and 2 were last used together: the lower slot goes first);
    # token 3 then misses 0 (2 is held)
    assert held == [{0, 1, 2}, {1, 2, 3}]
    assert (left, filled) == (1.0, 1.0)  # one miss a token, each one a fill
    pred = torch.tensor([[3, 4], [0, 6]])
    recall, vain = pp.miss_scores(pred, ids[2:], held)
    assert recall == 1.0  # 3, then 0: every miss named
    assert vain == (1 + 1) / 2  # 4 at token 2, 6 at token 3


def test_a_prefetch_fills_its_rows_before_the_token_routes():
    ids = torch.tensor([[0, 1], [2, 3], [0, 2]])
    # 2 slots; token 1 takes in 2 first (evicting 0, the lower slot of the two used together), then
    # routes 2 (hit) and 3 (a miss, evicting 1); token 2 takes in 0 (a fill, evicting 2: 2 and 3 were
    # used together, 2 in the lower slot), then routes 0 (hit) and 2 (a miss)
    held, left, filled = pp.cache_run(ids, 4, slots=2, policy="lru", start=1, pred=torch.tensor([[2], [0]]))
    assert held == [{1, 2}, {0, 3}]
    assert (left, filled) == ((1 + 1) / 2, (2 + 2) / 2)
