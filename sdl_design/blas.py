"""One BLAS thread while a stage runs, so that a release is byte-identical whatever the CPU
count (issue 15 item 12: OpenBLAS splits the reductions of matrix-vector products and LAPACK
solves between its threads, and the sums change in the last bits with the thread count).

threadpoolctl is not a dependency; OpenBLAS (the BLAS numpy and scipy wheels bundle) is told
directly through its C API, found among the shared libraries the process has loaded. A BLAS
this module does not know (MKL, Accelerate) is left alone: set MKL_NUM_THREADS=1 there."""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from functools import cache

_lock = threading.Lock()
_depth = 0
_saved: list[tuple[object, int]] = []


@cache
def _openblas() -> tuple[tuple[object, object], ...]:
    """(get_num_threads, set_num_threads) of every OpenBLAS loaded in this process."""
    import numpy  # noqa: F401  (loads numpy's OpenBLAS)
    import scipy.linalg  # noqa: F401  (and scipy's)

    paths = set()
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                path = line.split()[-1] if line.strip() else ""
                if "openblas" in path.lower() and ".so" in path:
                    paths.add(path)
    except OSError:  # not Linux: nothing pinned
        return ()
    out = []
    for path in sorted(paths):
        try:
            lib = ctypes.CDLL(path)
        except OSError:
            continue
        for prefix in ("scipy_openblas_", "openblas_", ""):
            for suffix in ("64_", ""):
                name = "openblas_" if prefix == "" else prefix
                get = getattr(lib, f"{name}get_num_threads{suffix}", None)
                put = getattr(lib, f"{name}set_num_threads{suffix}", None)
                if get is not None and put is not None:
                    get.restype = ctypes.c_int
                    put.argtypes = [ctypes.c_int]
                    out.append((get, put))
                    break
            else:
                continue
            break
    return tuple(out)


def blas_threads() -> list[int]:
    """The thread count of each OpenBLAS loaded (for tests and the manifest)."""
    return [int(get()) for get, _ in _openblas()]


@contextmanager
def single_blas_thread() -> Iterator[None]:
    """Run the block with every OpenBLAS on one thread; the previous counts come back when the
    last of the (possibly concurrent, e.g. thread-pool) blocks ends."""
    global _depth
    with _lock:
        if _depth == 0:
            _saved[:] = [(put, int(get())) for get, put in _openblas()]
            for put, _ in _saved:
                put(1)
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0:
                for put, n in _saved:
                    put(n)
                _saved.clear()
