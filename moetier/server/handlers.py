"""The completion and chat handlers: prompt to engine request, engine outputs to OpenAI responses,
streamed as server-sent events or returned whole.

Every check that can refuse a request (its fields, its prompt, whether it fits the context, the
queue) runs before the first byte is sent, so a refusal is a 400/404/503 with an error object, not
a broken stream. A client that goes away aborts its request: when streaming, starlette cancels the
response and the engine generator's cleanup aborts it; when not, a watcher polls for the disconnect
and cancels the wait. Either way the request's KV pages go back to the pool at once.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
import weakref
from collections.abc import AsyncIterator, Callable

from fastapi import Request as HttpRequest
from fastapi.responses import JSONResponse, Response, StreamingResponse

from moetier.engine.output import RequestOutput
from moetier.errors import MoetierError
from moetier.sampling_params import SamplingParams
from moetier.server.echo import Echo
from moetier.server.logprobs import LogprobFormatter
from moetier.server.metrics import ServerMetrics
from moetier.server.protocol import ApiError, ChatRequest, CompletionRequest
from moetier.server.parsers import Parsers
from moetier.tokenizer import TokenizerError

DISCONNECT_POLL_S = 0.25
CLIENT_GONE = 499  # nginx's "client closed request": what the (absent) client would have been sent
log = logging.getLogger("moetier.server")


def sse(data: dict | str) -> bytes:
    return f"data: {data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)}\n\n".encode()


def usage(out: RequestOutput) -> dict:
    p, c = len(out.prompt_token_ids), len(out.outputs[0].token_ids)
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}


class Handlers:
    def __init__(self, engine, model_name: str, metrics: ServerMetrics, max_queue: int, parsers: Parsers = Parsers()):
        self.engine, self.llm = engine, engine.llm
        self.model_name, self.metrics, self.max_queue = model_name, metrics, max_queue
        self.active = 0  # admitted requests not yet ended: running plus waiting in the engine
        self.logprob_text = LogprobFormatter(self.llm.tokenizer)
        self.parsers = parsers.for_family(self.llm.cfg.model_type)  # `auto`: the model family's formats

    # -- checks before anything is sent ------------------------------------------------------------
    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.model_name:
            raise ApiError(404, f"the model {name!r} does not exist; this server serves {self.model_name!r} "
                                "(GET /v1/models)", "model")

    def encode(self, prompt: str | list[int]) -> list[int]:
        try:
            return self.llm.encode(prompt)
        except (MoetierError, TokenizerError) as e:
            raise ApiError(400, str(e), "prompt") from None

    def params(self, req, ids: list[int]) -> SamplingParams:
        """Sampling parameters, with max_tokens checked against what is left of the context."""
        context = self.llm.scheduler.max_model_len
        if len(ids) >= context:
            raise ApiError(400, f"the prompt has {len(ids)} tokens but the context holds {context}, "
                                "output included; shorten the prompt", "messages" if isinstance(req, ChatRequest)
                           else "prompt")
        params = req.sampling(default_max=context - len(ids), vocab=self.llm.cfg.vocab_size)
        if len(ids) + params.max_tokens > context:
            raise ApiError(400, f"max_tokens {params.max_tokens} plus the prompt's {len(ids)} tokens exceed the "
                                f"context of {context} tokens; ask for at most {context - len(ids)}", "max_tokens")
        return params

    # -- engine outputs ------------------------------------------------------------------------------
    def outputs(self, ids: list[int], params: SamplingParams, rid: str) -> AsyncIterator[RequestOutput]:
        """Admit the request (503 beyond the limit) and hand back its outputs.

        NOTE: the request counts as active from this call, not from the first read of the stream:
        requests arriving together are all checked before any stream starts. It stops counting when the
        stream ends, or, for a stream that never started (a client gone before the response began),
        when the stream object is collected."""
        if self.active >= self.llm.config.max_num_seqs + self.max_queue:
            raise ApiError(503, f"the server is at its limit ({self.active} requests running or queued); "
                                "retry shortly", headers={"Retry-After": "1"})
        self.active += 1
        held = [True]

        def release() -> None:
            if held[0]:
                held[0] = False
                self.active -= 1

        stream = self._outputs(ids, params, rid, release)
        weakref.finalize(stream, release)
        return stream

    async def _outputs(self, ids, params, rid, release) -> AsyncIterator[RequestOutput]:
        gen = self.engine.generate(ids, params, rid)
        last = None
        try:
            async for out in gen:
                last = out
                if out.finished:
                    self.metrics.finished(out.metrics, out.outputs[0].finish_reason)
                yield out
        except (asyncio.CancelledError, GeneratorExit):  # the client went away: normal, one line, no traceback
            if last is None or not last.finished:
                self.metrics.finished(last.metrics if last is not None else {}, "abort")
                log.info("request %s aborted: the client disconnected", rid)
            raise
        finally:
            release()
            await gen.aclose()  # aborts an unfinished request: its pages are freed now

    async def last_output(self, outputs: AsyncIterator[RequestOutput], http: HttpRequest) -> RequestOutput | None:
        """The final output, or None with the request aborted when the client disconnects first."""

        async def drain() -> RequestOutput:
            last = None
            async for out in outputs:
                last = out
            return last

        task = asyncio.ensure_future(drain())
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
                if done:
                    return task.result()
                if await http.is_disconnected():
                    return None  # the finally below aborts it (_outputs logs and counts the abort)
        finally:
            if not task.done():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)

    @staticmethod
    def error_event(e: Exception) -> bytes:
        status = 400 if isinstance(e, (MoetierError, TokenizerError)) else 500
        return sse(ApiError(status, f"the request failed: {e}").body())

    def stream(self, outputs: AsyncIterator[RequestOutput], head: dict, include_usage: bool,
               chunks: Callable[[RequestOutput], list[bytes]], first: bytes | None = None,
               usage_of: Callable[[RequestOutput], dict] = usage) -> StreamingResponse:
        """Server-sent events: `first`, the chunks of each output, the usage chunk if asked, [DONE]."""

        async def events():
            if first is not None:
                yield first
            last = None
            try:
                async for out in outputs:
                    last = out
                    for c in chunks(out):
                        yield c
            except Exception as e:  # a failed engine step: tell the client, end the stream cleanly
                yield self.error_event(e)
            if include_usage and last is not None:
                yield sse({**head, "choices": [], "usage": usage_of(last)})
            yield sse("[DONE]")

        return StreamingResponse(events(), media_type="text/event-stream")

    # -- /v1/completions -------------------------------------------------------------------------------
    async def completion(self, req: CompletionRequest, http: HttpRequest):
        self.check_model(req.model)
        prompt = req.single_prompt()
        ids = self.encode(prompt)
        params = self.params(req, ids)
        rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        head = {"id": rid, "object": "text_completion", "created": created, "model": self.model_name}
        outputs = self.outputs(ids, params, rid)
        # the prompt's text only when echoed: decoding a long prompt of ids costs about a millisecond per
        # 4,000 tokens, before the request reaches the engine
        text = (prompt if isinstance(prompt, str) else self.llm.tokenizer.decode(ids)) if req.echo else ""
        echo = Echo(req, ids, text, self.logprob_text)

        def choice(text: str, out: RequestOutput, new: int | None = None) -> dict:
            """new: the output's last `new` tokens are this chunk's (None: all of them)."""
            c = out.outputs[0]
            lp = None
            if c.logprobs is not None:
                ids, entries = (c.token_ids, c.logprobs) if new is None else (c.token_ids[-new:], c.logprobs[-new:])
                lp = self.logprob_text.completion(ids, entries, len(c.text) - len(text) + len(echo.text))
            o = c if out.finished else None
            return {"index": 0, "text": text, "logprobs": lp, "finish_reason": o and o.finish_reason,
                    "stop_reason": o and o.stop_reason}

        if not req.stream:
            out = await self.last_output(outputs, http)
            if out is None:
                return Response(status_code=CLIENT_GONE)
            whole = echo.whole(out) if req.echo else choice(out.outputs[0].text, out)
            if req.prompt_logprobs is not None:
                whole["prompt_logprobs"] = self.logprob_text.prompt(ids, out.prompt_logprobs, req.prompt_logprobs)
            return JSONResponse({**head, "choices": [whole], "usage": echo.usage(out)})
        include_usage = bool(req.stream_options and req.stream_options.include_usage)

        # NOTE: one chunk per output that brings tokens, even when they add no text yet (a token that
        # ends inside a UTF-8 sequence, or a random-weight model's ids outside its tokenizer), as vLLM
        # does: a client times every token, not only the ones that print. With echo the prompt comes
        # first, in a chunk of its own, with the first output (its logprobs are known from then on).
        def chunks(out: RequestOutput) -> list[bytes]:
            first = [sse({**head, "choices": [echo.prompt_chunk(out)]})] if req.echo and echo.first(out) else []
            if req.scoring_only:
                return first + ([sse({**head, "choices": [echo.last_chunk()]})] if out.finished else [])
            return first + [sse({**head, "choices": [choice(out.outputs[0].delta, out, new=1)]})]

        return self.stream(outputs, head, include_usage, chunks, usage_of=echo.usage)

    # -- /v1/chat/completions ------------------------------------------------------------------------------
    def chat_prompt(self, req: ChatRequest) -> str:
        kwargs = dict(req.chat_template_kwargs or {})
        if req.tools:
            kwargs["tools"] = req.tools
        tok = self.llm.tokenizer
        if not tok.has_chat_template:
            raise ApiError(400, f"the model {self.model_name!r} has no chat template, so chat requests cannot be "
                                "rendered; send a plain prompt to /v1/completions instead", "messages")
        messages = req.template_messages()
        try:
            return tok.apply_chat_template(messages, add_generation_prompt=True, **kwargs)
        except TokenizerError as e:  # the tokenizer's advice is the command line's: not the client's to follow
            raise ApiError(400, str(e).replace(" or drop --chat", ""), "messages") from None

    async def chat(self, req: ChatRequest, http: HttpRequest):
        self.check_model(req.model)
        prompt = self.chat_prompt(req)
        ids = self.encode(prompt)
        params = self.params(req, ids)
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        head = {"id": rid, "object": "chat.completion", "created": created, "model": self.model_name}
        reasoning = self.parsers.splitter(prompt)
        tools = self.parsers.tool_parser(req.tools) if req.tool_choice != "none" else None
        # the parsers' markers reach them even where the checkpoint made them special tokens
        params.keep_special_ids = self.llm.tokenizer.special_ids_of(
            reasoning.markers + (tools.MARKERS if tools is not None else ()))
        outputs = self.outputs(ids, params, rid)

        def finish_reason(out: RequestOutput) -> str:
            r = out.outputs[0].finish_reason
            return "tool_calls" if tools is not None and tools.calls and r == "stop" else r

        if not req.stream:
            out = await self.last_output(outputs, http)
            if out is None:
                return Response(status_code=CLIENT_GONE)
            think, content = reasoning.split(out.outputs[0].text)
            calls = []
            if tools is not None:
                content, calls = tools.parse(content)  # the same text a stream sends, whitespace included
            message = {"role": "assistant", "content": content or None, "reasoning_content": think or None,
                       "reasoning": think or None, "tool_calls": [c.to_dict() for c in calls]}
            c = out.outputs[0]
            lp = None if c.logprobs is None else self.logprob_text.chat(c.token_ids, c.logprobs)
            choice = {"index": 0, "message": message, "logprobs": lp, "finish_reason": finish_reason(out),
                      "stop_reason": out.outputs[0].stop_reason}
            return JSONResponse({**head, "choices": [choice], "usage": usage(out)})

        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        head["object"] = "chat.completion.chunk"

        def chunk(delta: dict, finish: str | None = None, lp: dict | None = None) -> bytes:
            return sse({**head, "choices": [{"index": 0, "delta": delta, "logprobs": lp, "finish_reason": finish}]})

        def deltas(think: str, content: str, final: bool) -> list[bytes]:
            chunks = []
            if think:
                chunks.append(chunk({"reasoning_content": think, "reasoning": think}))
            calls = []
            if tools is not None:
                content, calls = tools.push(content)
                if final:
                    content += tools.flush()
            if content:
                chunks.append(chunk({"content": content}))
            for call in calls:
                i = tools.calls.index(call)
                chunks.append(chunk({"tool_calls": [{"index": i, **call.to_dict()}]}))
            return chunks

        def chunks(out: RequestOutput) -> list[bytes]:
            got = deltas(*reasoning.push(out.outputs[0].delta), final=False)
            if out.finished:
                got += deltas(*reasoning.flush(), final=True) + [chunk({}, finish_reason(out))]
            c = out.outputs[0]
            if c.logprobs is not None:
                # the output's token rides on a chunk of its own: its text may be held back (a
                # partial character, a reasoning or tool-call marker), its logprob is not
                got.insert(0, chunk({}, lp=self.logprob_text.chat(c.token_ids[-1:], c.logprobs[-1:])))
            return got

        return self.stream(outputs, head, include_usage, chunks, first=chunk({"role": "assistant", "content": ""}))
