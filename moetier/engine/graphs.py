"""CUDA graphs of the decode step: every layer from token ids to logits, then the sampler, for batch
sizes 1, 2, 4, 8 and up (a step of another size pads up to the next captured one).

Per size there is one graph of the model (ids -> logits) and one small graph of the sampler per
sampling mode (greedy, sample, filter: sampler.mode_of), replayed back to back with no host work in
between; the only host read of a step is its sampled tokens. Splitting the sampler off keeps three
modes from tripling the model captures.

Every graph reads its inputs from static buffers (token ids, positions, KV slots, context lengths,
page tables, sampling parameters, and for models with recurrent state the sequences' state slots)
that each step overwrites in place; padding rows write their keys into a scratch page that no request
owns and attend to that page only, and read and write the state pool's spare slot
(layers/state_cache.py). The slot cache's state lives in device tensors, so replays advance it exactly
as eager steps would. A step with a sequence at position 0 (a one-token prompt) runs eagerly when the
model keeps state: its slot is zeroed first from host integers (layers/kda.py).

Context buckets: a model whose decode step reads every column of the page table (the DSA and kpool
indexers score each key of the table's width, whatever the sequences' lengths) gets, per batch size,
graphs for narrower page tables too (plan/residents.graph_widths: 4,096 tokens times powers of 4, then the whole
width); a step replays the narrowest that holds its longest context, so the indexers' work follows the
context instead of the longest request the engine admits. The widest is captured first, so the narrower
ones reuse its memory pool and the plan's count (at the whole width) holds. Hybrid backends (pieces,
the whole-step switch) keep the one whole-width graph per size.
"""

from __future__ import annotations

import numpy as np
import torch

from moetier.engine.piecewise import (
    Pieces,
    capture_pieces,
    capture_whole,
    link_only,
    needs_pieces,
    replay_overhead_s,
    switchable,
)
from moetier.engine.step import SeqStep
from moetier.engine.switch import Switch
from moetier.layers.attention import AttnBatch
from moetier.layers.kv_cache import KVCache
from moetier.layers.sampler import add_bias, bias_of, mode_of, sample_rows
from moetier.models.base import CausalLM
from moetier.plan.residents import BUCKET_TOKENS, captured_sizes, graph_widths
from moetier.plan.residents import GRAPH_SIZES as SIZES

MODES = ("greedy", "sample", "filter")


class WidthGraphs:
    """One batch size's graphs at one page-table width: the model's (a CUDAGraph, or Pieces: both have
    replay()), its logits [n, V] float32, and per sampling mode the sampler's graph and its tokens."""

    def __init__(self, width: int, graph, logits: torch.Tensor):
        self.width, self.graph, self.logits = width, graph, logits
        self.samplers: dict[str, torch.cuda.CUDAGraph] = {}
        self.tokens: dict[str, torch.Tensor] = {}


class PageRows:
    """The decode graph's host page table [max_batch, width], written incrementally: a row keeps the
    page list it was last written from and how many entries it holds, so a running request's step
    writes only the pages it gained (a whole row of a long context is a Python-to-int32 conversion of
    every page, each step, serially with the GPU). Rows without a sequence hold the scratch page.

    Invariant it rests on (engine/scheduler.py): a running request's page list only grows, in place
    (`req.pages += ...`); admission and preemption give it a new list. A row holds a reference to its
    list, so the identity check cannot be fooled by a reused id; a list that arrives new every step (a
    worker rank's unpickled step) is written whole, which is correct, only slower."""

    def __init__(self, table: np.ndarray, scratch: int):
        self.table, self.scratch = table, scratch
        self.rows: list[tuple[list[int], int] | None] = [None] * table.shape[0]
        self.used = 0  # rows [used, max_batch) hold the scratch page only
        table.fill(scratch)

    def write(self, seq_pages: list[list[int]]) -> None:
        """Row i <- seq_pages[i]; every row after them back to the scratch page."""
        table, rows = self.table, self.rows
        for i, pages in enumerate(seq_pages):
            prev = rows[i]
            if prev is not None and prev[0] is pages and len(pages) >= prev[1]:
                if len(pages) > prev[1]:
                    table[i, prev[1]:len(pages)] = pages[prev[1]:]
            else:
                if prev is not None:
                    table[i].fill(self.scratch)
                table[i, :len(pages)] = pages
            rows[i] = (pages, len(pages))
        n = len(seq_pages)
        for i in range(n, self.used):
            if rows[i] is not None:
                table[i].fill(self.scratch)
                rows[i] = None
        self.used = n


