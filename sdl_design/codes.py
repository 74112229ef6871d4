"""pd.factorize remembered for Arrow-backed columns.

A release factorizes the same text column many times (each stage's key cells, the risk and
utility measures, the public order): at 1,000,000 records a string column's factorization
costs 40-50 ms and a demo release made 366 of them on 140 distinct arrays. Arrow arrays are
immutable, so an array's codes are remembered by the addresses of its buffers (two pandas
wrappers of the same buffers share them) while the array that made them is alive: the entry is
dropped when it is freed, so addresses are never matched against reused memory.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

import numpy as np
import pandas as pd

_MIN_RECORDS = 4096  # below this pd.factorize is cheaper than the lookup
_remembered: dict[tuple, tuple[np.ndarray, Any]] = {}
_lock = threading.Lock()


def factorize(values: Any, sort: bool = False, use_na_sentinel: bool = True) -> tuple:
    """pd.factorize(values, sort=, use_na_sentinel=), the same (codes, uniques); remembered
    for a Series or array backed by Arrow (codes returned as a fresh int64 array)."""
    chunked = _arrow_chunks(values)
    if chunked is None:
        return pd.factorize(values, sort=sort, use_na_sentinel=use_na_sentinel)
    key = (
        type(values).__name__,
        sort,
        use_na_sentinel,
        str(values.dtype),
        *(
            (c.offset, len(c), *(b.address if b else 0 for b in c.buffers()))
            for c in chunked.chunks
        ),
    )
    with _lock:
        hit = _remembered.get(key)
    if hit is not None:
        return hit[0].astype(np.intp), _fresh(hit[1])
    codes, uniques = pd.factorize(values, sort=sort, use_na_sentinel=use_na_sentinel)
    small = np.min_scalar_type(-max(len(uniques), 1))  # a signed type holding -1..len
    with _lock:
        _remembered[key] = (codes.astype(small), _fresh(uniques))
    weakref.finalize(chunked, _forget, key)
    return codes, uniques


def _fresh(uniques: Any) -> Any:
    """An Index as it is (immutable), an array copied (a caller may set its values)."""
    return uniques if isinstance(uniques, pd.Index) else uniques.copy()


def _forget(key: tuple) -> None:
    with _lock:
        _remembered.pop(key, None)


def _arrow_chunks(values: Any) -> Any:
    """The pyarrow ChunkedArray behind a Series or ExtensionArray backed by Arrow with at
    least _MIN_RECORDS values, else None."""
    arr = values.array if isinstance(values, pd.Series) else values
    if isinstance(values, pd.Index) or len(arr) < _MIN_RECORDS:
        return None
    return getattr(arr, "_pa_array", None)
