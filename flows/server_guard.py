"""Prefect's temporary server dies with the process that started it.

Prefect 3 starts its ephemeral API server (no PREFECT_API_URL) as a child process
`python -m uvicorn ...` (prefect.server.api.server.SubprocessASGIServer) and stops it from an
atexit hook, which never runs when the parent is killed (kill -9, OOM): the server lived on,
re-parented to init. `install()` makes that child run uvicorn under a small watchdog that ends it
when its parent process is gone (its parent PID changes), whatever thread started it.
"""

from __future__ import annotations

import os
import subprocess
import types

# run as `python -c GUARD <parent pid> <uvicorn args...>`
GUARD = r"""
import os, runpy, signal, sys, threading, time
parent = int(sys.argv[1])
def watch():
    while os.getppid() == parent:
        time.sleep(0.5)
    os.kill(os.getpid(), signal.SIGTERM)  # uvicorn shuts down cleanly on SIGTERM
    time.sleep(10)
    os._exit(1)
threading.Thread(target=watch, daemon=True, name="parent-watch").start()
sys.argv = ["uvicorn", *sys.argv[2:]]
runpy.run_module("uvicorn", run_name="__main__", alter_sys=True)
"""


class GuardedPopen(subprocess.Popen):
    """subprocess.Popen that starts `python -m uvicorn ...` under the parent watchdog."""

    def __init__(self, args, *a, **kw):  # noqa: ANN001, ANN002, ANN003 - Popen's signature
        if isinstance(args, list | tuple) and list(args[1:3]) == ["-m", "uvicorn"]:
            args = [args[0], "-c", GUARD, str(os.getpid()), *args[3:]]
        super().__init__(args, *a, **kw)


def install() -> bool:
    """Patch Prefect's temporary-server launcher (idempotent); False when Prefect has none."""
    try:
        from prefect.server.api import server as srv
    except ImportError:
        return False
    if not hasattr(srv, "SubprocessASGIServer") or not hasattr(srv, "subprocess"):
        return False
    if getattr(srv.subprocess, "Popen", None) is not GuardedPopen:
        shim = types.SimpleNamespace(**vars(subprocess))
        shim.Popen = GuardedPopen
        srv.subprocess = shim
    return True
