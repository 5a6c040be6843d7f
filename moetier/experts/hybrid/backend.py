"""The `hybrid` expert backend: the slot cache (slots.py) whose misses are each either filled into a
slot over the link and computed on the device, or computed by the host cores from the host store
(cpu_experts.py), as the cost model (cost_model.py) chooses per step and layer.

One decode step of one MoE layer (T tokens x k pairs, P = T * k):
  1. down:   topk ids with where each expert sits now (expert_slot[ids]), as one [2, P] int32 copy, and
             the hidden state [T, H] go to pinned host buffers; one event wait.
             NOTE: this is the layer's one host sync, by nature: the choice needs the miss list on the
             host. The copies are small (2P int32 and T x H: 128 KiB at T = 32, H = 2048 in bf16). The
             weights stay on the device: host pairs come back unweighted. So this layer runs eagerly
             between the engine's graph pieces (engine/piecewise.py reads ExpertBackend.graph_safe);
             hybrid_nodes.py makes the choice on the device instead (the CUDA default).
  2. choose: misses (distinct experts not in a slot, in order of first appearance) with their token
             counts -> CostModel.split -> the host set. Host-set experts are never filled (their bytes
             do not cross the link); the cache sees only the other pairs.
  3. host:   the host kernel computes the host pairs' outputs (unweighted) from the host store while
             the device path runs: pairs compacted to [n, 1] (each pair its own "token" row of x), the
             cache step, fills, the grouped GEMM; the device pairs' outputs land in y [P, H] at their
             pair positions. The host call is started before the device launches (host_path.py): the
             compiled kernel on its own native thread (no GIL to take back), its threads one fewer than
             the cores so that this thread keeps one to launch on. On CUDA the device path is launched
             kernel by kernel.
  4. combine: the host outputs go up into y at theirs; one fixed-order combine over k, the one the
             resident backend uses on this device (Triton on CUDA, reference.combine on the CPU).
A pair's output depends only on its token and its row's bytes, whichever pairs share its step; so
the result for a given choice is reproducible, and when every miss goes over the link (or there is
none) the layer takes the slots path unchanged: bit-exact against slots and resident.

On the CPU the same steps run with the 'device' being the CPU (CI tests it): the device path is the
reference (expert_pairs over slot rows), the host path the same host kernel as on a CUDA machine.
Steps above the decode limit (prefill) bypass the cache as in slots.
A pair with a negative id (experts/parallel/ep.NOT_MINE) is neither device nor host work: no miss, in no
position list, its y row zero on the CPU and skipped by the combine on CUDA.
"""

from __future__ import annotations

import time
from contextlib import contextmanager

import torch

from moetier.experts.backends import SlotExperts
from moetier.experts.cache.split import cached_run
from moetier.experts.hybrid.cost_model import CostModel, rate_key
from moetier.experts.hybrid.host_kernels import compute_dtype
from moetier.experts.kernels.gemm_config import GemmConfig
from moetier.experts.hybrid.host_path import HostPath, _Job, _timed
from moetier.experts.reference import combine, expert_pairs
from moetier.experts.shape import RowLayout

_COMPILED: set[tuple] = set()  # shapes whose kernel variants HybridExperts._precompile has compiled


