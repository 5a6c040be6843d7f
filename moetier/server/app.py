"""The fastapi app: routes, the API key, and errors in OpenAI's shape.

    POST /v1/completions, /v1/chat/completions   (handlers.py)
    GET  /v1/models, /health, /version, /metrics
    POST /tokenize, /detokenize

With an API key, every route but /health needs `Authorization: Bearer KEY`; a missing or wrong one
gets 401. The key check is plain ASGI middleware (not BaseHTTPMiddleware, which would sit between
a streaming response and the client's disconnect).
"""

from __future__ import annotations

import asyncio
import secrets
import time
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from starlette.exceptions import HTTPException

import moetier
from moetier.errors import MoetierError
from moetier.server.handlers import Handlers
from moetier.server.metrics import ServerMetrics, engine_snapshot
from moetier.server.parsers import Parsers
from moetier.server.protocol import ApiError, ChatRequest, CompletionRequest, parse
from moetier.tokenizer import TokenizerError


class ApiKey:
    """ASGI middleware: Bearer token on every HTTP route except the open ones."""

    OPEN = ("/health",)

    def __init__(self, app, key: str):
        self.app, self.expected = app, f"Bearer {key}".encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"] not in self.OPEN:
            got = dict(scope["headers"]).get(b"authorization", b"")
            if not secrets.compare_digest(got, self.expected):
                err = ApiError(401, "missing or wrong API key: send the header 'Authorization: Bearer KEY'")
                await JSONResponse(err.body(), 401)(scope, receive, send)
                return
        await self.app(scope, receive, send)


def build_app(engine, model_name: str, api_key: str | None = None, max_queue: int = 256,
              parsers: Parsers = Parsers()) -> FastAPI:
    """The app over an AsyncLLM; the engine is shut down with the app (after uvicorn has drained)."""
    llm = engine.llm

    def snapshot() -> dict:
        with engine._lock:  # counters are read between steps, never inside one
            return engine_snapshot(llm)

    metrics = ServerMetrics(snapshot, model_name)
    handlers = Handlers(engine, model_name, metrics, max_queue, parsers)

    @asynccontextmanager
    async def lifespan(app):
        yield
        engine.shutdown()

    app = FastAPI(title="moetier", version=moetier.__version__, lifespan=lifespan, docs_url=None,
                  redoc_url=None, openapi_url=None)
    app.state.handlers = handlers
    if api_key:
        app.add_middleware(ApiKey, key=api_key)

    @app.exception_handler(ApiError)
    async def api_error(_, e: ApiError):
        return JSONResponse(e.body(), e.status, headers=e.headers)

    @app.exception_handler(HTTPException)
    async def http_error(_, e: HTTPException):
        return JSONResponse(ApiError(e.status_code, str(e.detail)).body(), e.status_code)

    @app.exception_handler(Exception)
    async def bug(_, e: Exception):  # a bug in moetier, not the request: still an error object
        return JSONResponse(ApiError(500, f"internal error: {type(e).__name__}: {e}").body(), 500)

    @app.get("/health")
    async def health():
        return Response(status_code=200)

    @app.get("/version")
    async def version():
        return {"version": moetier.__version__}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{
            "id": model_name, "object": "model", "created": int(time.time()), "owned_by": "moetier",
            "root": str(llm.model_dir or model_name), "max_model_len": llm.scheduler.max_model_len}]}

    @app.get("/metrics")
    async def prometheus():
        body = await asyncio.to_thread(metrics.render)
        return PlainTextResponse(body, media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await handlers.completion(parse(CompletionRequest, await request.body()), request)

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await handlers.chat(parse(ChatRequest, await request.body()), request)

    @app.post("/tokenize")
    async def tokenize(request: Request):
        body = await json_object(request)
        if "messages" in body:
            req = parse(ChatRequest, await request.body())
            text = handlers.chat_prompt(req)
        elif isinstance(body.get("prompt"), str):
            text = body["prompt"]
        else:
            raise ApiError(400, "give 'prompt' (a string) or 'messages' (a chat)", "prompt")
        try:
            ids = llm.tokenizer.encode(text)
        except TokenizerError as e:
            raise ApiError(400, str(e), "prompt") from None
        return {"tokens": ids, "count": len(ids), "max_model_len": llm.scheduler.max_model_len}

    @app.post("/detokenize")
    async def detokenize(request: Request):
        tokens = (await json_object(request)).get("tokens")
        if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
            raise ApiError(400, "'tokens' must be a list of integer token ids", "tokens")
        bad = [t for t in tokens if not 0 <= t < llm.cfg.vocab_size]
        if bad:
            raise ApiError(400, f"token ids must be in [0, {llm.cfg.vocab_size}); got {bad[:5]}", "tokens")
        try:
            return {"prompt": llm.tokenizer.decode(tokens)}
        except (TokenizerError, MoetierError) as e:
            raise ApiError(400, str(e), "tokens") from None

    return app


async def json_object(request: Request) -> dict:
    import json

    try:
        body = json.loads(await request.body())
    except (ValueError, UnicodeDecodeError) as e:
        raise ApiError(400, f"the body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise ApiError(400, "the body must be a JSON object")
    return body
