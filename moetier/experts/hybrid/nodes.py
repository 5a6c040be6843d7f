"""The `hybrid` backend's `nodes` mode (the CUDA default: registry.nodes_by_default): the whole decode
step of a hybrid MoE layer as fixed-shape, capturable work, the host's share run by a host-function
node, so the engine captures the decode step as ONE CUDA graph (graph_safe: no pieces, no host sync; the engine's switch
replays it or the whole slots-step graph, engine/switch.py).

One decode step of one MoE layer (T tokens x k pairs, P = T * k, all buffers at fixed addresses):
  1. plan (main stream, one Triton launch, hybrid_plan.py): from the topk ids and the cache's expert_slot
     (read before this step's bookkeeping), the misses, their tokens and the host set, exactly as
     CostModel.split chooses it; out: dev_ids (host pairs -> -1), the host job (n, tokens, experts), the
     host pairs' positions, and the device counters of host experts and pairs (stats() reads them).
  2. down copies of the job and the hidden state (fp32, the compiled kernel's input) into pinned buffers,
     on the main stream before the fills; then fork to a side stream (an event): a host node
     (cuLaunchHostFunc: captured as a graph host node)
     calling csrc/host_node.cpp's moetier_host_node(job), which runs the compiled kernel over the host
     pairs into a pinned [P, H] fp32 buffer (compacted: row i is host pair i); an up copy of it.
  3. main stream meanwhile: the slots step over dev_ids as P rows of one pair each (bookkeeping, fills,
     grouped GEMM; all skip ids < 0, so host pairs are neither filled nor evicted for), their unweighted
     fp32 outputs into y [P + 1, H] at their positions (HybridExperts.device_pairs).
  4. join (the main stream waits on the side stream's event), the host outputs put into y at the host
     pairs' positions (padding positions are P: y's scratch row), then combine_pairs with the ORIGINAL
     ids and weights: the same fixed k order as the eager hybrid path, so a given choice gives its bits.
The pinned and device buffers are one set per model (layers run one after another: layer L + 1's down
copies are ordered after layer L's join); the job structs one per layer and hidden dtype, alive as long
as the backend (a captured graph holds their addresses).

On the CPU (CI) the same mode runs the plan's torch reference, calls moetier_host_node directly through
ctypes, and runs today's CPU device path (HybridExperts._device_cpu: the cache step over the compacted
device pairs), reading the plan on the host; so a given choice gives the eager hybrid path's bits.
Needs the compiled host kernel (the node has no torch to call): the backend refuses to build without it.
"""

from __future__ import annotations

import ctypes
from contextlib import contextmanager

import torch

from moetier.experts.hybrid import host_ext
from moetier.experts.backends import SlotExperts
from moetier.experts.hybrid.host_kernels import compute_dtype
from moetier.experts.kernels.grouped_gemm import combine_pairs
from moetier.experts.hybrid.backend import HybridExperts
from moetier.experts.hybrid.device_plan import (
    PlanBuffers,
    plan_kernel,
    plan_rates,
    plan_reference,
)
from moetier.experts.reference import combine


class NodeJob(ctypes.Structure):
    """csrc/host_node.cpp's MoetierNodeJob, field for field (every field 8 bytes: no padding)."""

    _fields_ = [("rows", ctypes.c_void_p), ("num_rows", ctypes.c_int64), ("row_bytes", ctypes.c_int64),
                ("kind", ctypes.c_int64), ("H", ctypes.c_int64), ("I", ctypes.c_int64), ("s13", ctypes.c_int64),
                ("s2", ctypes.c_int64), ("round_h", ctypes.c_int64), ("limit", ctypes.c_double),
                ("x", ctypes.c_void_p), ("T", ctypes.c_int64),
                ("plan", ctypes.c_void_p), ("max_pairs", ctypes.c_int64), ("h", ctypes.c_void_p),
                ("y", ctypes.c_void_p), ("threads", ctypes.c_int64), ("block", ctypes.c_int64),
                ("status", ctypes.c_int64), ("calls", ctypes.c_int64), ("pairs", ctypes.c_int64),
                ("seconds", ctypes.c_double), ("err", ctypes.c_char * 256)]


