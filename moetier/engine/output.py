"""What callers get back, shaped as vLLM shapes it, and the output processing that makes it: the
incremental detokenizer and stop strings of every request.

    RequestOutput.outputs[0].token_ids / .text / .finish_reason / .stop_reason, .finished, .metrics

A stop string ends its request: the text up to it is kept, the string itself and what follows are
dropped, even if max_tokens ended the request in the same step. A step may add several tokens
(speculative decoding): each is decoded in turn, and tokens after the one that completes a stop
string are dropped from the output too, as decoding them one step at a time would have.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from moetier.engine.request import Request, Status
from moetier.tokenizer import Tokenizer
from moetier.tokenizer.detokenizer import StopStrings, StreamDecoder


@dataclass
class CompletionOutput:
    index: int
    text: str  # all text so far
    token_ids: list[int]  # all output tokens so far
    finish_reason: str | None  # "stop" (EOS, a stop token or string), "length" or "abort"
    stop_reason: str | int | None  # the stop string or stop token id that ended it; None for EOS
    delta: str = ""  # the text the latest step added (for streaming)
    # when the request asked for logprobs: per output token (logprob, [(alternative id, logprob)])
    logprobs: list[tuple] | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: dict = field(default_factory=dict)  # timings: queue, ttft, e2e, token times, preemptions
    # when the request asked for prompt logprobs: per prompt token (logprob, rank, [(alternative id,
    # logprob)]), None for the first
    prompt_logprobs: list[tuple | None] | None = None


@dataclass
class _Text:
    decoder: StreamDecoder
    stops: StopStrings
    text: str = ""
    seen: int = 0  # output tokens decoded so far


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self._text: dict[str, _Text] = {}

    def add(self, req: Request) -> None:
        decoder = StreamDecoder(self.tokenizer, keep=req.params.keep_special_ids)
        self._text[req.id] = _Text(decoder, StopStrings(req.params.stop))

    def drop(self, request_id: str) -> None:
        self._text.pop(request_id, None)

    def process(self, req: Request, finish: Callable[[Request, str], None]) -> RequestOutput:
        """Text for the request's new tokens; a stop string ends the request through `finish`."""
        st = self._text[req.id]
        stopped_by_token = req.status is Status.FINISHED and req.finish_reason == "stop"
        text, stopped = "", False
        for i in range(st.seen, len(req.output_ids)):
            last = i == len(req.output_ids) - 1
            delta = "" if stopped_by_token and last else st.decoder.push(req.output_ids[i])
            piece, stopped = st.stops.push(delta)
            text += piece
            if stopped:
                del req.output_ids[i + 1:], req.token_times[i + 1:], req.output_logprobs[i + 1:]
                break
        st.seen = len(req.output_ids)
        if stopped:
            req.stop_reason = st.stops.matched
            finish(req, "stop")
            req.finish_reason = "stop"  # also when max_tokens had ended it in the same step
        elif req.status is Status.FINISHED:
            tail, stopped = st.stops.push(st.decoder.flush())
            if stopped:
                req.stop_reason, req.finish_reason = st.stops.matched, "stop"
            else:
                tail += st.stops.flush()
            text += tail
        st.text += text
        finished = req.status is Status.FINISHED
        if finished:
            self.drop(req.id)
        done = CompletionOutput(0, st.text, list(req.output_ids), req.finish_reason, req.stop_reason, text,
                                list(req.output_logprobs) if req.params.logprobs is not None else None)
        scored = req.prompt_logprobs if req.params.prompt_logprobs is not None else None  # complete by now
        # the prompt is the request's own list (nothing changes a prompt after add); the outputs are
        # copies, as each step's RequestOutput keeps what it had (a stop string shortens the live list)
        return RequestOutput(req.id, req.prompt, req.prompt_ids, [done], finished, req.metrics(), scored)
