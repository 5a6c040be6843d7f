"""Where a request's time goes outside the engine step, through `moetier serve`'s own app on this
machine: marks along the path of one streamed /v1/completions request (client send, the handler,
the engine's add_request, its first token handed to the event loop, the first chunk at the client), median of --repeats.

    python scripts/server_path_timing.py [--tokens 3000] [--repeats 9] [--out FILE.json]

The default model (tiny-stdlib) on the CPU or GPU: the step itself is not what this measures; the
gaps around it are (docs/prefix-cache.md, a prefix hit's fixed costs). The marks wrap methods of
the server's classes in this process only.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import threading
import time

import httpx
import numpy as np
import uvicorn

from moetier.bench.common import provenance
from moetier.engine import async_llm, llm as llm_mod
from moetier.server import handlers
from moetier.server.app import build_app

MARKS: list[tuple[str, float]] = []
# (class, method, mark, before or after the call): the path in order
WRAPS = [(handlers.Handlers, "completion", "handler", False), (handlers.Handlers, "params", "validated", True),
         (async_llm.AsyncLLM, "_send", "queued", False), (llm_mod.LLM, "add_request", "admitted", True),
         (async_llm.AsyncLLM, "_put", "first token out", False)]


def wrap(cls, name: str, mark: str, after: bool) -> None:
    f = getattr(cls, name)

    def marked(*a, **k):
        if not after:
            MARKS.append((mark, time.perf_counter()))
        r = f(*a, **k)
        if after:
            MARKS.append((mark, time.perf_counter()))
        return r

    setattr(cls, name, marked)


async def one(client: httpx.AsyncClient, url: str, ids: list[int]) -> dict[str, float]:
    MARKS.clear()
    t0, first = time.perf_counter(), None
    body = {"model": "m", "prompt": ids, "max_tokens": 2, "temperature": 0, "ignore_eos": True, "stream": True}
    async with client.stream("POST", url, json=body) as r:
        async for line in r.aiter_lines():
            if line.startswith("data:") and first is None:
                first = time.perf_counter()
    await asyncio.sleep(0.02)  # the engine thread's last marks
    out: dict[str, float] = {}
    for name, t in MARKS:
        out.setdefault(name, (t - t0) * 1e3)  # each mark's first time: the request's own
    out["first chunk at the client"] = (first - t0) * 1e3
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=3000, help="prompt length in token ids (below the context)")
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--port", type=int, default=8197)
    ap.add_argument("--out", default=None, help="a JSON record (default: print only)")
    args = ap.parse_args()
    if args.tokens < 1 or args.repeats < 1:
        ap.error(f"--tokens and --repeats take positive integers, got {args.tokens} and {args.repeats}")
    if not 1 <= args.port <= 65535:
        ap.error(f"--port takes 1 to 65535, got {args.port}")
    if args.out and os.path.isdir(args.out):
        ap.error(f"--out {args.out} is a directory; give a file name for the JSON record")
    for w in WRAPS:
        wrap(*w)
    engine = async_llm.AsyncLLM(llm_mod.LLM())
    ctx = engine.llm.scheduler.max_model_len
    if args.tokens + 2 > ctx:
        engine.shutdown()
        ap.error(f"--tokens {args.tokens} and 2 output tokens exceed the model's context of {ctx}")
    server = uvicorn.Server(uvicorn.Config(build_app(engine, "m"), port=args.port, log_level="warning"))
    threading.Thread(target=server.run, daemon=True).start()
    deadline = time.monotonic() + 30
    while not server.started:  # a port in use ends the server's thread without starting it
        if time.monotonic() > deadline:
            engine.shutdown()
            ap.error(f"the app did not start on port {args.port} within 30 s (in use?); give another --port")
        time.sleep(0.05)
    ids = np.random.default_rng(0).integers(3, engine.llm.cfg.vocab_size, args.tokens).tolist()

    async def run() -> list[dict[str, float]]:
        async with httpx.AsyncClient(timeout=120) as client:
            url = f"http://127.0.0.1:{args.port}/v1/completions"
            await one(client, url, ids)  # warm-up
            return [await one(client, url, ids) for _ in range(args.repeats)]

    runs = asyncio.run(run())
    names = list(runs[0])
    med = {n: statistics.median(r[n] for r in runs) for n in names}
    print(f"{'mark':28s} {'median ms':>10s} {'min':>8s} {'max':>8s}   (from the client's send; {args.repeats} requests, "
          f"{args.tokens} prompt tokens)")
    for n in names:
        vals = [r[n] for r in runs]
        print(f"{n:28s} {med[n]:10.2f} {min(vals):8.2f} {max(vals):8.2f}")
    outside = med["admitted"] + med["first chunk at the client"] - med["first token out"]
    print(f"outside the engine (send to admitted, plus the first token to the client's chunk): {outside:.2f} ms")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"provenance": provenance(), "args": vars(args), "median_ms": med, "runs": runs,
                       "outside_engine_ms": outside}, f, indent=1)
    server.should_exit = True
    engine.shutdown()


if __name__ == "__main__":
    main()
