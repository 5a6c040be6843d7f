"""A progress bar in bytes with the rate in GB/s, on stderr, for the long fills: the expert store
from a checkpoint (generate, bench) and random checkpoints being written (make-checkpoint).

It starts with the first bytes, so argument checks and preflight refusals print nothing before
their error; it draws only on a terminal (pipes and tests get no bar) unless `force` is set.
"""

from __future__ import annotations

import sys

from rich.console import Console
from rich.progress import BarColumn, DownloadColumn, Progress, TimeRemainingColumn, TransferSpeedColumn


class ByteBar:
    def __init__(self, description: str, force: bool = False):
        self.description = description
        self.enabled = force or sys.stderr.isatty()
        self.bar: Progress | None = None
        self.task = None

    def __call__(self, done: int, total: int) -> None:
        """The progress callback: bytes done of total (decimal units: GB and GB/s)."""
        if not self.enabled:
            return
        if self.bar is None:
            self.bar = Progress("[progress.description]{task.description}", BarColumn(), DownloadColumn(),
                                TransferSpeedColumn(), TimeRemainingColumn(), console=Console(stderr=True))
            self.bar.start()
            self.task = self.bar.add_task(self.description, total=total)
        self.bar.update(self.task, completed=done, total=total)

    def stop(self) -> None:
        if self.bar is not None:
            self.bar.stop()
            self.bar = None

    def __enter__(self) -> ByteBar:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
