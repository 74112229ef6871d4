"""Progress a person can follow: one line per step with its time; on a terminal, a ticking line
while a long step runs. Written to the real stderr, not printed (log_prints would turn a print
into a Prefect log record below the quiet level)."""

from __future__ import annotations

import sys
import threading
import time
from typing import TextIO

TICK_S = 1.0  # redraw interval of the running line on a terminal
BAR_WIDTH = 20


class _Ticker(threading.Thread):
    """Redraws '[puf] (i/n) name  [<=>   ] 12 s' every TICK_S until stopped."""

    def __init__(self, stream: TextIO, head: str, t0: float):
        super().__init__(daemon=True)
        self.stream, self.head, self.t0 = stream, head, t0
        self.stopped = threading.Event()

    def run(self) -> None:
        k = 0
        while not self.stopped.wait(TICK_S):
            k += 1
            pos = k % (2 * BAR_WIDTH - 2)
            pos = pos if pos < BAR_WIDTH else 2 * BAR_WIDTH - 2 - pos
            bar = " " * pos + "=" + " " * (BAR_WIDTH - 1 - pos)
            elapsed = time.perf_counter() - self.t0
            self.stream.write(f"\r{self.head} [{bar}] {elapsed:5.0f} s")
            self.stream.flush()


class Progress:
    """Step lines of a run: start(step, total, name) then done(step, total, name, t0)."""

    def __init__(self, stream: TextIO | None = None, tty: bool | None = None):
        self.stream = stream if stream is not None else sys.__stderr__ or sys.stderr
        self.tty = self.stream.isatty() if tty is None else tty
        self._ticker: _Ticker | None = None

    def __reduce__(self):  # a worker gets its own (a stream does not pickle)
        return type(self), ()

    def _stop(self) -> None:
        if self._ticker is not None:
            self._ticker.stopped.set()
            self._ticker.join()
            self._ticker = None
            self.stream.write("\r\033[K")  # clear the running line

    def start(self, step: int, total: int, name: str) -> float:
        """Announce a step; returns its start time."""
        self._stop()
        head = f"[puf] ({step}/{total}) {name}"
        t0 = time.perf_counter()
        if self.tty:
            self._ticker = _Ticker(self.stream, head, t0)
            self._ticker.start()
        else:
            self.stream.write(f"{head} ...\n")
        self.stream.flush()
        return t0

    def done(self, step: int, total: int, name: str, t0: float) -> None:
        """Close a step with its wall time."""
        self._stop()
        self.stream.write(
            f"[puf] ({step}/{total}) {name} done in {time.perf_counter() - t0:.1f} s\n"
        )
        self.stream.flush()

    def say(self, text: str) -> None:
        """A line of its own (clears a running line first)."""
        self._stop()
        self.stream.write(f"[puf] {text}\n")
        self.stream.flush()


PROGRESS = Progress()
