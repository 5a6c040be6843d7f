"""Streams engine outputs to asyncio callers: the engine steps on a background thread
while work exists; each request's outputs arrive on its own queue.

NOTE: callers never wait on the engine. New requests and aborts go into a command queue that the
engine thread applies between steps; an event loop that took the engine's lock instead would block
for a whole step, and as threading.Lock is not fair, the engine thread re-taking it after every step
starved the loop under load (H200, 64 streams: first tokens reached clients only as requests ended).
"""

from __future__ import annotations

import asyncio
import itertools
import queue
import threading
from collections.abc import AsyncIterator

from moetier.engine.llm import LLM
from moetier.engine.output import RequestOutput
from moetier.sampling_params import SamplingParams


class AsyncLLM:
    """Streams outputs to asyncio callers; the engine steps on a background thread while work exists.
    `_lock` is held by the engine thread while it applies commands and steps: whoever takes it (tests,
    metric reads) sees the engine between steps."""

    def __init__(self, llm: LLM):
        self.llm = llm
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._commands: queue.SimpleQueue = queue.SimpleQueue()  # ("add", rid, prompt, params) | ("abort", rid)
        self._queues: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._ids = itertools.count()
        self._stop = False
        self._thread = threading.Thread(target=self._loop, name="moetier-engine", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop:
            outputs = []
            with self._lock:
                self._apply_commands()
                busy = self.llm.has_unfinished()
                if busy:
                    try:
                        outputs = self.llm.step()
                    except Exception as e:  # a failed step fails its requests, not the loop
                        for rid in list(self.llm.scheduler.requests):
                            self.llm.abort(rid)
                            self._put(rid, e)
            for out in outputs:
                self._put(out.request_id, out)
            if not busy:
                # a command sent after the check above has set the event: no wake-up is lost
                self._wake.wait()
                self._wake.clear()

    def _apply_commands(self) -> None:
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return
            if cmd[0] == "add":
                _, rid, prompt, params = cmd
                try:
                    self.llm.add_request(prompt, params, rid)
                except Exception as e:  # a bad request fails alone, on its own stream
                    self._put(rid, e)
            else:
                self.llm.abort(cmd[1])

    def _put(self, rid: str, item) -> None:
        target = self._queues.get(rid)
        if target is not None:
            loop, q = target
            loop.call_soon_threadsafe(q.put_nowait, item)

    def _send(self, *cmd) -> None:
        self._commands.put(cmd)
        self._wake.set()

    async def generate(self, prompt: str | list[int], params: SamplingParams | None = None,
                       request_id: str | None = None) -> AsyncIterator[RequestOutput]:
        rid = request_id if request_id is not None else f"async-{next(self._ids)}"
        q: asyncio.Queue = asyncio.Queue()
        self._queues[rid] = (asyncio.get_running_loop(), q)
        self._send("add", rid, prompt, params)
        try:
            while True:
                item = await q.get()
                if isinstance(item, Exception):
                    raise item
                yield item
                if item.finished:
                    return
        finally:
            self._queues.pop(rid, None)
            self._send("abort", rid)  # no-op when finished; frees the pages of a cancelled stream

    def abort(self, request_id: str) -> None:
        """Abort a request (applied by the engine thread before its next step)."""
        self._send("abort", request_id)

    def shutdown(self) -> None:
        self._stop = True
        self._wake.set()
        self._thread.join(timeout=5)
