"""glm5_next's CUDA decode path, what of it runs on the CPU: the KDA layer's slot handling around
fla-core's kernels (the kernels swapped for the torch references), the graph-safe kpool selection
against the reference, which steps the decode graphs take, and the decode kernels in Triton's
interpreter (kda_interpreter.py: the fused mHC, fla's recurrent step through our wrapper;
kpool_select_interpreter.py: the kpool selection's kernels)."""

from __future__ import annotations

import functools

import pytest
import torch

import moetier.layers.kda as kda_module
from moetier.layers.attention import make_batch
from moetier.layers.kda import KdaAttention
from moetier.layers.kda_cuda import RECURRENT_TOKENS
from moetier.layers.kda_reference import kda_chunked, kda_step
from moetier.layers.state_cache import KdaStateCache, KdaStateSpec
from tests.interpreter import run_script
from tests.test_parity import rel_err

HEADS, D, HIDDEN, SLOTS = 2, 16, 32, 6


def layer() -> KdaAttention:
    g = torch.Generator().manual_seed(5)
    attn = KdaAttention(0, HIDDEN, HEADS, D, 4, -5.0, 1e-5, torch.float32, "cpu")
    for p in attn.parameters():
        p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return attn


def garbage_pool(seed: int) -> KdaStateCache:
    """A state pool whose slots hold what earlier sequences left: a fresh sequence must not read it."""
    pool = KdaStateCache(KdaStateSpec((0,), 3 * HEADS * D, 4, HEADS, D, D), SLOTS, torch.float32, "cpu")
    g = torch.Generator().manual_seed(seed)
    pool.conv.copy_(torch.randn(pool.conv.shape, generator=g))
    pool.recurrent.copy_(torch.randn(pool.recurrent.shape, generator=g))
    return pool


def fake_decode(q, k, v, g, beta, pool, slots):
    # kda_cuda.kda_decode_slots' contract on the reference: read each row's slot, write it back in place
    o, s = kda_step(q, k, v, g, beta, pool[slots])
    pool[slots] = s
    return o


def fake_prefill(q, k, v, g, beta, initial, starts, recurrent=False, log=None):
    # kda_cuda.kda_prefill_varlen's contract on the reference: each sequence from its carried state;
    # the recurrent kernel takes exactly the sequences of up to RECURRENT_TOKENS tokens
    lens = [b - a for a, b in zip(starts, starts[1:])]
    assert all((n <= RECURRENT_TOKENS) == recurrent for n in lens), (lens, recurrent)
    if log is not None:
        log.append(("recurrent" if recurrent else "chunk", lens))
    outs, finals = [], []
    for i in range(len(starts) - 1):
        a, b = starts[i], starts[i + 1]
        o, s = kda_chunked(q[a:b], k[a:b], v[a:b], g[a:b], beta[a:b], initial[i])
        outs.append(o)
        finals.append(s)
    return torch.cat(outs), torch.stack(finals)


def fake_slot(q, k, v, g, beta, state, log=None):
    # kda_cuda.kda_prefill_slot's contract on the reference: one short sequence, its slot's view in place
    assert q.shape[0] <= RECURRENT_TOKENS and state.shape[0] == 1
    if log is not None:
        log.append(("slot", [q.shape[0]]))
    o, s = kda_chunked(q, k, v, g, beta, state[0].clone())
    state[0] = s
    return o


def test_slot_handling_around_the_kernels_equals_the_reference(monkeypatch):
    """Fresh prompts, a prompt over two steps, a mixed step, decode with a one-token prompt (its slot
    must be zeroed) and an empty sequence, over pools holding garbage: the CUDA path's gathers,
    scatters and zeroing around the kernels give the reference's outputs and states."""
    attn = layer()
    g = torch.Generator().manual_seed(6)
    # (tokens before, new tokens, state slot) per sequence, per step; pages are irrelevant to KDA
    steps = [[(0, 70, 3), (0, 5, 1)],  # a long prompt, then a short one: each kernel's tokens gathered
             [(70, 1, 3), (5, 4, 1), (0, 0, 4)],  # short ones only (one recurrent launch), an empty one
             [(71, 1, 3), (9, 1, 1), (0, 1, 0)],
             [(72, 1, 3), (10, 1, 1), (1, 1, 0)],
             [(11, 3, 1)],  # one short sequence alone: on a view of its slot
             [(0, 2, 2), (73, 66, 3), (14, 2, 1)],  # short, long, short
             [(0, 9, 5)]]  # a fresh short prompt alone: its slot zeroed first
    ref, fla = garbage_pool(7), garbage_pool(7)
    kernels = []
    for step in steps:
        batch = make_batch([(a, n, [0] * 20) for a, n, _ in step], 8, "cpu", [s for _, _, s in step])
        x = torch.randn(batch.num_tokens, HIDDEN, generator=g)
        monkeypatch.setattr(kda_module, "on_fla", lambda t: False)
        want = attn(x, batch, ref)
        monkeypatch.setattr(kda_module, "on_fla", lambda t: True)
        monkeypatch.setattr(kda_module, "kda_decode_slots", fake_decode)
        monkeypatch.setattr(kda_module, "kda_prefill_varlen", functools.partial(fake_prefill, log=kernels))
        monkeypatch.setattr(kda_module, "kda_prefill_slot", functools.partial(fake_slot, log=kernels))
        got = attn(x, batch, fla)
        assert rel_err(got, want) <= 1e-5, step
        used = sorted({s for _, n, s in step if n})
        assert rel_err(fla.recurrent[0, used], ref.recurrent[0, used]) <= 1e-5, step
        assert torch.equal(fla.conv[0, used], ref.conv[0, used]), step
    assert kernels == [("recurrent", [5]), ("chunk", [70]), ("recurrent", [1, 4]), ("slot", [3]),
                       ("recurrent", [2, 2]), ("chunk", [66]), ("slot", [9])], kernels


