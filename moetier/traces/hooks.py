"""The engine's side of routing traces: a recorder that writes the experts each MoE layer chose, and
a replayer that makes the router choose the experts a trace says (the router's weights go to the
trace's experts by position: every router lists its picks largest weight first, layers/router.py, and
the recorder writes them in that order).

Both attach to the model's MoE blocks as `route_hook(layer, topk_ids, topk_weights)`. The recorder
reads ids back to the host once per step (recording is a measurement mode; the engine runs it
without CUDA graphs). The replayer is device-side only (a cursor tensor advanced in place), so it
replays inside the decode graph too.

With speculative decoding a step routes drafts that the verify may reject: the recorder writes, per
sequence, only the rows of the tokens the step made valid (its own tokens and the kept drafts; none
where a rejection rolled recurrent state back, since the next step recomputes those tokens), so every
position of a stream is written once, as without speculation. Loaded MTP layers (models/mtp.py,
layers num_layers and on) route in draft passes after the target's forward: the first of them in a
step, the catch-up, routes exactly the positions the step made valid, in the same order (engine/
spec_step.MtpDrafter), and that is what the recorder writes as the MTP layers' columns; the chained
drafts' passes route positions not verified yet and are left out. The replayer routes MTP layers
from the cursor without moving it (the target's layers move it): a trace with MTP columns gives them
their own, one without takes the layers' columns modulo its count. After a speculative step the
engine moves the cursor back by the rows that made no position valid (Replayer.rewind), which the
next steps route again.
"""

from __future__ import annotations

import numpy as np
import torch

from moetier.errors import MoetierError
from moetier.traces.format import Trace, TraceWriter


class Recorder:
    def __init__(self, net, path, **meta):  # meta: model name, source, ... for the header
        cfg = net.cfg
        self.blocks = net.moe_blocks()
        self.layers = [b.layer for b in self.blocks]  # the target's MoE layers, then any loaded MTP layers
        self.writer = TraceWriter(path, cfg.num_experts, cfg.top_k, self.layers, weights=True, **meta)
        self.num_layers = cfg.num_layers
        self.mtp_layers = [layer for layer in self.layers if layer >= cfg.num_layers]
        self._ids: dict[int, torch.Tensor] = {}
        self._weights: dict[int, torch.Tensor] = {}
        self._streams: dict[str, int] = {}
        for b in self.blocks:
            if b.route_hook is not None:
                raise MoetierError("the model's router already has a hook (a replay?); record and replay "
                                   "cannot run together")
            b.route_hook = self._hook

    def _hook(self, layer: int, ids: torch.Tensor, weights: torch.Tensor):
        # the router's order, largest weight first: the replayer pairs by it. An MTP layer keeps its first
        # pass of the step (the catch-up); the chained drafts' passes route unverified positions
        if layer < self.num_layers or layer not in self._ids:
            self._ids[layer], self._weights[layer] = ids, weights
        return ids, weights

    def end_step(self, request_ids: list[str], counts: list[int], kept: list[int] | None = None,
                 prefill: bool | None = None) -> None:
        """Write the step just run: request_ids[i] computed counts[i] rows, in token order, of which its
        first kept[i] are written (default: all; fewer where drafts were rejected). prefill: the
        record's flag (default: a request computed several rows)."""
        if not self._ids:
            return
        kept = list(counts) if kept is None else kept
        n = sum(kept)
        if n:
            take = None
            if n != sum(counts):  # [n] the written rows' indices among the step's
                starts = np.cumsum([0] + list(counts[:-1]))
                take = torch.from_numpy(np.concatenate([np.arange(a, a + c) for a, c in zip(starts, kept)]))
            ids, weights = [], []
            for layer in self.layers:
                i, w = self._ids[layer], self._weights[layer]
                if layer < self.num_layers and take is not None:
                    i, w = i[take.to(i.device)], w[take.to(w.device)]
                if i.shape[0] != n:
                    raise MoetierError(f"trace recording: layer {layer} routed {i.shape[0]} rows where the step "
                                       f"made {n} positions valid")
                ids.append(i)
                weights.append(w.float())
            seq = np.repeat([self._streams.setdefault(r, len(self._streams)) for r in request_ids], kept)
            self.writer.write(torch.stack(ids).cpu().numpy(), torch.stack(weights).cpu().numpy(), seq,
                              prefill=max(counts) > 1 if prefill is None else prefill)
        self._ids.clear()
        self._weights.clear()

    def close(self) -> None:
        for b in self.blocks:
            b.route_hook = None
        self.writer.close()


