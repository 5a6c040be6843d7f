"""One request from prompt ids to text: prefill, then decode token by token, streaming text out.

The serving engine (continuous batching) will drive the same model, sampler and detokenizer.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from moetier.config import ModelConfig
from moetier.detokenizer import StopStrings, StreamDecoder
from moetier.errors import MoetierError
from moetier.experts.placement import ExpertOptions
from moetier.loader import LoadReport, load_model
from moetier.models.qwen3_moe import Qwen3MoeForCausalLM
from moetier.sampler import SamplingParams, sample
from moetier.tokenizer import Tokenizer


@dataclass
class GenerationResult:
    prompt_ids: list[int]
    output_ids: list[int]
    text: str
    finish_reason: str  # "stop" (EOS, stop token or stop string) or "length"
    stop: str | None = None  # the stop string that ended it, if any
    timings: dict[str, float] = field(default_factory=dict)


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


class Generator:
    def __init__(self, cfg: ModelConfig, model: Qwen3MoeForCausalLM, tokenizer: Tokenizer, eos_ids: set[int],
                 load_report: LoadReport | None = None):
        self.cfg, self.model, self.tokenizer, self.eos_ids = cfg, model, tokenizer, eos_ids
        self.load_report = load_report

    @classmethod
    def from_dir(cls, model_dir: str | Path, dtype: str = "auto", experts: ExpertOptions | None = None,
                 device: str = "cpu") -> Generator:
        model_dir = Path(model_dir)
        if not model_dir.is_dir():
            raise MoetierError(f"--model {model_dir}: no such directory")
        ModelConfig.from_dir(model_dir)  # the plainest error first when the directory is not a checkpoint
        tokenizer = Tokenizer.from_dir(model_dir)
        cfg, model, report = load_model(model_dir, dtype=dtype, device=device, experts=experts)
        if tokenizer.vocab_size > cfg.vocab_size:
            raise MoetierError(f"the tokenizer has {tokenizer.vocab_size} tokens but the model only "
                               f"{cfg.vocab_size}: tokenizer.json does not belong to this model")
        return cls(cfg, model, tokenizer, eos_ids_of(model_dir, cfg, tokenizer), report)

    def prompt_ids(self, prompt: str, chat: bool = False, system: str | None = None) -> list[int]:
        if chat:
            messages = ([{"role": "system", "content": system}] if system else []) + [
                {"role": "user", "content": prompt}]
            prompt = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        ids = self.tokenizer.encode(prompt)
        if not ids:
            raise MoetierError("the prompt is empty after tokenization; give some text")
        return ids

    def generate(self, prompt_ids: list[int], params: SamplingParams,
                 on_text: Callable[[str], None] | None = None) -> GenerationResult:
        params.validate()
        n = len(prompt_ids)
        limit = self.cfg.max_position_embeddings
        if n + params.max_tokens > limit:
            raise MoetierError(f"prompt ({n} tokens) + max_tokens ({params.max_tokens}) exceeds the model's "
                               f"context of {limit} tokens; shorten the prompt or lower --max-tokens")
        if any(not 0 <= i < self.cfg.vocab_size for i in prompt_ids):
            raise MoetierError(f"prompt token ids must be in [0, {self.cfg.vocab_size})")
        stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else self.eos_ids)
        decoder, stops = StreamDecoder(self.tokenizer), StopStrings(params.stop)
        generator = params.generator(self.model.device)
        kv = self.model.new_kv_cache(n + params.max_tokens)
        emit = on_text or (lambda s: None)
        out: list[int] = []
        pieces: list[str] = []
        finish, stop_str = "length", None

        t0 = time.perf_counter()
        ids = torch.tensor(prompt_ids, device=self.model.device)
        logits = self.model.logits(self.model.forward(ids, kv)[-1:])
        t_prefill = time.perf_counter()
        t_first = t_prefill
        while len(out) < params.max_tokens:
            tok = int(sample(logits, [params], [generator])[0])
            if not out:
                t_first = time.perf_counter()
            out.append(tok)
            if tok in stop_ids:
                finish = "stop"
                break
            text, stopped = stops.push(decoder.push(tok))
            if text:
                pieces.append(text)
                emit(text)
            if stopped:
                finish, stop_str = "stop", stops.matched
                break
            if len(out) == params.max_tokens:
                break
            logits = self.model.logits(self.model.forward(torch.tensor([tok], device=self.model.device), kv))
        t_end = time.perf_counter()
        if stop_str is None:
            tail, stopped = stops.push(decoder.flush())
            if stopped:  # a stop string completed in the held-back bytes
                finish, stop_str = "stop", stops.matched
            else:
                tail += stops.flush()
            if tail:
                pieces.append(tail)
                emit(tail)
        decode_tokens = max(len(out) - 1, 0)
        timings = {
            "prefill_s": t_prefill - t0,
            "ttft_s": t_first - t0,
            "decode_s": t_end - t_first,
            "total_s": t_end - t0,
            "prefill_tok_per_s": n / max(t_prefill - t0, 1e-9),
            "decode_tok_per_s": decode_tokens / (t_end - t_first) if decode_tokens else 0.0,
        }
        return GenerationResult(list(prompt_ids), out, "".join(pieces), finish, stop_str, timings)