class HybridExperts(SlotExperts):
    """S slots over the host store; misses filled over the link or computed on the host."""

    name = "hybrid"
    graph_safe = False  # one host sync per layer (see the module NOTE)
    prefetches = False  # its misses may be computed on the host: a prefetch would fill them in vain

    def __init__(self, host_rows: torch.Tensor, layout: RowLayout, top_k: int, num_slots: int,
                 decode_tokens: int = 64, device: torch.device | str = "cpu", policy: str = "lfru",
                 gemm: GemmConfig = GemmConfig(), host: HostPath | None = None, pinned: tuple[int, ...] = (),
                 device_rows: torch.Tensor | None = None):
        super().__init__(host_rows, layout, top_k, num_slots, decode_tokens, device, policy, gemm,
                         pinned=pinned, device_rows=device_rows)
        self.hostpath = host or HostPath(layout)
        # calibrated on cached rows only: a split store backs no pinned row (experts/cache/split.py)
        rates = self.hostpath.calibrate(cached_run(host_rows, pinned), self.slots)
        self.model = CostModel(rates, host_rows.shape[1] * host_rows.element_size(),
                               rate_key(layout.quant, host_rows.dtype))
        self.host_experts = self.host_pairs = 0  # counted on the host: the choice is made there
        # steps served all on the host (no cache step); the cache counts the others, graph replays included
        self.host_only_steps = 0
        self._link_only = False  # link_only(): the choice sends nothing to the host
        # False: forward is the slots step alone (graph-safe); the engine's whole-graph variant is
        # captured so, for steps where the host path is not worth its sync (engine/switch.Switch)
        self.host_enabled = True
        self.host_us = 0.0  # wall time of the host kernel calls (on the thread that ran them)
        self.phases = None  # a hybrid_phases.PhaseClock while profile() has turned it on
        if self.cuda:
            self._ev = torch.cuda.Event()
            self._precompile()

    def forward(self, hidden, topk_ids, topk_weights):
        t, k = topk_ids.shape
        if t > self.decode_tokens:
            return self._bypass(hidden, topk_ids, topk_weights)
        if not self.host_enabled:
            return super().forward(hidden, topk_ids, topk_weights)
        clock = self.phases
        marks = {} if clock is not None else None
        t0 = time.perf_counter() if clock is not None else 0.0
        ids, slot_now, x = self._down(hidden, topk_ids)
        if marks is not None:
            marks["sync"] = time.perf_counter()
            if self.cuda:
                self._poll_device(clock)  # after the sync: the previous call's events are complete
        host_set = self.choose(ids, slot_now, t)
        if not host_set:
            out = super().forward(hidden, topk_ids, topk_weights)  # the slots step, unchanged
            if marks is not None:
                marks["choose"] = marks["done"] = time.perf_counter()
                clock.add_slots(t0, marks)
            return out
        host_pos = [p for p, e in enumerate(ids) if e in host_set]
        gpu_pos = [p for p, e in enumerate(ids) if e >= 0 and e not in host_set]  # e < 0: nobody's work
        self.host_experts += len(host_set)
        self.host_pairs += len(host_pos)
        self.host_only_steps += not gpu_pos
        if marks is not None:
            marks["choose"] = time.perf_counter()
        # the host call first: it runs while the device path launches
        job = self._start_host(x, host_pos, [ids[p] for p in host_pos], k, marks)
        try:
            if self.cuda:
                y, hpos = self._device_cuda(hidden, topk_ids, topk_weights, gpu_pos, host_pos)
            else:
                y = hidden.new_zeros(t * k, self.layout.hidden)  # pair outputs as expert_pairs keeps them (0: id < 0)
                self._device_cpu(hidden, topk_ids, gpu_pos, y)
        except BaseException:
            job.result()  # the host call writes buffers of ours: never leave it running
            raise
        if marks is not None:
            marks["launched"] = time.perf_counter()
        got = job.result()
        begin, end = job.times
        self.host_us += (end - begin) * 1e6
        if marks is not None:
            marks["host_begin"], marks["host_end"], marks["joined"] = begin, end, time.perf_counter()
            if self.cuda and gpu_pos:
                clock.device(finished_first=self._ev_dev[1].query())
        if self.cuda:
            out = self._combine_cuda(hidden, topk_ids, topk_weights, got, hpos, y)
        else:
            y[torch.tensor(host_pos)] = got.to(y.dtype)
            out = combine(y.view(t, k, -1), topk_weights)
        if marks is not None:
            marks["done"] = time.perf_counter()
            clock.add(t0, marks)
        return out

    def _start_host(self, x, host_pos: list[int], experts: list[int], k: int, marks: dict | None) -> _Job:
        """Hand the host pairs to the host kernel, built here and started on another thread (the compiled
        kernel's native one, else the worker); -> a job whose result() is [nh, H] (fp32 from the compiled
        kernel, the compute dtype from torch's) and whose times are the kernel's (start, end) on the
        perf_counter clock."""
        hp = self.hostpath
        cd = compute_dtype(self.host, x.dtype)
        xs = x if x.dtype == cd else x.to(cd)
        # one tensor of tokens then experts, the division in Python: fewer torch calls on this thread
        both = torch.tensor([p // k for p in host_pos] + experts)
        tok, exp = both[:len(host_pos)], both[len(host_pos):]
        # compiled: its own native thread, no GIL; on CUDA straight into the pinned upload buffer
        out = hp.buffer("y", (len(host_pos), self.layout.hidden), torch.float32, True) if self.cuda else None
        if marks is not None:
            marks["host_args"] = time.perf_counter()  # host_start - host_args: the hand-over alone
        native = hp.kernel.start(xs, tok, exp, self.host, out)
        job = _Job(native) if native is not None else _Job(
            hp.worker.submit(_timed, hp.kernel.pair_outputs, xs, tok, exp, self.host))
        if marks is not None:
            marks["host_start"] = time.perf_counter()
        return job

    @contextmanager
    def link_only(self):
        """Every miss over the link while inside: the engine times the host path's own cost so (its sync
        and choice here; the plan, the node and the copies in the nodes mode), at no host work."""
        self._link_only = True
        try:
            yield
        finally:
            self._link_only = False

    def choose(self, ids: list[int], slot_now: list[int], t: int) -> set[int]:
        """The host set: misses in order of first appearance, tokens per miss, the cost model's split."""
        if self._link_only:
            return set()
        tokens: dict[int, int] = {}
        for e, s in zip(ids, slot_now):
            if s < 0 <= e:  # a negative id is no expert of this layer (experts/parallel/ep.NOT_MINE)
                tokens[e] = tokens.get(e, 0) + 1  # a token lists an expert once: pairs == tokens
        if not tokens:
            return set()
        split = self.model.split(list(tokens.values()))
        return {e for e, h in zip(tokens, split.host) if h}

    def _down(self, hidden, topk_ids):
        """-> (ids [P] and their slots now [P], as host lists; hidden [T, H] on the host)."""
        slot_now = self.cache.expert_slot[topk_ids.clamp(min=0)]  # moot where the id is negative
        if not self.cuda:
            return topk_ids.reshape(-1).tolist(), slot_now.reshape(-1).tolist(), hidden
        t, k = topk_ids.shape
        hp = self.hostpath
        both = hp.buffer("ids", (2, t * k), torch.int32, True)
        both.copy_(torch.stack((topk_ids.reshape(-1).int(), slot_now.reshape(-1))), non_blocking=True)
        x = hp.buffer("x", (t, hidden.shape[1]), hidden.dtype, True)
        x.copy_(hidden, non_blocking=True)
        self._ev.record()
        self._ev.synchronize()  # NOTE: the layer's one host sync (module docstring)
        ids, slots = both.tolist()
        return ids, slots, x

    def _device_cpu(self, hidden, topk_ids, gpu_pos: list[int], y: torch.Tensor) -> None:
        if not gpu_pos:
            return
        k = topk_ids.shape[1]
        g = torch.tensor(gpu_pos)
        g_ids = topk_ids.reshape(-1)[g].view(-1, 1)
        slot_ids, miss = self.cache.step_reference(g_ids)
        self._fill_reference(miss)
        keys = torch.where(slot_ids >= 0, slot_ids.long(), self.cache.num_rows + g_ids)
        y[g] = expert_pairs(hidden[g // k], keys, self._fetcher(hidden.dtype), self.layout.swiglu_limit)[:, 0]

    def _device_cuda(self, hidden, topk_ids, topk_weights, gpu_pos, host_pos):
        """Launch the device path (nothing waits here): -> (y [P, H] fp32 with the device pairs' outputs
        to come, host pair positions on the device)."""
        timed = self.phases is not None
        t, k = topk_ids.shape
        ng, nh = len(gpu_pos), len(host_pos)
        plan = self.hostpath.buffer("plan", (ng + nh,), torch.int64, True)
        plan.numpy()[:] = gpu_pos + host_pos  # straight into the pinned buffer (no tensor built first)
        perm = plan.to(self.device, non_blocking=True)  # one upload: device pairs, then host pairs
        gpos, hpos = perm[:ng], perm[ng:]
        y = self.hostpath.buffer("pairs", (t * k, self.layout.hidden), torch.float32, device=self.device)
        if ng:
            if timed:
                self._ev_dev[0].record()
            scratch_out = torch.empty(ng, self.layout.hidden, dtype=torch.float32, device=self.device)
            self.device_pairs(hidden[gpos // k].contiguous(), topk_ids.reshape(-1)[gpos].view(ng, 1),
                              topk_weights.reshape(-1)[gpos].view(ng, 1), gpos, scratch_out, y)
            if timed:
                self._ev_dev[1].record()
                self._dev_pending = True
        return y, hpos

    def device_pairs(self, x, g_ids, g_w, gpos, out, y) -> None:
        """The device pairs' launches, eager (_device_cuda) or captured in the nodes graph (hybrid_nodes.py):
        the cache's step over g_ids [n, 1], the fills, the grouped GEMM over x [n, H] (its weighted output to
        out [n, H], unused), each pair's unweighted fp32 output into y at its position gpos [n]."""
        from moetier.experts.kernels.grouped_gemm import grouped_expert_mlp
        from moetier.experts.cache.slot_kernels import bookkeeping, copy_rows

        slot_ids = bookkeeping(self.cache, self._scratch, g_ids)
        copy_rows(self._host_dev, self.slots, self._scratch, self._copy_programs)
        grouped_expert_mlp(x, slot_ids, g_ids, g_w, self.slots, self._host_dev, self.layout.hidden,
                           self.layout.inter, self._work, out, self.gemm, self.layout.quant, self.layout.swiglu_limit)
        y.index_put_((gpos,), self._work.y[:g_ids.shape[0]])

    def _combine_cuda(self, hidden, topk_ids, topk_weights, got, hpos, y) -> torch.Tensor:
        from moetier.experts.kernels.grouped_gemm import combine_pairs

        out_host = self.hostpath.buffer("y", tuple(got.shape), got.dtype, True)
        if out_host.data_ptr() != got.data_ptr():  # host-first's compiled kernel wrote it there already
            out_host.copy_(got)
        y[hpos] = out_host.to(self.device, non_blocking=True).float()
        return combine_pairs(y, topk_weights, topk_ids, self._decode_out(hidden))  # skips ids < 0 (y unwritten)

    def _poll_device(self, clock) -> None:
        """The previous call's device-path GPU time (its events are complete: this call's sync came after)."""
        if getattr(self, "_dev_pending", False) and self._ev_dev[1].query():
            clock.device(gpu_s=self._ev_dev[0].elapsed_time(self._ev_dev[1]) / 1e3)
            self._dev_pending = False

    def profile(self, on: bool = True) -> None:
        """Turn the phase clock on (a fresh one) or off (hybrid_phases.py)."""
        from moetier.experts.hybrid.phases import PhaseClock

        self.phases = PhaseClock() if on else None
        self._dev_pending = False
        if on and self.cuda and not hasattr(self, "_ev_dev"):
            self._ev_dev = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))

    def host_count(self) -> int:
        """Experts served on the host so far (engine/switch.Switch): counted here, the choice is the host's."""
        return self.host_experts

    def host_saving_s(self, misses: float) -> float:
        """Seconds per layer-step the host path should save at `misses` misses a step (one token each):
        all over the link against the cost model's split. For the engine's choice of graphs."""
        m = round(misses)
        return self.model.all_link_s(m) - self.model.split([1] * m).seconds if m > 0 else 0.0

    def _precompile(self) -> None:
        """Compile, at build, the kernel variants the compacted device pairs can need: Triton specializes
        the bookkeeping kernel on BLOCK_N (the next power of two of the pairs) and the GEMM's plan on its
        block count, both on whether the count divides by 16; a step's count of device pairs is any of
        1..T*k, so without this a timed step could pay a compile. Throwaway cache, ids and outputs; once
        per process and shape."""
        from moetier.experts.kernels.grouped_gemm import (
            PLAN_BLOCK,
            combine_pairs,
            grouped_expert_mlp,
        )
        from moetier.experts.cache.slot_kernels import BookkeepingScratch, bookkeeping
        from moetier.experts.cache.slots import SlotCache

        c, k, p, dev = self.cache, self.top_k, self.decode_tokens * self.top_k, self.device
        xdt = compute_dtype(self.slots, torch.bfloat16)  # the hidden dtype: FP8 checkpoints run bf16
        key = (self.layout, k, c.num_experts, c.num_slots, p, self.slots.dtype, str(self.cache.policy))
        if key in _COMPILED:
            return
        sizes = {1, 2, 16, 17, 32, 33}
        for b in range(1, -(-p // PLAN_BLOCK) + 1):
            sizes |= {PLAN_BLOCK * b - 15, PLAN_BLOCK * b}
        cache = SlotCache(c.num_experts, c.num_slots, dev, c.policy)
        scratch = BookkeepingScratch(c.num_experts, c.num_slots, p, dev)
        x = torch.zeros(p, self.layout.hidden, dtype=xdt, device=dev)
        w = torch.ones(p, 1, device=dev)
        out = torch.empty(p, self.layout.hidden, dtype=torch.float32, device=dev)
        for n in sorted(m for m in sizes if m <= p):
            ids = (torch.arange(n, device=dev) % c.num_experts).view(n, 1)
            slot_ids = bookkeeping(cache, scratch, ids)
            grouped_expert_mlp(x[:n], slot_ids, ids, w[:n], self.slots, self._host_dev, self.layout.hidden,
                               self.layout.inter, self._work, out[:n], self.gemm, self.layout.quant,
                               self.layout.swiglu_limit)
        for wdt in (torch.float32, xdt):  # routing weights come in the hidden dtype (router.py)
            combine_pairs(out[:k], torch.ones(1, k, dtype=wdt, device=dev), torch.zeros(1, k, dtype=torch.int64,
                          device=dev), torch.empty(1, self.layout.hidden, dtype=xdt, device=dev))
            ids = torch.zeros(2, 1, dtype=torch.int64, device=dev)
            grouped_expert_mlp(x[:2], bookkeeping(cache, scratch, ids), ids, w[:2].to(wdt), self.slots,
                               self._host_dev, self.layout.hidden, self.layout.inter, self._work, out[:2], self.gemm,
                               self.layout.quant, self.layout.swiglu_limit)
        torch.cuda.synchronize(dev)
        _COMPILED.add(key)

    def stats(self):
        base = super().stats()
        return {**base, "steps": base["steps"] + self.host_only_steps, "host": self.host_experts,
                "host_pairs": self.host_pairs,
                "host_us": int(self.host_us)}

    def phase_means(self) -> dict | None:
        """Mean microseconds per phase of the calls since profile() or reset() (hybrid_phases.py)."""
        return None if self.phases is None else self.phases.means_us()

    def reset(self):
        super().reset()
        self.host_experts = self.host_pairs = self.host_only_steps = 0
        self.host_us = 0.0
        if self.phases is not None:
            self.profile()