class NodeBuffers:
    """One model's buffers (shared by its layers): the plan's, the pinned staging (x [T, H], the job
    [1 + 2 P], host outputs [P, H], all fp32 / int64) and the host kernel's scratch h [P, I]; on CUDA the
    host outputs' device twin [P, H], the pair outputs y [P + 1, H] (row P: the padding positions'
    scratch), the GEMM's weighted output [P, H] (unread: y is what counts), the positions 0..P-1 and the
    side stream. P = decode tokens x k (the largest step)."""

    def __init__(self, num_experts: int, tokens: int, top_k: int, hidden: int, inter: int, device: torch.device):
        p, cuda = tokens * top_k, device.type == "cuda"
        self.plan = PlanBuffers(num_experts, p, device)
        self.x = torch.zeros(tokens, hidden, dtype=torch.float32, pin_memory=cuda)
        self.job = torch.zeros(1 + 2 * p, dtype=torch.int64, pin_memory=cuda)
        self.out = torch.zeros(p, hidden, dtype=torch.float32, pin_memory=cuda)
        self.h = torch.zeros(p, inter, dtype=torch.float32)
        if cuda:
            self.device_buffers(p, hidden, device)
            self.side = torch.cuda.Stream(device)

    def device_buffers(self, p: int, hidden: int, device: torch.device | str) -> None:
        """The CUDA path's device buffers (tests/hybrid_nodes_cuda_interpreter.py makes them on the CPU)."""
        self.out_dev = torch.zeros(p, hidden, dtype=torch.float32, device=device)
        self.y = torch.zeros(p + 1, hidden, dtype=torch.float32, device=device)
        self.weighted = torch.empty(p, hidden, dtype=torch.float32, device=device)  # the GEMM's, unread
        self.gpos = torch.arange(p, device=device)


_LAUNCH = None  # cuLaunchHostFunc from the driver library, loaded at first use


def launch_host_func(stream: int, fn: int, data: int) -> None:
    """cuLaunchHostFunc(stream, fn, data): fn(data) runs on a driver thread once the stream's earlier
    work is done, and the stream's later work waits for it; under stream capture it becomes a graph host
    node (the graph keeps fn and data: data must outlive the graph)."""
    global _LAUNCH
    if _LAUNCH is None:
        f = ctypes.CDLL("libcuda.so.1").cuLaunchHostFunc
        f.argtypes, f.restype = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p], ctypes.c_int
        _LAUNCH = f
    rc = _LAUNCH(stream, fn, data)
    if rc != 0:
        raise RuntimeError(f"cuLaunchHostFunc failed: CUresult {rc}")