def test_fixed_kpool_selection_equals_the_reference():
    """The graph-safe selection (decode on CUDA) picks the pools the reference picks, plus the same
    tail, on decode rows over shuffled pages; positive scores, so that no two tie."""
    from moetier.layers.kpool_indexer import select_pools_fixed, select_pools_reference

    g = torch.Generator().manual_seed(8)
    d, kpool, topk = 8, 2, 4
    index_k = torch.rand(14, 4, 2 * d, generator=g)
    ape = torch.rand(kpool, d, generator=g)
    batch = make_batch([(9, 1, [3, 7, 1]), (0, 1, [0]), (13, 1, [5, 11, 4, 9]), (2, 1, [6, 8]), (6, 1, [2, 10])],
                       4, "cpu")
    n = batch.num_tokens
    q, w = torch.rand(n, 3, d, generator=g), torch.rand(n, 3, generator=g)
    want = select_pools_reference(q, w, index_k, ape, batch, topk, kpool, 0.3)
    got = select_pools_fixed(q, w, index_k, ape, batch, topk, kpool, 0.3)
    assert got.shape == want.shape == (n, topk + kpool - 1)
    assert torch.equal(got.sort(-1).values, want.sort(-1).values)
    assert_compact_with_tails(got, want, batch.positions, kpool)
    assert (want == -1).any(-1).any() and (want >= 0).all(-1).any()  # short and full rows


def test_kpool_selection_kernels_in_the_interpreter():
    """layers/kpool_select_triton.py (decode and verify on CUDA) against the torch form, in Triton's
    interpreter: tests/kpool_select_interpreter.py."""
    pytest.importorskip("triton")
    out = run_script("kpool_select_interpreter.py")
    lines = [line for line in out.splitlines() if line.startswith("kpool_select ")]
    assert len(lines) == 8 and all("tokens=exact whole=equal" in line for line in lines), out
    assert any("bfloat16" in line for line in lines) and any(" P=1 " in line for line in lines), out
    assert any(" rows=4 " in line for line in lines), out  # a verify step: k + 1 = 4 rows at most
    assert lines[-1].endswith("narrow-table"), out  # a graph bucket's strided page table


def assert_compact_with_tails(got, want, positions, kpool):
    """Both selections hold their valid entries first (kpool_indexer.place_tail: the attention walks
    a row up to its position + 1), and every tail token; some rows have a tail, some none."""
    from moetier.layers.kpool_indexer import tail_positions

    for rows in (got, want):
        valid = (rows >= 0).int()
        assert torch.equal(valid.cumprod(-1).sum(-1), valid.sum(-1))
        assert bool((valid.sum(-1) <= positions.cpu() + 1).all())
    tails = tail_positions(positions.cpu(), kpool)
    assert all(set(t[t >= 0].tolist()) <= set(r.tolist()) for t, r in zip(tails, want.cpu()))
    assert (tails >= 0).any() and (tails == -1).all(-1).any()


def test_decode_graphs_leave_one_token_prompts_of_state_models_to_eager():
    """A sequence at position 0 of a model with state needs its slot zeroed from host integers
    (layers/kda.py): the graphs do not take the step; other one-token steps they do."""
    from moetier.engine.graphs import DecodeGraphs
    from moetier.engine.step import SeqStep
    from moetier.sampling_params import SamplingParams

    def seq(start):
        return SeqStep("r", start, [1], [0], True, SamplingParams(), 0, 0, state_slot=2)
    graphs = object.__new__(DecodeGraphs)  # fits() reads two fields; no CUDA needed
    graphs.max_batch, graphs.has_state = 4, True
    assert graphs.fits([seq(5), seq(9)]) and not graphs.fits([seq(5), seq(0)])
    graphs.has_state = False
    assert graphs.fits([seq(5), seq(0)])


def test_decode_kernels_in_the_interpreter():
    out = run_script("kda_interpreter.py")
    assert out.count(": ok") >= 3, out
    assert "kda decode" in out, out


def test_decode_roofline_counts_the_state_each_sequence_reads_and_writes():
    """bench decode's roofline: a KDA model's decode step moves every running sequence's state twice
    (read, then written back), on top of the dense weights; a model without state moves none."""
    from types import SimpleNamespace

    from moetier.bench.decode import roofline
    from moetier.models.registry import model_class
    from moetier.presets import preset

    for name, stateful in (("tiny-glm5-next", True), ("tiny", False)):
        cfg = preset(name)
        model = model_class(cfg)(cfg, torch.float32, "cpu")
        bed = SimpleNamespace(host={1: None}, dense_bytes=1000, row_bytes=10, model=model)
        per_seq = model.kv_spec().state_bytes_per_seq(torch.float32)
        assert (per_seq > 0) == stateful
        for batch in (1, 4):
            assert roofline(bed, batch, 2, 0, 1.0, 1.0)["hbm_bytes_per_step"] == 1000 + 2 * batch * per_seq + 20


def test_missing_fla_core_is_one_clear_line(monkeypatch):
    import sys

    import pytest

    from moetier.errors import MoetierError
    from moetier.layers.kda_cuda import fla_kda

    fla_kda.cache_clear()
    monkeypatch.setitem(sys.modules, "fla", None)  # as if not installed
    try:
        with pytest.raises(MoetierError, match=r"need fla-core.*pip install fla-core==0\.6\.0") as e:
            fla_kda()
        assert "\n" not in str(e.value)
    finally:
        fla_kda.cache_clear()
