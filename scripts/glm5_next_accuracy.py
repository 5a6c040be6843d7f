"""Where glm5_next's float32 CUDA logits part from the CPU's (a diagnosis, not a benchmark): the tiny
preset's model on CUDA against the same checkpoint on the CPU, a prompt in two steps then decode
steps, routed from one trace, with each CUDA-only path swapped for its torch reference in turn
(fla's KDA, the fused mHC, the router kernel); then fla's chunk_kda alone against the token-by-token recurrence over
gate scales and lengths (as shipped, and fla's bounded-gate variant: safe_gate with the lower bound).
The tiny preset's random gates sit near -2.5 a token (lower_bound -5 times a sigmoid near 0.5), the
CPU tests' transformers-initialised ones near -0.35. Prints a table of relative errors per step; JSON to argv[1] if given.

    python scripts/glm5_next_accuracy.py [OUT.json]      (CUDA and fla-core; TRITON_F32_DEFAULT=ieee
                                                           before start to take fla's dots in IEEE)
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from moetier.checkpoint.writer import make_checkpoint  # noqa: E402
from moetier.layers import kda as kda_layer  # noqa: E402
from moetier.layers import mhc_triton, router  # noqa: E402
from moetier.layers.kda_reference import kda_recurrent  # noqa: E402
from tests.helpers import cuda_tracks_cpu  # noqa: E402


def rel(a, b) -> float:
    return ((a.float().cpu() - b.float().cpu()).norm() / b.float().cpu().norm()).item()


def model_rows(tmp: Path) -> dict:
    ckpt = make_checkpoint(tmp / "ckpt", "tiny-glm5-next", seed=4, dtype="float32")
    run = cuda_tracks_cpu(ckpt, tmp)
    rows = {"shipped": run()}
    on_fla, fused = kda_layer.on_fla, mhc_triton.fused_supported
    kda_layer.on_fla = lambda x: False
    rows["kda torch reference"] = run()
    mhc_triton.fused_supported = lambda s: False
    rows["kda + mhc torch reference"] = run()
    kda_layer.on_fla = on_fla
    rows["mhc torch reference"] = run()
    mhc_triton.fused_supported = fused
    with torch.backends.cudnn.flags(enabled=False):
        rows["cudnn off"] = run()
    fwd = router.GroupedSigmoidTopK.forward

    def reference(self, x):  # the CPU's router on CUDA: its own top-k order
        logits = F.linear(x.float(), self.weight)
        ids, w = router.grouped_route_reference(logits, self.bias, self.top_k, self.n_group, self.topk_group,
                                                self.renormalize, self.scaling)
        return ids, w.to(x.dtype)
    router.GroupedSigmoidTopK.forward = reference
    rows["router torch reference"] = run()
    router.GroupedSigmoidTopK.forward = fwd
    return rows


def chunk_rows() -> dict:
    from moetier.layers.kda_cuda import fla_kda, kda_prefill_varlen

    out = {}
    for scale in (0.01, 0.1, 1.0, 5.0):
        for t in (9, 64, 130):
            g = torch.Generator().manual_seed(t)
            h, dk, dv = 4, 64, 64
            q, k, v = (torch.randn(t, h, d, generator=g) for d in (dk, dk, dv))
            gate = -torch.rand(t, h, dk, generator=g) * scale
            beta = torch.rand(t, h, generator=g)
            s0 = torch.randn(h, dk, dv, generator=g) * 0.1
            want_o, want_s = kda_recurrent(q, k, v, gate, beta, s0)
            o, s = kda_prefill_varlen(*(x.cuda() for x in (q, k, v, gate, beta)), s0[None].cuda(), [0, t])
            # fla's bounded-gate variant (gates in [lower_bound, 0), as glm5_next's are): its own intra-chunk path
            chunk, _ = fla_kda()
            cu = torch.tensor([0, t])
            o2, s2 = chunk(*(x.cuda().contiguous()[None] for x in (q, k, v, gate, beta)), scale=dk ** -0.5,
                           initial_state=s0[None].cuda(), output_final_state=True, use_qk_l2norm_in_kernel=True,
                           safe_gate=True, lower_bound=-5.0, cu_seqlens=cu.cuda(), cu_seqlens_cpu=cu)
            out[f"g~{scale} T={t}"] = [rel(o, want_o), rel(s[0], want_s), rel(o2[0], want_o), rel(s2[0], want_s)]
    return out


def main() -> None:
    print(f"TRITON_F32_DEFAULT={os.environ.get('TRITON_F32_DEFAULT')}")
    chunks = chunk_rows()  # first, printed at once: cheap, and what the model rows then explain
    print("| fla chunk_kda against the recurrence | o | final state | o, safe_gate | final, safe_gate |")
    for name, errs in chunks.items():
        print(f"| {name} | " + " | ".join(f"{e:.2e}" for e in errs) + " |", flush=True)
    with tempfile.TemporaryDirectory() as d:
        rows = model_rows(Path(d))
    print("| CUDA model against the CPU's | " + " | ".join(f"step {i}" for i in range(7)) + " |")
    for name, errs in rows.items():
        print(f"| {name} | " + " | ".join(f"{e:.2e}" for e in errs) + " |")
    if len(sys.argv) > 1:
        Path(sys.argv[1]).write_text(json.dumps({"model": rows, "chunk": chunks}, indent=1))


if __name__ == "__main__":
    main()
