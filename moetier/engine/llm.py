"""The engine: scheduler, runner and output processing in one loop.

    from moetier import LLM, SamplingParams
    llm = LLM("~/models/Qwen3-30B-A3B", max_num_seqs=32)
    outs = llm.generate(["Hello", "Tell me"], SamplingParams(max_tokens=64))
    outs[0].outputs[0].text

`LLM.step()` is the loop's body; `AsyncLLM` (async_llm.py) runs it on a background thread and
streams outputs to asyncio callers.
"""

from __future__ import annotations

import itertools
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from moetier.checkpoint.loader import LoadReport, load_model
from moetier.models.registry import config_from_dir
from moetier.engine.config import EngineConfig
from moetier.engine.graphs import captures, decode_graphs
from moetier.engine.piecewise import needs_pieces
from moetier.engine.output import OutputProcessor, RequestOutput
from moetier.engine.overlap import Overlap
from moetier.engine.metrics import engine_metrics, expert_stats_per_rank, last_stats
from moetier.engine.kv_setup import auto_chunk, engine_kv, engine_moves, engine_scheduler, page_bytes
from moetier.engine.request import Request
from moetier.engine.runner import ModelRunner
from moetier.engine.spec_k import attach_chooser, time_graphs
from moetier.engine.verify_graphs import verify_graphs
from moetier.engine.warmup import warm_up
from moetier.errors import MoetierError
from moetier.experts.backends import set_prefill_policy, set_prefill_stream
from moetier.experts.prefetch import attach_prefetch
from moetier.models.base import CausalLM
from moetier.sampling_params import SamplingParams
from moetier.tokenizer import Tokenizer


def valid_positions(plan, step) -> list[int]:
    """Per sequence of a step just updated, the positions whose KV it made valid (update() moved
    num_computed past them): its own tokens and the kept drafts up to a stop, none where a rejection
    rolled its recurrent state back (the next step recomputes them). A recorded trace writes these
    rows; a replayed one routes the rest again."""
    return [max(0, min(p.request.num_computed - s.start, s.num_tokens)) for p, s in zip(plan.seqs, step.seqs)]


def eos_ids_of(model_dir: Path, eos_token_ids: Sequence[int], tokenizer: Tokenizer) -> set[int]:
    """EOS ids from config.json, generation_config.json and the tokenizer's eos token, together."""
    ids = set(eos_token_ids) | set(tokenizer.eos_token_ids)
    gen = model_dir / "generation_config.json"
    if gen.is_file():
        try:
            eos = json.loads(gen.read_text()).get("eos_token_id")
        except (OSError, json.JSONDecodeError, AttributeError) as e:
            raise MoetierError(f"{gen} is not readable JSON ({e}); fix or delete it") from None
        ids |= set(eos if isinstance(eos, list) else [] if eos is None else [eos])
    return {i for i in ids if isinstance(i, int)}


def pick_device(name: str) -> str:
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise MoetierError("--device cuda: no CUDA device is visible; use --device cpu")
    if name not in ("cuda", "cpu"):
        raise MoetierError(f"--device {name!r}: choose auto, cuda or cpu")
    return name


def model_dir_of(model: str | Path | None) -> Path:
    """The checkpoint directory (default: the embedded tiny model), or one clear error."""
    if model is None:
        from moetier.default_model import default_model_dir

        return default_model_dir()
    path = Path(model).expanduser()
    if path.is_file():
        raise MoetierError(f"--model {path} is a file; give the checkpoint directory that holds config.json")
    if not path.is_dir():
        raise MoetierError(f"--model {path}: no such directory")
    return path


