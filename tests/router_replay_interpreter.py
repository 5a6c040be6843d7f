"""A replayed trace routes alike whichever router computed the weights: the CUDA router kernels
(layers/fused.route_topk for softmax top-k, layers/router_triton.route_grouped for the sigmoid
groups) run in Triton's interpreter on the CPU, against the torch routers, on the embedded model and
on the tiny glm5_next preset, a prompt in two steps then decode steps from one trace. Every router
lists its picks largest weight first and the replayer pairs them by position, so the logits agree to
float32 rounding (pairing by position in each router's own order left them 5e-3 apart on glm5_next). Run as a
script (TRITON_INTERPRET before triton is imported); tests/test_traces.py does that in a subprocess."""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from moetier.checkpoint.writer import make_checkpoint  # noqa: E402
from moetier.engine.llm import LLM  # noqa: E402
from moetier.layers import fused, router, router_triton  # noqa: E402
from moetier.traces.format import read_trace, write_trace  # noqa: E402
from moetier.traces.hooks import Replayer  # noqa: E402
from moetier.traces.synth import SynthParams, meta_of, synthesize  # noqa: E402
from tests.helpers import Sequence  # noqa: E402


def softmax_kernel(self, x):
    return fused.route_topk(F.linear(x, self.weight), self.top_k, self.renormalize)


def grouped_kernel(self, x):
    logits = F.linear(x.float(), self.weight)
    return router_triton.route_grouped(logits, self.bias, self.top_k, self.n_group, self.topk_group,
                                       self.renormalize, self.scaling, x.dtype)


def errors(ckpt: Path | None, tmp: Path, cls, kernel) -> list[float]:
    model = LLM(ckpt, dtype="float32", device="cpu").model
    cfg = model.cfg
    p = SynthParams(experts=cfg.num_experts, top_k=cfg.top_k, layers=len(model.moe_blocks()), tokens=64, seed=3)
    write_trace(tmp / "t.mtrace", synthesize(p), meta_of(p))
    rep = Replayer(model, read_trace(tmp / "t.mtrace"))
    ids = torch.randint(0, min(cfg.vocab_size, 448), (19,), generator=torch.Generator().manual_seed(5))
    steps = ((0, 9), (9, 14), *((n, n + 1) for n in range(14, 19)))

    def run():
        rep.cursor.zero_()
        seq = Sequence(model, 64, page_size=16)
        return [model.logits(seq.forward(ids[lo:hi])) for lo, hi in steps]

    want = run()
    torch_forward, cls.forward = cls.forward, kernel
    try:
        got = run()
    finally:
        cls.forward = torch_forward
    return [((g - w).norm() / w.norm()).item() for g, w in zip(got, want)]


def main() -> None:
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        cases = {"tiny-stdlib (softmax top-k)": errors(None, tmp, router.SoftmaxTopK, softmax_kernel),
                 "tiny-glm5-next (sigmoid groups)": errors(
                     make_checkpoint(tmp / "glm", "tiny-glm5-next", seed=4, dtype="float32"), tmp,
                     router.GroupedSigmoidTopK, grouped_kernel)}
    bad = False
    for name, errs in cases.items():
        print(name, " ".join(f"{e:.1e}" for e in errs))
        bad |= max(errs) > 1e-5
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
