"""Expert-aware k, per step (spec/expert_k.py's cost model, docs/speculative.md): before each step
the engine picks the number of drafts (0 .. num_speculative_tokens) with the most expected tokens per
second, from what it measured:

    acceptance [K]   spec/expert_k.AcceptanceMeter, fed by every verify row's (kept, drafted)
    routing [L, E]   each target MoE layer's expert shares, a moving average of the experts its router
                     chose (counted on the device by a route hook, read between steps)
    resident [L, E]  where each expert sits now: every one under resident, none under uva, the slot
                     cache's mapped experts under slots and hybrid (expert_slot >= 0: pinned ones too);
                     under expert parallelism rank 0's own experts only (E / ep columns of the routing:
                     each rank fills its own misses, alongside the others)
    StepCosts        timed or measured on this machine, never assumed:
                     - fixed: the dense bytes over the HBM rate, or more where a one-row step was
                       timed longer (its launches: an eager step on a GPU costs several times its
                       bytes); one expert row from HBM and over the link: copies of an
                       expert-row-sized buffer, HBM to HBM and pinned host to device (on the CPU
                       both are one memcpy)
                     - per_token and fixed: each row's cost and a one-row step's in an eager step,
                       timed at start on the pool's scratch page (row_seconds); with decode graphs,
                       replaced after capture by the replays' (graphs.DecodeGraphs.step_costs), which
                       also give the eager step's cost over a replay, charged to the steps that run
                       eagerly
                     - with MTP drafting, one chained MTP pass, timed at start on the scratch page
                       (draft_pass_seconds; the drafter makes the step's k drafts for the next step,
                       engine/speculation.draft_next, so a smaller k saves passes too)
                     - under hybrid, the host cores' seconds per expert row from the backend's own
                       calibration (experts/hybrid/cost_model.CostModel.host_row_s)
                     One process only: under several ranks nothing is timed on the model (rank 0
                     alone would run collectives without its workers) and those terms are 0.

The reads (routing, resident mask) are two small host reads between steps, never inside one.
"""

from __future__ import annotations

import math
import time
from dataclasses import replace

import torch

from moetier.experts.backends import UvaExperts
from moetier.experts.hybrid.cost_model import CostModel
from moetier.experts.parallel.ep import owned_experts
from moetier.layers.attention import make_batch
from moetier.spec.expert_k import AcceptanceMeter, StepCosts, choose_k

DECAY = 0.9  # the routing shares' moving average per step: recent steps weigh most
PRIOR = 0.7  # acceptance assumed before any verify step (optimistic: k > 0 is tried, then measured)
TIMED_BYTES = 32 * 2**20  # the smallest copy the link and HBM rates are timed over
RETRY = 0.02  # per step without a verify, the measured acceptance moves this share back to PRIOR


def _seconds(fn, device: torch.device, reps: int = 5) -> float:
    # the fastest of reps after a warm-up call: other work on the device (another process's kernels
    # time-slicing the GPU, a busy host) only ever adds time, and a median of five can still take it
    times = []
    for _ in range(reps + 1):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t0)
    return min(times[1:])


