"""The engine: scheduler, runner and output processing in one loop.

    llm = LLM(model="~/models/Qwen3-30B-A3B")
    outs = llm.generate(["Hello", "Tell me"], SamplingParams(max_tokens=64))

`LLM.step()` is the loop's body; `AsyncLLM` runs it on a background thread and streams outputs to
asyncio callers (the server uses it).
"""

from __future__ import annotations

import asyncio
import itertools
import math
import json
import threading
from collections.abc import AsyncIterator, Sequence
from pathlib import Path

import torch

from moetier.config import ModelConfig
from moetier.detokenizer import StopStrings, StreamDecoder
from moetier.errors import MoetierError
from moetier.experts.placement import ExpertOptions
from moetier.graphs import SIZES as GRAPH_SIZES, DecodeGraphs
from moetier.kv import KVCache, PagePool
from moetier.loader import load_model
from moetier.models.qwen3_moe import Qwen3MoeForCausalLM
from moetier.request import Request, RequestOutput, Status
from moetier.runner import ModelRunner
from moetier.sampler import SamplingParams
from moetier.scheduler import Scheduler
from moetier.tokenizer import Tokenizer


def eos_ids_of(model_dir: Path, cfg: ModelConfig, tokenizer: Tokenizer) -> set[int]:
    """EOS ids from config.json, generation_config.json and the tokenizer's eos token, together."""
    ids = set(cfg.eos_token_ids) | set(tokenizer.eos_token_ids)
    gen = model_dir / "generation_config.json"
    if gen.is_file():
        try:
            eos = json.loads(gen.read_text()).get("eos_token_id")
        except (OSError, json.JSONDecodeError) as e:
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


class LLM:
    def __init__(self, model: str | Path | None = None, dtype: str = "auto", device: str = "auto",
                 experts: ExpertOptions | None = None, **engine: object):
        """Load a checkpoint directory (default: the embedded tiny model). `engine`: the options of
        `setup` (kv_tokens, page_size, max_num_tokens, max_num_seqs, max_model_len, cuda_graphs,
        record_trace, replay_trace, trace_meta)."""
        if model is None:
            from moetier.default_model import default_model_dir

            model = default_model_dir()
        model_dir = Path(model).expanduser()
        if not model_dir.is_dir():
            raise MoetierError(f"--model {model_dir}: no such directory")
        ModelConfig.from_dir(model_dir)  # the plainest error first when the directory is not a checkpoint
        tokenizer = Tokenizer.from_dir(model_dir)
        cfg, net, self.load_report = load_model(model_dir, dtype=dtype, device=pick_device(device), experts=experts)
        eos = eos_ids_of(model_dir, cfg, tokenizer)
        self.setup(net, tokenizer, eos, model_dir, **engine)

    @classmethod
    def from_model(cls, model: Qwen3MoeForCausalLM, tokenizer: Tokenizer, **engine: object) -> LLM:
        """An engine over a model built in memory (benchmarks: random weights too large for a file)."""
        self = cls.__new__(cls)
        self.load_report = None
        self.setup(model, tokenizer, set(model.cfg.eos_token_ids) | set(tokenizer.eos_token_ids), None, **engine)
        return self

    def setup(self, model: Qwen3MoeForCausalLM, tokenizer: Tokenizer, eos_ids: set[int], model_dir: Path | None,
              kv_tokens: int = 32768, page_size: int = 16, max_num_tokens: int = 512, max_num_seqs: int = 64,
              max_model_len: int | None = None, cuda_graphs: bool = True, record_trace: str | Path | None = None,
              replay_trace: str | Path | None = None, trace_meta: dict | None = None) -> None:
        self.model_dir, self.tokenizer, self.model, self.cfg = model_dir, tokenizer, model, model.cfg
        if self.tokenizer.vocab_size > self.cfg.vocab_size:
            raise MoetierError(f"the tokenizer has {self.tokenizer.vocab_size} tokens but the model only "
                               f"{self.cfg.vocab_size}: tokenizer.json does not belong to this model")
        self.eos_ids = eos_ids
        c = self.cfg
        max_len = min(max_model_len or c.max_position_embeddings, c.max_position_embeddings)
        num_pages = math.ceil(kv_tokens / page_size)
        max_len = min(max_len, num_pages * page_size)
        # One page more than the pool hands out: padding rows of graph-replayed steps write there.
        self.kv = KVCache(c.num_layers, num_pages + 1, page_size, c.num_kv_heads, c.head_dim, self.model.dtype,
                          self.model.device)
        self.scheduler = Scheduler(PagePool(num_pages), page_size, max_num_tokens, max_num_seqs, max_len)
        self.recorder = self.replayer = None
        if record_trace is not None:
            from moetier.traces.hooks import Recorder

            meta = {"model": str(model_dir), "source": "moetier engine", **(trace_meta or {})}
            self.recorder = Recorder(self.model, record_trace, **meta)
            cuda_graphs = False  # the recorder reads ids on the host every step
        if replay_trace is not None:
            from moetier.traces.format import read_trace
            from moetier.traces.hooks import Replayer

            self.replayer = Replayer(self.model, read_trace(replay_trace))
        graphs = None
        if cuda_graphs and self.model.device.type == "cuda":
            # Decode steps above the experts' decode threshold take the eager prefill path.
            cap = min(max_num_seqs, self.model.placement.options.decode_tokens)
            sizes = [n for n in GRAPH_SIZES if n <= cap] or [1]
            graphs = DecodeGraphs(self.model, self.kv, scratch_page=num_pages,
                                  max_pages_per_seq=math.ceil(max_len / page_size), sizes=sizes)
            if self.replayer is not None:
                self.replayer.cursor.zero_()  # warm-up steps of the capture moved it
        self.runner = ModelRunner(self.model, self.kv, graphs)
        self._ids = itertools.count()
        self.steps = 0

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
        if any(not 0 <= i < self.cfg.vocab_size for i in ids):
            raise MoetierError(f"prompt token ids must be in [0, {self.cfg.vocab_size})")
        return ids

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None) -> str:
        params = (params or SamplingParams()).validate()
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        req = Request(rid, self.encode(prompt), params, params.noise_seed(),
                      StreamDecoder(self.tokenizer), StopStrings(params.stop))
        if params.max_tokens == 0:
            raise MoetierError("max_tokens must be at least 1")
        self.scheduler.add(req)
        return rid

    def abort(self, request_id: str) -> bool:
        return self.scheduler.abort(request_id)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # -- the loop -----------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedule, run, sample, detokenize: one step. Returns an output per request that changed."""
        plan = self.scheduler.schedule()
        result = self.runner.execute(plan)
        if self.recorder is not None:
            self.recorder.end_step([q.request.id for q in plan.seqs], [q.num_tokens for q in plan.seqs])
        got = self.scheduler.update(plan, result.sampled, self.eos_ids)
        self.steps += 1
        outputs = []
        for req in got:
            outputs.append(RequestOutput.of(req, self._detokenize(req)))
        return outputs

    def _detokenize(self, req: Request) -> str:
        """Text for the request's newest token; applies stop strings (which end the request)."""
        tok = req.output_ids[-1]
        stopped_by_token = req.status is Status.FINISHED and req.finish_reason == "stop"
        delta = "" if stopped_by_token else req.decoder.push(tok)
        text, stopped = req.stops.push(delta)
        if stopped:  # text after the stop string is dropped, even if max_tokens ended the request too
            req.stop = req.stops.matched
            self.scheduler.finish(req, "stop")
            req.finish_reason = "stop"
        elif req.status is Status.FINISHED:
            tail, stopped = req.stops.push(req.decoder.flush())
            if stopped:
                req.stop, req.finish_reason = req.stops.matched, "stop"
            else:
                tail += req.stops.flush()
            text += tail
        req.text += text
        return text

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
        """Finish a recorded trace (the file is complete only after this); unhook a replayed one."""
        if self.recorder is not None:
            self.recorder.close()
            self.recorder = None
        if self.replayer is not None:
            self.replayer.close()
            self.replayer = None

    def metrics(self) -> dict:
        s = self.scheduler
        stats = self.model.expert_stats()
        looked = stats["hits"] + stats["misses"] + stats["overflow"]
        return {
            "running": len(s.running),
            "waiting": len(s.waiting),
            "kv_pages_used": s.pages.num_used,
            "kv_pages_total": s.pages.num_pages,
            "kv_usage": s.pages.usage(),
            "steps": self.steps,
            "expert_hit_rate": stats["hits"] / looked if looked else None,
            "expert_stats": stats,
        }