class HybridNodesExperts(HybridExperts):
    """hybrid with the host's share as a host-function node: graph-safe (the module docstring)."""

    graph_safe = True  # no host sync in a decode step: the engine captures it whole

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        kernel = self.hostpath.kernel
        if getattr(kernel, "lib", None) is None or host_ext.kind_of(self.host, self.layout) is None:
            why = getattr(kernel, "fallback_reason", "") or f"no compiled code for {self.host.dtype} rows"
            raise ValueError(f"the hybrid nodes mode needs the compiled host kernel ({why})")
        self.lib = kernel.lib
        p = self.decode_tokens * self.top_k
        key = ("nodes", self.device, self.cache.num_experts, p, self.layout.hidden, self.layout.inter)
        shared = self.hostpath.__dict__.setdefault("node_buffers", {})
        if key not in shared:
            shared[key] = NodeBuffers(self.cache.num_experts, self.decode_tokens, self.top_k, self.layout.hidden,
                                      self.layout.inter, self.device)
        self.bufs: NodeBuffers = shared[key]
        self.rates_table = plan_rates(self.model, self.decode_tokens, self.device)  # fp64 [3 + decode tokens]
        self.counters = torch.zeros(2, dtype=torch.int64, device=self.device)  # host experts, host pairs
        self.jobs: dict[torch.dtype, NodeJob] = {}  # by hidden dtype; a graph holds their addresses
        self._fn = ctypes.cast(self.lib.moetier_host_node, ctypes.c_void_p).value

    def _job(self, xdt: torch.dtype) -> NodeJob:
        """This layer's job for hidden states of dtype xdt (kind and rounding: host_ext.call_kind, as every
        call of the kernel)."""
        job = self.jobs.get(xdt)
        if job is None:
            b, lay, rows = self.bufs, self.layout, self.host
            bf16 = compute_dtype(rows, xdt) == torch.bfloat16
            kind, s13, s2 = host_ext.call_kind(rows, lay, bf16)
            job = self.jobs[xdt] = NodeJob(
                rows.data_ptr(), rows.shape[0], rows.shape[1] * rows.element_size(), kind, lay.hidden, lay.inter,
                s13, s2, int(bf16), host_ext.limit_arg(lay), b.x.data_ptr(),
                b.x.shape[0], b.job.data_ptr(), b.plan.max_pairs, b.h.data_ptr(), b.out.data_ptr(),
                self.hostpath.kernel.threads, getattr(self.hostpath.kernel, "block_bytes", 0))
        return job

    def forward(self, hidden, topk_ids, topk_weights):
        t, k = topk_ids.shape
        if t > self.decode_tokens:
            return self._bypass(hidden, topk_ids, topk_weights)
        if not self.host_enabled:
            return SlotExperts.forward(self, hidden, topk_ids, topk_weights)
        if not self.cuda:
            return self._forward_cpu(hidden, topk_ids, topk_weights)
        b, p = self.bufs, t * k
        job = self._job(hidden.dtype)
        main = torch.cuda.current_stream(self.device)
        plan_kernel(topk_ids, self.cache.expert_slot, self.rates_table, b.plan, self.counters)
        # NOTE: the down copies run on the main stream, BEFORE the fills: on the side stream they queued
        # behind the fill kernel (which holds every SM reading the link), so the node started when the
        # fills ended, not beside them (H200, batch 1: x's conversion 170 us instead of 2, the node's
        # start 370 us late; scripts/profile_hybrid.py)
        b.job.copy_(b.plan.job, non_blocking=True)
        b.x[:t].copy_(hidden.to(compute_dtype(self.host, hidden.dtype)).float(), non_blocking=True)
        b.side.wait_stream(main)
        with torch.cuda.stream(b.side):  # the host's share: the node, the outputs up
            launch_host_func(b.side.cuda_stream, self._fn, ctypes.addressof(job))
            b.out_dev[:p].copy_(b.out[:p], non_blocking=True)
        # the device's share meanwhile: every pair its own row, host pairs (-1) skipped
        g_ids = b.plan.dev_ids[:p].view(p, 1)
        # row p: token p // k, one copy (no sync). NOTE: contiguous, always: at t = 1 reshape gives a
        # stride-0 VIEW of hidden, and the GEMM indexes x as dense [p, H] rows, so it read rows 1..p-1
        # past hidden's end (NaN on the H200, whose router then picked ids out of range)
        x = hidden.unsqueeze(1).expand(t, k, hidden.shape[1]).contiguous().view(p, -1)
        self.device_pairs(x, g_ids, topk_weights.reshape(p, 1), b.gpos[:p],
                          b.weighted[:p], b.y)
        main.wait_stream(b.side)
        b.y.index_put_((b.plan.pos[:p],), b.out_dev[:p])  # host pairs at their positions; padding -> row P
        return combine_pairs(b.y[:p], topk_weights, topk_ids, self._decode_out(hidden))  # skips ids < 0

    def _forward_cpu(self, hidden, topk_ids, topk_weights):
        """The same mode without a device: the plan's reference, the node function called here."""
        b, (t, k) = self.bufs, topk_ids.shape
        job = self._job(hidden.dtype)
        plan_reference(topk_ids, self.cache.expert_slot, self.rates_table, b.plan, self.counters)
        b.job.copy_(b.plan.job)
        b.x[:t] = hidden.to(compute_dtype(self.host, hidden.dtype)).float()
        self.lib.moetier_host_node(ctypes.addressof(job))
        self._check(job)
        nh = int(b.plan.job[0])
        if nh == 0:  # as the eager path: no host set is the slots step unchanged
            return SlotExperts.forward(self, hidden, topk_ids, topk_weights)
        dev = b.plan.dev_ids[:t * k]
        gpu_pos = torch.nonzero(dev >= 0).view(-1).tolist()
        self.host_only_steps += not gpu_pos
        y = hidden.new_zeros(t * k, self.layout.hidden)
        self._device_cpu(hidden, topk_ids, gpu_pos, y)
        y[b.plan.pos[:nh]] = b.out[:nh].to(y.dtype)
        return combine(y.view(t, k, -1), topk_weights)

    @contextmanager
    def link_only(self):
        """Every miss over the link while inside, captured graphs included: the plan reads its rates from
        this tensor at every replay, and an infinite host cost never chooses the host (as a host rate of 0)."""
        saved = self.rates_table.clone()
        self.rates_table[2:] = float("inf")
        try:
            yield
        finally:
            self.rates_table.copy_(saved)

    def host_count(self) -> torch.Tensor:
        """Experts served on the host so far: the plan's device counter (one element; the Switch reads it
        with the cache counters in one transfer)."""
        return self.counters[:1]

    @staticmethod
    def _check(job: NodeJob) -> None:
        if job.status != 0:
            raise RuntimeError(f"hybrid host node failed: {job.err.decode(errors='replace')}")

    def profile(self, on: bool = True) -> None:
        """No phase clock here: the step runs inside a graph; nothing on the host's clock to mark."""
        self.phases = None

    def stats(self):
        # NOTE: a host read of the device counters (a sync): between steps only, as every backend's stats
        for job in self.jobs.values():
            self._check(job)
        host, pairs = self.counters.tolist()
        base = SlotExperts.stats(self)
        return {**base, "steps": base["steps"] + self.host_only_steps, "host": host, "host_pairs": pairs,
                "host_us": int(sum(j.seconds for j in self.jobs.values()) * 1e6)}

    def reset(self):
        if self.cuda:  # a host node still in flight writes the job's counts
            torch.cuda.synchronize(self.device)
        super().reset()
        self.counters.zero_()
        for job in self.jobs.values():
            job.calls = job.pairs = job.status = 0
            job.seconds = 0.0
