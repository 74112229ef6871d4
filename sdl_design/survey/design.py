"""SurveyDesign: weights, strata, PSUs, replicate weights; Taylor and replicate variance, vectorized."""

from __future__ import annotations

import fnmatch
import warnings
from collections.abc import Sequence
from typing import Any, Literal

import numpy as np
import pandas as pd
import scipy.linalg
import scipy.sparse as sp

from sdl_design.codes import factorize
from sdl_design.survey.design_base import DesignError, take_rows
from sdl_design.survey.quantiles import Quantiles

ReplicateMethod = Literal["brr", "fay", "jk1", "jkn", "sdr", "bootstrap"]
METHODS = ("brr", "fay", "jk1", "jkn", "sdr", "bootstrap")
# how bootstrap replicate weights were drawn, which sets their scale as R survey does:
# "rao-wu": n_h - 1 of the n_h PSUs of a stratum drawn with replacement and rescaled by
# n_h/(n_h - 1) (R's subbootweights; what svrepdesign(type="bootstrap") assumes), scale
# 1/(R - 1); "canty-davison": n_h of n_h drawn (R's bootweights, as.svrepdesign(type=
# "bootstrap")), scale nbar/((nbar - 1)(R - 1)), nbar the harmonic mean of the PSUs per stratum
BootstrapConvention = Literal["rao-wu", "canty-davison"]
BOOTSTRAP_CONVENTIONS = ("rao-wu", "canty-davison")
# the weight column of an unweighted file (a spec's `design: {weight: null}`): ones, added when
# the input is read (sdl_design.io.type_input), published as the file's weight (not a '__'
# working column: the input check refuses those, and the public design needs its weight)
UNIT_WEIGHT = "unit_weight"
# R survey's options(survey.lonely.psu=...): what a stratum with a single PSU contributes
LonelyPSU = Literal["fail", "remove", "adjust", "average", "certainty"]
LONELY_PSU = ("fail", "remove", "adjust", "average", "certainty")
SELF_REPRESENTING = 1e-7  # 1 - n/N below this: a census stratum, no variance (R's onestrat)


def resolve_replicates(columns: Sequence[str], given: str | Sequence[str]) -> list[str]:
    """Replicate weight columns: those matching a glob such as "rw_*" in data order, or the
    explicit list as given (the one place replicate columns are resolved)."""
    if isinstance(given, str):
        return [str(c) for c in columns if fnmatch.fnmatchcase(str(c), given)]
    return list(given)


def replicate_options(rs: Any) -> dict[str, Any]:
    """The SurveyDesign keywords of a spec's design.replicate_weights section (a ReplicateSpec,
    or None: none): method, rho, rscales, scale, the bootstrap convention (for method bootstrap
    only) and mse."""
    if rs is None:
        return {}
    method = rs.method
    return {
        "method": method,
        "rho": rs.rho,
        "rscales": getattr(rs, "rscales", None),
        "scale": getattr(rs, "scale", None),
        "bootstrap": getattr(rs, "bootstrap", None) if method == "bootstrap" else None,
        "mse": getattr(rs, "mse", True),
    }