def measured_costs(model, row_bytes: int, dense_bytes: int) -> StepCosts:
    """StepCosts from copies timed on this machine (never assumed rates). The rates are timed over at
    least TIMED_BYTES: a step's misses move together, so an expert costs its bytes at the link's rate,
    and one small row's copy would time the launch instead (a tiny model's rows are tens of kB: the
    link then timed faster than HBM on an H200)."""
    dev = model.device
    n = max(row_bytes, TIMED_BYTES)
    src = torch.empty(n, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    host = torch.empty(n, dtype=torch.uint8, pin_memory=dev.type == "cuda")
    hbm = n / max(_seconds(lambda: dst.copy_(src), dev), 1e-9)
    link = n / max(_seconds(lambda: dst.copy_(host, non_blocking=True), dev), 1e-9)
    return StepCosts.from_rates(dense_bytes, row_bytes, hbm, link, per_token_s=0.0)


def resident_mask(block, e: int) -> torch.Tensor:
    """[e] bool: the experts of this MoE block (this rank's e under expert parallelism, by local id) in
    device memory now (one host read for a cache)."""
    ex = getattr(block.experts, "inner", block.experts)  # experts/parallel/ep.ShardedExperts
    cache = getattr(ex, "cache", None)
    if cache is not None:
        return (cache.expert_slot >= 0).cpu()
    return torch.zeros(e, dtype=torch.bool) if isinstance(ex, UvaExperts) else torch.ones(e, dtype=torch.bool)


def host_expert_seconds(blocks) -> float | None:
    """Under hybrid, the host cores' seconds for one expert row (the backend's calibrated cost model;
    every layer's host path runs the same kernel over rows of one size); None for other backends."""
    for b in blocks:
        ex = getattr(b.experts, "inner", b.experts)  # experts/parallel/ep.ShardedExperts
        model = getattr(ex, "model", None)
        if isinstance(model, CostModel):
            return model.host_row_s if math.isfinite(model.host_row_s) else None
    return None


def _unhooked(model, fn, dev) -> float:
    """fn timed with no route hook seeing it (a recorder would keep its routing, a replayer move its
    cursor, the chooser count it); the expert caches emptied afterwards."""
    blocks = model.moe_blocks()
    hooks = [b.route_hook for b in blocks]
    try:
        for b in blocks:
            b.route_hook = None
        return _seconds(fn, dev)
    finally:
        for b, h in zip(blocks, hooks):
            b.route_hook = h
        model.reset_experts()


def draft_pass_seconds(model, kv, scratch_page: int) -> float:
    """One chained MTP pass of one sequence, timed: model.draft on token 0 at position 0 of the pool's
    scratch page (no request owns it)."""
    dev = model.device
    ids = torch.zeros(1, dtype=torch.int64, device=dev)
    hidden = torch.zeros(1, model.cfg.hidden_size, dtype=model.dtype, device=dev)
    batch = make_batch([(0, 1, [scratch_page])], kv.page_size, dev)
    return _unhooked(model, lambda: model.draft(ids, hidden, batch, kv), dev)


def row_seconds(model, kv, scratch_page: int, state_slot: int, rows: int) -> tuple[float, float]:
    """(a one-row eager step's seconds, each further row's): `rows` one-token sequences against one,
    timed, each at position 0 of the pool's scratch page (and the spare state slot), token 0
    everywhere, so the rows route alike and the union of experts (priced apart) does not grow."""
    dev = model.device
    state = getattr(kv, "state", None) is not None

    def step(n: int):
        batch = make_batch([(0, 1, [scratch_page])] * n, kv.page_size, dev, [state_slot] * n if state else None)
        ids = torch.zeros(n, dtype=torch.int64, device=dev)
        return lambda: model.logits(model.forward(ids, batch, kv))

    one, many = _unhooked(model, step(1), dev), _unhooked(model, step(rows), dev)
    return one, max(0.0, (many - one) / max(rows - 1, 1))


def attach_chooser(spec, model, kv=None, config=None) -> None:
    """Give the scheduler's Speculation (engine/speculation.py) its KChooser when the config asks for
    expert-aware k (and the model has MoE layers); None or off: nothing. Timed on kv's scratch page
    (config: the engine's EngineConfig; kv None, several ranks: nothing timed, those terms 0): each
    row's cost in an eager step (decode graphs, once captured, replace it: time_graphs) and, drafting
    with MTP, one chained pass."""
    if spec is not None and spec.config.expert_aware_k and model.moe_blocks():
        spec.chooser = c = KChooser(model, spec.config.num_speculative_tokens)
        if kv is not None:
            rows = max(2, min(config.max_num_seqs, config.decode_tokens))
            one, per_token = row_seconds(model, kv, config.num_pages, config.max_num_seqs, rows)
            c.costs = replace(c.costs, per_token_s=per_token, fixed_s=max(c.dense_s, one - per_token))
            if spec.mtp:
                c.costs = replace(c.costs, draft_pass_s=draft_pass_seconds(model, kv, config.num_pages))


def time_graphs(spec, graphs, verify=None) -> None:
    """After the decode graphs' capture (one process: a worker rank would not replay with rank 0 here),
    give the chooser the eager step's cost over a replay and each row's cost (DecodeGraphs.step_costs),
    and which steps replay: k = 0 up to the decode graphs' largest batch, k > 0 where the verify graphs
    (verify_graphs.VerifyGraphs, or None) hold the batch and k."""
    chooser = getattr(spec, "chooser", None)
    if chooser is not None and graphs is not None:
        dev = chooser.device
        eager_s, per_token_s, replay_s = graphs.step_costs(lambda fn: _seconds(fn, dev))
        chooser.costs = replace(chooser.costs, per_token_s=per_token_s,
                                fixed_s=max(chooser.dense_s, replay_s - per_token_s))
        chooser.eager_s, chooser.replay_batch = eager_s, graphs.max_batch
        chooser.verify_covers = verify.covers if verify is not None else None


class KChooser:
    def __init__(self, model, max_k: int, costs: StepCosts | None = None):
        cfg = model.cfg
        self.blocks = [b for b in model.moe_blocks() if b.layer < cfg.num_layers]  # the target's layers
        self.max_k, self.top_k = max_k, cfg.top_k
        self.meter, self.prior = AcceptanceMeter(max_k, PRIOR), PRIOR
        e = cfg.num_experts
        self.counts = torch.zeros(len(self.blocks), e, dtype=torch.float32, device=model.device)
        self.routing = torch.full((len(self.blocks), e), 1.0 / e, dtype=torch.float64)  # uniform until measured
        self.rates: list[float] = []
        self.primed = False  # the first counts are the graph capture's warm-up steps: dropped
        for i, b in enumerate(self.blocks):
            b.route_hook = self._hook(i, b.route_hook)
        if costs is None:  # the routed experts are the backends' tensors, not the model's parameters
            row = self.blocks[0].experts.layout.row_bytes(model.dtype)
            costs = measured_costs(model, row, sum(p.numel() * p.element_size() for p in model.parameters()))
            costs = replace(costs, host_expert_s=host_expert_seconds(self.blocks))
        self.costs, self.num_experts, self.device = costs, e, model.device
        self.dense_s = costs.fixed_s  # the dense bytes' share of fixed: its floor when a step is timed
        # a k = 0 step of up to replay_batch sequences replays a decode graph, a verify step of n sequences
        # and k drafts one where verify_covers(n, k) (n-gram drafting); every other step runs eagerly and
        # pays eager_s more (time_graphs; 0 without graphs: every step eager alike)
        self.eager_s, self.replay_batch = 0.0, 0
        self.verify_covers = None
        # expert parallelism: this rank prices its own experts (each rank fills its own misses, in
        # parallel with the others), the routing shares' columns it owns against its local residency
        ex = self.blocks[0].experts
        self.own = (torch.tensor(owned_experts(e, ex.rank, ex.ep)) if getattr(ex, "over", None) == "ep" else None)

    def _hook(self, i: int, inner):
        def hook(layer: int, ids: torch.Tensor, weights: torch.Tensor):
            if inner is not None:  # a replayed trace chooses first; its choice is what the step routes
                ids, weights = inner(layer, ids, weights)
            self.counts[i].index_add_(0, ids.reshape(-1).clamp_min(0),
                                      torch.ones(ids.numel(), dtype=torch.float32, device=ids.device))
            return ids, weights
        return hook

    def observe(self, outcomes: list[tuple[int, int]]) -> None:
        """The step just run: (drafted, kept) per verify row; its routing counts folded in. A step that
        verified nothing moves the acceptance back toward the meter's prior by RETRY, so that a k of 0
        chosen on poor acceptance is tried again once the text may have changed."""
        if outcomes:
            kept, drafted = torch.tensor([[k, d] for d, k in outcomes], dtype=torch.int64).T
            self.meter.update(kept, drafted)
        else:
            self.meter.rate += RETRY * (self.prior - self.meter.rate)
        counts = self.counts.double().cpu()
        self.counts.zero_()
        if not self.primed:
            self.primed, counts = True, torch.zeros_like(counts)
        seen = counts.sum(-1, keepdim=True)
        shares = counts / seen.clamp_min(1) / self.top_k  # each token picks top_k experts
        self.routing = torch.where(seen > 0, DECAY * self.routing + (1 - DECAY) * shares, self.routing)

    def choose(self, batch: int) -> int:
        """The k for the next step of `batch` decoding sequences (0 when none decodes)."""
        if batch == 0:
            return self.max_k
        routing = self.routing if self.own is None else self.routing[:, self.own]
        resident = torch.stack([resident_mask(b, routing.shape[1]) for b in self.blocks])
        costs = replace(self.costs, eager_s=self.eager_s)
        covers = self.verify_covers or (lambda n, k: False)
        eager = [not (batch <= self.replay_batch if k == 0 else covers(batch, k)) for k in range(self.max_k + 1)]
        k, self.rates = choose_k(self.max_k, batch, self.meter.rate, routing, resident, self.top_k, costs, eager)
        return k
