"""A `moetier serve` of our own for an evaluation: started as a child process on a free loopback port
with the given serve flags, waited for until it listens, stopped with Ctrl-C's signal (it drains and
exits) when the evaluation is done. Its log goes to a file; a server that fails to start is one error
line with the last lines of that log.

`started_ahead` serves a gate's configurations in order with up to `jobs` servers starting at once: a
server's start (load, plan, graph capture) is most of a configuration's time, its evaluation a few
seconds, so the next ones start while one is evaluated. The evaluations themselves stay one at a time,
in the caller's thread."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Iterator

from moetier.errors import MoetierError

START_TIMEOUT_S = 1800.0  # a large checkpoint's plan, load and graph capture
STOP_TIMEOUT_S = 60.0
LISTENING = re.compile(r"moetier serve: (http://\S+)/v1 ")


class SpawnedServer:
    def __init__(self, flags: list[str], label: str = ""):
        self.flags, self.label = flags, label
        self.log = Path(tempfile.mkstemp(prefix="moetier-eval-serve-", suffix=".log")[1])
        self.proc: subprocess.Popen | None = None
        self.url = ""
        self.cancelled = threading.Event()  # set from another thread: stop waiting for the start

    def __enter__(self) -> SpawnedServer:
        cmd = [sys.executable, "-m", "moetier.cli", "serve", "--host", "127.0.0.1", "--port", "0", *self.flags]
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline and not self.cancelled.is_set():
            m = LISTENING.search(self.log.read_text(errors="replace"))
            if m:
                self.url = m[1]
                return self
            if self.proc.poll() is not None:
                break
            time.sleep(0.2)
        self.stop()
        raise MoetierError(f"moetier serve {' '.join(self.flags)} did not start{self._where()}:\n{self.tail()}")

    def _where(self) -> str:
        return f" (configuration {self.label})" if self.label else ""

    def tail(self, lines: int = 12) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGINT)  # the server drains and exits
        try:
            self.proc.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def __exit__(self, *exc) -> None:
        self.stop()
        if exc[0] is None:
            self.log.unlink(missing_ok=True)  # kept when the evaluation failed, for its tail


def started_ahead(configs: list[tuple[str, list[str]]], jobs: int) -> Iterator[tuple[str, list[str], SpawnedServer]]:
    """(label, serve flags) in order -> (label, flags, a listening server), with up to `jobs` servers
    started ahead of the one yielded. The caller evaluates each before asking for the next, which stops
    it; every server started is stopped when the caller stops early or a start fails."""
    todo = deque(configs)
    pending: deque[tuple[str, list[str], SpawnedServer, object]] = deque()
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        def start_next() -> None:
            label, flags = todo.popleft()
            server = SpawnedServer(flags, label)
            pending.append((label, flags, server, pool.submit(server.__enter__)))
        try:
            while todo and len(pending) < jobs:
                start_next()
            while pending:
                label, flags, server, started = pending.popleft()
                ok = False
                try:
                    started.result()  # a start that failed raises its MoetierError here
                    yield label, flags, server
                    ok = True
                finally:
                    server.__exit__(None if ok else MoetierError, None, None)  # a failure keeps its log
                if todo:
                    start_next()
        finally:  # stopped early (an error, Ctrl-C): the servers still starting stop waiting, then stop
            for _, _, server, _ in pending:
                server.cancelled.set()
            for _, _, server, started in pending:
                try:
                    started.result()
                except Exception:
                    pass
                server.stop()
