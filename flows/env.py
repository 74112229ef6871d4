"""The quiet environment of a run: no analytics, Prefect warnings only, matplotlib without a display."""

from __future__ import annotations

import gc
import importlib
import logging
import os
import threading
from collections.abc import Sequence

QUIET = {
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    "PREFECT_LOGGING_LEVEL": "WARNING",
    # the temporary server's own tracebacks (its database over a file-size limit) stay off the
    # terminal: the CLI says in one line that the API failed (exit 3)
    "PREFECT_SERVER_LOGGING_LEVEL": "CRITICAL",
    "GX_ANALYTICS_ENABLED": "false",
    "MPLBACKEND": "Agg",
    # Prefect's temporary server gets 20 s to start by default: too short on a loaded 2-core box
    "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "120",
}


# third-party loggers whose INFO lines are noise on a person's terminal
NOISY_LOGGERS = ("great_expectations", "distributed", "numexpr", "matplotlib")


def quiet_env() -> None:
    """Set the quiet defaults in os.environ (a value already set wins); third-party INFO off."""
    for k, v in QUIET.items():
        os.environ.setdefault(k, v)
    for name in NOISY_LOGGERS:
        logging.getLogger(name).setLevel(logging.WARNING)


def peak_reset() -> bool:
    """Start this process's peak resident set (VmHWM) anew, Linux >= 4.0; False elsewhere."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def peak_gib() -> float | None:
    """This process's peak resident set (VmHWM) in GiB, None where /proc is not there."""
    try:
        with open("/proc/self/status") as f:
            return next(int(x.split()[1]) for x in f if x.startswith("VmHWM:")) / 2**20
    except (OSError, StopIteration):
        return None


def return_freed_memory() -> None:
    """Hand the memory freed by a finished step back to the system (glibc's malloc_trim):
    numpy's column-sized temporaries otherwise stay in the heap and the next step's peak starts
    from them (1.3 GB at 1M records after MASSC). No-op where glibc is not the allocator."""
    import ctypes
    import ctypes.util

    try:  # no gc.collect(): 0.5 s with Prefect loaded, and the frames are freed by refcount
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.malloc_trim(0)
    except (OSError, AttributeError):
        pass


# imported while the flow reads its input (pyarrow's Parquet reader leaves the interpreter free):
# Great Expectations takes 2.6 s to import on the 2-core machine, matplotlib 0.3 s
PRELOAD = (
    "great_expectations",
    "great_expectations.expectations",
    "matplotlib.figure",
    "matplotlib.backends.backend_agg",
)


_FROZEN = threading.Event()


def _freeze_once() -> None:
    """Move the objects alive after the first preload (the imported packages', mostly) out of
    the cyclic collector's scans, once per process: the full collections in a release's later
    steps each walked them (0.36 s at 1M records, 460,000 objects) and find nothing there."""
    if not _FROZEN.is_set():
        _FROZEN.set()
        gc.freeze()


def preload(names: Sequence[str] = PRELOAD) -> threading.Thread:
    """Import modules in a daemon thread; a step that needs one waits only for what is left of
    its import. A module that fails to import here is imported again by the step that needs
    it, which raises there. The caller imports first what it needs meanwhile (two threads
    importing one package at once can deadlock on a cycle of module locks)."""

    def run() -> None:
        # no cyclic collection while the packages import (their objects are frozen after):
        # a full one in the middle walked 440,000 of them for 0.47 s of the 1M release's load
        collecting = gc.isenabled() and not _FROZEN.is_set()
        if collecting:
            gc.disable()
        try:
            for name in names:
                try:
                    importlib.import_module(name)
                except Exception:  # noqa: BLE001, S112 - the step that needs it says why
                    continue
        finally:
            if collecting:
                gc.enable()
        _freeze_once()

    t = threading.Thread(target=run, name="puf-preload", daemon=True)
    t.start()
    return t


def task_runner(runner: str, dask_address: str | None):
    """The task runner the run asked for: a thread pool, or Dask (a cluster at dask_address, else
    a local cluster of two single-threaded workers)."""
    if runner == "thread":
        from prefect.task_runners import ThreadPoolTaskRunner

        return ThreadPoolTaskRunner(max_workers=2)
    if runner == "dask":
        import dask
        from prefect_dask import DaskTaskRunner

        dask.config.set({"distributed.nanny.pre-spawn-environ.MALLOC_MMAP_THRESHOLD_": 4194304})
        if dask_address:
            return DaskTaskRunner(address=dask_address)
        return DaskTaskRunner(cluster_kwargs={"n_workers": 2, "threads_per_worker": 1})
    raise ValueError(f"runner must be 'thread' or 'dask', not {runner!r}")
