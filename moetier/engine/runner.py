"""The model runner: turns the scheduler's record of what to run (step.StepInput) into device tensors,
runs the model, samples, and hands back one record of what came out (step.StepOutput). It holds no
scheduling state; decode steps that fit a captured size replay CUDA graphs (graphs.py), and so do the
verify steps of n-gram drafting that fit one (verify_graphs.py). Other steps that verify drafts, and
every step of an engine that drafts with MTP layers, run eagerly (spec_step.py)."""

from __future__ import annotations

from collections.abc import Callable
from itertools import chain

import numpy as np
import torch

from moetier.engine.graphs import DecodeGraphs
from moetier.engine.kv_moves import KVMoves
from moetier.engine.overlap import Launched
from moetier.engine.prompt_logprobs import prompt_logprobs
from moetier.engine.spec_step import MtpDrafter, verify
from moetier.engine.step import RankQuery, SeqStep, StepInput, StepOutput, StepVerdict
from moetier.engine.verify_graphs import VerifyGraphs
from moetier.layers.attention import make_batch
from moetier.layers.kv_cache import KVCache
from moetier.layers.sampler import sample, token_logprobs
from moetier.models.base import CausalLM


class ModelRunner:
    def __init__(self, model: CausalLM, kv: KVCache, graphs: DecodeGraphs | None = None,
                 moves: KVMoves | None = None, mtp: bool = False, verify: VerifyGraphs | None = None):
        """moves: the prefix cache's host-tier copies and state checkpoints (None: neither). mtp: every
        step also runs the model's MTP layer (speculative method mtp: spec_step.MtpDrafter). verify: the
        verify step's graphs (n-gram drafting: verify_graphs.py), replayed by the steps they fit."""
        self.model, self.kv, self.graphs, self.verify = model, kv, graphs, verify
        self.mtp = MtpDrafter(model, kv, kv.page_size) if mtp else None
        self.moves = moves if moves is not None else KVMoves(kv)
        self.moves.attach(model)  # per-layer waits for the host tier's copies (CUDA)
        self.graph_steps = 0  # steps replayed: decode graphs, and verify graphs (counted apart too)
        self.verify_graph_steps = 0
        self.graphs_on = True  # False: every step eager with the graphs kept (bench decode --parallel)
        # bench decode/prefill's output check (bench/outputs.py): each step, the logits of its first
        # keep_logits sampled rows are copied on the device (no host read) into kept_logits as
        # (request ids, [n, V] float32); 0 (the product): off
        self.keep_logits = 0
        self.kept_logits: list[tuple[list[str], torch.Tensor]] = []
        # rank 0 of a parallel engine (dist/executor.DistributedRunner): sends the step's verdict to the
        # workers where shares_verdict() holds, after verifying and before the MTP passes
        self.on_verdict: Callable[[StepVerdict], None] | None = None
        # launch(): two (pinned buffer, event) pairs the sampled tokens land in, in turn; a pair is reused
        # two launches later, after the overlap loop has collected the launch that held it
        self._landing: list[tuple[torch.Tensor, torch.cuda.Event]] = []

    def shares_verdict(self, seqs: list[SeqStep]) -> bool:
        """Whether the workers of a parallel engine need this step's verdict (step.StepVerdict): to run
        the MTP passes with rank 0, or to roll recurrent state back where a draft may be rejected."""
        return self.mtp is not None or (self.moves.backup_base >= 0 and any(s.num_draft for s in seqs))

    def replays(self, seqs: list[SeqStep]) -> bool:
        """Whether execute() replays the decode graph for these sequences."""
        if self.mtp is not None or any(s.num_draft for s in seqs):
            return False  # speculative steps run eagerly
        return self.graphs_on and self.graphs is not None and self.graphs.fits(seqs)

    @torch.inference_mode()
    def execute(self, step: StepInput) -> StepOutput:
        seqs = step.seqs
        if not seqs:
            return StepOutput({}, 0)
        if self.verify is not None and self.graphs_on and not self.keep_logits and self.verify.fits(seqs):
            self.moves.before(step)
            self.graph_steps += 1
            self.verify_graph_steps += 1
            return self.verify.run(seqs)
        replay = self.replays(seqs)  # one-token steps that sample: no prompt token left to score (SeqStep)
        self.moves.before(step, layered=not replay)
        if replay:
            tokens = self.graphs.run(seqs)
            self.graph_steps += 1
            logits = self.graphs.logits_of(len(seqs)) if _wants_logprobs(seqs) or self.keep_logits else None
            self._keep(seqs, logits)
            return self._output(seqs, tokens, logits if _wants_logprobs(seqs) else None, len(seqs))
        dev = self.model.device
        self.moves.back_up(seqs)  # recurrent state before a verify step (kv_moves.py)
        hidden, batch, ids = self._forward(seqs)
        scored = prompt_logprobs(self.model, hidden, batch.query_start_host, seqs)
        rows = [i for i, s in enumerate(seqs) if s.sample and not s.num_draft]
        drafting = [(i, s) for i, s in enumerate(seqs) if s.num_draft]
        out = StepOutput({}, len(ids), prompt_logprobs=scored)
        if rows:
            last = torch.tensor([batch.query_start_host[i + 1] - 1 for i in rows], device=dev)
            logits = self.model.logits(hidden[last])
            picked = [seqs[i] for i in rows]
            tokens = sample(logits, [s.params for s in picked], [s.seed for s in picked],
                            [s.sample_index for s in picked])
            self._keep(picked, logits)
            out = self._output(picked, tokens, logits if _wants_logprobs(picked) else None, len(ids))
            out.prompt_logprobs = scored
        if drafting:
            out.emitted, out.emitted_logprobs = verify(self.model, hidden, batch.query_start_host, drafting,
                                                       None if self.mtp is None else self.mtp.q)
            self.moves.roll_back(seqs, out.emitted)
            out.sampled.update({r: toks[-1] for r, toks in out.emitted.items()})
        if self.on_verdict is not None and self.shares_verdict(seqs):
            self.on_verdict(StepVerdict(out.sampled, out.emitted))
        if self.mtp is not None:
            out.drafts = self.mtp.run(seqs, hidden, batch, out.sampled, out.emitted)
        return out

    @staticmethod
    def can_launch(step: StepInput) -> bool:
        """Whether launch() runs this step: one-token rows that sample and need nothing but their token
        read back (no drafts, logprobs, prompt logprobs, state checkpoints; an engine without MTP passes)."""
        return bool(step.seqs) and all(
            s.num_tokens == 1 and s.sample and not s.num_draft and not s.prompt_targets and s.params.logprobs is None
            and s.restore_checkpoint < 0 and s.save_checkpoint < 0 for s in step.seqs)

    @torch.inference_mode()
    def launch(self, step: StepInput, after: Launched | None = None) -> Launched:
        """Start the step (can_launch(step) holds, and the runner drafts with no MTP layer) without waiting
        for it: the forward (a graph replay where one fits), the sampler, and the copy of the sampled
        tokens to pinned host memory. after: the step launched before this one, still in flight, whose
        sampled tokens are this step's input ids (every row's request was in it; the rows' own token ids
        are placeholders). collect() reads the tokens."""
        seqs, dev = step.seqs, self.model.device
        src = None
        if after is not None:
            row = {r: i for i, r in enumerate(after.ids)}
            src = (after.tokens, [row[s.request_id] for s in seqs])
        replay = self.replays(seqs)
        self.moves.before(step, layered=not replay)
        if replay:
            tokens = self.graphs.run(seqs, src=src)
            self.graph_steps += 1
            logits = self.graphs.logits_of(len(seqs)) if self.keep_logits else None
        else:
            ids = None if src is None else src[0][torch.tensor(src[1], device=dev)]
            hidden = self._forward(seqs, ids)[0]
            logits = self.model.logits(hidden)  # one row a sequence
            tokens = sample(logits, [s.params for s in seqs], [s.seed for s in seqs], [s.sample_index for s in seqs])
        self._keep(seqs, logits)
        kept = self.kept_logits[-1][0] if self.keep_logits else None
        host, event = tokens, None
        if tokens.is_cuda:
            n = tokens.shape[0]
            if not self._landing or self._landing[0][0].shape[0] < n:
                self._landing = [(torch.empty(max(n, 64), dtype=torch.int64, pin_memory=True), torch.cuda.Event())
                                 for _ in range(2)]
            self._landing.reverse()  # the other pair: the last launch's copy may still be landing in this one
            buffer, event = self._landing[0]
            host = buffer[:n]
            host.copy_(tokens, non_blocking=True)
            event.record()
        return Launched([s.request_id for s in seqs], tokens, host, event, kept)

    @staticmethod
    def collect(launched: Launched) -> StepOutput:
        """Wait for a launched step's tokens (its own work only, not what was launched after it)."""
        if launched.event is not None:
            launched.event.synchronize()
        return StepOutput(dict(zip(launched.ids, launched.host.tolist())), len(launched.ids))

    def _keep(self, seqs: list[SeqStep], logits: torch.Tensor | None) -> None:
        if self.keep_logits:
            n = min(self.keep_logits, len(seqs))
            self.kept_logits.append(([s.request_id for s in seqs[:n]], logits[:n].float().clone()))

    @torch.inference_mode()
    def forward_only(self, step: StepInput) -> torch.Tensor:
        """The step's forward without sampling -> last hidden states [N, H]: what a worker rank runs
        (dist/worker.py; rank 0 samples). Writes the step's KV like execute()."""
        self.moves.before(step)
        return self._forward(step.seqs)[0]

    @torch.inference_mode()
    def run_worker_step(self, step: StepInput, verdict: Callable[[], StepVerdict] | None = None) -> None:
        """A worker rank's step (dist/worker.py): the forward rank 0 runs, without sampling, graph-replayed
        when rank 0's is (step.replay: rank 0 decided). Waits for the GPU before returning. A speculative
        step: the state backups before the forward; after it, where shares_verdict() holds, rank 0's
        verdict (verdict(): the next record on the channel) rolls state back and feeds the MTP passes."""
        self.moves.before(step)
        if step.replay:
            self.graphs.run(step.seqs, sample=False)
            # NOTE: the next step rewrites the graphs' pinned input blocks; rank 0 is protected by
            # reading its tokens back, a worker by this wait
            if self.model.device.type == "cuda":
                torch.cuda.current_stream(self.model.device).synchronize()
            self.graph_steps += 1
            return
        seqs = step.seqs
        self.moves.back_up(seqs)
        hidden, batch, _ = self._forward(seqs)
        if self.shares_verdict(seqs):
            v = verdict()
            self.moves.roll_back(seqs, v.emitted)
            if self.mtp is not None:  # drafts made here too (the same logits): only rank 0's are used
                self.mtp.run(seqs, hidden, batch, v.sampled, v.emitted)

    def ask(self, query: RankQuery) -> list:
        """Every rank's answer, in rank order: this one process's alone (DistributedRunner.ask gathers
        a parallel engine's). Between steps only: answers read device counters."""
        return [query.answer(self.model)]

    def release(self) -> None:
        """Drop the captured graphs (before a parallel engine's process group goes: graphs.release)."""
        if self.verify is not None:
            self.verify.release()
            self.verify = None
        if self.graphs is not None:
            self.graphs.release()
            self.graphs = None

    def _forward(self, seqs: list[SeqStep], ids_dev: torch.Tensor | None = None):
        """ids_dev: the input ids already on the device (launch() after an overlapped step); None: the
        seqs' token ids. -> (hidden [N, H], batch, ids: the host ids, or ids_dev)"""
        dev = self.model.device
        if ids_dev is None:
            # numpy, not torch.tensor(list): a prefill chunk is thousands of Python ints, converted on the host
            ids = np.fromiter(chain.from_iterable(s.token_ids for s in seqs), dtype=np.int64)
            ids_dev = torch.from_numpy(ids).to(dev)
        else:
            ids = ids_dev
        slots = [s.state_slot for s in seqs] if seqs[0].state_slot >= 0 else None  # models with state
        batch = make_batch([(s.start, s.num_tokens, s.pages) for s in seqs], self.kv.page_size, dev, slots)
        hidden = self.model.forward(ids_dev, batch, self.kv)
        self.moves.after(seqs)
        return hidden, batch, ids

    @staticmethod
    def _output(seqs: list[SeqStep], tokens: torch.Tensor, logits: torch.Tensor | None, num_tokens: int
                ) -> StepOutput:
        """tokens [B] (device), logits [B, V] float32 or None when no row asked for logprobs. One host
        read of everything (NOTE: the step's only sync; the logprobs ride along with the tokens)."""
        if logits is None:
            return StepOutput({s.request_id: t for s, t in zip(seqs, tokens.tolist())}, num_tokens)
        k = max(s.params.logprobs or 0 for s in seqs)
        chosen, top, top_ids = token_logprobs(logits, tokens, k)
        host = torch.cat([tokens.double()[:, None], chosen.double()[:, None], top.double(), top_ids.double()], 1)
        out = StepOutput({}, num_tokens)
        for s, row in zip(seqs, host.tolist()):
            out.sampled[s.request_id] = int(row[0])
            n = s.params.logprobs
            if n is not None:
                out.logprobs[s.request_id] = (row[1], [(int(i), v) for v, i in zip(row[2:2 + n], row[2 + k:2 + k + n])])
        return out


def _wants_logprobs(seqs: list[SeqStep]) -> bool:
    return any(s.params.logprobs is not None for s in seqs)
