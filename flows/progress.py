"""Progress a person can follow: one line per step with its time; on a terminal, a ticking line
while a long step runs. Written to the real stderr, not printed (log_prints would turn a print
into a Prefect log record below the quiet level), and, inside a Prefect flow run, to the run's
log on the server (run_log: the UI's flow-run page shows the same lines)."""

from __future__ import annotations

import logging
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, TextIO

TICK_S = 1.0  # redraw interval of the running line on a terminal
BAR_WIDTH = 20


STEP_LOGGER = "prefect.flow_runs.puf"  # the step lines in the run's log (INFO, API only)


def _step_logger() -> logging.Logger:
    """A child of Prefect's run logger that sends INFO to the API whatever PREFECT_LOGGING_LEVEL
    (WARNING under quiet_env) and nothing to the console: the terminal has its own line."""
    logger = logging.getLogger(STEP_LOGGER)
    if not logger.handlers:
        from prefect.logging.handlers import APILogHandler

        logger.addHandler(APILogHandler())
        logger.setLevel(logging.INFO)
        logger.propagate = False
    return logger


def run_log(text: str, level: int = logging.INFO) -> bool:
    """Send a line to the current Prefect run's log (get_run_logger's run, seen in the UI);
    False outside a run (nothing imported for it: a line outside a run costs no import)."""
    context = sys.modules.get("prefect.context")
    if context is None or (
        context.FlowRunContext.get() is None and context.TaskRunContext.get() is None
    ):
        return False
    try:
        from prefect.logging import get_run_logger
        from prefect.logging.loggers import PrefectLogAdapter

        extra = dict(getattr(get_run_logger(), "extra", None) or {})
        PrefectLogAdapter(_step_logger(), extra).log(level, text)
    except Exception:  # noqa: BLE001 - a log line is never worth a failed run
        return False
    return True


def flow_run_url(run_id: object) -> str | None:
    """The UI page of a flow run (PREFECT_UI_URL, derived from PREFECT_API_URL); None without."""
    from prefect.utilities.urls import url_for

    try:
        return url_for("flow-run", obj_id=str(run_id)) if run_id else None
    except Exception:  # noqa: BLE001 - a URL is never worth a failed run
        return None


@contextmanager
def prints_to_run_log() -> Iterator[None]:
    """Inside: a print to stdout or stderr goes where it goes and, as a line, to the current
    run's log too (for a flow with log_prints=False: Prefect's print_as_log would drop a line
    below the quiet WARNING level, from the terminal as well)."""
    import builtins

    original = builtins.print

    def tee(*args: Any, **kwargs: Any) -> None:
        original(*args, **kwargs)
        if kwargs.get("file") in (None, sys.stdout, sys.stderr):
            sep = kwargs.get("sep")
            run_log((" " if sep is None else sep).join(map(str, args)))

    builtins.print = tee
    try:
        yield
    finally:
        builtins.print = original


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
        run_log(f"{head} ...")
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
        line = f"[puf] ({step}/{total}) {name} done in {time.perf_counter() - t0:.1f} s"
        self.stream.write(line + "\n")
        self.stream.flush()
        run_log(line)

    def say(self, text: str) -> None:
        """A line of its own (clears a running line first)."""
        self._stop()
        self.stream.write(f"[puf] {text}\n")
        self.stream.flush()
        run_log(f"[puf] {text}")


PROGRESS = Progress()
