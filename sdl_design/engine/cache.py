"""What a process has read or derived from its partitions, kept while it fits a byte
budget: a stage reads the same partition in several passes (MASSC's calibration seven
times, each reading the same columns and coding the same categories). A value is known by
its files' identities (path, inode, modification time and size: a file written again is
another file) and what was asked of them, so a hit returns what computing it again would
return; under pandas' copy-on-write no reader can change a kept frame or column, and kept
arrays are read-only. Least recently used values go first.
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable
from dataclasses import fields, is_dataclass
from typing import Any

import numpy as np

CACHE_ENV = "PUF_PARTITION_CACHE_MB"  # the budget in MiB; 0 turns the cache off
CACHE_MB = 512  # default budget (a process: the thread runner's driver or a Dask worker)


def budget_bytes() -> int:
    """The cache's budget in bytes: PUF_PARTITION_CACHE_MB, else CACHE_MB."""
    raw = os.environ.get(CACHE_ENV, "").strip()
    try:
        mb = float(raw) if raw else CACHE_MB
    except ValueError:
        raise ValueError(
            f"{CACHE_ENV}={raw!r}: give the partition cache's size in MiB (0 turns it off)"
        ) from None
    return max(0, int(mb * 2**20))


class PartitionCache:
    """Values by key, least recently used dropped first beyond the byte budget;
    thread-safe (the thread runner reads two partitions at a time)."""

    def __init__(self, budget: int | None = None):
        self._budget = budget
        self._items: OrderedDict[Hashable, tuple[Any, int]] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self.hits = self.misses = 0

    @property
    def budget(self) -> int:
        return budget_bytes() if self._budget is None else self._budget

    @property
    def nbytes(self) -> int:
        return self._bytes

    def get(self, key: Hashable) -> Any:
        """The value kept under key, else None."""
        with self._lock:
            got = self._items.get(key)
            if got is None:
                self.misses += 1
                return None
            self._items.move_to_end(key)
            self.hits += 1
            return got[0]

    def put(self, key: Hashable, value: Any, nbytes: int) -> None:
        """Keep value, of nbytes bytes (not when it alone is over the budget)."""
        size = int(nbytes)
        budget = self.budget
        if size > budget:
            return
        with self._lock:
            old = self._items.pop(key, None)
            if old is not None:
                self._bytes -= old[1]
            self._items[key] = (value, size)
            self._bytes += size
            while self._bytes > budget and self._items:
                _, (_, dropped) = self._items.popitem(last=False)
                self._bytes -= dropped

    def forget(self, part: Hashable) -> None:
        """Drop what was kept of a partition (part: its identity, an item of the keys)."""
        with self._lock:
            for key in [k for k in self._items if isinstance(k, tuple) and part in k]:
                self._bytes -= self._items.pop(key)[1]

    def clear(self) -> None:
        with self._lock:
            self._items.clear()
            self._bytes = 0


CACHE = PartitionCache()  # this process's


def cached(key: Hashable, compute: Callable[[], Any], nbytes: Callable[[Any], int]) -> Any:
    """The value kept under key, else compute()'s, kept (nbytes(value): its size)."""
    if not CACHE.budget:
        return compute()
    got = CACHE.get(key)
    if got is None:
        got = compute()
        CACHE.put(key, got, nbytes(got))
    return got


def file_identity(path: str) -> tuple:
    """(path, inode, mtime_ns, size): a file replaced (written again, renamed over) differs."""
    st = os.stat(path)  # (a file replaced by a rename has another inode)
    return (path, st.st_ino, st.st_mtime_ns, st.st_size)


def array_bytes(obj: Any) -> int:
    """The bytes of the numpy arrays obj holds, in dataclasses, dicts, lists and tuples."""
    if isinstance(obj, np.ndarray):
        return int(obj.nbytes)
    if isinstance(obj, dict):
        return sum(array_bytes(v) for v in obj.values())
    if isinstance(obj, list | tuple):
        return sum(array_bytes(v) for v in obj)
    if is_dataclass(obj) and not isinstance(obj, type):
        return sum(array_bytes(getattr(obj, f.name)) for f in fields(obj))
    return 0
