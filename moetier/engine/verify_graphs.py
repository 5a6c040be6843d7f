"""CUDA graphs of the verify step (speculative decoding with n-gram drafts, docs/speculative.md): per
captured batch size n and q = k + 1 verified positions a sequence, one graph of the model over the
step's n q rows (ids -> logits [n q, V] float32) and, per sampling mode, one graph of the verify
arithmetic (spec_step.verdict, the eager step's own function) into a static [n, 1 + q] int64: the
drafts kept, then the emitted tokens. Replayed back to back; the step's one host read is that result.

Which steps replay (fits): every sequence decodes (its last token and its drafts, no prompt token to
score), samples, asks no logprobs and no logit bias, and either drafted or is greedy (a sampled
sequence without drafts draws from the sampler in an eager step, whose noise the verify's last-token
draw does not repeat); the step's most drafts k >= 1 and a (size, k + 1) graph that holds it. Which
engines capture them (captures_verify): one process, n-gram drafting (an MTP engine reads the verified
tokens on the host between its passes), and a model whose decode keeps no recurrent state (KDA rolls
back per sequence; that also leaves out kpool's indexer, glm5_next's, whose selection for several rows
of a sequence is the host-looped reference), on a backend that needs no pieces. The DSA indexer (GLM-5)
scores a verify step's rows in place (layers/dsa_select_triton.py), over the whole table.

Padding. A sequence with d < k drafts fills rows d + 1 .. k with its last token at the following
positions: they write the scratch page (their slot mapping), attend within its own table whose later
columns hold the scratch page (PageRows), and its draft length keeps them out of the verdict. Padding
sequences (the step's n below the captured size) are token 0 at positions 0 .. q - 1 of the scratch
page with no drafts. A replayed trace's cursor advances inside the replay by the real sequences' n q
rows (model.real_rows); the step reports those rows (StepOutput.num_tokens) and the engine rewinds by
what was not kept.

Memory. The graphs share the decode graphs' pool. A graph keeps only its [n, 1 + q] verdict: the
logits are freed once the (n, q) captures are done, so later captures reuse their memory; a replay
of (n, q) rewrites them before its verdict graph reads them. The plan counts the largest (n, q)
step's transients (plan/residents.verify_shapes, plan/memory.py).
"""

from __future__ import annotations

import numpy as np
import torch

from moetier.engine.graphs import PageRows
from moetier.engine.spec_step import verdict
from moetier.engine.step import SeqStep, StepOutput
from moetier.layers.attention import AttnBatch
from moetier.layers.sampler import mode_of
from moetier.plan.residents import verify_shapes
from moetier.spec.verify import PAD

MODES = ("greedy", "sample", "filter")


def captures_verify(kv, spec_config, pieces: bool, parallel: bool) -> bool:
    """Whether an engine captures verify graphs beside its decode graphs (the module docstring)."""
    return (spec_config is not None and spec_config.method == "ngram" and not pieces and not parallel
            and getattr(kv, "state", None) is None)


def verify_graphs(model, kv, config, max_len: int, graphs, parallel: bool) -> VerifyGraphs | None:
    """The verify graphs an engine of `config` (engine/config.EngineConfig) captures after its decode
    graphs (graphs.DecodeGraphs, whose sizes and pool they share), or None."""
    pieces = graphs is not None and (graphs.piecewise or graphs.switching)
    if graphs is None or not captures_verify(kv, config.speculative_config, pieces, parallel):
        return None
    k = config.speculative_config.num_speculative_tokens
    if not verify_shapes(graphs.sizes, k, config.decode_tokens):
        return None
    return VerifyGraphs(model, kv, config.num_pages, max_len, graphs.sizes, k, config.decode_tokens, graphs.pool,
                        graphs.side)