class DecodeGraphs:
    def __init__(self, model: CausalLM, kv: KVCache, scratch_page: int, max_pages_per_seq: int, sizes=SIZES[:4],
                 piecewise: bool = False, scratch_state: int | None = None, bucket_tokens: int = BUCKET_TOKENS):
        self.model, self.kv, self.scratch = model, kv, scratch_page
        self.piecewise = piecewise  # the model graph split at MoE layers that run eagerly (piecewise.py)
        # with hybrid backends (pieces, or nodes: one graph with host-function nodes): also the whole step
        # in one graph with every hybrid backend on its slots step, replayed when the recent misses do not
        # pay for the host path's cost (engine/switch.Switch). switch = None after capture replays the host
        # path's graph on every step (scripts/profile_hybrid.py and tests look at one variant so)
        self.switching = bool(switchable(model))
        self.whole: dict[int, torch.cuda.CUDAGraph] = {}
        self.overhead_s: dict[int, float] = {}  # per size: pieces replay - whole replay, at no misses
        self.switch: Switch | None = None
        self.sizes = tuple(sorted(sizes))
        self.max_batch = b = self.sizes[-1]
        dev = model.device
        self.width = width = max_pages_per_seq
        # The static inputs are views of two device blocks with pinned host twins, so a step fills
        # them with two copies. int64: ids, positions, KV slots, top_k, noise seeds, sample steps, state
        # slots, the rows of the previous step's tokens that are this step's ids (overlapped scheduling:
        # run's src), and last the step's count of real rows; 32-bit: context lengths, page table
        # (int32), then temperature and top_p (float32 bits). Two host twins, used in turn: a step writes
        # the pair its step-before-last uploaded (whose tokens the caller has read back since, which
        # orders that upload before this write), never the pair an overlapped step may still be reading.
        self._dev64 = torch.zeros(8 * b + 1, dtype=torch.int64, device=dev)
        self._dev32 = torch.zeros(b * (3 + width), dtype=torch.int32, device=dev)
        self._hosts = [(torch.zeros(8 * b + 1, dtype=torch.int64, pin_memory=True),
                        torch.zeros(b * (3 + width), dtype=torch.int32, pin_memory=True)) for _ in range(2)]
        self._turn = 0
        self.ids, self.positions, self.slots, self.top_k, self.seeds, self.steps, self.state_slots, self.src = \
            self._dev64[:8 * b].view(8, b)
        # [1]: the rows before the padding; a route hook that counts tokens (traces/hooks.Replayer) reads it
        # inside a replay, where its own row count is the captured size
        model.real_rows = self._dev64[8 * b:]
        state = getattr(kv, "state", None)  # the recurrent-state pool (layers/state_cache.py) or None
        self.has_state = state is not None
        # the pool's spare slot (engine/kv_setup.py: index max_num_seqs; the slots above it hold prefix-cache
        # state checkpoints, which padding rows must never write)
        self.scratch_state = (state.num_slots - 1 if scratch_state is None else scratch_state) if state is not None else 0
        self.seq_lens = self._dev32[:b]
        self.page_table = self._dev32[b:b * (1 + width)].view(b, width)
        self.temperature, self.top_p = self._dev32[b * (1 + width):].view(torch.float32).view(2, b)
        self.query_start = torch.arange(b + 1, dtype=torch.int32, device=dev)
        # each host twin's page table, written incrementally
        self._page_rows = [PageRows(self._host_views(turn)[7], scratch_page) for turn in (0, 1)]
        # context buckets (module docstring): only for a model whose decode reads the table's whole width
        self.buckets = graph_widths(width, kv.page_size, bool(getattr(kv, "index_slot", None)),
                                    piecewise or self.switching, bucket_tokens)
        self.by_width: dict[tuple[int, int], WidthGraphs] = {}  # (size, width) for every size and bucket
        self.graphs: dict[int, torch.cuda.CUDAGraph | Pieces] = {}  # per size, the whole width's model graph
        self.last: dict[int, WidthGraphs] = {}  # per size: what its last replay used (logits_of, replayed)
        self._capture()

    def _batch(self, n: int, max_ctx: int, width: int | None = None) -> AttnBatch:
        """The captured step's batch: n rows, the page table's first `width` columns (default all)."""
        return AttnBatch(self.positions[:n], self.slots[:n], self.query_start[:n + 1], self.seq_lens[:n],
                         self.page_table[:n, :width], list(range(n + 1)), [max_ctx] * n, 1,
                         state_slots=self.state_slots[:n] if self.has_state else None)

    def _host_views(self, turn: int | None = None):
        # numpy views of the pinned blocks: a host step writes a few dozen scalars, and a numpy store
        # costs ~0.1 us against a torch op's few us (the host part of a decode step is serial).
        # (twin `turn`, default this turn's; the last two: state slots, src)
        b, w = self.max_batch, self.width
        host64, host32 = self._hosts[self._turn if turn is None else turn]
        h64, h32 = host64.numpy()[:8 * b].reshape(8, b), host32.numpy()
        return (*h64[:6], h32[:b], h32[b:b * (1 + w)].reshape(b, w), *h32[b * (1 + w):].view(np.float32).reshape(2, b),
                h64[6], h64[7])

    def _set_real_rows(self, n: int) -> None:
        self._hosts[self._turn][0].numpy()[8 * self.max_batch] = n

    def _pad_host(self) -> None:
        ids, pos, slot, top_k, seeds, steps, lens, table, temp, top_p, state, src = self._host_views()
        for t in (ids, pos, top_k, seeds, steps, temp, src):
            t.fill(0)
        slot.fill(self.scratch * self.kv.page_size)
        state.fill(self.scratch_state)
        lens.fill(1)
        top_p.fill(1.0)  # the page table's padding rows: PageRows

    def _upload(self) -> None:
        host64, host32 = self._hosts[self._turn]
        self._dev64.copy_(host64, non_blocking=True)
        self._dev32.copy_(host32, non_blocking=True)

    def _sampler(self, logits: torch.Tensor, n: int, mode: str) -> torch.Tensor:
        return sample_rows(logits, self.temperature[:n], self.top_k[:n], self.top_p[:n], self.seeds[:n],
                           self.steps[:n], mode)

    @torch.inference_mode()
    def _capture(self) -> None:
        # kept: the verify graphs (engine/verify_graphs.py) capture into the same pool afterwards
        self.pool = pool = torch.cuda.graph_pool_handle()
        self._pad_host()
        self._upload()
        # NOTE: one warm-up stream for every size: torch keeps a cuBLAS workspace per stream that ran a
        # GEMM (32 MiB on Hopper), so a stream per size held 96 MiB more (plan/residents.cublas_workspace)
        self.side = side = torch.cuda.Stream()  # kept for the verify graphs' warm-up too
        for n in reversed(self.sizes):  # largest first: the smaller graphs reuse its pool
            for w in reversed(self.buckets):  # widest first, likewise
                self.by_width[n, w] = self._capture_width(n, w, pool, side)
            self.graphs[n] = self.by_width[n, self.width].graph
        self.model.reset_experts()  # warm-up and capture ran the cache on padding: serve from empty
        if self.switching:
            self.switch = Switch(switchable(self.model))

    def _capture_width(self, n: int, w: int, pool, side: torch.cuda.Stream) -> WidthGraphs:
        """Size n's graphs over the first w columns of the page table (a view: the host block and its
        one upload stay as they are). The attention kernel sizes its key splits from the host lengths:
        captured for the longest context the width holds, so every replay at it is covered."""
        batch = self._batch(n, w * self.kv.page_size, w)
        def run():
            return self.model.logits(self.model.forward(self.ids[:n], batch, self.kv))
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up: compile kernels, size workspaces
            logits = run()
            for mode in MODES:
                self._sampler(logits, n, mode)
        torch.cuda.current_stream().wait_stream(side)
        self.model.reset_experts()
        if self.piecewise:
            graph, logits = capture_pieces(self.model, run, pool)
        else:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                logits = run()
        if self.switching:  # hybrid: one width only (graph_widths)
            self.whole[n] = capture_whole(self.model, run, logits, pool)
            with link_only(self.model):  # the host path's own cost, at no misses and no host work
                self.overhead_s[n] = replay_overhead_s(graph.replay, self.whole[n].replay)
        out = WidthGraphs(w, graph, logits)
        for mode in MODES:
            out.samplers[mode] = torch.cuda.CUDAGraph()
            with torch.cuda.graph(out.samplers[mode], pool=pool):
                out.tokens[mode] = self._sampler(logits, n, mode)
        return out

    @torch.inference_mode()
    def step_costs(self, timer) -> tuple[float, float, float]:
        """(seconds an eager one-row step pays beyond its graph's replay, seconds each row adds to a
        replay, seconds of the one-row replay), timed by timer(fn) -> seconds on the padded inputs (every row one token 0 at position 0
        on the scratch page and the spare state slot, as capture ran them): expert-aware k's eager and
        per-token terms (engine/spec_k.py). Every row routes alike, so the rows' cost leaves out the union
        of experts growing, which the chooser prices itself. The host's part of an eager step (its batch
        built, its tokens read) is not in it. Empties the expert caches afterwards, as capture does."""
        w, one, big = self.width, self.sizes[0], self.sizes[-1]
        batch = self._batch(one, w * self.kv.page_size, w)
        eager = timer(lambda: self.model.logits(self.model.forward(self.ids[:one], batch, self.kv)))
        small = timer(self.by_width[one, w].graph.replay)
        large = timer(self.by_width[big, w].graph.replay) if big > one else small
        self.model.reset_experts()
        return max(0.0, eager - small), max(0.0, (large - small) / max(big - one, 1)), small

    def width_of(self, seqs: list[SeqStep]) -> int:
        """The narrowest captured page-table width that holds every sequence's context."""
        if len(self.buckets) == 1:
            return self.width
        need = max(s.start for s in seqs) // self.kv.page_size + 1
        return next(w for w in self.buckets if w >= need)

    def replayed(self, n: int) -> WidthGraphs:
        """What size n's last replay used (the whole width before any): what bench decode times
        (bench/decode_steps.replay_ms)."""
        return self.last.get(n) or self.by_width[n, self.width]

    def release(self) -> None:
        """Destroy every captured graph now (not whenever the collector gets to them). NOTE: under
        several ranks the graphs hold NCCL work of the process group: they must be gone before the
        group is destroyed, or destroying it waits forever (seen on two H200s)."""
        every = [g for x in self.by_width.values() for g in (x.graph, *x.samplers.values())]
        for g in [*every, *self.whole.values()]:
            for graph in (g.graphs if isinstance(g, Pieces) else [g]):
                graph.reset()
        self.by_width.clear(), self.graphs.clear(), self.whole.clear(), self.last.clear()
        torch.cuda.synchronize(self.model.device)

    def logits_of(self, n: int) -> torch.Tensor:
        """The last replay's logits [n, V] float32 (valid until the next replay)."""
        return self.replayed(next(s for s in self.sizes if s >= n)).logits[:n]

    def fits(self, seqs: list[SeqStep]) -> bool:
        # a sequence at position 0 of a model with state needs its slot zeroed first: eager (layers/kda.py)
        return 0 < len(seqs) <= self.max_batch and all(
            s.num_tokens == 1 and s.sample and (s.start > 0 or not self.has_state) for s in seqs)

    @torch.inference_mode()
    def run(self, seqs: list[SeqStep], sample: bool = True,
            src: tuple[torch.Tensor, list[int]] | None = None) -> torch.Tensor | None:
        """Replay the decode step for these one-token steps -> sampled token ids [len(seqs)] (device);
        sample=False (a worker rank: rank 0 samples) replays the model only and returns None.
        src (overlapped scheduling, engine/overlap.py): (tokens [m] on the device, rows [len(seqs)]):
        row i's input id is tokens[rows[i]], gathered on the device (seqs' own token ids are ignored)."""
        n = len(seqs)
        size = next(s for s in self.sizes if s >= n)
        page = self.kv.page_size
        # NOTE: the host twins alternate (see __init__): the one written now was uploaded two steps
        # ago, and the caller has read that step's sampled tokens back since.
        self._turn ^= 1
        self._pad_host()
        ids, pos, slot, top_k, seeds, steps, lens, _, temp, top_p, state, rows = self._host_views()
        if src is not None:
            rows[:n] = src[1]
        for i, s in enumerate(seqs):
            p = s.start
            ids[i] = s.token_ids[0]
            pos[i] = p
            slot[i] = s.pages[p // page] * page + p % page
            lens[i] = p + 1
            top_k[i], seeds[i], steps[i] = s.params.top_k, s.seed, s.sample_index
            temp[i], top_p[i] = s.params.temperature, s.params.top_p
            state[i] = s.state_slot
        self._page_rows[self._turn].write([s.pages for s in seqs])
        self._set_real_rows(n)
        self._upload()
        if src is not None:  # after the upload (which wrote ids too), in stream order before the replay
            torch.index_select(src[0], 0, self.src[:n], out=self.ids[:n])
        mode = mode_of([s.params for s in seqs])
        bias = bias_of([s.params for s in seqs], self.model.device)  # copied up before the replay: no wait
        at = self.last[size] = self.by_width[size, self.width_of(seqs)]
        graph = at.graph
        if self.switch is not None and not self.switch.choose(self.overhead_s[size], size):
            graph = self.whole[size]
        graph.replay()
        if not sample:
            return None
        if bias is not None:  # a batch with logit_bias: its sampler runs eagerly on the biased logits
            return self._sampler(add_bias(at.logits[:n], bias), n, mode)
        at.samplers[mode].replay()
        return at.tokens[mode][:n]


def captures(config, model: CausalLM, parallel: bool) -> bool:
    """Whether an engine of `config` (engine/config.EngineConfig) captures decode graphs: on CUDA, with
    graphs on and no trace recorder (it reads ids on the host every step); a backend that needs pieces
    (hybrid: a host decision per MoE layer) only on one rank (pieces decide on one rank's host).
    NOTE: every rank of a parallel engine decides here, so the captures' warm-up collectives pair up."""
    pieces = needs_pieces(model)
    return (model.device.type == "cuda" and config.cuda_graphs and config.record_trace is None
            and not (pieces and parallel))


def decode_graphs(model: CausalLM, kv: KVCache, config, max_len: int, piecewise: bool = False) -> DecodeGraphs:
    """The decode graphs an engine of `config` captures (config: engine/config.EngineConfig), for
    requests of up to max_len tokens. NOTE: every rank of a parallel engine calls this with the same
    config and max_len, so all capture the same sizes in the same order: the warm-up forwards before
    each capture run their collectives in lockstep, and each step replays the same graph everywhere."""
    sizes = captured_sizes(config.max_num_seqs, config.decode_tokens)
    return DecodeGraphs(model, kv, scratch_page=config.num_pages, max_pages_per_seq=-(-max_len // config.page_size),
                        sizes=sizes, piecewise=piecewise, scratch_state=config.max_num_seqs,
                        bucket_tokens=BUCKET_TOKENS)