def dense_codes(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """np.unique(x, return_inverse=True) for integers (the sorted distinct values and each
    value's index among them): by counting when they are >= 0 in a small range, else by
    hashing and a sort of the distinct values only (1M records in 2,000 keys: 5x faster than
    np.unique's sort of the records)."""
    x = np.asarray(x)
    if x.dtype.kind not in "iu":
        u, inv = np.unique(x, return_inverse=True)
        return u, inv.ravel()
    top = int(x.max(initial=0)) + 1
    if len(x) and int(x.min()) >= 0 and top <= 4 * len(x) + 100_000:
        present = np.bincount(x, minlength=top) > 0
        return np.flatnonzero(present), (np.cumsum(present) - 1)[x]
    codes, uniq = pd.factorize(x)
    order = np.argsort(uniq, kind="stable")
    rank = np.empty(len(order), dtype=np.intp)
    rank[order] = np.arange(len(order))
    return uniq[order], rank[codes]


def sorted_codes(x: pd.Series | np.ndarray) -> np.ndarray:
    """factorize(x, sort=True)[0] as int64: by counting (dense_codes) for numpy integers,
    their range shifted to start at 0; by pandas for anything else (strings, categoricals)."""
    v = x if isinstance(x, np.ndarray) else x.array
    if isinstance(v, np.ndarray | pd.arrays.NumpyExtensionArray):
        v = np.asarray(v)
        if v.dtype.kind in "iu" and len(v) and int(v.max()) - (lo := int(v.min())) < 2**62:
            return dense_codes(v.astype(np.int64) - lo)[1].astype(np.int64, copy=False)
    return factorize(x, sort=True)[0].astype(np.int64, copy=False)


def distinct_rows(A: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The distinct rows of A (in order of first appearance) and each row's index among them,
    by hashing one column at a time (no sort of rows)."""
    # g: an injective code of each row's columns so far (any one: the last factorize numbers
    # the distinct rows in order of first appearance). The 0/1 columns (a model matrix's
    # dummies) are bits of one code, 52 at a time, summed exactly as powers of 2 a block of
    # rows at a time; the others are factorized; g is compressed only before it could overflow
    binary = _binary_columns(A)
    codes = [(binary[a : a + 52], -1) for a in range(0, len(binary), 52)]
    codes += [(None, j) for j in np.flatnonzero(~np.isin(np.arange(A.shape[1]), binary))]
    g, span = np.zeros(len(A), dtype=np.int64), 1
    for cols, j in codes:
        if cols is not None:
            c, k = _bits(A, cols), 1 << len(cols)
        else:
            c, u = factorize(np.ascontiguousarray(A[:, j]), use_na_sentinel=False)
            k = len(u)  # (NaN: a value of its own)
        if span * k >= 2**62:
            g = factorize(g)[0]
            span = int(g.max(initial=-1)) + 1
        g, span = g * k + c, span * k
    g = factorize(g)[0]
    first = first_of(g, int(g.max(initial=-1)) + 1)
    return A[first], g


def _binary_columns(A: np.ndarray, step: int = 1 << 16) -> np.ndarray:
    """The columns of A whose values are all 0 or 1 (-0.0 too), read a block of rows at a time."""
    ok = np.ones(A.shape[1], dtype=bool)
    for a in range(0, len(A), step):
        B = A[a : a + step]
        ok &= ((B == 0) | (B == 1)).all(axis=0)
    return np.flatnonzero(ok)


def _bits(A: np.ndarray, cols: np.ndarray, step: int = 1 << 16) -> np.ndarray:
    """sum_j A[:, cols[j]] 2^j of 0/1 columns (at most 52: every partial sum exact), as A @ w
    with w 0 off cols (a product with A's columns as they are: picking them copies A); the
    columns picked when another column's inf or NaN would make the product NaN."""
    w = np.zeros(A.shape[1])
    w[cols] = 2.0 ** np.arange(len(cols))
    out = np.empty(len(A), dtype=np.int64)
    for a in range(0, len(A), step):
        with np.errstate(invalid="ignore"):
            r = A[a : a + step] @ w
        if not np.isfinite(r).all():
            r = A[a : a + step][:, cols] @ w[cols]
        out[a : a + step] = r
    return out


def factors_equal(
    W: np.ndarray, w: np.ndarray, codes: np.ndarray, F: np.ndarray, tol: float
) -> bool:
    """Whether every record's replicate factors W_i / w_i equal its group's row of F (to tol):
    a block of records at a time, stopping at the first block that differs."""
    if W.flags.c_contiguous and not W.flags.f_contiguous:
        # blocks of 32K values (256 KB) computed in place: they stay in cache (blocks of 1M
        # values and a temporary per operation took 3.4x longer at 1M records x 70 replicates)
        step = max(1, (1 << 15) // max(W.shape[1], 1))
        dev = np.empty((min(step, len(w)), W.shape[1]))
        for a in range(0, len(w), step):
            d = dev[: min(step, len(w) - a)]
            np.divide(W[a : a + step], w[a : a + step, None], out=d)
            d -= F[codes[a : a + step]]
            if np.abs(d, out=d).max(initial=0.0) > tol:
                return False
        return True
    # columns: 16K records at a time, a replicate at a time, in two 128 KB buffers that stay
    # in cache with the block's weights and codes (whole columns: 0.51 -> 0.38 s at 1M x 70)
    Ft = np.ascontiguousarray(F.T)
    step = 1 << 14
    dev, fac = np.empty(min(step, len(w))), np.empty(min(step, len(w)))
    for a in range(0, len(w), step):
        wa, ca = w[a : a + step], codes[a : a + step]
        d, f = dev[: len(wa)], fac[: len(wa)]
        for r in range(W.shape[1]):
            np.divide(W[a : a + step, r], wa, out=d)
            d -= Ft[r].take(ca, out=f)
            if np.abs(d, out=d).max(initial=0.0) > tol:
                return False
    return True


def _factors_off(
    W: np.ndarray, w: np.ndarray, codes: np.ndarray, F: np.ndarray, tol: float
) -> np.ndarray:
    """The records whose replicate factors W_i / w_i differ from their group's row of F by more
    than tol in some replicate (a replicate at a time, as factors_equal)."""
    Ft = np.ascontiguousarray(F.T)
    off = np.zeros(len(w), dtype=bool)
    dev = np.empty(len(w))
    for r in range(W.shape[1]):
        np.divide(W[:, r], w, out=dev)
        dev -= Ft[r].take(codes)
        off |= np.abs(dev) > tol
    return off


def replicate_factor_groups(
    W: np.ndarray, w: np.ndarray
) -> tuple[np.ndarray, int, np.ndarray] | None:
    """(codes, G, F): the records (W: n x R replicate weights, w their weights) in G groups
    whose replicate factors W_i / w_i are equal (to 1e-12 of the largest), F (G x R) each
    group's factors; None when the groups are not few (more than n/4). Grouped by two fixed
    projections of the factors, then checked record by record."""
    n, R = W.shape
    v = np.random.default_rng(0).uniform(1.0, 2.0, (R, 2))  # two fixed projections
    h = np.round((W @ v) / w[:, None], 9)  # (W_i / w_i) . v
    a, ua = factorize(h[:, 0])
    b, ub = factorize(h[:, 1])
    codes, uniq = factorize(a.astype(np.int64) * len(ub) + b)  # equal in both
    G = len(uniq)
    if G > n // 4:
        return None
    codes = codes.astype(np.int64)
    first = first_of(codes, G)
    F = W[first] / w[first, None]
    tol = 1e-12 * max(float(F.max(initial=0.0)), 1.0)
    if factors_equal(W, w, codes, F, tol):  # every record's factors equal its group's
        return codes, G, F
    # equal projections of unequal factors (seen: 40 of 5M records in 3 of 80,806 groups):
    # those records grouped again by their factors themselves, and everything checked again
    sub = np.flatnonzero(_factors_off(W, w, codes, F, tol))
    if len(sub) > n // 100:
        return None
    rows, sub_codes = distinct_rows(W[sub] / w[sub, None])
    codes[sub] = G + sub_codes
    G, F = G + len(rows), np.vstack([F, rows])
    if G > n // 4 or not factors_equal(W, w, codes, F, tol):
        return None
    return codes, G, F


DEFF_CLASSES = (0.1, 1.0, 2.0, 5.0, 25.0)  # (0.1, 1], (1, 2], (2, 5], (5, 25]


def deff_class(deff: pd.Series | np.ndarray, edges: Sequence[float] = DEFF_CLASSES) -> pd.Series:
    """Design-effect class labels '(0.1,1]', '(1,2]', '(2,5]', '(5,25]' (NaN outside)."""
    labels = [f"({a:g},{b:g}]" for a, b in zip(edges[:-1], edges[1:], strict=True)]
    return pd.cut(pd.Series(np.asarray(deff, dtype=float)), list(edges), labels=labels)


def design_columns(design: Any) -> dict[str, Any]:
    """df, weight, strata, psu, segment, replicate columns, method, rho, the replicates'
    factors, mse, the finite population corrections and the lonely-PSU rule of a
    SurveyDesign."""
    return {
        "df": design.df,
        "weight": design.weight,
        "strata": design.strata,
        "psu": design.psu,
        "segment": design.segment,
        "replicate_weights": list(design.replicate_weights),
        "method": design.method,
        "rho": design.rho,
        # the replicates' factors c_r (the declared scale and bootstrap convention applied)
        "rscales": None if design.rscales is None else list(design.rscales),
        "mse": design.mse,
        "fpc": design.fpc,
        "ssu": design.ssu,
        "fpc2": design.fpc2,
        "lonely_psu": design.lonely_psu,
    }


def first_of(codes: np.ndarray, m: int, absent: int = 0) -> np.ndarray:
    """The index of the first record of each code 0..m-1 (`absent` for a code no record has)."""
    first = np.full(m, absent, dtype=np.int64)
    first[codes[::-1]] = np.arange(len(codes))[::-1]
    return first


def group_indicator(of: np.ndarray, P: int) -> sp.csc_matrix:
    """The P x n indicator of records' groups (record i in group of[i]) as CSC: one entry per
    column, built without a sort. `indicator @ a` sums the rows of a (n x k) by group in
    record order (the same sums, bit for bit, as np.bincount by column)."""
    n = len(of)
    return sp.csc_matrix((np.ones(n), of, np.arange(n + 1)), shape=(P, n))


def sparse_times(A: sp.spmatrix | sp.sparray, y: np.ndarray) -> np.ndarray:
    """A @ y for a sparse A and a dense y; a column-major y (a frame's columns) is read a column
    at a time, where scipy would first copy the whole of it to row-major. A group indicator
    in CSR (one entry per column: records -> groups, e.g. PSU totals) goes as CSC: each column
    of y streamed into its groups instead of gathered by group, the same additions in the same
    order (1M records x 70 columns into 90 PSUs: 0.82 -> 0.43 s)."""
    if y.ndim == 2 and y.shape[1] > 1 and not y.flags.c_contiguous and y.flags.f_contiguous:
        if _one_entry_per_column(A):
            A = A.tocsc()
        return np.column_stack([A @ y[:, j] for j in range(y.shape[1])])
    return np.asarray(A @ y)


def _one_entry_per_column(A: sp.spmatrix | sp.sparray) -> bool:
    """A is CSR with sorted indices (scipy sums each row in column order, as CSC's product
    does) and one entry in each column."""
    if A.format != "csr" or A.nnz != A.shape[1] or not A.has_sorted_indices:
        return False
    return bool((np.bincount(A.indices, minlength=A.shape[1]) == 1).all())


def psu_sums(
    yT: np.ndarray, w: np.ndarray, starts: np.ndarray, squares: bool = True
) -> tuple[np.ndarray, np.ndarray]:
    """(t, s2) for variables yT (k x n) of records sorted by PSU (PSU j's records start at
    starts[j]): t (PSUs x k) the PSU totals of w y, one GEMV per PSU; s2 (k) the sums of w y^2
    (NaN when not squares), a few variables squared at a time into one buffer."""
    k, n = yT.shape
    t, s2 = np.empty((len(starts), k)), np.full(k, np.nan)
    for j, (a, b) in enumerate(zip(starts.tolist(), [*starts[1:].tolist(), n], strict=True)):
        t[j] = yT[:, a:b] @ w[a:b]
    if squares:
        rows = max(1, min(k, (1 << 18) // max(n, 1)))  # ~2 MB of squares at a time
        sq = np.empty((rows, n))  # one buffer: a new one per block costs page faults
        for a in range(0, k, rows):
            B = yT[a : a + rows]
            np.multiply(B, B, out=sq[: len(B)])
            s2[a : a + len(B)] = sq[: len(B)] @ w
    return t, s2


def pair_replicate_totals(
    F: np.ndarray, grp: np.ndarray, cell: np.ndarray, S: np.ndarray, L: int
) -> np.ndarray:
    """Replicate totals by cell (R x L x k) from the sums S (P x k) of w y over pairs of a
    factor group (grp: its row of F, G x R) and a cell (0..L-1): sum_p F[grp_p, r] S_p over
    the pairs of each cell, one matrix product per cell."""
    R, k = F.shape[1], S.shape[1]
    out = np.zeros((R, L, k))
    order = None if (np.diff(cell) >= 0).all() else np.argsort(cell, kind="stable")
    if order is not None:
        grp, cell, S = grp[order], cell[order], S[order]
    bounds = np.searchsorted(cell, np.arange(L + 1))
    for c in np.flatnonzero(np.diff(bounds)):
        a, b = bounds[c], bounds[c + 1]
        out[:, c, :] = F[grp[a:b]].T @ S[a:b]
    return out


def block_view(df: pd.DataFrame, cols: Sequence[str]) -> np.ndarray | None:
    """The columns as a read-only (records x columns) Fortran view of the frame's own float
    block when they lie in it side by side in this order (replicate weights as read from a
    file), else None: no copy of n x R values."""
    mgr = getattr(df, "_mgr", None)
    if mgr is None or not len(cols) or not df.columns.is_unique:
        return None
    try:
        locs = df.columns.get_indexer(list(cols))
        blkno, blkloc = mgr.blknos[locs], mgr.blklocs[locs]
    except (AttributeError, TypeError, IndexError):
        return None
    if (locs < 0).any() or (blkno != blkno[0]).any() or (np.diff(blkloc) != 1).any():
        return None
    values = mgr.blocks[int(blkno[0])].values
    if not isinstance(values, np.ndarray) or values.dtype != np.float64 or values.ndim != 2:
        return None
    rows = values[int(blkloc[0]) : int(blkloc[-1]) + 1]  # columns x records, C order
    if not rows.flags.c_contiguous:
        return None
    out = rows.T
    out.flags.writeable = False
    return out


def _fortran_columns(df: pd.DataFrame, cols: Sequence[str]) -> np.ndarray:
    """df[cols] as a column-major float matrix: a view of the frame's block when the columns
    are one float block, else filled a column at a time (no row-major copy on the way)."""
    view = block_view(df, cols)
    if view is not None:
        return view
    sub = df[list(cols)]
    blocks = getattr(getattr(sub, "_mgr", None), "blocks", None)
    if blocks is not None and len(blocks) == 1 and all(d == np.float64 for d in sub.dtypes):
        return np.asfortranarray(sub.to_numpy(dtype=float))
    out = np.empty((len(df), len(cols)), order="F")
    for j, c in enumerate(cols):
        out[:, j] = df[c].to_numpy(dtype=float)
    return out


class _Columns:
    """Study variables read a block at a time (variables x records), checked for missing values."""

    def __init__(self, data: pd.DataFrame | np.ndarray, names: Sequence):
        self.names, self.k = list(names), len(names)
        # records x variables; for a frame of one float dtype this is a view, not a copy
        # (a read-only view when the columns lie side by side in the frame's float block)
        if isinstance(data, np.ndarray):
            self.data = data
        else:
            view = block_view(data, self.names)
            self.data = view if view is not None else data[self.names].to_numpy(float)

    def _checked(self, m: np.ndarray, names: list) -> np.ndarray:
        bad = np.isnan(m).any(axis=1)
        if bad.any():
            cols = [c for c, b in zip(names, bad, strict=True) if b]
            raise DesignError(
                f"columns {cols} have missing values; drop or impute them, or use a domain"
            )
        return m

    def block(self, a: int, b: int, idx: np.ndarray | None = None) -> np.ndarray:
        """Variables a..b-1 as rows, records idx (all when None)."""
        m = self.data[:, a:b].T
        m = m if idx is None else np.take(m, idx, axis=1)
        return self._checked(m, self.names[a:b])

    def full(self) -> np.ndarray:
        """All variables, records x variables."""
        return self._checked(self.data.T, self.names).T


def _estimate_frame(parts: list[tuple], index: list, by: str | None, levels: list) -> pd.DataFrame:
    """One frame of the estimates (estimate, se and deff when given) of every level, indexed by
    variable (and by's level: its values typed as a column of them would be), built once: a
    frame and a MultiIndex per level cost most of an estimate on a small file."""
    names = ["estimate", "se"] + (["deff"] if parts[0][2] is not None else [])
    cols = {c: np.concatenate([p[i] for p in parts]) for i, c in enumerate(names)}
    out = pd.DataFrame(cols, index=pd.Index(list(index) * len(parts), name="variable"))
    if by is None:
        return out
    out[by] = [level for level in levels for _ in index]
    return out.set_index(by, append=True)


def _as_list(cols: str | Sequence[str]) -> list[str]:
    return [cols] if isinstance(cols, str) else list(cols)


def _is_prime(q: int) -> bool:
    return q > 1 and all(q % k for k in range(2, int(q**0.5) + 1))


def _paley(m: int) -> np.ndarray | None:
    """Paley I (m = q + 1, q prime = 3 mod 4) or Paley II (m = 2(q + 1), q prime = 1 mod 4)."""
    q = m - 1
    if _is_prime(q) and q % 4 == 3:
        chi = np.full(q, -1)
        chi[(np.arange(1, q) ** 2) % q] = 1
        chi[0] = 0
        Q = chi[(np.arange(q)[None, :] - np.arange(q)[:, None]) % q]  # Jacobsthal matrix
        S = np.zeros((m, m), dtype=int)
        S[0, 1:], S[1:, 0], S[1:, 1:] = 1, -1, Q
        return S + np.eye(m, dtype=int)
    q = m // 2 - 1
    if m % 2 == 0 and _is_prime(q) and q % 4 == 1:
        chi = np.full(q, -1)
        chi[(np.arange(1, q) ** 2) % q] = 1
        chi[0] = 0
        Q = chi[(np.arange(q)[None, :] - np.arange(q)[:, None]) % q]
        C = np.zeros((q + 1, q + 1), dtype=int)
        C[0, 1:], C[1:, 0], C[1:, 1:] = 1, 1, Q
        return np.kron(C, np.array([[1, -1], [-1, -1]])) + np.kron(
            np.eye(q + 1, dtype=int), np.array([[1, 1], [1, -1]])
        )
    return None


def hadamard(m: int) -> np.ndarray | None:
    """A Hadamard matrix of order m (Sylvester doubling of 1, 2 or a Paley matrix), or None."""
    k = 0
    while m % 2 == 0 and m > 2 and _paley(m) is None:
        m //= 2
        k += 1
    base = (
        np.ones((1, 1), dtype=int)
        if m == 1
        else (np.array([[1, 1], [1, -1]]) if m == 2 else _paley(m))
    )
    if base is None:
        return None
    return np.kron(scipy.linalg.hadamard(2**k), base) if k else base


def hadamard_for(n_strata: int) -> np.ndarray:
    """The smallest constructible Hadamard matrix of order R (multiple of 4, R >= n_strata),
    rows rescaled so that the first column is all ones."""
    R = 4
    while True:
        if R >= n_strata and (H := hadamard(R)) is not None:
            return H * H[:, :1]
        R += 4


def population_sizes(
    df: pd.DataFrame, cols: Sequence[str | None]
) -> tuple[list[np.ndarray | None], bool]:
    """The fpc columns (None where not given) as floats and whether they are sampling
    fractions: as R's as.fpc, all of them together are fractions when every value is <= 1,
    else population sizes (then every value must be >= 1)."""
    vals: list[np.ndarray | None] = []
    for c in cols:
        if c is None:
            vals.append(None)
            continue
        v = pd.to_numeric(df[c], errors="coerce").to_numpy(dtype=float)
        if np.isnan(v).any() or (v < 0).any():
            raise DesignError(
                f"design.fpc: column '{c}' has {int((~(v >= 0)).sum())} missing, non-numeric or "
                "negative values; give population sizes (or sampling fractions) >= 0"
            )
        vals.append(v)
    given = [v for v in vals if v is not None]
    fraction = all(not (v > 1).any() for v in given)
    if not fraction and any((v < 1).any() for v in given):
        raise DesignError(
            f"design.fpc: columns {[c for c in cols if c]} mix values below and above 1; give "
            "population sizes (all >= 1) or sampling fractions (all <= 1), as R's svydesign"
        )
    return vals, fraction


def per_group(v: np.ndarray, codes: np.ndarray, G: int, what: str) -> np.ndarray:
    """The value of v in each group 0..G-1 of records (codes), which must be constant within
    the group (`what` names the column and the group for the error)."""
    first = first_of(codes, G)
    out = v[first]
    bad = out[codes] != v
    if bad.any():
        raise DesignError(
            f"{what}: {int(bad.sum())} records differ from the first record of their group; "
            "the value must be constant within the group"
        )
    return out


def one_minus_f(n: np.ndarray, N: np.ndarray) -> np.ndarray:
    """1 - f = (N - n) / N from sample and population sizes (1 for N infinite), as R's
    onestrat: f = ifelse(fpc == Inf, 1, (fpc - nPSU) / fpc)."""
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(np.isinf(N), 1.0, (N - n) / N)


def stage_constants(
    n: np.ndarray, q: np.ndarray, lonely_psu: str
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(c, d, lonely) of a stage's groups (strata of PSUs, or PSUs of SSUs), as R's onestrat:
    the group's variance is c (s2 - s1^2 / d) from the sums s1, s2 of its n units' totals and
    their squares. c = (1 - f) n/(n-1) (1 - f for one unit), 0 for a self-representing
    group (1 - f < 1e-7); d = n (centred at the group mean), inf for a lonely unit under
    "adjust" (not centred). lonely: groups of one unit that are not self-representing
    (remove/certainty/average: c = 0; average then scales the stage, fail raises)."""
    single = n == 1
    selfrep = q < SELF_REPRESENTING
    lonely = single & ~selfrep
    with np.errstate(divide="ignore", invalid="ignore"):
        c = np.where(single, q, q * n / (n - 1.0))  # (1 - f) n/(n-1); q = 1: n/(n-1) exactly
    c[selfrep] = 0.0
    d = n.astype(float, copy=True)
    if lonely_psu == "adjust":
        d[lonely] = np.inf
    elif lonely_psu in ("remove", "certainty", "average"):
        c[lonely] = 0.0
    return c, d, lonely


class SurveyDesign(Quantiles):
    """A stratified multistage design: Taylor linearization with with-replacement PSUs within
    strata, or replicate variance when replicate weights are given (a list of columns or a glob
    such as "rw_*"). PSU labels are nested in strata. No strata: one stratum; no psu: each
    record is a PSU. segment is kept for the masking stage and plays no part in the variance.
    weight None: every record has weight 1 (an unweighted, equal-probability file: with no
    strata and no psu a simple random sample with replacement, R's svydesign(ids=~1) without
    weights).

    Replicate variance, as R's svrepdesign: V = sum_r c_r (theta_r - centre)^2 with c_r =
    scale * rscales_r. rscales (one per replicate) and scale (one number) as R's; without
    them the method's: brr 1/R, fay 1/(R (1-rho)^2), jk1 (R-1)/R, sdr 4/R, jkn (n_h-1)/n_h of
    the stratum whose PSU has zero weight in the replicate (the strata must be declared, else
    rscales given: R's "Must provide rscales for combined JKn weights"), bootstrap by its
    `bootstrap` convention (BOOTSTRAP_CONVENTIONS; undeclared: 1/R, this package's scale
    before conventions were named). mse=True (the default) centres on the full-sample
    estimate (R's mse=TRUE); mse=False on the mean of the replicates whose rscales are > 0
    (R's default option survey.replicates.mse=FALSE). mse applies to totals, means, ratios,
    proportions and replicate_se; quantile refuses mse=False.

    As R survey's svydesign(id=~psu+ssu, strata=, fpc=~fpc+fpc2, nest=TRUE): fpc is the
    number of PSUs in the stratum's population (or the sampling fraction n_h/N_h when every
    fpc value is <= 1); the Taylor variance of stage 1 is sum_h (1-f_h) n_h/(n_h-1)
    sum_i (z_hi - zbar_h)^2. ssu (nested in psu) and fpc2 (SSUs in the PSU's population, or
    the fraction) add the second stage sum_hi f_h (1-f_hi) m_i/(m_i-1) sum_j (z_hij - zbar_hi)^2
    when fpc is given (without fpc the PSUs are ultimate clusters; ssu without fpc2: an
    infinite population of SSUs). lonely_psu: R's survey.lonely.psu, for a stratum (or, at
    stage 2, a PSU) with a single unit: fail; remove and certainty (it adds 0); adjust (its
    total is not centred); average (the stage's sum times H/(H - lonely strata); NaN at stage
    2, as R). A self-representing stratum (1 - f_h < 1e-7) adds 0 under every option.
    Replicate variance does not use the fpc (as R's svrepdesign); with_replicates("jkn" or
    "jk1") puts 1 - f_h in the rscales (as R's as.svrepdesign)."""

    def __init__(
        self,
        df: pd.DataFrame,
        weight: str | None,
        strata: str | None = None,
        psu: str | None = None,
        segment: str | None = None,
        replicate_weights: Sequence[str] | None = None,
        method: ReplicateMethod | None = None,
        rho: float | None = None,
        rscales: Sequence[float] | None = None,
        fpc: str | None = None,
        ssu: str | None = None,
        fpc2: str | None = None,
        lonely_psu: LonelyPSU = "fail",
        *,
        scale: float | None = None,
        bootstrap: BootstrapConvention | None = None,
        mse: bool = True,
    ):
        if isinstance(replicate_weights, str):  # a glob pattern such as "rw_*"
            pattern = replicate_weights
            replicate_weights = resolve_replicates(df.columns, pattern)
            if not replicate_weights:
                raise DesignError(
                    f"design.replicate_weights: no column matches '{pattern}'; fix the pattern"
                )
        missing = [
            c
            for c in (weight, strata, psu, segment, fpc, ssu, fpc2, *(replicate_weights or []))
            if c and c not in df.columns
        ]
        if missing:
            raise DesignError(f"design: columns {missing} are not in the data; fix the names")
        self.df, self.weight, self.strata, self.psu, self.segment = df, weight, strata, psu, segment
        self.w = self._read_weight(df, weight)
        n = len(df)
        self.n = n
        for c in (strata, psu, ssu):
            if c and df[c].isna().any():
                raise DesignError(
                    f"design: column '{c}' has missing values; every record needs one"
                )
        self.h = sorted_codes(df[strata]) if strata else np.zeros(n, dtype=np.int64)
        p = sorted_codes(df[psu]) if psu else np.arange(n, dtype=np.int64)
        m = int(p.max()) + 1 if n else 1
        uniq, g = dense_codes(self.h * m + p)  # PSU within stratum
        self.g = g.astype(np.int64)
        self.psu_h = (uniq // m).astype(np.int64)
        self.n_psu = len(self.psu_h)
        self.n_h = np.bincount(self.psu_h).astype(float)
        # records in PSU order (None when the file is already sorted by stratum and PSU)
        self._psu_order = None if (np.diff(g) >= 0).all() else np.argsort(g, kind="stable")
        # sparse aggregation: (records -> PSUs: _P, built when first asked for) PSUs -> strata
        self._P_cache: sp.csr_matrix | None = None
        self._S = sp.csr_matrix(
            (np.ones(self.n_psu), (self.psu_h, np.arange(self.n_psu))),
            shape=(len(self.n_h), self.n_psu),
        )
        self._setup_stages(fpc, ssu, fpc2, lonely_psu)
        self.replicate_weights = list(replicate_weights) if replicate_weights else []
        self.method, self.rho, self.mse = method, rho, bool(mse)
        self.scale, self.bootstrap = scale, bootstrap
        self.rscales: np.ndarray | None = None
        self._F_cache: tuple[np.ndarray | None] | None = None
        self._columns_cache: tuple[tuple, _Columns] | None = None
        self._groups_cache: tuple[tuple[np.ndarray, int, np.ndarray] | None] | None = None
        if self.replicate_weights:
            self._setup_replicates(rscales)
        elif bootstrap is not None or scale is not None:
            raise DesignError(
                "design.replicate_weights: bootstrap and scale describe replicate weights; "
                "give the replicate weight columns or drop them"
            )

    @staticmethod
    def _read_weight(df: pd.DataFrame, weight: str | None) -> np.ndarray:
        """The weights as floats (1 for every record when weight is None), checked > 0."""
        if weight is None:
            return np.ones(len(df))
        w = df[weight].to_numpy(dtype=float)
        if np.isnan(w).any() or (w <= 0).any():
            raise DesignError(
                f"design.weight: column '{weight}' has {int((~(w > 0)).sum())} missing or non-positive "
                "weights; every record needs a weight > 0 (drop or fix those records)"
            )
        return w

    def _setup_replicates(self, rscales: Sequence[float] | None) -> None:
        """The replicate weights as a Fortran matrix W (n x R), checked >= 0, and the scale
        factors c_r (self.rscales) from the method, its conventions and the given scales."""
        method = self.method
        if method not in METHODS:
            raise DesignError(
                f"design.replicate_weights.method: give one of {METHODS}, not {method!r}"
            )
        if method == "fay" and self.rho is None:
            raise DesignError("design.replicate_weights.rho: Fay's method needs rho (e.g. 0.3)")
        # Fortran order: W' y runs as one fast GEMM (C-order W' is ~20x slower in OpenBLAS)
        self.W = _fortran_columns(self.df, self.replicate_weights)
        bad = ~(self.W.min(axis=0, initial=np.inf) >= 0)  # negative or missing weights
        if bad.any():
            cols = [c for c, b in zip(self.replicate_weights, bad, strict=True) if b][:5]
            raise DesignError(
                f"design.replicate_weights: columns {cols} have missing or negative weights; "
                "replicate weights must be >= 0"
            )
        self.rscales = self._scales(rscales)

    @classmethod
    def from_spec(cls, df: pd.DataFrame, design: Any, replicates: bool = True) -> SurveyDesign:
        """The design a spec's `design` section describes on df (replicate weights when the
        section has them and replicates is True, with their conventions: replicate_options)."""
        rs = design.replicate_weights
        rw = resolve_replicates(df.columns, rs.columns) if (replicates and rs) else []
        return cls(
            df,
            weight=design.weight,
            strata=design.strata,
            psu=design.psu,
            segment=design.segment,
            replicate_weights=rw or None,
            fpc=getattr(design, "fpc", None),
            ssu=getattr(design, "ssu", None),
            fpc2=getattr(design, "fpc2", None),
            lonely_psu=getattr(design, "lonely_psu", "fail"),
            **(replicate_options(rs) if rw else {}),
        )

    def _setup_stages(
        self, fpc: str | None, ssu: str | None, fpc2: str | None, lonely_psu: str
    ) -> None:
        """The population sizes N_h (strata) and M_i (PSUs) from fpc and fpc2, the SSUs
        (codes nested in PSUs, sorted by PSU) and the constants of the stage kernels."""
        if lonely_psu not in LONELY_PSU:
            raise DesignError(f"design.lonely_psu: give one of {LONELY_PSU}, not {lonely_psu!r}")
        if ssu is not None and self.psu is None:
            raise DesignError("design.ssu: SSUs are nested in PSUs; name the psu column")
        if fpc2 is not None and ssu is None:
            raise DesignError("design.fpc2: it counts the SSUs of a PSU; name the ssu column")
        if fpc2 is not None and fpc is None:
            raise DesignError(
                "design.fpc2: without fpc the PSUs are ultimate clusters and fpc2 changes "
                "nothing; name the fpc column or drop fpc2"
            )
        self.fpc, self.ssu, self.fpc2, self.lonely_psu = fpc, ssu, fpc2, lonely_psu
        (v1, v2), fraction = population_sizes(self.df, [fpc, fpc2])
        self.N_h: np.ndarray | None = None  # PSUs in each stratum's population
        q1 = np.ones(len(self.n_h))  # 1 - f_h
        if v1 is not None:
            v = per_group(v1, self.h, len(self.n_h), f"design.fpc '{fpc}' within strata")
            with np.errstate(divide="ignore"):
                self.N_h = self.n_h / v if fraction else v  # fraction 0: N_h infinite
            self._check_population(self.n_h, self.N_h, "strata", fpc)
            q1 = one_minus_f(self.n_h, self.N_h)
        self._q1 = q1
        self._c1, self._d1, self._lonely1 = stage_constants(self.n_h, q1, lonely_psu)
        self._stage2 = ssu is not None and v1 is not None  # R: stage 2 only with an fpc
        self._Q_cache: sp.csr_matrix | None = None
        if ssu is None:
            return
        s = sorted_codes(self.df[ssu])
        top = int(s.max(initial=0)) + 1
        uniq, sc = dense_codes(self.g * top + s)
        self.ssu_code = sc.astype(np.int64)  # SSU within PSU, sorted by PSU then SSU label
        self.ssu_psu = (uniq // top).astype(np.int64)
        self.m_i = np.bincount(self.ssu_psu, minlength=self.n_psu).astype(float)
        M = np.full(self.n_psu, np.inf)  # SSUs in each PSU's population
        if v2 is not None:
            v = per_group(v2, self.g, self.n_psu, f"design.fpc2 '{fpc2}' within PSUs")
            with np.errstate(divide="ignore"):
                M = self.m_i / v if fraction else v
            self._check_population(self.m_i, M, "PSUs", fpc2)
        self.M_i = M
        self._S2 = sp.csr_matrix(
            (np.ones(len(self.ssu_psu)), (self.ssu_psu, np.arange(len(self.ssu_psu)))),
            shape=(self.n_psu, len(self.ssu_psu)),
        )
        c2, self._d2, self._lonely2 = stage_constants(
            self.m_i, one_minus_f(self.m_i, M), lonely_psu
        )
        if self._stage2:  # times f_h = n_h / N_h of the PSU's stratum (R: nPSUs / fpcs)
            self._c2 = c2 * (self.n_h / self.N_h)[self.psu_h]
            order = np.argsort(self.ssu_code, kind="stable")  # records by SSU (so by PSU)
            self._psu_order = None if (np.diff(self.ssu_code) >= 0).all() else order

    def _check_population(self, n: np.ndarray, N: np.ndarray, what: str, col: str) -> None:
        """R's as.fpc: a population smaller than the sample is an error."""
        bad = N < n * (1.0 - 1e-10)
        if bad.any():
            raise DesignError(
                f"design: column '{col}' gives {int(bad.sum())} {what} a population smaller than "
                f"their sample (e.g. {N[bad][0]:g} < {n[bad][0]:g}): fpc is the population size "
                "(or the sampling fraction) of the stratum's PSUs, fpc2 of the PSU's SSUs"
            )

    @property
    def _P(self) -> sp.csr_matrix:
        """The PSUs x records indicator (PSU totals of record scores: _P @ z)."""
        if self._P_cache is None:
            n = self.n
            self._P_cache = sp.csr_matrix(
                (np.ones(n), (self.g, np.arange(n))), shape=(self.n_psu, n)
            )
        return self._P_cache

    @property
    def _sorted_psu_starts(self) -> np.ndarray | None:
        """The first record of each PSU when the file is sorted by PSU and PSUs hold 50
        records on average (then PSU totals are one GEMV per PSU), else None."""
        if self._psu_order is not None:
            return None
        g = self.g
        starts = np.flatnonzero(np.r_[True, g[1:] != g[:-1]])
        return starts if 50 * len(starts) <= self.n else None

    @property
    def _F(self) -> np.ndarray | None:
        """F (PSUs x R) when every replicate weight is w times a factor constant within PSU (as
        for jackknife, BRR/Fay, bootstrap built from the design): replicate totals are then
        F' (PSU totals), a G x R x k product instead of n x R x k. None otherwise (e.g. after
        replicate recalibration), and the full product W' y is used."""
        if self._F_cache is None:
            first = first_of(self.g, self.n_psu)  # first record of each PSU
            F = self.W[first] / self.w[first, None]
            tol = 1e-13 * max(float(F.max(initial=0.0)), 1.0)
            self._F_cache = (F if self._factors_equal(self.g, F, tol) else None,)
        return self._F_cache[0]

    def _factors_equal(self, codes: np.ndarray, F: np.ndarray, tol: float) -> bool:
        return factors_equal(self.W, self.w, codes, F, tol)

    @property
    def factor_groups(self) -> tuple[np.ndarray, int, np.ndarray] | None:
        """(codes, G, F): records in G groups of equal replicate factors W_i / w_i (the PSUs
        when the factors are constant within PSUs), F (G x R) each group's factors; None when
        the factors are not constant on few groups or there are no replicate weights."""
        return self._factors if self.replicate_weights else None

    @property
    def _factors(self) -> tuple[np.ndarray, int, np.ndarray] | None:
        """(codes, G, F): groups of records with equal replicate factors and F (G x R): the
        PSUs and _F when the factors are constant within PSUs, else _factor_groups."""
        if self._F is not None:
            return self.g, self.n_psu, self._F
        return self._factor_groups

    @property
    def _factor_groups(self) -> tuple[np.ndarray, int, np.ndarray] | None:
        """(codes, G, F): the records in G groups whose replicate factors W_i / w_i are equal,
        F (G x R) the factors of each group; None when the groups are not few (more than n/4)
        or the replicate factors are constant within PSUs (then _F serves). Recalibrated
        replicates (MASSC) have factors constant within PSU x calibration profile: replicate
        totals are then F' (group totals of w y), G x R x k instead of n x R x k."""
        if self._groups_cache is None:
            self._groups_cache = (None if self._F is not None else self._find_groups(),)
        return self._groups_cache[0]

    def _find_groups(self) -> tuple[np.ndarray, int, np.ndarray] | None:
        return replicate_factor_groups(self.W, self.w)

    # ------------------------------------------------------------ replicate scale factors
    def _scales(self, rscales: Sequence[float] | None) -> np.ndarray:
        """c_r = scale * rscales_r, as R's svrepdesign: the given rscales (else the method's,
        _method_scales) times the given scale (else 1)."""
        R = self.W.shape[1]
        scale, bootstrap, method = self.scale, self.bootstrap, self.method
        if bootstrap is not None and method != "bootstrap":
            raise DesignError(
                f"design.replicate_weights.bootstrap: {bootstrap!r} describes bootstrap "
                f"replicates, not {method}; drop it or declare method bootstrap"
            )
        if bootstrap is not None and bootstrap not in BOOTSTRAP_CONVENTIONS:
            raise DesignError(
                f"design.replicate_weights.bootstrap: give one of {BOOTSTRAP_CONVENTIONS}, "
                f"not {bootstrap!r}"
            )
        if bootstrap is not None and (rscales is not None or scale is not None):
            raise DesignError(
                "design.replicate_weights: give the bootstrap convention or the scale and "
                "rscales the producer publishes, not both"
            )
        if scale is not None:
            if method in ("brr", "fay", "sdr"):
                raise DesignError(
                    f"design.replicate_weights.scale: {method}'s scale is fixed by the method "
                    "(as R's svrepdesign); drop scale, or give rscales"
                )
            if not (np.isfinite(scale) and scale > 0):
                raise DesignError(f"design.replicate_weights.scale: give a number > 0, not {scale}")
        if rscales is not None:
            r = np.asarray(rscales, dtype=float)
            if r.shape != (R,):
                raise DesignError(f"design: rscales needs {R} values, one per replicate")
            if not (np.isfinite(r).all() and (r >= 0).all()):
                raise DesignError("design: rscales must be finite numbers >= 0")
        elif scale is not None and method != "jkn":
            r = np.ones(R)  # R's svrepdesign: rscales 1 unless given (jkn: its own)
        else:
            r = self._method_scales(R)
        return r * scale if scale is not None else r

    def _method_scales(self, R: int) -> np.ndarray:
        """The scale factors of the method when neither rscales nor scale is given."""
        if self.method == "brr":
            return np.full(R, 1.0 / R)
        if self.method == "fay":
            return np.full(R, 1.0 / (R * (1.0 - self.rho) ** 2))
        if self.method == "jk1":
            return np.full(R, (R - 1.0) / R)
        if self.method == "sdr":
            return np.full(R, 4.0 / R)
        if self.method == "bootstrap":
            return np.full(R, self._bootstrap_scale(R))
        return self._jkn_scales()

    def _bootstrap_scale(self, R: int) -> float:
        """The scale of R bootstrap replicates by their convention (BOOTSTRAP_CONVENTIONS)."""
        if R < 2:
            raise DesignError("design.replicate_weights: a bootstrap needs at least 2 replicates")
        if self.bootstrap is None:
            return 1.0 / R
        if self.bootstrap == "rao-wu":
            return 1.0 / (R - 1.0)
        nbar = 1.0 / np.mean(1.0 / self.n_h)  # harmonic mean of the PSUs per stratum
        if nbar <= 1.0:
            raise DesignError(
                "design.replicate_weights.bootstrap: canty-davison scales by nbar/(nbar - 1), "
                "nbar the harmonic mean of the PSUs per stratum; every stratum here has one "
                "PSU: declare design.strata and design.psu as the replicates were drawn"
            )
        return nbar / ((nbar - 1.0) * (R - 1.0))

    def _one_stratum_jkn(self) -> bool:
        """Whether every replicate deletes one PSU and multiplies every other PSU by
        G/(G - 1) (G PSUs): JKn of a single stratum (= JK1), whose scale (G-1)/G is known."""
        F, G = self._F, self.n_psu
        if F is None or G < 2:
            return False
        zero = F == 0
        if not (zero.sum(axis=0) == 1).all():
            return False
        return bool(np.allclose(F[~zero], G / (G - 1.0), rtol=1e-9, atol=0.0))

    def _jkn_scales(self) -> np.ndarray:
        """jkn: the stratum of the PSU deleted in replicate r gives (n_h - 1)/n_h. Without
        declared strata, refused (R: "Must provide rscales for combined JKn weights") unless
        the replicates are those of a single stratum (_one_stratum_jkn): else one stratum
        would be assumed, and the SEs would be off by the strata's (n_h-1)/n_h."""
        if self.strata is None and not self._one_stratum_jkn():
            raise DesignError(
                "design.replicate_weights: jkn replicates scale by (n_h - 1)/n_h of the "
                "stratum of the PSU each deletes; no strata are declared, and the replicates "
                "are not those of a single stratum (not every other PSU is reweighted by "
                "G/(G - 1)): declare design.strata (and design.psu) as the replicates were "
                "made, or give design.replicate_weights.rscales (one per replicate), or "
                "declare method jk1 if the sample has a single stratum"
            )
        psu_sum = sparse_times(self._P, self.W)  # PSUs x R
        zero = psu_sum == 0
        ok = zero.any(axis=0)
        if not ok.all():
            raise DesignError(
                f"design.replicate_weights: jkn replicates {np.flatnonzero(~ok)[:5].tolist()} delete no PSU; "
                "give rscales or check the method"
            )
        deleted = zero.argmax(axis=0)
        n_h = self.n_h[self.psu_h[deleted]]
        return (n_h - 1.0) / n_h

    def _labels(self, mask: np.ndarray, k: int = 8) -> list:
        """Original labels of the strata flagged in mask (at most k)."""
        if self.strata is None:
            return ["(all)"] if mask.any() else []
        levels = factorize(self.df[self.strata], sort=True)[1]
        return list(levels[np.flatnonzero(mask)[:k]])

    # ------------------------------------------------------------ data
    def _matrix(self, cols: Sequence[str]) -> _Columns:
        """The study columns as a matrix; the last one asked for is kept (estimates of the same
        variables by several domains and variances read the frame once)."""
        missing = [c for c in cols if c not in self.df.columns]
        if missing:
            raise DesignError(f"columns {missing} are not in the data")
        key = tuple(cols)
        if self._columns_cache is None or self._columns_cache[0] != key:
            self._columns_cache = (key, _Columns(self.df, cols))
        return self._columns_cache[1]

    def _domains(self, by: str | None) -> tuple[list, np.ndarray | None]:
        if by is None:
            return [None], None
        codes, levels = factorize(self.df[by], sort=True)
        return list(levels), codes

    # ------------------------------------------------------------ variance kernels
    @property
    def _Q(self) -> sp.csr_matrix:
        """The SSUs x records indicator (SSU totals of record scores: _Q @ z)."""
        if self._Q_cache is None:
            n = self.n
            self._Q_cache = sp.csr_matrix(
                (np.ones(n), (self.ssu_code, np.arange(n))), shape=(len(self.ssu_psu), n)
            )
        return self._Q_cache

    def taylor_variance(self, z: np.ndarray | sp.spmatrix | sp.sparray) -> np.ndarray:
        """Variance of the totals of linearized scores z (n x k, dense or scipy sparse): PSUs
        with replacement in strata (and the second stage of a two-stage design with fpc). A
        sparse z (e.g. scores of many domains, each zero outside its domain) costs its
        nonzeros, not n x k."""
        if sp.issparse(z):
            z = sp.csr_matrix(z)
            st = sp.csr_matrix(self._Q @ z) if self._stage2 else None
            return self._psu_variance(sp.csr_matrix(self._P @ z), st)
        z = np.asarray(z)
        st = sparse_times(self._Q, z) if self._stage2 else None
        return self._psu_variance(sparse_times(self._P, z), st)

    def psu_variance(
        self,
        zt: np.ndarray | sp.spmatrix | sp.sparray,
        ssu_totals: np.ndarray | sp.spmatrix | sp.sparray | None = None,
    ) -> np.ndarray:
        """Variance of totals from their PSU totals zt (PSUs x k, dense or scipy sparse; row j
        is the PSU coded j in `g`): the kernel of taylor_variance. The second stage of a
        two-stage design with fpc needs the SSU totals (SSUs x k, row j the SSU coded j in
        ssu_code); without them the PSUs are ultimate clusters (R's survey.ultimate.cluster)."""
        zt = sp.csr_matrix(zt) if sp.issparse(zt) else np.asarray(zt)
        st = None
        if ssu_totals is not None and self._stage2:
            st = sp.csr_matrix(ssu_totals) if sp.issparse(ssu_totals) else np.asarray(ssu_totals)
        return self._psu_variance(zt, st)

    def taylor_covariance(self, z: np.ndarray) -> np.ndarray:
        """Covariance matrix (k x k) of the totals of scores z (n x k): sum_h (1-f_h)
        n_h/(n_h-1) sum_i (z_hi - zbar_h)(z_hi - zbar_h)' over PSU totals z_hi (svyrecvar's
        kernel, with the second stage when the design has one; the B of a GLM sandwich
        A^-1 B A^-1)."""
        z = np.asarray(z, dtype=float).reshape(self.n, -1)
        st = sparse_times(self._Q, z) if self._stage2 else None
        return self.psu_covariance(sparse_times(self._P, z), st)

    def psu_covariance(self, zt: np.ndarray, ssu_totals: np.ndarray | None = None) -> np.ndarray:
        """taylor_covariance from the PSU totals zt (PSUs x k; row j the PSU coded j in g) and,
        for the second stage of a two-stage design with fpc, the SSU totals (see psu_variance)."""
        self._check_psus()
        zt = np.asarray(zt, dtype=float)
        dev = zt - (np.asarray(self._S @ zt) / self._d1[:, None])[self.psu_h]
        cov = (dev * self._c1[self.psu_h][:, None]).T @ dev * self._average_factor()
        if ssu_totals is None or not self._stage2:
            return cov
        st = np.asarray(ssu_totals, dtype=float)
        dev = st - (np.asarray(self._S2 @ st) / self._d2[:, None])[self.ssu_psu]
        return cov + (dev * self._c2[self.ssu_psu][:, None]).T @ dev * self._average_factor(2)

    def replicate_totals(self, z: np.ndarray | sp.spmatrix | sp.sparray) -> np.ndarray:
        """Totals of z (n x k, dense or scipy sparse) under every replicate weight (R x k):
        F' (PSU totals of w z) when the replicate factors are constant within PSUs, else W' z."""
        if not self.replicate_weights:
            raise DesignError("replicate_totals needs replicate weights in the design")
        fac = self._factors
        if sp.issparse(z):
            z = sp.csr_matrix(z)
            if fac is not None:  # group totals of w z (the indicator matrix with data w), F'
                codes, G, F = fac
                Gw = sp.csr_matrix((self.w, (codes, np.arange(self.n))), shape=(G, self.n))
                return np.asarray((sp.csr_matrix(Gw @ z).T @ F).T)
            return np.asarray((z.T @ self.W).T)
        z = np.asarray(z, dtype=float).reshape(self.n, -1)
        if fac is not None:
            codes, G, F = fac
            Gw = sp.csr_matrix((self.w, (codes, np.arange(self.n))), shape=(G, self.n))
            return F.T @ sparse_times(Gw, z)
        return self.W.T @ z

    def replicate_cell_totals(self, y: np.ndarray, codes: np.ndarray, L: int) -> np.ndarray:
        """Totals of the columns of y (n x k) within each cell (codes 0..L-1; -1: no cell)
        under every replicate weight: R x L x k. replicate_totals of the n x (L k) matrix of
        y in its cell's columns, without the sparse product: through the PSU totals and F when
        the factors are constant within PSUs, else one dense product W_c' y_c per cell over
        its records (read a block at a time)."""
        if not self.replicate_weights:
            raise DesignError("replicate_cell_totals needs replicate weights in the design")
        y = np.asarray(y, dtype=float).reshape(self.n, -1)
        k, R = y.shape[1], self.W.shape[1]
        codes = np.asarray(codes, dtype=np.int64)
        fac = self._factors
        if fac is not None:  # totals of w y by (group, cell) pair that holds records, then F'
            gc, G, F = fac
            w = self.w
            ok = codes >= 0
            if not ok.all():
                gc, codes, y, w = gc[ok], codes[ok], y[ok], w[ok]
            pair, of = dense_codes(codes * G + gc)  # cell-major: a cell's pairs are contiguous
            S = group_indicator(of, len(pair)) @ (w[:, None] * y)  # pairs x k
            return pair_replicate_totals(F, pair % G, pair // G, S, L)
        out = np.zeros((R, L, k))
        order = np.argsort(codes, kind="stable")
        bounds = np.searchsorted(codes[order], np.arange(L + 1))
        block = max(1, (1 << 22) // max(R, 1))  # ~32 MB of replicate weights at a time
        for c in range(L):
            rows = order[bounds[c] : bounds[c + 1]]
            for a in range(0, len(rows), block):
                r = rows[a : a + block]
                out[:, c, :] += take_rows(self.W, r).T @ y[r]
        return out

    def _check_psus(self) -> None:
        """lonely_psu="fail": a stratum with a single PSU (not self-representing), or at the
        second stage a PSU with a single SSU, is an error."""
        if self.lonely_psu != "fail":
            return
        if self._lonely1.any():
            raise DesignError(
                f"design.strata: strata {self._labels(self._lonely1)} of column '{self.strata}' "
                "have a single PSU; Taylor variance needs >= 2: collapse them with a neighbouring "
                "stratum (or set lonely_psu: remove, adjust, average or certainty)"
            )
        if self._stage2 and self._lonely2.any():
            first = first_of(self.g, self.n_psu)[np.flatnonzero(self._lonely2)[:8]]
            raise DesignError(
                f"design.ssu: PSUs {self.df[self.psu].iloc[first].tolist()} of column "
                f"'{self.psu}' have a single SSU ('{self.ssu}') and fpc2 says there are more; the "
                "second-stage variance needs >= 2 (or set lonely_psu: remove, adjust or certainty)"
            )

    def _average_factor(self, stage: int = 1) -> float:
        """lonely_psu="average": stage 1's sum times H / (H - lonely strata), R's onestage
        nstrat / nokstrat; at stage 2 each PSU is its own onestage, so a lonely SSU gives NaN."""
        if self.lonely_psu != "average":
            return 1.0
        if stage == 2:
            return np.nan if self._lonely2.any() else 1.0
        H, bad = len(self.n_h), int(self._lonely1.sum())
        return H / (H - bad) if bad < H else np.nan

    def _psu_variance(
        self, zt: np.ndarray | sp.csr_matrix, st: np.ndarray | sp.csr_matrix | None = None
    ) -> np.ndarray:
        """sum_h c_h (s2_h - s1_h^2 / d_h) from PSU totals zt (PSUs x k, dense or sparse; a
        sparse zt is summed over its nonzeros, PSUs without them counting as 0): s1_h, s2_h the
        stratum sums of the PSU totals and their squares, c_h = (1-f_h) n_h/(n_h-1), d_h = n_h
        (stage_constants, lonely_psu). With SSU totals st (two-stage design with fpc) plus
        the same over the SSUs of each PSU, times f_h = n_h / N_h (R's multistage)."""
        self._check_psus()
        var = self._stage_variance(zt, self._S, self._c1, self._d1) * self._average_factor()
        if st is not None:
            v2 = self._stage_variance(st, self._S2, self._c2, self._d2)
            var = var + v2 * self._average_factor(2)
        return var

    @staticmethod
    def _stage_variance(
        zt: np.ndarray | sp.csr_matrix, S: sp.csr_matrix, c: np.ndarray, d: np.ndarray
    ) -> np.ndarray:
        """sum_g c_g (s2_g - s1_g^2 / d_g) over the groups of units (S: groups x units) from
        the units' totals zt (units x k, dense or sparse), clipped at 0."""
        if sp.issparse(zt):
            s1 = sp.csr_matrix(S @ zt)
            s2 = sp.csr_matrix(S @ zt.multiply(zt))
            dev = s2 - sp.diags(1.0 / d) @ s1.multiply(s1)  # per group, as below
            return np.maximum(np.asarray(dev.T @ c).ravel(), 0.0)
        s1 = np.asarray(S @ zt)
        s2 = np.asarray(S @ (zt * zt))
        return np.maximum((c[:, None] * (s2 - s1 * s1 / d[:, None])).sum(axis=0), 0.0)

    def _variance_kind(self, variance: str | None) -> str:
        kind = variance or ("replicate" if self.replicate_weights else "taylor")
        if kind == "replicate" and not self.replicate_weights:
            raise DesignError("variance='replicate' needs replicate weights in the design")
        if kind not in ("taylor", "replicate"):
            raise DesignError(f"variance must be 'taylor' or 'replicate', not {kind!r}")
        return kind

    def _replicate_se(self, theta: np.ndarray, theta_r: np.ndarray) -> np.ndarray:
        return self.replicate_se(theta, theta_r)

    def replicate_se(self, theta: np.ndarray, theta_r: np.ndarray) -> np.ndarray:
        """The replicate SE sqrt(sum_r c_r (theta_r - centre)^2) of estimates theta (any
        shape) from their replicates theta_r (R x that shape): centre theta when mse (R's
        mse=TRUE), else the mean of the replicates whose rscales are > 0 (R's svrVar)."""
        theta_r = np.asarray(theta_r, dtype=float)
        if self.mse:
            centre = np.asarray(theta, dtype=float)
        else:
            centre = theta_r[self.rscales > 0].mean(axis=0)
        d = theta_r - centre[None]
        if d.ndim == 3:  # (R, domains, variables)
            return np.sqrt(np.einsum("r,rlk->lk", self.rscales, d * d))
        return np.sqrt(self.rscales @ (d * d))

    # ------------------------------------------------------------ estimators
    def _taylor(
        self, y: _Columns, x: _Columns | str | None, domain: np.ndarray | None
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Estimate, Taylor SE and deff of totals (x None), means (x "ones") or ratios y/x.

        PSU (or, two-stage with fpc, SSU) totals of the scores z = w d (y - R x) / X (z = w d y
        for totals) are sums over runs of records in PSU (SSU) order (np.add.reduceat), a few
        variables at a time so every block
        stays in cache; strata with no domain records still
        count. deff is Kish's with-replacement deff V / (W^2 s2_w / n),
        s2_w = n/(n-1) sum w (u - ubar_w)^2 / W over the domain's n records (svy deff='wr').
        """
        idx = self._psu_order
        if domain is not None:
            idx = np.flatnonzero(domain) if idx is None else idx[domain[idx]]
        # the units summed: PSUs, or SSUs of a two-stage design with fpc (then PSU totals
        # are the sums of their SSU totals)
        codes, units = (self.ssu_code, len(self.ssu_psu)) if self._stage2 else (self.g, self.n_psu)
        g, w = (codes, self.w) if idx is None else (codes[idx], self.w[idx])
        nd, k = len(w), y.k
        starts = np.flatnonzero(np.r_[True, g[1:] != g[:-1]])
        psu_ids, psu_w = g[starts], np.add.reduceat(w, starts)
        Wd = w.sum()
        est, ss, X = np.empty(k), np.empty(k), np.empty(k)
        zt = np.zeros((units, k))
        xc = x if isinstance(x, _Columns) else None

        def run(a: int, b: int) -> None:  # variables a..b-1
            B = y.block(a, b, idx)  # variables x records
            Yc = B @ w
            XB = None if xc is None else xc.block(a, b, idx)
            if x is None:  # totals
                X[a:b], est[a:b] = 1.0, Yc
                shift = (Yc / Wd)[:, None]
            else:
                X[a:b] = Wd if XB is None else XB @ w
                with np.errstate(divide="ignore", invalid="ignore"):
                    est[a:b] = Yc / X[a:b]
                shift = est[a:b, None] if XB is None else est[a:b, None] * XB
            c = B - shift  # y - R x (y - ybar for totals)
            wc = c * w
            r = np.add.reduceat(wc, starts, axis=1)  # PSU sums of w c
            if x is None:  # PSU totals of w y = sums of w c + ybar * PSU weight sums
                r += shift * psu_w
            else:
                with np.errstate(divide="ignore", invalid="ignore"):
                    r /= X[a:b, None]
            zt[psu_ids, a:b] = r.T
            ss[a:b] = np.einsum("ji,ji->j", wc, c)

        step = max(1, min(k, (1 << 17) // max(nd, 1)))  # ~1 MB blocks (measured best)
        if idx is None and xc is None and 50 * len(starts) <= nd and not self._stage2:
            redo = self._taylor_sorted(y, x, starts, psu_ids, psu_w, est, X, zt, ss)
            for a in np.flatnonzero(redo):  # columns where the one-pass sums cancel: centred path
                run(int(a), int(a) + 1)
        else:
            for a in range(0, k, step):
                run(a, min(a + step, k))
        if self._stage2:  # zt: the SSU totals; PSU totals z_hi = sum_j z_hij
            var = self._psu_variance(np.asarray(self._S2 @ zt), zt)
        else:
            var = self._psu_variance(zt)
        with np.errstate(divide="ignore", invalid="ignore"):
            srs = Wd * ss / ((nd - 1.0) * np.square(X))  # = W^2 s2_w / n
            deff = var / srs if nd > 1 else np.full_like(var, np.nan)
        return est, np.sqrt(var), deff

    def _taylor_sorted(
        self,
        y: _Columns,
        x: str | None,
        starts: np.ndarray,
        psu_ids: np.ndarray,
        psu_w: np.ndarray,
        est: np.ndarray,
        X: np.ndarray,
        zt: np.ndarray,
        ss: np.ndarray,
    ) -> np.ndarray:
        """Totals or means of a file sorted by PSU: PSU totals by one GEMV per PSU and
        sum w y^2 by blocks (two passes over y, no centred copy); fills est, X, zt, ss and
        returns the columns whose one-pass sums lose more than 6 digits (to redo centred)."""
        w, Wd = self.w, self.w.sum()
        t, s2 = psu_sums(y.data.T, w, starts)
        y._checked(s2[:, None], y.names)  # a missing value anywhere makes its sums NaN
        Y = t.sum(axis=0)
        mean = Y / Wd
        ss[:] = s2 - mean * Y  # sum w (y - ybar)^2
        dev = t - mean * psu_w[:, None]  # PSU totals of w (y - ybar)
        if x is None:  # totals
            X[:], est[:] = 1.0, Y
            zt[psu_ids] = t
        else:  # means
            X[:], est[:] = Wd, mean
            zt[psu_ids] = dev / Wd
        scale = np.abs(t).max(axis=0)
        return (ss <= 1e-6 * s2) | (np.abs(dev).max(axis=0) <= 1e-6 * scale)

    def _replicate(
        self, y: np.ndarray, x: np.ndarray | str | None, rows: np.ndarray | None
    ) -> tuple[np.ndarray, np.ndarray]:
        """Estimate and replicate SE (centred on the full-sample estimate)."""
        ym = y if rows is None else y[rows]
        wm = self.w if rows is None else self.w[rows]
        xm = None  # a ratio's denominator columns (None for totals and means)
        if isinstance(x, np.ndarray):
            xm = x if rows is None else x[rows]
        fac = self._factors
        t = None  # PSU totals of w y (PSUs x k) when the file is sorted by PSU
        if fac is not None and rows is None and fac[0] is self.g and ym.flags.f_contiguous:
            starts = self._sorted_psu_starts
            t = None if starts is None else psu_sums(ym.T, wm, starts, squares=False)[0]
        Y = wm @ ym if t is None else t.sum(axis=0)
        X = 1.0 if x is None else (wm.sum() if xm is None else wm @ xm)
        with np.errstate(divide="ignore", invalid="ignore"):
            est = Y / X
        if fac is not None:  # group (PSU) totals of w y and w x, then F'
            codes, G, F = fac
            gm = codes if rows is None else codes[rows]
            Gw = None
            if t is None or xm is not None:
                Gw = sp.csc_matrix((wm, (gm, np.arange(len(wm)))), shape=(G, len(wm)))
            theta_r = F.T @ (sparse_times(Gw, ym) if t is None else t)  # R x k
            if x is None:
                xr = None
            elif xm is None:
                xr = F.T @ np.bincount(gm, wm, G)[:, None]
            else:
                xr = F.T @ sparse_times(Gw, xm)
        else:
            Wr = self.W if rows is None else take_rows(self.W, rows)
            theta_r = Wr.T @ ym  # R x k: one matrix product for all variables
            xr = None if x is None else (Wr.sum(axis=0)[:, None] if xm is None else Wr.T @ xm)
        if xr is not None:
            with np.errstate(divide="ignore", invalid="ignore"):
                theta_r = theta_r / xr
        return est, self._replicate_se(est, theta_r)

    def _replicate_by(
        self, ym: np.ndarray, xm: np.ndarray | str | None, codes: np.ndarray, L: int
    ) -> tuple[np.ndarray, np.ndarray]:
        """Estimates and replicate SEs (L x k) in every domain (codes 0..L-1; -1: none) at once,
        for replicate factors constant on groups: the (group, domain) sums of w y (and w x),
        then F' by domain (pair_replicate_totals); _replicate of each domain's records."""
        gc, G, F = self._factors
        w = self.w
        ok = codes >= 0
        if not ok.all():
            gc, codes, w = gc[ok], codes[ok], w[ok]
            ym = ym[ok]
            xm = xm[ok] if isinstance(xm, np.ndarray) else xm
        pair, of = dense_codes(codes.astype(np.int64) * G + gc)
        A = group_indicator(of, len(pair))
        cell, grp = pair // G, pair % G
        Cp = sp.csr_matrix((np.ones(len(pair)), (cell, np.arange(len(pair)))), shape=(L, len(pair)))
        S = sparse_times(A, w[:, None] * ym)  # pairs x k
        Y = np.asarray(Cp @ S)  # L x k
        theta_r = pair_replicate_totals(F, grp, cell, S, L)  # R x L x k
        if xm is None:  # totals
            est = Y
        else:
            if isinstance(xm, np.ndarray):  # ratios: one denominator column per variable
                Sx = sparse_times(A, w[:, None] * xm)
            else:  # means: the weight
                Sx = (A @ w)[:, None]
            X, xr = np.asarray(Cp @ Sx), pair_replicate_totals(F, grp, cell, Sx, L)
            with np.errstate(divide="ignore", invalid="ignore"):
                est = Y / X
                theta_r = theta_r / xr
        return est, self.replicate_se(est, theta_r)

    def _estimate(
        self,
        y: _Columns,
        x: _Columns | str | None,
        by: str | None,
        index: list,
        variance: str | None,
    ) -> pd.DataFrame:
        """Totals (x None), means (x "ones") or ratios of totals y/x, one column per variable.

        Taylor: see _taylor. Replicate: one product (replicate weights)' y for all variables.
        """
        vkind = self._variance_kind(variance)
        levels, codes = self._domains(by)
        parts = []  # (estimate, se, deff) of each level, in level order
        by_level = None
        if vkind == "replicate":  # without domains, missing values are found from the sums
            ym = y.data if codes is None else y.full()
            xm = (x.data if codes is None else x.full()) if isinstance(x, _Columns) else x
            if codes is not None and self._factors is not None:  # every domain in one pass
                by_level = self._replicate_by(ym, xm, codes, len(levels))
        for j in range(len(levels)):  # loop over domains only, never over variables
            if vkind == "taylor":
                est, se, deff = self._taylor(y, x, None if codes is None else codes == j)
            elif by_level is not None:
                est, se, deff = by_level[0][j], by_level[1][j], None
            else:
                rows = None if codes is None else np.flatnonzero(codes == j)
                est, se = self._replicate(ym, xm, rows)
                deff = None
                if rows is None and np.isnan(est).any():  # a missing value makes its sum NaN
                    y.full()  # raises naming the columns
                    if isinstance(x, _Columns):
                        x.full()
            parts.append((est, se, deff))
        return _estimate_frame(parts, index, by, levels)

    def total(
        self, cols: str | Sequence[str], by: str | None = None, variance: str | None = None
    ) -> pd.DataFrame:
        """Weighted totals of cols (and by domain)."""
        cols = _as_list(cols)
        return self._estimate(self._matrix(cols), None, by, cols, variance)

    def mean(
        self, cols: str | Sequence[str], by: str | None = None, variance: str | None = None
    ) -> pd.DataFrame:
        """Weighted means of cols (ratio to the sum of weights), linearized for Taylor."""
        cols = _as_list(cols)
        return self._estimate(self._matrix(cols), "ones", by, cols, variance)

    def ratio(
        self,
        num: str | Sequence[str],
        den: str | Sequence[str],
        by: str | None = None,
        variance: str | None = None,
    ) -> pd.DataFrame:
        """Ratios of totals sum w y / sum w x (index 'num/den'); one den, or one per num."""
        num, den = _as_list(num), _as_list(den)
        if len(den) == 1 and len(num) > 1:
            den = den * len(num)
        if len(den) != len(num):
            raise DesignError("ratio: give one denominator, or one per numerator")
        index = [f"{a}/{b}" for a, b in zip(num, den, strict=True)]
        return self._estimate(self._matrix(num), self._matrix(den), by, index, variance)

    def proportion(
        self, col: str, by: str | None = None, variance: str | None = None
    ) -> pd.DataFrame:
        """Proportions of each category of col (index: variable, category)."""
        if col not in self.df.columns:
            raise DesignError(f"column '{col}' is not in the data")
        codes, cats = factorize(self.df[col], sort=True)
        if (codes < 0).any():
            raise DesignError(
                f"column '{col}' has missing values; recode them to a category or drop the records"
            )
        ind = np.zeros((self.n, len(cats)))
        ind[np.arange(self.n), codes] = 1.0
        out = self._estimate(
            _Columns(ind, range(len(cats))), "ones", by, list(range(len(cats))), variance
        )
        tuples = [(col, cats[int(v)]) for v in out.index.get_level_values("variable")]
        idx = pd.MultiIndex.from_tuples(tuples, names=["variable", "category"])
        if by is not None:
            idx = pd.MultiIndex.from_arrays(
                [idx.get_level_values(0), idx.get_level_values(1), out.index.get_level_values(by)],
                names=["variable", "category", by],
            )
        out.index = idx
        return out

    def linearized_scores(
        self, cols: str | Sequence[str], estimator: Literal["total", "mean"] = "mean"
    ) -> np.ndarray:
        """Record-level linearized scores z (n x k) whose PSU totals give the Taylor variance:
        z = w y for totals, z = w (y - ybar) / W for means (taylor_variance(z) is V)."""
        y = self._matrix(_as_list(cols)).full()
        if estimator == "total":
            return self.w[:, None] * y
        W = self.w.sum()
        return self.w[:, None] * (y - (self.w @ y) / W) / W

    # ------------------------------------------------------------ creating replicate weights
    def _replicates_fpc(self, method: str) -> None:
        """Replicates of a design with an fpc, as R's as.svrepdesign: bootstrap (R rescales
        its resampling) and jk1 of several strata refused, brr and fay drop it (a warning)."""
        if method == "bootstrap":
            raise DesignError(
                "with_replicates: bootstrap replicates do not take an fpc here; use jkn"
            )
        if method == "jk1" and len(self.n_h) > 1:
            raise DesignError("with_replicates: jk1 with an fpc needs one stratum; use jkn")
        if method in ("brr", "fay"):
            warnings.warn(
                f"with_replicates: {method} ignores the fpc (as R's as.svrepdesign)", stacklevel=3
            )

    def with_replicates(
        self,
        method: ReplicateMethod,
        rho: float | None = None,
        seed: int | np.random.Generator | None = None,
        n_replicates: int | None = None,
        prefix: str = "rw_",
    ) -> pd.DataFrame:
        """New replicate weight columns for this design (attrs: method, rho, rscales). With an
        fpc, as R's as.svrepdesign: jkn and jk1 (one stratum) rscales times 1 - f_h; brr and
        fay drop it (a warning); bootstrap (R rescales its resampling) refuses it."""
        if self.strata is None and method in ("brr", "fay"):
            raise DesignError(f"{method} replicate weights need strata")
        if self.N_h is not None:
            self._replicates_fpc(method)
        w = self.w
        G, H = self.n_psu, len(self.n_h)
        if method == "jkn":
            if (self.n_h < 2).any():
                raise DesignError(
                    f"jkn: strata {self._labels(self.n_h < 2)} have a single PSU; collapse them"
                )
            f = np.ones((self.n, G))
            starts = np.r_[0, np.cumsum(self.n_h.astype(int))]  # PSUs are sorted by stratum
            order = np.argsort(self.h, kind="stable")
            bounds = np.r_[0, np.cumsum(np.bincount(self.h, minlength=H))]
            for hh in range(H):  # other PSUs of the deleted PSU's stratum: n_h / (n_h - 1)
                rows = order[bounds[hh] : bounds[hh + 1]]
                f[rows, starts[hh] : starts[hh + 1]] = self.n_h[hh] / (self.n_h[hh] - 1.0)
            f[np.arange(self.n), self.g] = 0.0
            rscales = (self.n_h[self.psu_h] - 1.0) / self.n_h[self.psu_h]
            if self.N_h is not None:  # R's jknweights: (1 - f_h) (n_h - 1) / n_h
                rscales = self._q1[self.psu_h] * rscales
        elif method == "jk1":
            f = np.full((self.n, G), G / (G - 1.0))
            f[np.arange(self.n), self.g] = 0.0
            rscales = np.full(G, (G - 1.0) / G)
            if self.N_h is not None:  # R's jk1weights: (1 - f) (n - 1) / n
                rscales = self._q1[0] * rscales
        elif method in ("brr", "fay"):
            if (self.n_h != 2).any():
                raise DesignError(
                    f"{method} needs exactly 2 PSUs per stratum; strata {self._labels(self.n_h != 2)} "
                    f"of column '{self.strata}' do not have 2: use method='jkn', or pair the PSUs"
                )
            r_fay = 0.0 if method == "brr" else float(rho if rho is not None else 0.3)
            had = hadamard_for(H)
            R = had.shape[0]
            had = had[:, 1 : H + 1] if R > H else had  # skip the column of ones when R > H
            first = np.zeros(G, dtype=bool)
            first[np.r_[0, np.flatnonzero(np.diff(self.psu_h)) + 1]] = (
                True  # first PSU of each stratum
            )
            sign = np.where(first, 1, -1)[None, :] * had[:, self.psu_h]  # R x G
            fpsu = np.where(sign > 0, 2.0 - r_fay, r_fay)
            f = fpsu.T[self.g]  # n x R
            rscales = np.full(R, 1.0 / (R * (1.0 - r_fay) ** 2))
            rho = r_fay
        elif method == "bootstrap":
            rng = seed if isinstance(seed, np.random.Generator) else np.random.default_rng(seed)
            R = n_replicates or 100
            m = np.zeros((R, G))
            starts = np.r_[0, np.cumsum(self.n_h.astype(int))]
            for hh in range(H):  # Rao-Wu: n_h - 1 PSUs drawn with replacement per stratum
                k = int(self.n_h[hh])
                draws = rng.integers(0, k, size=(R, k - 1))
                for j in range(k):
                    m[:, starts[hh] + j] = (draws == j).sum(axis=1) * k / (k - 1.0)
            f = m.T[self.g]
            rscales = np.full(R, 1.0 / R)
        else:
            raise DesignError(
                f"with_replicates: method must be one of jkn, jk1, brr, fay, bootstrap, not {method!r}"
            )
        out = pd.DataFrame(
            w[:, None] * f,
            index=self.df.index,
            columns=[f"{prefix}{i + 1:03d}" for i in range(f.shape[1])],
        )
        out.attrs.update(
            {"method": method, "rho": rho, "rscales": np.asarray(rscales, dtype=float)}
        )
        return out
