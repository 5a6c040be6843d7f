"""engine/graphs.PageRows, the decode graph's host page table written incrementally, driven on the CPU
through steps in which requests join, grow a page, leave, are preempted (a new page list for the same
request) and arrive as unpickled copies (a worker rank): after every step the table must equal the
table written from scratch, padding rows on the scratch page."""

from __future__ import annotations

import pickle
import random

import numpy as np

from moetier.engine.graphs import PageRows

SCRATCH, WIDTH, ROWS = 99, 12, 6


def from_scratch(seq_pages: list[list[int]]) -> np.ndarray:
    t = np.full((ROWS, WIDTH), SCRATCH, dtype=np.int32)
    for i, pages in enumerate(seq_pages):
        t[i, :len(pages)] = pages
    return t


def test_page_rows_equal_a_table_written_from_scratch():
    rng = random.Random(0)
    table = np.zeros((ROWS, WIDTH), dtype=np.int32)
    rows = PageRows(table, SCRATCH)
    assert (table == SCRATCH).all()
    running: list[list[int]] = []  # each request's live page list, in batch order
    next_page = 0
    kinds = set()
    for _ in range(400):
        op = rng.random()
        if op < 0.2 and len(running) < ROWS:  # a request joins (anywhere in the batch order)
            running.insert(rng.randrange(len(running) + 1), list(range(next_page, next_page + rng.randint(1, 4))))
            next_page += 4
            kinds.add("join")
        elif op < 0.35 and running:  # one finishes
            running.pop(rng.randrange(len(running)))
            kinds.add("leave")
        elif op < 0.45 and running:  # one is preempted and comes back: a new list, other pages
            i = rng.randrange(len(running))
            running[i] = list(range(next_page, next_page + len(running[i])))
            next_page += WIDTH
            kinds.add("preempt")
        for pages in running:  # decode: some rows cross into a new page, in place
            if len(pages) < WIDTH and rng.random() < 0.3:
                pages += [next_page]
                next_page += 1
                kinds.add("grow")
        step = pickle.loads(pickle.dumps(running)) if rng.random() < 0.1 else running  # a worker's copy
        rows.write(step)
        assert (table == from_scratch(running)).all()
    assert kinds == {"join", "leave", "preempt", "grow"}
    rows.write([])
    assert (table == SCRATCH).all()
