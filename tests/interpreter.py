"""Runs one of the *_interpreter.py scripts in a subprocess: TRITON_INTERPRET must be set before
triton is imported, so the kernels' CPU-interpreter checks cannot share the test process.

What the interpreter can promise: the kernels' logic (indices, masks, plans, integer bookkeeping) and
their values within a tolerance. Its tl.dot is numpy's matmul on OpenBLAS, whose summation order (and
so the last bits) depends on the CPU's BLAS kernel and, under some kernels (Haswell, Zen), on a row's
position in the tile. So bit-equality is claimed here only between launches that run the very same
matmuls on the same bytes; batch invariance is tests/test_gpu.py's to show on the compiled kernels."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


def run_script(name: str) -> str:
    """-> the script's stdout; fails the calling test with its output when it exits non-zero."""
    script = Path(__file__).with_name(name)
    root = str(Path(__file__).parents[1])
    env = {**os.environ, "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}
    p = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=600, env=env)
    assert p.returncode == 0, p.stdout + p.stderr
    return p.stdout


def narrow_table(batch, num_pages: int, g):
    """batch with its page table a column view of a wider one (a decode graph's narrow context bucket,
    engine/graphs.py): rows strided by the wide table's width, the extra columns other pages."""
    import dataclasses

    import torch

    table = batch.page_table
    wide = torch.randint(0, num_pages, (table.shape[0], table.shape[1] + 3), generator=g, dtype=table.dtype)
    wide[:, :table.shape[1]] = table
    return dataclasses.replace(batch, page_table=wide[:, :table.shape[1]])


# The indexer scripts' steps over shuffled pages, (tokens before, new tokens, page table) a sequence:
# decode (one row a sequence, one sequence without a token) and verify (k + 1 = 4 rows at most, fewer
# for some, none for one)
DECODE_SEQS = [(9, 1, [3, 7, 1]), (0, 1, [0]), (13, 0, [5, 11, 4, 9]), (2, 1, [6, 8]), (6, 1, [2, 10]),
               (30, 1, [12, 13, 14, 15, 16, 17, 18, 19, 20])]
VERIFY_SEQS = [(9, 3, [3, 7, 1]), (0, 2, [0]), (13, 0, [5, 11, 4, 9]), (4, 1, [6, 8]),
               (27, 4, [12, 13, 14, 15, 16, 17, 18, 19])]


def decode_rows(seqs, page: int, row_width: int, d: int, hi: int, dtype, g, narrow: bool = False, ape: int = 0):
    """An indexer's decode inputs over make_batch(seqs), uniform in [0, 1): (index_k [pages, page,
    row_width] in dtype, kpool's position embedding [ape, d] in dtype or None, the batch (narrow:
    narrow_table's), q [N, hi, d] in dtype, w [N, hi] float32), drawn from g in that order."""
    import torch

    from moetier.layers.attention import make_batch

    num_pages = max(p for _, _, pages in seqs for p in pages) + 2
    index_k = torch.rand(num_pages, page, row_width, generator=g).to(dtype)
    pos_emb = torch.rand(ape, d, generator=g).to(dtype) if ape else None
    batch = make_batch(seqs, page, "cpu")
    if narrow:
        batch = narrow_table(batch, num_pages, g)
    n = batch.num_tokens
    return index_k, pos_emb, batch, torch.rand(n, hi, d, generator=g).to(dtype), torch.rand(n, hi, generator=g)
