"""The generic MoE block: a router chooses experts, an expert backend computes them.

    x [T, H] -> router -> topk_ids [T, k], topk_weights [T, k] -> (route hook) -> experts -> [T, H]
                                                                   (+ shared(x): dense shared experts)

The router is the model's (layers/router.py); the expert backend (experts/backends.py: resident,
slots, uva) is built by the loader after the weights are in place and handed to the block, so the
model never knows where its experts live. With expert prefetch (experts/prefetch.py) a block first
asks the next MoE layer's backend to take in the experts predicted from this block's input. The route
hook sees (layer, ids, weights) and may replace them: routing traces record and replay through it
(traces/hooks.py). Shared experts (DeepSeek-V3,
GLM-5) are a dense module every token runs, always on the device, outside the expert tiers.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import torch
from torch import nn

if TYPE_CHECKING:
    from moetier.experts.backends import ExpertBackend

RouteHook = Callable[[int, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


class MoEBlock(nn.Module):
    def __init__(self, layer: int, router: nn.Module, shared: nn.Module | None = None):
        super().__init__()
        self.layer = layer
        self.router = router
        self.shared = shared
        self.experts: ExpertBackend | None = None  # set by the loader (checkpoint/loader.py)
        self.route_hook: RouteHook | None = None
        # Set only while engine/piecewise.py captures a decode step: called instead of the backend, it
        # ends the graph being captured and runs the backend eagerly at replay (backends that are not
        # graph-safe, such as hybrid).
        self.eager_split: Callable | None = None
        # (the next MoE block, a predictor of its experts from this layer's input): set by
        # experts/prefetch.attach_prefetch; its backend's fills start here, before this layer's experts
        # run. The block, not its backend: a backend rebuilt later is never kept alive by the link
        self.prefetch_next: tuple[MoEBlock, Callable] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ids, weights = self.router(x)
        if self.route_hook is not None:
            ids, weights = self.route_hook(self.layer, ids, weights)
        if self.prefetch_next is not None:  # after the hook: a replayed step's ids exist from here
            nxt, predict = self.prefetch_next
            nxt.experts.prefetch(predict, x)
        if self.eager_split is not None:
            out = self.eager_split(self.experts.forward, x, ids, weights)
        else:
            out = self.experts.forward(x, ids, weights)
        return out if self.shared is None else out + self.shared(x)
