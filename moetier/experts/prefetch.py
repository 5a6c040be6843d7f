"""Next-layer expert prefetch (issue 33; docs/prefetch.md measured the predictors first): as soon as
MoE layer l has its input, the slot cache of the next MoE layer takes in the experts a predictor names
for the step's tokens, so their fills cross the link while layer l's experts (and layer l+1's
attention) run, instead of after layer l+1's router, serially with its compute.

    attach_prefetch(model, mode, replayer=None) -> links made    (engine/llm.py, after the replayer)
    detach_prefetch(model)                                       (LLM.close: a bench's next row)

Modes (ExpertOptions.prefetch):
    off     nothing (the default until the H200 measures the mechanism)
    router  layer l+1's router on layer l's MoE input ("router@moe-in", the predictor worth building
            in docs/prefetch.md: about 0.6 of the misses named from the second MoE layer on)
    trace   the replayed trace's layer-l+1 experts of the step's tokens: a perfect predictor, for
            benchmarks on random weights (whose routers predict nothing of a trace): the most a
            prefetch can save; needs a replayed trace

Only backends with `prefetches` (SlotExperts; not hybrid, whose misses the host may compute, nor the
parallel wrappers) take a link, and only decode steps prefetch. What a prefetch is, in the backend
(SlotExperts.prefetch): one step of layer l+1's slot cache over the named experts (a warm step: it may
evict a row the real step then misses, as docs/prefetch.md simulated), its counters apart from the
cache's (stats "prefetch_*"), and the fill of its misses; on CUDA on a side stream forked from the
step's stream and joined at layer l+1's forward, so a CUDA graph captures both. The real routing still
decides and every expert's row holds the same bytes wherever it sits, so outputs are bit-exact with
prefetch off: only where rows sit and what crosses the link when change.
"""

from __future__ import annotations

from typing import Callable

import torch

from moetier.errors import MoetierError

MODES = ("off", "router", "trace")

Predict = Callable[[torch.Tensor], torch.Tensor]  # layer l's MoE input [T, H] -> layer l+1's ids [T, k']


def check_mode(mode: str) -> str:
    if mode not in MODES:
        raise ValueError(f"unknown expert prefetch {mode!r}; one of {', '.join(MODES)}")
    return mode


def attach_prefetch(model, mode: str, replayer=None) -> int:
    """Link every MoE block to the next one whose backend prefetches: returns the links made."""
    check_mode(mode)
    detach_prefetch(model)
    if mode == "off":
        return 0
    if mode == "trace" and replayer is None:
        raise MoetierError("expert prefetch 'trace' predicts from the replayed routing: give a trace to replay "
                           "(--replay-trace / --trace), or use prefetch 'router'")
    blocks = [b for b in model.moe_blocks() if b.layer < model.cfg.num_layers]  # not MTP layers
    links = 0
    for cur, nxt in zip(blocks, blocks[1:]):
        if not getattr(nxt.experts, "prefetches", False):
            continue
        cur.prefetch_next = (nxt, predictor(mode, nxt, replayer))
        links += 1
    return links


def predictor(mode: str, nxt, replayer) -> Predict:
    """The guess of block `nxt`'s experts from the previous MoE layer's input x [T, H]."""
    if mode == "router":
        return lambda x: nxt.router(x)[0]  # no route hook: a guess moves no trace cursor
    return lambda x: replayer.peek(nxt.layer, x.shape[0])


def detach_prefetch(model) -> None:
    for b in model.moe_blocks():
        b.prefetch_next = None


_SIDE: dict[torch.device, torch.cuda.Stream] = {}


def side_stream(device: torch.device) -> torch.cuda.Stream:
    """The one stream a device's prefetches run on (forked from the step's stream, joined by the next
    MoE layer: at most one prefetch is in flight, so one stream serves every layer)."""
    if device.type == "cuda" and device.index is None:  # "cuda" and "cuda:0" are one device
        device = torch.device("cuda", torch.cuda.current_device())
    if device not in _SIDE:
        _SIDE[device] = torch.cuda.Stream(device=device)
    return _SIDE[device]