class LLM:
    def __init__(self, model: str | Path | None = None, dtype: str = "auto", device: str = "auto",
                 config: EngineConfig | None = None, plan: Any = None,
                 progress: Callable[[int, int], None] | None = None, on_audit: Callable[[str], None] | None = None,
                 rank_plans: Any = None, **options: Any):
        """Load a checkpoint directory (default: the embedded tiny model). `options`: fields of EngineConfig
        (max_num_seqs, ..., dense_weights, experts: where the routed experts live, experts/placement.ExpertOptions)
        over `config`. plan: the memory plan preflight
        made (moetier/plan); on CUDA audited after loading and after graph capture (self.audits; each, and
        each load note, through on_audit). progress(bytes, total): loading. rank_plans: with several ranks,
        each rank's memory share (plan/nodes.RankPlans), checked against every node's free memory first."""
        config = EngineConfig.of(config, **options)
        self.chunk_reason = None
        if config.max_num_tokens is None and plan is not None:  # the chunk the memory plan counted
            config = EngineConfig.of(config, max_num_tokens=plan.request["max_num_tokens"])
            self.chunk_reason = (plan.chunk or {}).get("reason", "the memory plan's")
        experts = config.experts
        model_dir = model_dir_of(model)
        config_from_dir(model_dir)  # the plainest error first when the directory is not a checkpoint
        tokenizer = Tokenizer.from_dir(model_dir)
        device = pick_device(device)
        self.plan, self.audits, self._on_audit = plan, [], on_audit
        baseline = self._measure() if plan is not None and device == "cuda" else None
        self._workers, self.parallel = None, None
        if config.world_size > 1:
            # ranks 1..N-1 in other processes, this process is rank 0 (moetier/dist, docs/parallel.md)
            device = self._start_workers(model_dir, dtype, device, config, config_from_dir(model_dir), rank_plans)
        try:
            kw = {} if self.parallel is None else {"parallel": self.parallel}
            cfg, net, self.load_report = load_model(model_dir, dtype=dtype, device=device, experts=experts,
                                                    decode_tokens=config.decode_tokens, progress=progress,
                                                    dense_weights=config.dense_weights, mtp=config.drafts_with_mtp,
                                                    **kw)
            if self._workers is not None:
                self._workers.ready()
        except BaseException:
            if self._workers is not None:
                self._workers.stop(graceful=False)
            raise
        for note in self.load_report.notes if on_audit else ():  # once each (4-bit: W4A16, input scales unread)
            on_audit(f"load: {note}")
        self._audit("after load", baseline)
        self._setup(net, tokenizer, eos_ids_of(model_dir, cfg.eos_token_ids, tokenizer), model_dir, config,
                    baseline)

    def _start_workers(self, source: Any, dtype: str, device: str, config: EngineConfig, cfg: Any,
                       rank_plans: Any) -> str:
        """Refuse a layout the model cannot split (before anything starts), start ranks 1..N-1 with
        the configured executor, join as rank 0: sets self.parallel and self._workers. -> rank 0's
        device, with its index on CUDA (the executor chose it: Ray may reserve another GPU than 0),
        so that threads other than this one (AsyncLLM's) allocate on the same GPU."""
        from moetier.checkpoint.loader import check_parallel
        from moetier.dist.executor import spec_for, start

        check_parallel(cfg, config.experts, config.decode_tokens, config.layout())
        self.parallel, self._workers = start(spec_for(source, dtype, device, config), rank_plans)
        return f"cuda:{torch.cuda.current_device()}" if device == "cuda" else device

    @classmethod
    def from_random(cls, random: Any, dtype: str = "auto", device: str = "auto", config: EngineConfig | None = None,
                    rank_plans: Any = None, **options: Any) -> LLM:
        """Random weights of a preset shape (checkpoint/random_bed.RandomModel), made in memory: in one
        process, or over tensor/expert-parallel ranks that each make their own share (the server's
        --preset, bench decode's parallel rows). self.bed: rank 0's share (row sizes for rooflines)."""
        from moetier.checkpoint.loader import resolve_dtype
        from moetier.checkpoint.random_bed import build_random
        from moetier.presets import preset

        config = EngineConfig.of(config, **options)
        device = pick_device(device)
        cfg = preset(random.preset, random.layers)
        torch_dtype = resolve_dtype("bfloat16" if dtype == "auto" else dtype, cfg)
        # the bed's placement, with the caller's prefill options (the one record says what runs)
        experts = random.options(cfg, config.layout())
        config = EngineConfig.of(config, experts=replace(experts, prefill=config.experts.prefill,
                                                         prefill_stream=config.experts.prefill_stream))
        if config.world_size == 1:
            bed = build_random(random, torch_dtype, device, config.decode_tokens)
            self = cls.from_model(bed.model, bed.tokenizer, config)
            self.bed = bed
            return self
        self = cls.__new__(cls)
        self._workers, self.load_report = None, None
        self.plan, self.audits, self._on_audit = None, [], None
        device = self._start_workers(random, dtype, device, config, cfg, rank_plans)
        try:
            self.bed = build_random(random, torch_dtype, device, config.decode_tokens, self.parallel)
            self._workers.ready()
        except BaseException:
            self._workers.stop(graceful=False)
            raise
        eos = set(self.bed.cfg.eos_token_ids) | set(self.bed.tokenizer.eos_token_ids)
        self._setup(self.bed.model, self.bed.tokenizer, eos, None, config)
        return self

    @staticmethod
    def _measure() -> dict:
        from moetier.plan.audit import measure

        return measure("cuda")

    def _audit(self, stage: str, baseline: dict | None) -> None:
        """Measured memory against the plan (moetier/plan/audit.py); a warning beyond 5% (CUDA only:
        on the CPU the host figures are dominated by the interpreter and the tests' own memory)."""
        if baseline is None:
            return
        from moetier.plan.audit import lines, report

        audit = report(self.plan, stage, self._measure(), baseline)
        self.audits.append(audit)
        if self._on_audit is not None:
            self._on_audit("\n".join(lines(audit)))

    @classmethod
    def from_model(cls, model: CausalLM, tokenizer: Tokenizer, config: EngineConfig | None = None,
                   **options: Any) -> LLM:
        """An engine over a model built in memory, expert backends attached (benchmarks: random
        weights too large for a file). Its backends must have been built for config.decode_tokens."""
        self = cls.__new__(cls)
        config = EngineConfig.of(config, **options)
        if config.world_size > 1:
            raise MoetierError("LLM.from_model runs one process; tensor or expert parallelism needs a checkpoint "
                               "directory (LLM(model_dir, tensor_parallel_size=N)): every rank loads its share")
        self._workers, self.parallel = None, None
        self.load_report: LoadReport | None = None
        self.plan, self.audits, self._on_audit = None, [], None
        self.chunk_reason = None
        eos = set(model.cfg.eos_token_ids) | set(tokenizer.eos_token_ids)
        self._setup(model, tokenizer, eos, None, config)
        return self

    def _setup(self, model: CausalLM, tokenizer: Tokenizer, eos_ids: set[int], model_dir: Path | None,
               config: EngineConfig, baseline: dict | None = None) -> None:
        """baseline: the memory measured before loading (the plan's audits; None: no audit)."""
        if config.max_num_tokens is None:  # no memory plan made it: the same rule (plan/chunk.py)
            tokens, self.chunk_reason = auto_chunk(model)
            config = EngineConfig.of(config, max_num_tokens=tokens)
        for block in model.moe_blocks():  # a model built elsewhere (a bench's or a random bed): the config's say
            set_prefill_policy(block.experts, config.experts.prefill)
            set_prefill_stream(block.experts, config.experts.prefill_stream)
        self.model_dir, self.tokenizer, self.model, self.cfg, self.config = model_dir, tokenizer, model, model.cfg, config
        if tokenizer.vocab_size > self.cfg.vocab_size:
            raise MoetierError(f"the tokenizer has {tokenizer.vocab_size} tokens but the model only "
                               f"{self.cfg.vocab_size}: tokenizer.json does not belong to this model")
        self.eos_ids = eos_ids
        max_len = config.model_len(self.cfg.max_position_embeddings)
        # the device pool, the prefix cache and its host tier, the scheduler over them (kv_setup.py)
        spec = model.kv_spec()
        self.kv = engine_kv(spec, config, model.dtype, model.device)
        moves = engine_moves(self.kv, config, spec, model.dtype)
        self.scheduler = engine_scheduler(config, spec, model.dtype, moves, max_len, self.cfg.model_type)
        self.kv_page_bytes, self.outputs = page_bytes(self.kv), OutputProcessor(tokenizer)
        self.recorder = self.replayer = None
        if config.record_trace is not None:  # no graphs then (graphs.captures)
            from moetier.traces.hooks import Recorder

            meta = {"model": str(model_dir), "source": "moetier engine", **config.trace_meta}
            self.recorder = Recorder(model, config.record_trace, **meta)
        if config.replay_trace is not None:
            from moetier.traces.format import read_trace
            from moetier.traces.hooks import Replayer

            self.replayer = Replayer(model, read_trace(config.replay_trace))
        attach_prefetch(model, config.experts.prefetch, self.replayer)  # (re)links or unlinks, before the graphs
        # expert-aware k: its route hook is in the graphs too; an MTP pass timed on the scratch page (one
        # process only: rank 0 alone would run the pass's collectives without its workers)
        attach_chooser(self.scheduler.spec, model, self.kv if self._workers is None else None, config)
        graphs = verify = None
        if captures(config, model, parallel=self._workers is not None) and not config.drafts_with_mtp:
            # piecewise: e.g. hybrid, a host decision per MoE layer (experts/hybrid/backend.py)
            graphs = decode_graphs(model, self.kv, config, max_len, needs_pieces(model))
            # n-gram speculation: the verify step's graphs, in the same pool (verify_graphs.py)
            verify = verify_graphs(model, self.kv, config, max_len, graphs, parallel=self._workers is not None)
            if self._workers is None:
                time_graphs(self.scheduler.spec, graphs, verify)  # expert-aware k: which steps replay, their costs
            if self.replayer is not None:
                self.replayer.cursor.zero_()  # warm-up steps of the capture moved it
        # the plan's "capture" stage ends here: the warm-up's large step brings runtime items (the
        # default stream's cuBLAS workspace, a prefill ring) that the plan counts as runtime
        self._audit("after graph capture", baseline)
        warm_up(model, self.kv, config, self.replayer, parallel=self._workers is not None)
        self.runner = ModelRunner(model, self.kv, graphs, moves, mtp=config.drafts_with_mtp, verify=verify)  # MTP: eager
        if self._workers is not None:
            from moetier.dist.executor import DistributedRunner

            self.runner = DistributedRunner(self.runner, self._workers)
        # overlapped scheduling (overlap.py; one process: the config refuses it with several ranks), no trace
        # recorder (it reads each step's rows), no MTP passes (they read the step's verdict on the host)
        self.overlap = None
        if config.async_scheduling and self.recorder is None and not config.drafts_with_mtp:
            self.overlap = Overlap(self.scheduler, self.runner)
        # large steps: above decode_tokens, the large-step expert path (with slots each streams every
        # missing expert of a layer once, however few its tokens; docs/prefix-cache.md)
        self._ids, self.steps, self.large_steps, self.large_step_tokens = itertools.count(), 0, 0, 0
        self.step_seconds = self.large_step_seconds = 0.0

    # -- requests ---------------------------------------------------------------------------------
    def encode(self, prompt: str | list[int], chat: bool = False, system: str | None = None) -> list[int]:
        if isinstance(prompt, list):
            ids = list(prompt)
        else:
            if chat:
                messages = ([{"role": "system", "content": system}] if system else []) + [
                    {"role": "user", "content": prompt}]
                prompt = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
            ids = self.tokenizer.encode(prompt)
        if not ids:
            raise MoetierError("the prompt is empty after tokenization; give some text")
        # the types once, then min and max: a per-id generator cost 0.3 ms a 4,000-token prompt, paid twice
        # by a server request (its handler validates, then the engine)
        if not all(issubclass(t, int) for t in set(map(type, ids))) or min(ids) < 0 or max(ids) >= self.cfg.vocab_size:
            raise MoetierError(f"prompt token ids must be integers in [0, {self.cfg.vocab_size})")
        return ids

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None) -> str:
        params = (params or SamplingParams()).validate()
        bad = [t for t in params.logit_bias or {} if t >= self.cfg.vocab_size]  # an index the sampler cannot add to
        if bad:
            raise MoetierError(f"logit_bias token ids must be below the vocabulary size {self.cfg.vocab_size}; "
                               f"got {bad[:5]}")
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        text = prompt if isinstance(prompt, str) else None
        req = Request(rid, self.encode(prompt), params, params.noise_seed(), prompt=text)
        self.scheduler.add(req)
        self.outputs.add(req)
        return rid

    def abort(self, request_id: str) -> bool:
        self.outputs.drop(request_id)
        return self.scheduler.abort(request_id)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # -- the loop -----------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedule, run, sample, detokenize: one step. Returns an output per request that changed."""
        t0 = time.perf_counter()
        if self.overlap is not None:  # async_scheduling: the step in flight, its successor launched first
            plan, step, result = self.overlap.step()
        else:
            plan = self.scheduler.schedule()
            step = plan.step()
            result = self.runner.execute(step)
        got = self.scheduler.update(plan, result.sampled, self.eos_ids, result.logprobs, result.prompt_logprobs,
                                    result.emitted, result.drafts, result.emitted_logprobs)
        drafts = any(s.num_draft for s in step.seqs)
        if self.recorder is not None or (drafts and self.replayer is not None and self._workers is None):
            kept = valid_positions(plan, step)  # after update: the positions each request's step made valid
            if self.recorder is not None:
                self.recorder.end_step([s.request_id for s in step.seqs], [s.num_tokens for s in step.seqs], kept,
                                       prefill=any(s.num_tokens - s.num_draft > 1 for s in step.seqs))
            if drafts and self.replayer is not None and self._workers is None:
                # the rows the step routed (a verify graph pads drafts) that made no position valid: again
                self.replayer.rewind(result.num_tokens - sum(kept))
        # wall time to the sampled tokens on the host (update() reads them: the step's one sync)
        seconds = time.perf_counter() - t0
        self.steps, self.step_seconds = self.steps + 1, self.step_seconds + seconds
        if step.num_tokens > self.config.decode_tokens:
            self.large_steps, self.large_step_tokens = self.large_steps + 1, self.large_step_tokens + step.num_tokens
            self.large_step_seconds += seconds
        outputs = [self.outputs.process(req, self.scheduler.finish) for req in got]
        if self.overlap is not None:
            self.overlap.settle()
        return outputs

    def generate(self, prompts: Sequence[str | list[int]] | str, params: SamplingParams | Sequence[SamplingParams]
                 | None = None) -> list[RequestOutput]:
        """Run a batch to completion; outputs in the order of the prompts."""
        if isinstance(prompts, str):
            prompts = [prompts]
        plist = list(params) if isinstance(params, Sequence) else [params] * len(prompts)
        if len(plist) != len(prompts):
            raise MoetierError(f"{len(prompts)} prompts but {len(plist)} sampling parameters")
        ids = [self.add_request(p, sp) for p, sp in zip(prompts, plist)]
        final: dict[str, RequestOutput] = {}
        while self.has_unfinished():
            for out in self.step():
                if out.finished:
                    final[out.request_id] = out
        return [final[i] for i in ids]

    def close(self) -> None:
        """Finish a recorded trace (complete only after this), unhook a replayed one, stop the workers."""
        if self._workers is not None:
            if not self._workers.stopped and hasattr(self, "runner"):
                self._closed_stats = last_stats(self)
                self.runner.release()  # graphs before the group (graphs.release)
            self._workers.stop()
        for hook in (self.recorder, self.replayer):
            if hook is not None:
                hook.close()
        self.recorder = self.replayer = None

    def expert_stats_per_rank(self) -> list[dict]:
        """Each rank's expert statistics, rank 0's first (engine/metrics.py)."""
        return expert_stats_per_rank(self)

    def metrics(self) -> dict:
        """Queues, KV pages, prefix cache, step counts, expert statistics, speculation counters
        (engine/metrics.py)."""
        return engine_metrics(self)
