"""The model runner: turns the scheduler's record of what to run into device tensors, runs the model,
samples, and hands back one record of what came out. It holds no scheduling state.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moetier.graphs import DecodeGraphs
from moetier.kv import KVCache, make_batch
from moetier.models.qwen3_moe import Qwen3MoeForCausalLM
from moetier.sampler import sample
from moetier.scheduler import SchedulerOutput


@dataclass
class StepResult:
    sampled: dict[str, int]  # request id -> the token sampled for it this step
    num_tokens: int


class ModelRunner:
    def __init__(self, model: Qwen3MoeForCausalLM, kv: KVCache, graphs: DecodeGraphs | None = None):
        self.model, self.kv, self.graphs = model, kv, graphs
        self.graph_steps = 0

    @torch.inference_mode()
    def execute(self, step: SchedulerOutput) -> StepResult:
        if not step.seqs:
            return StepResult({}, 0)
        if self.graphs is not None and self.graphs.fits(step.seqs):
            tokens = self.graphs.run(step.seqs).tolist()  # the step's one host read
            self.graph_steps += 1
            reqs = [s.request for s in step.seqs]
            return StepResult({r.id: t for r, t in zip(reqs, tokens)}, len(reqs))
        dev = self.model.device
        ids = [t for s in step.seqs for t in s.token_ids]
        batch = make_batch([(s.start, s.num_tokens, s.request.pages) for s in step.seqs], self.kv.page_size, dev)
        hidden = self.model.forward(torch.tensor(ids, device=dev), batch, self.kv)
        rows = [i for i, s in enumerate(step.seqs) if s.sample]
        if not rows:
            return StepResult({}, len(ids))
        last = torch.tensor([batch.query_start_host[i + 1] - 1 for i in rows], device=dev)
        logits = self.model.logits(hidden[last])
        reqs = [step.seqs[i].request for i in rows]
        tokens = sample(logits, [r.params for r in reqs], [r.seed for r in reqs], [len(r.output_ids) for r in reqs]
                        ).tolist()
        return StepResult({r.id: t for r, t in zip(reqs, tokens)}, len(ids))
