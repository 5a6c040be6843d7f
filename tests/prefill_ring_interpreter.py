"""The ring prefill stream mode on the large-step Triton kernels (prefill_ring.ring_large), in Triton's
CPU interpreter: the hits' pass and each group's pass write unweighted pair outputs into one y, then
one combine; bit-exact against the one-GEMM step (uva: misses read from the host rows in the kernel)
and resident, for several group sizes and ring depths, all hits, all misses, mixed and skipped (-1)
ids. Every expert's pairs run in the same chunks in both (see prefill_ring.py), so the interpreter's
BLAS runs the very same matmuls (tests/interpreter.py). Run as a script; test_prefill_ring.py does."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402

from moetier.experts.kernels.gemm_config import GemmConfig  # noqa: E402
from moetier.experts.kernels.grouped_gemm_large import grouped_expert_mlp_large  # noqa: E402
from moetier.experts.prefill.ring import StagingRing, ring_large  # noqa: E402
from moetier.experts.shape import RowLayout  # noqa: E402

E, S = 12, 5


def case(t: int, k: int, h: int, i: int, dtype: torch.dtype, kind: str, ring: tuple[int, int], seed: int) -> str:
    g = torch.Generator().manual_seed(seed)
    layout = RowLayout(h, i)
    host = (torch.randn(E, layout.numel, generator=g) * 0.1).to(dtype)
    cached = torch.randperm(E, generator=g)[:S]
    slot_of = torch.full((E,), -1, dtype=torch.int32)
    slot_of[cached] = torch.randperm(S, generator=g).int()
    slots = torch.full((S, layout.numel), float("nan")).to(dtype)
    slots[slot_of[cached].long()] = host[cached]
    pool = {"hits": cached, "misses": (slot_of < 0).nonzero().flatten()}.get(kind, torch.arange(E))
    ids = torch.stack([pool[torch.randperm(pool.numel(), generator=g)[:k]] for _ in range(t)])
    if kind == "dup":  # long runs: several chunks of one row
        ids = pool[torch.randint(0, 3, (t, k), generator=g)]
    if kind == "skipped":
        ids = torch.where(torch.rand(t, k, generator=g) < 0.3, -1, ids)
    x = torch.randn(t, h, generator=g).to(dtype)
    w = torch.rand(t, k, generator=g).to(dtype)
    cfg = GemmConfig(large_block_m=16, large_gate_up=(32, 32, 4), large_down=(32, 32, 4))
    slot_ids = slot_of[ids.clamp(min=0)]
    uva = grouped_expert_mlp_large(x, slot_ids, ids, w, slots, host, h, i, S + E, cfg)
    resident = grouped_expert_mlp_large(x, ids.int(), ids, w, host, host, h, i, E, cfg)
    staging = StagingRing(*ring, layout.numel, dtype, torch.device("cpu"))
    staging.buffers.fill_(float("nan"))  # a row read from an unfilled place would show
    got, copied = ring_large(staging, x, slot_ids, ids, w, host, slots, h, i, cfg)
    missing = {e for e in ids.flatten().tolist() if e >= 0 and int(slot_of[e]) < 0}
    assert copied == len(missing), (copied, missing)
    assert torch.equal(got, uva), (kind, ring, (got.float() - uva.float()).abs().max())
    assert torch.equal(got, resident), (kind, ring)
    return f"ring t={t} k={k} {str(dtype)[6:]} {kind} G={ring[0]} D={ring[1]} copied={copied}"


if __name__ == "__main__":
    n = 0
    for kind in ("mixed", "hits", "misses", "skipped", "dup"):
        for ring in ((1, 2), (3, 2), (2, 3)) if kind in ("mixed", "dup") else ((1, 2), (3, 2)):
            for dtype in (torch.float32, torch.bfloat16):
                print(case(40, 4, 64, 32, dtype, kind, ring, seed=n), flush=True)
                n += 1
    print("ring steps ok")
