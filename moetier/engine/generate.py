"""One request at a time through the engine, text streamed as it comes: what `moetier generate` runs."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from moetier.engine.llm import LLM
from moetier.sampling_params import SamplingParams


@dataclass
class GenerationResult:
    prompt_ids: list[int]
    output_ids: list[int]
    text: str
    finish_reason: str  # "stop" (EOS, stop token or stop string) or "length"
    stop: str | int | None = None  # the stop string or stop token id that ended it, if any
    timings: dict[str, float] = field(default_factory=dict)


class Generator:
    def __init__(self, llm: LLM):
        self.llm = llm
        self.cfg, self.model, self.tokenizer = llm.cfg, llm.model, llm.tokenizer
        self.eos_ids, self.load_report = llm.eos_ids, llm.load_report

    def prompt_ids(self, prompt: str, chat: bool = False, system: str | None = None) -> list[int]:
        return self.llm.encode(prompt, chat=chat, system=system)

    def generate(self, prompt_ids: list[int], params: SamplingParams,
                 on_text: Callable[[str], None] | None = None) -> GenerationResult:
        rid = self.llm.add_request(prompt_ids, params)
        final = None
        while self.llm.has_unfinished():
            for out in self.llm.step():
                if out.request_id != rid:
                    continue
                if out.outputs[0].delta and on_text:
                    on_text(out.outputs[0].delta)
                if out.finished:
                    final = out
        m = final.metrics
        decode_s = m["token_times"][-1] - m["token_times"][0]
        timings = {
            "prefill_s": m["ttft_s"],
            "ttft_s": m["ttft_s"],
            "decode_s": decode_s,
            "total_s": m["e2e_s"],
            "prefill_tok_per_s": len(prompt_ids) / m["ttft_s"],
            "decode_tok_per_s": m["decode_tok_per_s"],
        }
        done = final.outputs[0]
        return GenerationResult(final.prompt_token_ids, done.token_ids, done.text, done.finish_reason,
                                done.stop_reason, timings)
