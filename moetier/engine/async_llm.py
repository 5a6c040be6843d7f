"""Streams engine outputs to asyncio callers: the engine steps on a background thread
while work exists; each request's outputs arrive on its own queue."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator

from moetier.engine.llm import LLM
from moetier.engine.output import RequestOutput
from moetier.sampling_params import SamplingParams


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
                except Exception as e:  # a failed step fails its requests, not the loop
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


