"""What the design and its estimators share below them: the design's error and the
replicate weights' row gather."""

from __future__ import annotations

import numpy as np


class DesignError(ValueError):
    """The design does not fit the data; the message names the column and the fix."""


def take_rows(W: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """W[rows] for a Fortran-ordered W (records x replicates) as a Fortran array, gathered a
    column at a time: numpy's row gather reads every row's R values n apart (a cache miss
    each: 77 s for the replicate cell totals of 5M records), a column gather streams."""
    if not W.flags.f_contiguous:
        return np.asfortranarray(W[rows])
    out = np.empty((len(rows), W.shape[1]), order="F")
    for j in range(W.shape[1]):
        np.take(W[:, j], rows, out=out[:, j])
    return out