class Replayer:
    """Drives the router from a trace: token i of the run gets the ids of token i (mod length) of the
    trace, layer by layer (model MoE layer j takes traced layer j mod L). The weights stay computed."""

    def __init__(self, model, trace: Trace):
        cfg = model.cfg
        if trace.num_experts != cfg.num_experts or trace.top_k != cfg.top_k:
            raise MoetierError(f"the trace routes top-{trace.top_k} of {trace.num_experts} experts; the model "
                               f"routes top-{cfg.top_k} of {cfg.num_experts}: make or record a trace for this model")
        if trace.num_tokens == 0:
            raise MoetierError("the trace holds no tokens")
        self.model, self.blocks = model, model.moe_blocks()
        dev = model.device
        # [L, N, k]: one gather per step takes every layer's ids; each layer then slices its own.
        self.ids = torch.as_tensor(trace.ids, device=dev).permute(1, 0, 2).contiguous()
        self.length = trace.num_tokens
        self.cursor = torch.zeros(1, dtype=torch.int64, device=dev)
        self.slot = {b.layer: i % trace.ids.shape[1] for i, b in enumerate(self.blocks)}
        target = [b.layer for b in self.blocks if b.layer < cfg.num_layers]  # MTP layers: not the step's
        self.first, self.last, self.num_layers = target[0], target[-1], cfg.num_layers
        self._arange = torch.arange(4096, device=dev)
        self._step: torch.Tensor | None = None  # [L, T, k] ids of the step in flight
        for b in self.blocks:
            if b.route_hook is not None:
                raise MoetierError("the model's router already has a hook; record and replay cannot run together")
            b.route_hook = self._hook

    def _hook(self, layer: int, ids: torch.Tensor, weights: torch.Tensor):
        # NOTE: device ops only (graph-safe); three small kernels per step, none per layer. The router's
        # weights go to the trace's experts by position: every router lists them largest first on
        # every device (layers/router.py), so a replay's weights never depend on the device
        t = ids.shape[0]
        if layer >= self.num_layers:  # an MTP layer's draft step: the trace's next tokens, cursor kept
            return self.ids[self.slot[layer], (self.cursor + self._steps(t)) % self.length], weights
        if layer == self.first:
            self._step = self.ids[:, (self.cursor + self._steps(t)) % self.length]
        out = self._step[self.slot[layer]]
        if layer == self.last:
            # in place: a graph replay advances it too, by its real rows only (the padding rows took trace
            # rows after them, which the next step routes again), so a run routes as it would eagerly
            capturing = self.model.real_rows is not None and torch.cuda.is_current_stream_capturing()
            self.cursor.add_(self.model.real_rows if capturing else t)
        return out, weights

    def rewind(self, rows: int) -> None:
        """Move the cursor back by `rows`: a speculative step's rows that made no position valid (rejected
        drafts, or a step rolled back), which the next steps route again, as a run without speculation
        routes each position once (one process: engine/llm.py). Between steps only."""
        if rows:
            self.cursor.sub_(rows)

    def peek(self, layer: int, t: int) -> torch.Tensor:
        """The step's ids [t, k] for `layer` (a target MoE layer after the step's first), the cursor
        untouched: the 'trace' predictor of expert prefetch (experts/prefetch.py)."""
        if self._step is None or layer == self.first or layer >= self.num_layers:
            raise MoetierError(f"layer {layer}'s replayed ids are known only after the step's first MoE layer")
        return self._step[self.slot[layer], :t]

    def _steps(self, t: int) -> torch.Tensor:
        return self._arange[:t] if t <= self._arange.numel() else torch.arange(t, device=self._arange.device)

    def close(self) -> None:
        for b in self.blocks:
            b.route_hook = None
