"""The engine's side of routing traces: a recorder that writes the experts each MoE layer chose, and
a replayer that makes the router choose the experts a trace says (the router's weights go to the
trace's experts by position: every router lists its picks largest weight first, layers/router.py, and
the recorder writes them in that order).

Both attach to the model's MoE blocks as `route_hook(layer, topk_ids, topk_weights)`. The recorder
reads ids back to the host once per step (recording is a measurement mode; the engine runs it
without CUDA graphs). The replayer is device-side only (a cursor tensor advanced in place), so it
replays inside the decode graph too.

Loaded MTP layers (models/mtp.py, layers num_layers and on) run in draft steps of their own, not in
the target's: the recorder leaves them out of the trace (NOTE: their routing is not recorded yet),
and the replayer routes them from the cursor without moving it (the target's layers move it).
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
        self.layers = [b.layer for b in self.blocks if b.layer < cfg.num_layers]  # the target's, not MTP
        self.writer = TraceWriter(path, cfg.num_experts, cfg.top_k, self.layers, weights=True, **meta)
        self.num_layers = cfg.num_layers
        self._ids: dict[int, torch.Tensor] = {}
        self._weights: dict[int, torch.Tensor] = {}
        self._streams: dict[str, int] = {}
        for b in self.blocks:
            if b.route_hook is not None:
                raise MoetierError("the model's router already has a hook (a replay?); record and replay "
                                   "cannot run together")
            b.route_hook = self._hook

    def _hook(self, layer: int, ids: torch.Tensor, weights: torch.Tensor):
        if layer < self.num_layers:  # the router's order, largest weight first: the replayer pairs by it
            self._ids[layer], self._weights[layer] = ids, weights
        return ids, weights

    def end_step(self, request_ids: list[str], counts: list[int]) -> None:
        """Write the step just run: `counts[i]` tokens of request `request_ids[i]`, in token order."""
        if not self._ids:
            return
        ids = torch.stack([self._ids[layer] for layer in self.layers]).cpu().numpy()
        weights = torch.stack([self._weights[layer].float() for layer in self.layers]).cpu().numpy()
        seq = np.repeat([self._streams.setdefault(r, len(self._streams)) for r in request_ids], counts)
        self.writer.write(ids, weights, seq, prefill=max(counts) > 1)
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
