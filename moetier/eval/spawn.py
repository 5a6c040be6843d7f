"""A `moetier serve` of our own for an evaluation: started as a child process on a free loopback port
with the given serve flags, waited for until it listens, stopped with Ctrl-C's signal (it drains and
exits) when the evaluation is done. Its log goes to a file; a server that fails to start is one error
line with the last lines of that log."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

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

    def __enter__(self) -> SpawnedServer:
        cmd = [sys.executable, "-m", "moetier.cli", "serve", "--host", "127.0.0.1", "--port", "0", *self.flags]
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
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
