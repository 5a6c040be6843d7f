"""The host KV tier's page-copy kernel (layers/page_copy_triton.py) in Triton's interpreter against the
torch copy along runs (engine/kv_moves.KVMoves._copy, the CPU path): scattered pages both ways, a
device page evicted to the host and refilled from another host slot in the same step, pages whose
bytes take int32, int16 or single-byte words. Run as a script (TRITON_INTERPRET must be set before
triton is imported); test_kv_host_tier.py does that in a subprocess."""

from __future__ import annotations

import os
import random

os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402

from moetier.engine.kv_moves import KVMoves  # noqa: E402
from moetier.engine.step import StepInput  # noqa: E402
from moetier.layers.page_copy_triton import copy_pages, word_dtype, word_rows  # noqa: E402


class Pages:
    """Just enough of a KV cache for KVMoves: page tensors [rows, pages, page_size, ...] and layer rows."""

    def __init__(self, tensors: list[torch.Tensor], rows: dict[int, list[tuple[int, int]]]):
        self.tensors, self.rows = tensors, rows

    def page_tensors(self) -> list[torch.Tensor]:
        return self.tensors

    def layer_rows(self) -> dict[int, list[tuple[int, int]]]:
        return self.rows


def kernel_copy(moves: KVMoves, step: StepInput) -> None:
    """What KVMoves._copy_cuda launches, on CPU tensors: per row one kernel up, one down."""
    up = torch.tensor(step.copies_to_host, dtype=torch.int32).reshape(-1, 2).t().contiguous()
    down = torch.tensor(step.copies_to_gpu, dtype=torch.int32).reshape(-1, 2).t().contiguous()
    for rows in word_rows(moves.device_tensors, moves.host, moves.rows).values():
        for d, h, words in rows:
            copy_pages(d, h, up[0], up[1], words)
            copy_pages(h, d, down[0], down[1], words)


def case(shapes: list[tuple[tuple[int, ...], torch.dtype]], pages: int, slots: int, seed: int) -> str:
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)

    def filled(shape, dtype):
        return torch.randint(-120, 120, shape, generator=g, dtype=torch.int16).to(dtype)

    def make():
        g.manual_seed(seed)
        tensors = [filled((layers, pages, *page), dtype) for (layers, *page), dtype in shapes]
        rows = {}
        for t, ((layers, *_), _) in enumerate(shapes):
            for r in range(layers):
                rows.setdefault(r, []).append((t, r))
        moves = KVMoves(Pages(tensors, rows), host_slots=slots)
        for h in moves.host:
            h.copy_(filled(h.shape, h.dtype))
        return moves

    want, got = make(), make()
    evicted = rng.sample(range(pages), pages // 3)  # scattered device pages to scattered host slots
    up = list(zip(evicted, rng.sample(range(slots), len(evicted))))
    free = [s for s in range(slots) if s not in {s for _, s in up}]
    # hits: into some of the evicted pages (the same step reuses them) and into others
    targets = evicted[: len(evicted) // 2] + rng.sample([p for p in range(pages) if p not in evicted], 3)
    down = list(zip(rng.sample(free, len(targets)), targets))
    step = StepInput(seqs=[], copies_to_host=up, copies_to_gpu=down)
    want._copy(step)
    kernel_copy(got, step)
    for a, b in zip(want.device_tensors + want.host, got.device_tensors + got.host, strict=True):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), "page copies differ from the runs' copy"
    words = [str(word_dtype(torch.Size(page).numel() * dtype.itemsize)).removeprefix("torch.")
             for (_, *page), dtype in shapes]
    return f"{len(up)} up, {len(down)} down, equal; words {' '.join(words)}"


if __name__ == "__main__":
    # GQA K and V (bf16, int32 words); MLA latent (bf16) beside fp8-like indexer keys of odd bytes
    print("gqa", case([((3, 4, 2, 8), torch.bfloat16), ((3, 4, 2, 8), torch.bfloat16)], pages=24, slots=20,
                      seed=1))
    print("mla", case([((2, 4, 12), torch.bfloat16), ((1, 4, 3), torch.uint8)], pages=18, slots=16, seed=2))
    print("odd", case([((2, 3, 3), torch.uint8), ((2, 1, 5), torch.int16)], pages=15, slots=12, seed=3))
