"""Piecewise CUDA graphs of the decode step, split at the MoE layers whose expert backend cannot be
captured (ExpertBackend.graph_safe is False: hybrid reads its miss list on the host every layer).

    pieces = capture_pieces(model, run, pool)   # run(): the model's forward, as DecodeGraphs captures it
    pieces.replay()                              # graph 0, eager MoE 0, graph 1, eager MoE 1, ..., graph L

During capture each such MoE block, instead of calling its backend, ends the graph being captured,
remembers (backend, hidden, ids, weights, out) and begins the next graph; the block returns `out`, a
static buffer allocated between the two captures (outside the pool), which the next graph reads. A
replay runs the graphs in order and, between them, each remembered backend eagerly on the tensors the
graph before it wrote (their addresses are fixed: they were allocated while capturing and stay
referenced here), copying its result into `out`. So attention, norms, routers and the trace replay
keep their graphs, and only the expert backend runs eagerly.

Invariants: the pieces of one capture are replayed in capture order, all of them, before any other
capture of the same pool is replayed (DecodeGraphs replays one size at a time). The eager parts run
on the current stream, after the graph before them and before the graph after them.
"""

from __future__ import annotations

from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import Callable

import torch

from moetier.models.base import CausalLM


@dataclass
class EagerPart:
    forward: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
    hidden: torch.Tensor  # [T, H], written by the graph before
    ids: torch.Tensor  # [T, k]
    weights: torch.Tensor  # [T, k]
    out: torch.Tensor  # [T, H], read by the graph after

    @torch.inference_mode()  # the buffers were made under it (the model's forward)
    def run(self) -> None:
        self.out.copy_(self.forward(self.hidden, self.ids, self.weights))


@dataclass
class Pieces:
    """Graphs and the eager parts between them; len(graphs) == len(eager) + 1."""

    graphs: list[torch.cuda.CUDAGraph] = field(default_factory=list)
    eager: list[EagerPart] = field(default_factory=list)

    def replay(self) -> None:
        for graph, part in zip(self.graphs, self.eager):
            graph.replay()
            part.run()
        self.graphs[-1].replay()


class _Splitter:
    def __init__(self, pool):
        self.pool, self.pieces = pool, Pieces()
        self.current: torch.cuda.CUDAGraph | None = None

    def begin(self) -> None:
        self.current = torch.cuda.CUDAGraph()
        self.current.capture_begin(pool=self.pool)

    def end(self) -> None:
        self.current.capture_end()
        self.pieces.graphs.append(self.current)
        self.current = None

    def split(self, forward, hidden: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        self.end()
        out = torch.empty_like(hidden)  # not capturing: the caching allocator's, not the graph pool's
        self.pieces.eager.append(EagerPart(forward, hidden, ids, weights, out))
        self.begin()
        return out


def needs_pieces(model: CausalLM) -> bool:
    return not all(getattr(b.experts, "graph_safe", True) for b in model.moe_blocks())


@contextmanager
def link_only(model: CausalLM):
    """Every hybrid backend sends every miss over the link while inside (HybridExperts.link_only)."""
    with ExitStack() as stack:
        for b in switchable(model):
            stack.enter_context(b.link_only())
        yield


def switchable(model: CausalLM) -> list:
    """The backends a Switch can turn to their slots step (hybrid, eager or nodes: a `host_enabled` flag)."""
    return [b.experts for b in model.moe_blocks() if hasattr(b.experts, "host_enabled")]


def capture_pieces(model: CausalLM, run: Callable[[], torch.Tensor], pool) -> tuple[Pieces, torch.Tensor]:
    """Capture run() (the model's forward and logits, after its warm-up) split at every MoE block whose
    backend is not graph-safe. -> (pieces, the logits tensor the last graph writes)."""
    splitter = _Splitter(pool)
    blocks = [b for b in model.moe_blocks() if not getattr(b.experts, "graph_safe", True)]
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    try:
        for b in blocks:
            b.eager_split = splitter.split
        with torch.cuda.stream(stream):
            splitter.begin()
            try:
                logits = run()
            finally:
                if splitter.current is not None:
                    splitter.end()
    finally:
        for b in blocks:
            b.eager_split = None
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    return splitter.pieces, logits


def host_enabled(model: CausalLM, on: bool) -> None:
    """Turn the host path of every hybrid backend on or off (off: the graph-safe slots step)."""
    for b in model.moe_blocks():
        if hasattr(b.experts, "host_enabled"):
            b.experts.host_enabled = on


def capture_whole(model: CausalLM, run: Callable[[], torch.Tensor], logits_out: torch.Tensor, pool
                  ) -> torch.cuda.CUDAGraph:
    """The whole step as one graph, every hybrid backend on its slots step (host path off), after an
    eager warm-up that compiles those kernels at this size. The graph writes `logits_out` (the pieces'
    logits, which the sampler graphs read), so either variant feeds the same samplers."""
    host_enabled(model, False)
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            run()
        torch.cuda.current_stream().wait_stream(side)
        model.reset_experts()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            logits_out.copy_(run())
    finally:
        host_enabled(model, True)
    return graph


def replay_overhead_s(slow: Callable[[], None], fast: Callable[[], None], reps: int = 10) -> float:
    """Seconds slow() takes beyond fast(), each replayed to completion `reps` times, alternately (so a
    drift of the machine hits both), after one untimed replay of each; the least time of each: a replay
    is never faster than its work, so the least is the least disturbed (medians of 5 were 0 to 4.6 ms
    apart at neighbouring sizes on the H200)."""
    import time

    best = {slow: float("inf"), fast: float("inf")}
    for fn in (slow, fast):
        fn()
    torch.cuda.synchronize()
    for _ in range(reps):
        for fn in (slow, fast):
            t0 = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            best[fn] = min(best[fn], time.perf_counter() - t0)
    return max(0.0, best[slow] - best[fast])
