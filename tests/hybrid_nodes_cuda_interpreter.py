"""Runs the hybrid nodes mode's CUDA forward (experts/hybrid/nodes.HybridNodesExperts.forward past its
`if not self.cuda`: the Triton plan, the side stream's down copies and host node, the slots step over
dev_ids as P rows of one pair each, the host rows put in, the Triton combine) in Triton's interpreter
on the CPU, with CPU tensors for device ones, and holds it to the fp32 oracle and to the eager hybrid
CUDA path (tests/hybrid_interpreter.as_cuda) within bf16 tolerance, over steps of 1, 2, 3 and 5 tokens.

Stand-ins: the streams are no-ops (the interpreter runs every launch at once), the host node is
moetier_host_node called in place of cuLaunchHostFunc, pinned buffers are plain CPU tensors.
The hidden states are row 0.. of a larger buffer whose later rows are NaN: a device-pair GEMM that
reads past the step's rows (as the stride-0 view of a one-token step did: NaN on the H200) gives NaN
here too, every time. Needs the compiled host kernel. Run as a script (TRITON_INTERPRET must be set
before triton is imported); test_hybrid_nodes.py does that in a subprocess.
What it cannot check: streams, pinned copies, the host node inside a captured graph (the gpu tests).
"""

from __future__ import annotations

import contextlib
import ctypes
import os

os.environ["TRITON_INTERPRET"] = "1"

import torch

from moetier.experts.hybrid import nodes as hybrid_nodes
from moetier.experts.hybrid.cost_model import PathRates
from moetier.experts.hybrid.host_kernels import reference
from moetier.experts.hybrid.backend import HostPath, HybridExperts
from moetier.experts.hybrid.nodes import HybridNodesExperts
from moetier.experts.shape import RowLayout
from tests.hybrid_interpreter import CpuHostPath, E, H, I, K, N, S, as_cuda


class NoStream:
    cuda_stream = 0

    def wait_stream(self, other):
        pass


def nodes_as_cuda(b: HybridNodesExperts) -> HybridNodesExperts:
    """as_cuda, plus the CUDA-only NodeBuffers members (on the CPU) and the host node called in place."""
    as_cuda(b)
    nb = b.bufs
    nb.device_buffers(nb.plan.max_pairs, H, "cpu")
    nb.side = NoStream()
    return b


def main() -> None:
    lib_calls = []

    def launch_host_func(stream, fn, data):  # the node's function, now (cuLaunchHostFunc's job)
        lib_calls.append(data)
        lib.moetier_host_node(ctypes.c_void_p(data))

    hybrid_nodes.launch_host_func = launch_host_func
    torch.cuda.current_stream = lambda *a: NoStream()
    torch.cuda.stream = lambda s: contextlib.nullcontext()
    torch.cuda.synchronize = lambda *a: None

    lay = RowLayout(H, I)
    g = torch.Generator().manual_seed(0)
    rows = (torch.randn(E, lay.numel, generator=g) * 0.1).to(torch.bfloat16)
    cases = {"link": PathRates(1e6, {"bfloat16": 1e-3}), "split": PathRates(50.0, {"bfloat16": 50.0}),
             "host": PathRates(1e-3, {"bfloat16": 1e6})}
    nodes = {n: nodes_as_cuda(HybridNodesExperts(rows, lay, K, S, N, host=HostPath(lay, "compiled", 1, r)))
             for n, r in cases.items()}
    eager = {n: as_cuda(HybridExperts(rows, lay, K, S, N, host=CpuHostPath(lay, "compiled", 1, r)))
             for n, r in cases.items()}
    lib = nodes["split"].lib
    for step in range(16):
        t = (1, 2, 3, 5)[step % 4]
        ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(t)])
        ids[0, 1] = -1  # another rank's expert: nobody's work
        big = torch.full((N * K, H), float("nan"), dtype=torch.bfloat16)  # rows past the step's: NaN
        big[:t] = torch.randn(t, H, generator=g).to(torch.bfloat16)
        x, w = big[:t], torch.rand(t, K, generator=g)
        flat = ids.reshape(-1)
        keep = torch.nonzero(flat >= 0).view(-1)
        want = reference(x, keep, flat[keep], w.reshape(-1)[keep], rows, lay, K)
        for n in cases:
            got = nodes[n].forward(x, ids, w).float()
            ref = eager[n].forward(x, ids, w).float()
            assert bool(got.isfinite().all()), (n, step, t, "NaN: the device pairs read rows past the step's")
            for other in (want, ref):
                err = (got - other).abs().max() / other.abs().max()
                assert err <= 2e-2, (n, step, t, float(err))
            nodes[n].cache.check()
    st = {n: b.stats() for n, b in nodes.items()}
    es = {n: b.stats() for n, b in eager.items()}
    for n in cases:  # the same choices, counted on the device in the plan
        assert st[n]["host"] == es[n]["host"] and st[n]["host_pairs"] == es[n]["host_pairs"], (n, st[n], es[n])
    assert st["link"]["host"] == 0 and st["split"]["host"] > 0 and st["host"]["misses"] == 0, st
    assert lib_calls, "the host node never ran"
    print("hybrid nodes CUDA path in the interpreter: ok", {n: (s["host"], s["misses"]) for n, s in st.items()})


if __name__ == "__main__":
    main()
