"""A bounded load test on loopback: 64 concurrent streams, each sending requests one after another,
zero failures, and every greedy reply identical to the same request served alone.

The issue asks for 64 streams x 20 requests (1280). On the 2-core CPU machines that takes about
50 s of the suite's time, so the suite runs REQUESTS_PER_STREAM = 8 (512 requests, about 20 s);
MOETIER_LOAD_REQUESTS=20 runs the issue's full count (it passes too; see docs/server.md).
"""

from __future__ import annotations

import asyncio
import json
import os
import time

import httpx
import pytest

from server_helpers import serve, wait_idle

STREAMS = 64
REQUESTS_PER_STREAM = int(os.environ.get("MOETIER_LOAD_REQUESTS", "8"))
MAX_TOKENS = 12
PROMPTS = ["def fibonacci(n):", "import os\n", "class Parser:", "for i in range(", "def main():\n    ",
           "# Read the file", "return self.", "if __name__ == ", "def __init__(self, path):", "try:\n    import",
           "while True:", "with open(", "raise ValueError(", "from collections import", "x = [", "def test_"]
TIME_LIMIT_S = 240


async def stream_one(client: httpx.AsyncClient, url: str, prompt: str, chat: bool) -> str:
    if chat:
        body = {"model": "tiny-stdlib", "messages": [{"role": "user", "content": prompt}]}
        path, key = "/v1/chat/completions", "delta"
    else:
        body, path, key = {"model": "tiny-stdlib", "prompt": prompt}, "/v1/completions", None
    body.update(max_tokens=MAX_TOKENS, temperature=0, stream=True)
    text = []
    async with client.stream("POST", url + path, json=body) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choice = json.loads(line[6:])["choices"][0]
            text.append((choice[key].get("content") if key else choice["text"]) or "")
    return "".join(text)


@pytest.mark.slow
def test_64_concurrent_streams_greedy_equal_to_alone():
    server = serve()
    try:
        async def run():
            limits = httpx.Limits(max_connections=STREAMS + 4, max_keepalive_connections=STREAMS + 4)
            async with httpx.AsyncClient(timeout=120, limits=limits) as client:
                jobs = [(p, chat) for p in PROMPTS for chat in (False, True)]
                alone = {}
                for job in jobs:  # each request served alone, the reference
                    alone[job] = await stream_one(client, server.url, *job)
                failures, mismatches, done = [], [], 0

                async def worker(w: int):
                    nonlocal done
                    for i in range(REQUESTS_PER_STREAM):
                        job = jobs[(w * 7 + i) % len(jobs)]
                        try:
                            got = await stream_one(client, server.url, *job)
                        except Exception as e:  # counted, not raised: the test reports all of them
                            failures.append(repr(e))
                            continue
                        done += 1
                        if got != alone[job]:
                            mismatches.append((job, got, alone[job]))

                start = time.perf_counter()
                await asyncio.wait_for(asyncio.gather(*(worker(w) for w in range(STREAMS))), TIME_LIMIT_S)
                return failures, mismatches, done, time.perf_counter() - start

        failures, mismatches, done, seconds = asyncio.run(run())
        assert not failures, failures[:3]
        assert not mismatches, mismatches[:3]
        assert done == STREAMS * REQUESTS_PER_STREAM
        wait_idle(server.llm)
        print(f"{done} requests over {STREAMS} streams in {seconds:.1f} s")
    finally:
        server.close()