class AsyncLLM:
    """Streams outputs to asyncio callers; the engine steps on a background thread while work exists."""

    def __init__(self, llm: LLM):
        self.llm = llm
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._queues: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._stop = False
        self._thread = threading.Thread(target=self._loop, name="moetier-engine", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop:
            self._wake.wait()
            with self._lock:
                if not self.llm.has_unfinished():
                    self._wake.clear()
                    continue
                try:
                    outputs = self.llm.step()
                except Exception as e:  # a failed step fails its requests, not the server
                    outputs = []
                    for rid in list(self.llm.scheduler.requests):
                        self.llm.abort(rid)
                        self._put(rid, e)
            for out in outputs:
                self._put(out.request_id, out)

    def _put(self, rid: str, item) -> None:
        target = self._queues.get(rid)
        if target is not None:
            loop, queue = target
            loop.call_soon_threadsafe(queue.put_nowait, item)

    async def generate(self, prompt: str | list[int], params: SamplingParams | None = None,
                       request_id: str | None = None) -> AsyncIterator[RequestOutput]:
        queue: asyncio.Queue = asyncio.Queue()
        with self._lock:
            rid = self.llm.add_request(prompt, params, request_id)
            self._queues[rid] = (asyncio.get_running_loop(), queue)
        self._wake.set()
        try:
            while True:
                item = await queue.get()
                if isinstance(item, Exception):
                    raise item
                yield item
                if item.finished:
                    return
        finally:
            self._queues.pop(rid, None)
            with self._lock:
                self.llm.abort(rid)  # no-op when finished; frees the pages of a cancelled stream

    def abort(self, request_id: str) -> bool:
        with self._lock:
            return self.llm.abort(request_id)

    def shutdown(self) -> None:
        self._stop = True
        self._wake.set()
        self._thread.join(timeout=5)


