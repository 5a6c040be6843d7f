"""The model runner: turns the scheduler's record of what to run (step.StepInput) into device tensors,
runs the model, samples, and hands back one record of what came out (step.StepOutput). It holds no
scheduling state; decode steps that fit a captured size replay CUDA graphs (graphs.py)."""

from __future__ import annotations

import torch

from moetier.engine.graphs import DecodeGraphs
from moetier.engine.step import StepInput, StepOutput
from moetier.layers.attention import make_batch
from moetier.layers.kv_cache import KVCache
from moetier.layers.sampler import sample
from moetier.models.base import CausalLM


class ModelRunner:
    def __init__(self, model: CausalLM, kv: KVCache, graphs: DecodeGraphs | None = None):
        self.model, self.kv, self.graphs = model, kv, graphs
        self.graph_steps = 0

    @torch.inference_mode()
    def execute(self, step: StepInput) -> StepOutput:
        seqs = step.seqs
        if not seqs:
            return StepOutput({}, 0)
        if self.graphs is not None and self.graphs.fits(seqs):
            tokens = self.graphs.run(seqs).tolist()  # the step's one host read
            self.graph_steps += 1
            return StepOutput({s.request_id: t for s, t in zip(seqs, tokens)}, len(seqs))
        dev = self.model.device
        ids = [t for s in seqs for t in s.token_ids]
        batch = make_batch([(s.start, s.num_tokens, s.pages) for s in seqs], self.kv.page_size, dev)
        hidden = self.model.forward(torch.tensor(ids, device=dev), batch, self.kv)
        rows = [i for i, s in enumerate(seqs) if s.sample]
        if not rows:
            return StepOutput({}, len(ids))
        last = torch.tensor([batch.query_start_host[i + 1] - 1 for i in rows], device=dev)
        logits = self.model.logits(hidden[last])
        picked = [seqs[i] for i in rows]
        tokens = sample(logits, [s.params for s in picked], [s.seed for s in picked],
                        [s.sample_index for s in picked]).tolist()
        return StepOutput({s.request_id: t for s, t in zip(picked, tokens)}, len(ids))