class VerifyGraphs:
    def __init__(self, model, kv, scratch_page: int, max_len: int, sizes, max_k: int, token_cap: int, pool,
                 side: torch.cuda.Stream):
        """sizes: the decode graphs' batch sizes; max_k: the most drafts a step verifies; token_cap: the
        most rows a graph runs (decode_tokens: above it a step takes the large-step expert path, which
        is not graph-safe); pool, side: the decode graphs' memory pool and warm-up stream (a stream
        that runs a GEMM gets a cuBLAS workspace of its own: graphs.py)."""
        self.model, self.kv, self.scratch = model, kv, scratch_page
        self.shapes = verify_shapes(sizes, max_k, token_cap)  # [(n, q)], every q's sizes ascending
        if not self.shapes:
            raise ValueError(f"no verify graph fits {token_cap} rows at k = 1")
        page = kv.page_size
        self.width = width = -(-max_len // page)
        self.limit = max_len  # a padded row's position stays below it (rope tables, the page table)
        b, t, k = max(n for n, _ in self.shapes), max(n * q for n, q in self.shapes), max_k
        self.max_batch, self.max_k = b, k
        dev = model.device
        # two device blocks with pinned host twins, so a step fills them with two copies. int64: ids,
        # positions, KV slots [t]; drafts [b, k]; draft lengths, top_k, seeds, sample steps [b]; real rows
        # [1]. int32: context lengths [b], page table [b, width], temperature and top_p [b] (float32 bits)
        n64, n32 = 3 * t + b * k + 4 * b + 1, b * (3 + width)
        self._dev64 = torch.zeros(n64, dtype=torch.int64, device=dev)
        self._dev32 = torch.zeros(n32, dtype=torch.int32, device=dev)
        self._host64 = torch.zeros(n64, dtype=torch.int64, pin_memory=True)
        self._host32 = torch.zeros(n32, dtype=torch.int32, pin_memory=True)
        d64, d32 = self._dev64, self._dev32
        self.ids, self.positions, self.slots = d64[:3 * t].view(3, t)
        self.draft = d64[3 * t:3 * t + b * k].view(b, k)
        self.lens, self.top_k, self.seeds, self.steps = d64[3 * t + b * k:n64 - 1].view(4, b)
        self.real_rows = d64[n64 - 1:]
        self.seq_lens = d32[:b]
        self.page_table = d32[b:b * (1 + width)].view(b, width)
        self.temperature, self.top_p = d32[b * (1 + width):].view(torch.float32).view(2, b)
        h64, h32 = self._host64.numpy(), self._host32.numpy()
        o = 3 * t + b * k
        lens, top_k, seeds, steps = h64[o:o + 4 * b].reshape(4, b)
        self._h = {"ids": h64[:t], "pos": h64[t:2 * t], "slot": h64[2 * t:3 * t], "draft": h64[3 * t:o].reshape(b, k),
                   "lens": lens, "top_k": top_k, "seeds": seeds, "steps": steps, "real": h64[n64 - 1:],
                   "lens32": h32[:b], "temp": h32[b * (1 + width):b * (2 + width)].view(np.float32),
                   "top_p": h32[b * (2 + width):].view(np.float32)}
        self.page_rows = PageRows(h32[b:b * (1 + width)].reshape(b, width), scratch_page)
        self.query_start = {q: torch.arange(0, (b + 1) * q, q, dtype=torch.int32, device=dev)
                            for q in sorted({q for _, q in self.shapes})}
        # (n, q) -> (the model's graph, {mode: verdict graph}, verdict [n, 1 + q] int64 per mode)
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, dict, dict]] = {}
        self._capture(pool, side)

    def _batch(self, n: int, q: int) -> AttnBatch:
        t = n * q
        return AttnBatch(self.positions[:t], self.slots[:t], self.query_start[q][:n + 1], self.seq_lens[:n],
                         self.page_table[:n], list(range(0, t + 1, q)), [self.width * self.kv.page_size] * n, q)

    def _pad_host(self, q: int) -> None:
        """Every row a padding sequence's: token 0 at positions 0 .. q - 1 of the scratch page."""
        h, page, t = self._h, self.kv.page_size, self._h["ids"].shape[0]
        h["ids"].fill(0)
        h["pos"][:] = np.arange(t) % q
        h["slot"][:] = self.scratch * page + h["pos"] % page
        h["draft"].fill(PAD)
        for name in ("lens", "top_k", "seeds", "steps", "temp"):
            h[name].fill(0)
        h["top_p"].fill(1.0)
        h["lens32"].fill(q)

    def _upload(self) -> None:
        self._dev64.copy_(self._host64, non_blocking=True)
        self._dev32.copy_(self._host32, non_blocking=True)

    def _verdict(self, logits: torch.Tensor, n: int, q: int, mode: str) -> torch.Tensor:
        return verdict(logits.view(n, q, -1), self.draft[:n, :q - 1], self.lens[:n], self.temperature[:n],
                       self.top_k[:n], self.top_p[:n], self.seeds[:n], self.steps[:n], mode)

    @torch.inference_mode()
    def _capture(self, pool, side: torch.cuda.Stream) -> None:
        model = self.model
        decode_rows = model.real_rows  # the decode graphs' count; the replayer reads it while capturing
        model.real_rows = self.real_rows
        try:
            for n, q in sorted(self.shapes, key=lambda s: -s[0] * s[1]):  # largest first: the rest reuse its pool
                self.page_rows.write([])
                self._pad_host(q)
                self._h["real"][0] = n * q
                self._upload()
                batch = self._batch(n, q)

                def run():
                    return model.logits(model.forward(self.ids[:n * q], batch, self.kv))

                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):  # warm-up: compile kernels, size workspaces
                    logits = run()
                    for mode in MODES:
                        self._verdict(logits, n, q, mode)
                torch.cuda.current_stream().wait_stream(side)
                model.reset_experts()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    logits = run()
                verdicts, outs = {}, {}
                for mode in MODES:
                    verdicts[mode] = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(verdicts[mode], pool=pool):
                        outs[mode] = self._verdict(logits, n, q, mode)
                del logits  # its memory goes back to the pool (the module docstring)
                self.graphs[n, q] = (graph, verdicts, outs)
        finally:
            model.real_rows = decode_rows
        model.reset_experts()  # warm-up and capture ran the cache on padding: serve from empty

    def covers(self, n: int, k: int) -> bool:
        """Whether a step of n sequences verifying up to k drafts each has a graph (expert-aware k's
        question: engine/spec_k.py)."""
        return k >= 1 and any(m >= n and q == k + 1 for m, q in self.shapes)

    def fits(self, seqs: list[SeqStep]) -> bool:
        k = max((s.num_draft for s in seqs), default=0)
        return self.covers(len(seqs), k) and all(
            s.sample and s.num_tokens == s.num_draft + 1 and s.params.logprobs is None and not s.params.logit_bias
            and (s.num_draft or s.params.temperature == 0) and s.start + k + 1 <= self.limit for s in seqs)

    @torch.inference_mode()
    def run(self, seqs: list[SeqStep]) -> StepOutput:
        """Replay the verify step of these sequences (fits() holds) -> the step's output: per sequence
        with drafts the kept drafts and one more token, per sequence its last token."""
        n, k = len(seqs), max(s.num_draft for s in seqs)
        q = k + 1
        size = min(m for m, qq in self.shapes if qq == q and m >= n)
        page = self.kv.page_size
        self._pad_host(q)
        h = self._h
        ids, pos, slot, draft = h["ids"], h["pos"], h["slot"], h["draft"]
        for i, s in enumerate(seqs):
            p, d, toks, r = s.start, s.num_draft, s.token_ids, i * q
            for j in range(q):
                at = p + j
                ids[r + j] = toks[min(j, d)]
                pos[r + j] = at
                slot[r + j] = (s.pages[at // page] * page if j <= d else self.scratch * page) + at % page
            draft[i, :d] = toks[1:]
            h["lens"][i], h["top_k"][i], h["seeds"][i], h["steps"][i] = d, s.params.top_k, s.seed, s.sample_index
            h["temp"][i], h["top_p"][i], h["lens32"][i] = s.params.temperature, s.params.top_p, p + q
        self.page_rows.write([s.pages for s in seqs])
        h["real"][0] = n * q
        self._upload()
        mode = mode_of([s.params for s in seqs])
        graph, verdicts, outs = self.graphs[size, q]
        graph.replay()
        verdicts[mode].replay()
        host = outs[mode][:n].tolist()  # NOTE: the step's one host read
        out = StepOutput({}, n * q)
        for s, row in zip(seqs, host):
            got = row[1:row[0] + 2]
            out.sampled[s.request_id] = got[-1]
            if s.num_draft:
                out.emitted[s.request_id] = got
        return out

    def release(self) -> None:
        for graph, verdicts, _ in self.graphs.values():
            graph.reset()
            for g in verdicts.values():
                g.reset()
        self.graphs.clear()
