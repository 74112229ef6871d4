"""Group sums that do not depend on how records are ordered or split into partitions.

Each term x is rounded down to a grid of 2^(E - 78), where 2^E bounds |x| over the whole file
(a maximum: the same from any partitioning), and the grid integer is split into three 26-bit
limbs. Float sums of such limbs over at most 2^26 records (a file of up to 67 million) are exact
integers below 2^53, so
bincount adds them exactly in any order; partial limb sums of partitions add exactly too. The
total, rebuilt from its limbs with one rounding, is then the same float whichever records were
summed where: the in-memory path and the partitioned path publish the same bits. Terms below
2^-78 of the column's bound are dropped (a relative error under 4e-24 of the bound per term).
"""

from __future__ import annotations

import numpy as np

LIMB_BITS = 26
SPAN = 3 * LIMB_BITS  # grid bits below the bound 2^E
MAX_RECORDS = 2**LIMB_BITS  # records of one file: their limb sums stay exact
_B = float(2**LIMB_BITS)


def grid_exponent(bound: np.ndarray) -> np.ndarray:
    """E per column with |x| < 2^E for every term bounded by `bound` (a maximum of |x|)."""
    bound = np.asarray(bound, dtype=float)
    if not np.all(np.isfinite(bound)):
        raise ValueError("exact sums: a term is infinite or missing (NaN); replace it first")
    return np.frexp(bound)[1].astype(np.int64)


def limb_sums(codes: np.ndarray, x: np.ndarray, n_groups: int, E: np.ndarray) -> np.ndarray:
    """Limb sums (3, n_groups, q) of the columns of x (n, q) by group code (0..n_groups-1), on
    the grids 2^(E - 78) (E: grid_exponent of a bound of every column over the whole file)."""
    x = np.asarray(x, dtype=float)
    if x.ndim == 1:
        x = x[:, None]
    n, q = x.shape
    E = np.broadcast_to(np.asarray(E, dtype=np.int64), (q,))
    if n == 0:
        return np.zeros((3, n_groups, q))
    if n > MAX_RECORDS:
        raise ValueError(f"exact sums: {n} records; at most {MAX_RECORDS} in one file")
    scale = np.exp2((SPAN - E).astype(float))  # powers of two: exact products
    big = np.maximum(x.max(axis=0), -x.min(axis=0))
    if not np.all(np.isfinite(big)):
        raise ValueError("exact sums: a term is infinite or missing (NaN); replace it first")
    if np.any(big * scale >= 2.0**SPAN):
        raise ValueError("exact sums: a term exceeds the bound its grid was built for")
    codes = np.asarray(codes, dtype=np.intp)
    acc = np.zeros((3, q, n_groups))
    chunk = max(1 << 15, n_groups)  # records per pass: in cache, and O(n) bincount minlengths
    t, a = np.empty(min(chunk, n)), np.empty(min(chunk, n))
    for s in range(0, n, chunk):
        c = codes[s : s + chunk]
        tt, aa = t[: len(c)], a[: len(c)]
        for j in range(q):
            np.multiply(x[s : s + chunk, j], scale[j], out=tt)
            np.floor(tt, out=tt)  # the grid integer, |t| < 2^78
            for i, unit in ((2, _B * _B), (1, _B)):  # top limb in [-2^26, 2^26), then [0, 2^26)
                np.multiply(tt, 1.0 / unit, out=aa)
                np.floor(aa, out=aa)
                acc[i, j] += np.bincount(c, weights=aa, minlength=n_groups)
                aa *= unit
                tt -= aa  # exact: what is left is an integer below unit
            acc[0, j] += np.bincount(c, weights=tt, minlength=n_groups)
    out = acc.transpose(0, 2, 1).copy()
    return normalize(out)


def normalize(limbs: np.ndarray) -> np.ndarray:
    """Limbs with the two low ones carried into [0, 2^26) (the same integer, exactly)."""
    out = np.array(limbs, dtype=float)
    for i in (0, 1):
        carry = np.floor(out[i] / _B)
        out[i] -= carry * _B
        out[i + 1] += carry
    if np.any(np.abs(out[2]) >= 2.0**53):
        raise ValueError(f"exact sums: more than {MAX_RECORDS} records in one sum")
    return out


def add_limbs_at(total: np.ndarray, groups: np.ndarray, limbs: np.ndarray) -> np.ndarray:
    """total (3, G, q) with a partition's limb sums of some groups added (limbs (3, len(groups),
    q) of the groups `groups`: a partition sends only the groups it has); exact, any order."""
    out = np.array(total, dtype=float)
    out[:, groups] += limbs
    return normalize(out)


def limb_total(limbs: np.ndarray) -> np.ndarray:
    """Limbs (3, q) of the sum over all groups, e.g. the whole file's total (exact: every
    partial sum of at most 2^26 records' limbs is an integer below 2^53)."""
    return normalize(limbs.sum(axis=1))


def value(limbs: np.ndarray, E: np.ndarray) -> np.ndarray:
    """The float of each limb sum (one rounding of the exact integer), scaled back by 2^(E-78)."""
    limbs = normalize(limbs)
    hi = limbs[2] * _B**2  # exact: a power-of-two scaling
    lo = limbs[1] * _B + limbs[0]  # exact: an integer below 2^52
    return np.ldexp(hi + lo, np.asarray(E, dtype=np.int64) - SPAN)  # hi + lo: one rounding
