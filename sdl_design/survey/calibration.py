"""Calibration of survey weights (MASSC Step IV, Singh 2009 section 4; Deville and Sarndal 1992).

Calibrated weights w_k g_k meet control totals T: sum_k w_k g_k x_k = T, with g_k = F(x_k' lambda)
and the Lagrange multipliers lambda found by Newton's method:
- "linear": F(u) = 1 + u (GREG, chi-square distance; one Newton step is the closed form),
- "raking": F(u) = exp(u) (multiplicative; the fixed point of iterative proportional fitting),
- "logit": bounded logit, the Folsom-Singh generalized exponential model with centre 1,
  F(u) = [L(U - 1) + U(1 - L) e^{Au}] / [(U - 1) + (1 - L) e^{Au}], A = (U - L)/((1 - L)(U - 1)),
  so that L < g < U,
- "poststratify": one categorical margin, g = N_c / Nhat_c.

Records with the same auxiliary vector x share g, so the solver works on distinct profiles of
x (aggregated weights) when every control is categorical, and on records otherwise. The design
matrix is built once and shared by the full weight and all replicate weights.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd
import scipy.linalg
import scipy.linalg.lapack
import scipy.sparse
from scipy.optimize import linprog

from sdl_design.codes import factorize
from sdl_design.keys import MISSING, key_frame
from sdl_design.spec import KeySpec
from sdl_design.survey.blocksum import group_sum, group_sums
from sdl_design.survey.design import dense_codes, first_of

METHODS = ("linear", "raking", "logit", "poststratify")
TOL = 1e-8  # relative tolerance to which every control total must be met
_SPARSE_AT = 200  # categorical controls with more categories than this: X held sparse
_NEWTON_TOL = 1e-12
_MAX_ITER = 100


class CalibrationError(ValueError):
    """Bad calibration input; the message names the column or control and the fix."""


class CalibrationInfeasible(CalibrationError):
    """The control totals cannot be reached within the bounds: says which control, by how much."""


# ---------------------------------------------------------------- design matrix


class _Dense:
    """Auxiliary matrix X (m x p): the profiles of categorical controls, held densely, or as a
    scipy CSR matrix when there are many categories (one nonzero per margin and profile)."""

    def __init__(self, X: np.ndarray | scipy.sparse.csr_matrix) -> None:
        self.X = X
        self.m, self.p = X.shape
        self.sparse = scipy.sparse.issparse(X)

    def matvec(self, lam: np.ndarray) -> np.ndarray:
        return self.X @ lam

    def rmatvec(self, a: np.ndarray) -> np.ndarray:
        return self.X.T @ a

    def gram(self, v: np.ndarray) -> np.ndarray:
        if self.sparse:
            return (self.X.T @ self.X.multiply(v[:, None]).tocsr()).toarray()
        return self.X.T @ (self.X * v[:, None])

    def abs_rmatvec(self, a: np.ndarray) -> np.ndarray:
        return abs(self.X).T @ np.abs(a)

    def weighted_rows(self, w: np.ndarray) -> scipy.sparse.csr_matrix:
        """(X * w)' as a sparse p x m matrix (for the feasibility LP)."""
        if self.sparse:
            return scipy.sparse.csr_matrix(self.X.multiply(w[:, None]).T)
        return scipy.sparse.csr_matrix((self.X * w[:, None]).T)


class _Structured:
    """X = [one-hot profile columns, numeric columns] on records, never formed: profile matrix
    Xc (K x pc), the profile of each record and the numeric columns Z (n x q). Products cost
    O(n q^2) through bincounts instead of O(n p^2)."""

    def __init__(self, Xc: np.ndarray, inverse: np.ndarray, Z: np.ndarray) -> None:
        self.Xc, self.inverse, self.Z = Xc, inverse, Z
        self.K, self.pc = Xc.shape
        self.m, self.p = len(inverse), self.pc + Z.shape[1]

    def _by_profile(self, a: np.ndarray) -> np.ndarray:
        return np.bincount(self.inverse, weights=a, minlength=self.K)

    def matvec(self, lam: np.ndarray) -> np.ndarray:
        return (self.Xc @ lam[: self.pc])[self.inverse] + self.Z @ lam[self.pc :]

    def rmatvec(self, a: np.ndarray) -> np.ndarray:
        return np.concatenate([self.Xc.T @ self._by_profile(a), self.Z.T @ a])

    def gram(self, v: np.ndarray) -> np.ndarray:
        vk = self._by_profile(v)
        Zv = self.Z * v[:, None]
        B = np.column_stack([self._by_profile(Zv[:, j]) for j in range(self.Z.shape[1])])
        top = np.hstack([self.Xc.T @ (self.Xc * vk[:, None]), self.Xc.T @ B])
        bottom = np.hstack([(self.Xc.T @ B).T, self.Z.T @ Zv])
        return np.vstack([top, bottom])

    def abs_rmatvec(self, a: np.ndarray) -> np.ndarray:
        a = np.abs(a)
        return np.concatenate([self.Xc.T @ self._by_profile(a), np.abs(self.Z).T @ a])

    def weighted_rows(self, w: np.ndarray) -> scipy.sparse.csr_matrix:
        n = self.m
        onehot = scipy.sparse.csr_matrix(
            (w, (self.inverse, np.arange(n))), shape=(self.K, n)
        )  # profile indicator times w
        cat = scipy.sparse.csr_matrix(self.Xc.T) @ onehot
        num = scipy.sparse.csr_matrix((self.Z * w[:, None]).T)
        return scipy.sparse.vstack([cat, num]).tocsr()


@dataclass
class _Design:
    """The auxiliary variables: categorical profiles Xc (K x pc), the profile of each record,
    numeric controls Z (n x q); labels in the order of X's columns (categorical first)."""

    Xc: np.ndarray
    inverse: np.ndarray
    Z: np.ndarray
    labels: list[tuple[str, Any]]  # (column, category) or (column, None) for a numeric total
    margins: dict[str, list[Any]]  # categorical column -> categories (columns of Xc)

    @property
    def on_profiles(self) -> bool:
        """No numeric control: records of one profile share g, solve on aggregated weights."""
        return self.Z.shape[1] == 0

    def problem(self) -> _Dense | _Structured:
        if self.on_profiles:
            return _Dense(self.Xc)
        return _Structured(self.Xc, self.inverse, self.Z)

    def aggregate(self, w: np.ndarray) -> np.ndarray:
        """Profile sums of weights (n,) or (n, R) when solving on profiles; else w itself."""
        if not self.on_profiles:
            return w
        K = self.Xc.shape[0]  # block sums in record order (sdl_design.survey.blocksum)
        if w.ndim == 1:
            return group_sum(self.inverse, w, K, len(self.inverse))
        return group_sums(self.inverse, w, K)

    def expand(self, g: np.ndarray) -> np.ndarray:
        return g[self.inverse] if self.on_profiles else g

    def target(self, totals: Mapping[str, Any]) -> np.ndarray:
        """Vector T of the control totals in the order of X's columns (checked against the data)."""
        missing = [c for c in self.margins if c not in totals]
        missing += [c for c, v in self.labels if v is None and c not in totals]
        if missing:
            raise CalibrationError(f"no control total for {sorted(set(missing))}; add them")
        T = np.empty(len(self.labels))
        for j, (col, cat) in enumerate(self.labels):
            if cat is None:
                T[j] = float(totals[col])
            elif cat in totals[col]:
                T[j] = float(totals[col][cat])
            else:
                raise CalibrationError(
                    f"control '{col}': data category {cat!r} has no control total; add it"
                )
        for col, cats in self.margins.items():
            extra = {c: float(v) for c, v in totals[col].items() if c not in set(cats)}
            bad = {c: v for c, v in extra.items() if v != 0.0}
            if bad:
                raise CalibrationError(
                    f"control '{col}': categories {sorted(map(str, bad))} have totals "
                    f"{list(bad.values())} but no record in the data; recode '{col}' so the "
                    "data has them, or drop them from the totals"
                )
        sums = {c: float(sum(float(v) for v in totals[c].values())) for c in self.margins}
        if sums and max(sums.values()) - min(sums.values()) > TOL * max(
            abs(v) for v in sums.values()
        ):
            raise CalibrationError(
                f"the margins sum to different population totals {sums}; give margins of the "
                "same population"
            )
        return T


def _is_margin(t: Any) -> bool:
    return isinstance(t, Mapping)


def _margin_codes(s: pd.Series) -> tuple[np.ndarray, list]:
    """Codes and sorted categories of a margin column; a missing value is a category of its own
    (MISSING, the missing-value policy), in the control totals and in the calibrated file alike."""
    code, cats = factorize(s, sort=True, use_na_sentinel=False)
    return code, [MISSING if pd.isna(c) else c for c in cats]


def _unique_first_inverse(key: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """np.unique(key, return_index=True, return_inverse=True)[1:] of non-negative integer
    codes (design.dense_codes: by a count when their range is small, no sort)."""
    _, inverse = dense_codes(key)
    return first_of(inverse, int(inverse.max(initial=-1)) + 1), inverse


def _design(df: pd.DataFrame, totals: Mapping[str, Any]) -> _Design:
    """One column of X per category of each margin and one per numeric total."""
    if not totals:
        raise CalibrationError("totals is empty; give at least one control")
    missing = [c for c in totals if c not in df.columns]
    if missing:
        raise CalibrationError(
            f"control columns {missing} are not in the data (columns: {list(df.columns)[:20]})"
        )
    labels, nlabels, margins, codes, sizes, nums = [], [], {}, [], [], []
    for col, t in totals.items():
        s = df[col]
        n_na = int(s.isna().sum())
        if n_na and not _is_margin(t):
            raise CalibrationError(
                f"control column '{col}' has {n_na} missing values; a numeric total needs "
                "every value (calibrate to its categories, or impute)"
            )
        if _is_margin(t):
            code, cats = _margin_codes(s)
            absent = [c for c in cats if c not in t]
            if absent:
                raise CalibrationError(
                    f"control '{col}': data categories {sorted(map(str, absent))} have no "
                    f"control total (totals give {sorted(map(str, t))}); add them to the totals "
                    "or recode the column"
                )
            margins[col] = cats
            labels += [(col, c) for c in cats]
            # in the narrowest integer type (a margin's codes per record, kept to the end)
            codes.append(code.astype(np.min_scalar_type(max(len(cats) - 1, 0))))
            sizes.append(len(cats))
        else:
            if not pd.api.types.is_numeric_dtype(s):
                raise CalibrationError(
                    f"control '{col}' has a single total but is not numeric; give a margin "
                    "{category: total} instead"
                )
            nlabels.append((col, None))
            nums.append(s.to_numpy(dtype=float))
    n = len(df)
    Z = np.column_stack(nums) if nums else np.zeros((n, 0))
    if not codes:
        return _Design(np.zeros((1, 0)), np.zeros(n, dtype=np.intp), Z, nlabels, margins)
    if np.prod(np.array(sizes, dtype=float)) < 2.0**62:  # mixed radix profile code
        key = np.zeros(n, dtype=np.int64)
        for code, m in zip(codes, sizes, strict=True):
            key = key * m + code
        first, inverse = _unique_first_inverse(key)
    else:
        _, first, inverse = np.unique(
            np.column_stack([c.astype(np.intp) for c in codes]),
            axis=0,
            return_index=True,
            return_inverse=True,
        )
    Xc = _profile_matrix(np.stack([code[first] for code in codes], axis=1), sizes, not nums)
    return _Design(Xc, inverse.ravel().astype(np.intp), Z, labels + nlabels, margins)


def _profile_matrix(
    codes: np.ndarray, sizes: Sequence[int], may_be_sparse: bool
) -> np.ndarray | scipy.sparse.csr_matrix:
    """Xc of the profiles (codes: profiles x margins, each margin's category code): one column
    per category of each margin, one 1 per margin and profile; CSR when there are many."""
    K, p = len(codes), int(sum(sizes))
    offsets = np.cumsum([0, *sizes[:-1]])
    cols = codes.astype(np.intp) + offsets.astype(np.intp)
    if may_be_sparse and p > _SPARSE_AT:  # many categories: X as CSR (profiles x p)
        rows = np.repeat(np.arange(K), codes.shape[1])
        return scipy.sparse.csr_matrix((np.ones(rows.size), (rows, cols.ravel())), shape=(K, p))
    Xc = np.zeros((K, p))
    for j in range(codes.shape[1]):
        Xc[np.arange(K), cols[:, j]] = 1.0
    return Xc


def profile_design(
    codes: np.ndarray,
    margins: Mapping[str, list[Any]],
    numeric: Mapping[str, np.ndarray] | None = None,
) -> _Design:
    """The design of controls from their distinct profiles alone (codes: profiles x margins, in
    the order of margins: {column: categories}, codes into them; numeric: {column: each
    profile's value} of numeric totals, whose distinct values the profiles tell apart): the
    design _design builds from records whose profiles these are, for solving on profile sums
    (records of one profile share every column of X, so they share g)."""
    sizes = [len(c) for c in margins.values()]
    labels = [(col, c) for col, cats in margins.items() for c in cats]
    codes = np.asarray(codes).reshape(len(codes), len(sizes))
    Xc = _profile_matrix(codes, sizes, not numeric)
    if numeric:
        Xc = np.column_stack([Xc, *(np.asarray(v, dtype=float) for v in numeric.values())])
        labels += [(col, None) for col in numeric]
    return _Design(Xc, np.zeros(0, dtype=np.intp), np.zeros((0, 0)), labels, dict(margins))


# ---------------------------------------------------------------- distance functions


def _family(method: str, bounds: tuple[float, float] | None):
    """(F, F') of the calibration function g = F(u)."""
    if method == "linear":
        return (lambda u: 1.0 + u), (lambda u, g: np.ones_like(u))
    if method == "raking":
        return (lambda u: np.exp(np.minimum(u, 700.0))), (lambda u, g: g)
    if method == "logit":
        L, U = bounds  # type: ignore[misc]
        A = (U - L) / ((1.0 - L) * (U - 1.0))

        def F(u: np.ndarray) -> np.ndarray:
            # Folsom-Singh GEM with centre 1 (exponent clipped: g is L or U to 1e-200 there)
            e = np.clip(u, -460.0 / A, 460.0 / A)
            e *= A
            np.exp(e, out=e)
            return (L * (U - 1.0) + U * (1.0 - L) * e) / ((U - 1.0) + (1.0 - L) * e)

        def dF(u: np.ndarray, g: np.ndarray) -> np.ndarray:
            return A * (g - L) * (U - g) / (U - L)  # F'(u); F'(0) = 1

        return F, dF
    raise CalibrationError(f"method '{method}' unknown; use one of {METHODS}")


def _check_bounds(method: str, bounds: Any) -> tuple[float, float] | None:
    if bounds is None:
        if method == "logit":
            raise CalibrationError(
                "method 'logit' needs bounds (L, U) with 0 < L < 1 < U, e.g. (0.5, 2.0)"
            )
        return None
    L, U = (float(b) for b in bounds)
    if not 0.0 < L < 1.0 < U:
        raise CalibrationError(f"bounds ({L}, {U}) must satisfy 0 < L < 1 < U")
    return L, U


# ---------------------------------------------------------------- solver


def _scale(P: _Dense | _Structured, wp: np.ndarray, T: np.ndarray) -> np.ndarray:
    return np.maximum(np.maximum(np.abs(T), P.abs_rmatvec(wp)), 1e-300)


def _independent(G: np.ndarray) -> np.ndarray:
    """Columns of X with linearly independent weighted columns, from the Gram matrix G = X'|W|X:
    pivoted Cholesky of G (LAPACK dpstrf, diagonal pivoting) picks the columns that pivoted QR of
    |W|^1/2 X picks, stopping at a remaining pivot of 1e-12 on the scale of unit columns."""
    dg = np.diag(G)
    nz = np.flatnonzero(dg > 0)  # an empty category or all-zero column carries nothing
    if len(nz) == 0:
        return nz
    Gn = G[np.ix_(nz, nz)] / np.sqrt(np.outer(dg[nz], dg[nz]))  # unit columns
    _, piv, rank, info = scipy.linalg.lapack.dpstrf(Gn, tol=1e-12)
    if info < 0:
        raise CalibrationError(f"pivoted Cholesky failed (LAPACK dpstrf info {info})")
    return np.sort(nz[piv[:rank] - 1])


def _newton(
    P: _Dense | _Structured,
    wp: np.ndarray,
    T: np.ndarray,
    method: str,
    bounds: Any,
    warm: dict | None = None,
) -> tuple[np.ndarray | None, float]:
    """g on the rows of P meeting sum wp g x = T, or (None, misfit) when Newton does not.
    warm: {"lam": multipliers} to start from (a previous replicate's), updated on success."""
    F, dF = _family(method, bounds)
    scale = _scale(P, wp, T)
    # independent columns (categorical margins overlap in the intercept; empty categories)
    keep = _independent(P.gram(np.abs(wp)))
    lam = np.zeros(P.p)
    if warm is not None and warm.get("lam") is not None and method != "linear":
        lam[keep] = warm["lam"][keep]
    u = P.matvec(lam)
    g = F(u)
    misfit = np.inf
    r = (T - P.rmatvec(wp * g))[keep]  # the calibration equations sum w g x = T
    for _ in range(_MAX_ITER):
        misfit = float(np.max(np.abs(r) / scale[keep])) if len(r) else 0.0
        if misfit < _NEWTON_TOL:
            break
        J = P.gram(wp * dF(u, g))[np.ix_(keep, keep)]
        try:
            step = np.linalg.solve(J, r)
        except np.linalg.LinAlgError:
            step = np.linalg.lstsq(J, r, rcond=None)[0]
        if not np.all(np.isfinite(step)):
            break
        full = np.zeros(P.p)
        full[keep] = step
        t = 1.0
        for _ in range(40):  # step halving on the scaled misfit
            u_new = P.matvec(lam + t * full)
            g_new = F(u_new)
            r_new = (T - P.rmatvec(wp * g_new))[keep]
            if method == "linear" or float(np.max(np.abs(r_new) / scale[keep])) < misfit:
                break
            t *= 0.5
        else:
            break
        lam, u, g, r = lam + t * full, u_new, g_new, r_new
    misfit = float(np.max(np.abs(T - P.rmatvec(wp * g)) / scale))  # all controls, dropped too
    if misfit > TOL or not np.all(np.isfinite(g)):
        return None, misfit
    if warm is not None:
        warm["lam"] = lam
    return g, misfit


def _poststratify(X: np.ndarray, wp: np.ndarray, T: np.ndarray) -> np.ndarray | None:
    """g = N_c / Nhat_c on the one margin (X one-hot)."""
    Nhat = X.T @ wp
    ok = (Nhat != 0) | (T == 0)
    if not ok.all():
        return None
    ratio = np.divide(T, Nhat, out=np.ones_like(T), where=Nhat != 0)
    return X @ ratio


def _diagnose(
    P: _Dense | _Structured, wp: np.ndarray, T: np.ndarray, labels: list, lo: float, hi: Any
) -> str:
    """LP: the closest totals reachable with g in [lo, hi]; names the control furthest off."""
    scale = _scale(P, wp, T)
    active = np.flatnonzero(wp != 0)
    A = scipy.sparse.diags(1.0 / scale) @ P.weighted_rows(wp)[:, active]
    K, p = A.shape[1], A.shape[0]
    eye = scipy.sparse.identity(p)
    c = np.concatenate([np.zeros(K), np.ones(2 * p)])
    res = linprog(
        c,
        A_eq=scipy.sparse.hstack([A, eye, -eye]).tocsr(),
        b_eq=T / scale,
        bounds=[(lo, hi)] * K + [(0, None)] * (2 * p),
        method="highs",
    )
    if res.status != 0:
        return f"the feasibility LP failed ({res.message})"
    dev = (res.x[K : K + p] - res.x[K + p :]) * scale  # T - reachable
    j = int(np.argmax(np.abs(dev) / scale))
    col, cat = labels[j]
    name = col if cat is None else f"{col}={cat}"
    where = f"g in [{lo}, {hi}]" if hi is not None else "g > 0"
    if abs(dev[j]) <= TOL * scale[j]:
        return (
            f"the totals are reachable only at the edge of {where} (control '{name}' is "
            "tight); widen the bounds"
        )
    reach = T[j] - dev[j]
    rel = dev[j] / T[j] if T[j] != 0 else np.inf
    return (
        f"control '{name}' has total {T[j]:.6g} but the closest total reachable with {where} "
        f"is {reach:.6g} (off by {dev[j]:.6g}, {rel:.2%}); widen the bounds, merge sparse "
        "categories, or drop the control"
    )


def _solve(
    d: _Design,
    wp: np.ndarray,
    T: np.ndarray,
    method: str,
    bounds: Any,
    warm: dict | None = None,
    explain: bool = True,
) -> tuple[np.ndarray | None, str]:
    """g on the rows of d.problem() (profiles or records), or None and the reason (the
    feasibility LP that names the control furthest off runs only when explain)."""
    if method == "poststratify":
        if len(d.margins) != 1 or not d.on_profiles:
            raise CalibrationError(
                "method 'poststratify' takes one categorical margin; cross the variables into "
                "one column, or use 'raking' or 'logit' for several margins"
            )
        g = _poststratify(d.Xc, wp, T)
        if g is None:
            empty = [d.labels[j] for j in np.flatnonzero((d.Xc.T @ wp == 0) & (T != 0))]
            return None, f"post-strata {empty} have no weight but a nonzero total; merge them"
    else:
        P = d.problem()
        g, misfit = _newton(P, wp, T, method, bounds, warm)
        if g is None:
            if method == "linear":
                return None, f"the controls are inconsistent (relative misfit {misfit:.3g})"
            lo, hi = bounds if method == "logit" else (0.0, None)
            return None, _diagnose(P, wp, T, d.labels, lo, hi) if explain else "infeasible"
    if bounds is not None and method != "logit":  # bounds are checked, not enforced
        w_ = wp != 0
        gmin, gmax = float(g[w_].min()), float(g[w_].max())
        if gmin < bounds[0] - 1e-12 or gmax > bounds[1] + 1e-12:
            return None, (
                f"'{method}' gives factors g in [{gmin:.4g}, {gmax:.4g}], outside the bounds "
                f"{tuple(bounds)}; use method 'logit' to enforce them, or widen them"
            )
    return g, ""


# ---------------------------------------------------------------- public API


def _weights(df: pd.DataFrame, weight: Any) -> np.ndarray:
    if isinstance(weight, str):
        if weight not in df.columns:
            raise CalibrationError(f"weight column '{weight}' is not in the data")
        w = df[weight].to_numpy(dtype=float)
    else:
        w = np.asarray(weight, dtype=float)
        if w.shape != (len(df),):
            raise CalibrationError(f"weight has shape {w.shape}, expected ({len(df)},)")
    if not np.all(np.isfinite(w)):
        raise CalibrationError("weight has missing or infinite values")
    return w


def calibrate(
    df: pd.DataFrame,
    weight: str | np.ndarray,
    totals: Mapping[str, Any],
    method: str = "logit",
    bounds: tuple[float, float] | None = None,
    explain: bool = True,
) -> pd.Series:
    """Calibrated weights (a Series aligned with df). totals: {column: {category: total}} for a
    categorical margin, {column: total} for a numeric control. method: linear, raking, logit
    (bounds (L, U) required, 0 < L < 1 < U, enforced), poststratify (one margin). For linear and
    raking, bounds are checked afterwards. Raises CalibrationInfeasible when the totals cannot be
    met, naming the control and the gap (explain=False: without the feasibility LP that
    finds it)."""
    if method not in METHODS:
        raise CalibrationError(f"method '{method}' unknown; use one of {METHODS}")
    bounds = _check_bounds(method, bounds)
    w = _weights(df, weight)
    d = _design(df, totals)
    g = calibrate_profiles(d, d.aggregate(w), totals, method, bounds, explain)
    name = weight if isinstance(weight, str) else "weight"
    return pd.Series(w * d.expand(g), index=df.index, name=name)


def calibrate_profiles(
    d: _Design,
    wp: np.ndarray,
    totals: Mapping[str, Any],
    method: str = "logit",
    bounds: tuple[float, float] | None = None,
    explain: bool = True,
) -> np.ndarray:
    """The factors g on d's rows (profiles, or records with a numeric control) from the sums
    wp of the weight on them (d.aggregate), as calibrate finds them; CalibrationInfeasible
    when the totals cannot be met."""
    if method not in METHODS:
        raise CalibrationError(f"method '{method}' unknown; use one of {METHODS}")
    bounds = _check_bounds(method, bounds)
    g, why = _solve(d, wp, d.target(totals), method, bounds, explain=explain)
    if g is None:
        raise CalibrationInfeasible(f"calibration ({method}) failed: {why}")
    return g


def control_totals(
    df: pd.DataFrame, weight: str | Sequence[str], controls: Sequence[str | KeySpec]
) -> Any:
    """Control totals of the (original) file: a margin {category: weighted count} for a
    categorical (or recoded KeySpec) column, the weighted sum for a numeric one. weight: one
    column (returns one dict) or a list of columns, e.g. replicate weights (returns a list;
    the controls are coded once)."""
    many = not isinstance(weight, str)
    wcols = list(weight) if many else [weight]
    missing = [c for c in wcols if c not in df.columns]
    if missing:
        raise CalibrationError(f"weight columns {missing[:5]} are not in the data")
    if not all(np.isfinite(df[c].to_numpy(dtype=float)).all() for c in wcols):
        raise CalibrationError(f"weights {wcols[:5]} have missing or infinite values")
    specs = [KeySpec(name=c) if isinstance(c, str) else c for c in controls]
    missing = [k.name for k in specs if k.name not in df.columns]
    if missing:
        raise CalibrationError(f"control columns {missing} are not in the data")
    kf = key_frame(df, specs)
    out: list[dict[str, Any]] = [{} for _ in wcols]
    parts = []  # per control: its values (numeric total) or its category indicator and labels
    for k in specs:
        s = kf[k.name]
        if k.bins is None and k.map is None and pd.api.types.is_numeric_dtype(s):
            if s.isna().any():
                raise CalibrationError(
                    f"control column '{k.name}' has missing values; a numeric total needs every "
                    "value (give it bins, or impute)"
                )
            parts.append((k.name, s.to_numpy(dtype=float), None))
        else:
            code, cats = _margin_codes(s)
            parts.append((k.name, code, cats))
    # the weights a block of columns at a time (no copy of all replicates); a category's sums
    # are block sums in record order (sdl_design.survey.blocksum: the same bits by partition). A
    # numeric total (a BLAS product, whose summation may depend on the shape) reads them all
    # at once.
    block = len(wcols) if any(cats is None for _, _, cats in parts) else 16
    for a in range(0, len(wcols), block):
        W = df[wcols[a : a + block]].to_numpy(dtype=float)
        for name, x, cats in parts:
            if cats is None:
                v = x @ W
                for i in range(W.shape[1]):
                    out[a + i][name] = float(v[i])
            else:
                sums = group_sums(x, W, len(cats))  # (categories, weights)
                for i in range(W.shape[1]):
                    out[a + i][name] = {c: float(v) for c, v in zip(cats, sums[:, i], strict=True)}
    return out if many else out[0]


def calibrate_replicates(
    df: pd.DataFrame,
    replicate_cols: Sequence[str],
    totals_per_replicate: Sequence[Mapping[str, Any]] | Mapping[str, Mapping[str, Any]],
    method: str = "logit",
    bounds: tuple[float, float] | None = None,
    policy: str = "widen",
    chunk: int = 16,
    factor: np.ndarray | None = None,
    values: Callable[[list[str]], np.ndarray] | None = None,
) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Each replicate weight calibrated to its own controls (a list aligned with replicate_cols,
    or a dict keyed by column). An infeasible replicate is widened (bounds divided/multiplied
    by 1.25 until it calibrates) or raked, per policy; the report says which and with which
    bounds. Zero replicate weights stay zero. factor: each record's replicate weights are
    multiplied by it first (read a chunk at a time: no second copy of all of them). values:
    reads replicate columns of df's records ((records, columns) array, read before the next
    call: it may be a buffer the caller fills again; default df[columns]), so that df may hold
    only the controls. Returns (replicate weights, report)."""
    if method not in METHODS:
        raise CalibrationError(f"method '{method}' unknown; use one of {METHODS}")
    if policy not in ("widen", "rake"):
        raise CalibrationError(f"policy '{policy}' unknown; use 'widen' or 'rake'")
    bounds = _check_bounds(method, bounds)
    reps = list(replicate_cols)
    if isinstance(totals_per_replicate, Mapping):
        per = [totals_per_replicate[c] for c in reps]
    else:
        per = list(totals_per_replicate)
    if len(per) != len(reps):
        raise CalibrationError(
            f"{len(per)} sets of replicate totals for {len(reps)} replicate columns"
        )
    missing = [c for c in reps if c not in df.columns] if values is None else []
    if missing:
        raise CalibrationError(f"replicate columns {missing[:5]} are not in the data")
    if values is None:
        values = lambda cols: df[cols].to_numpy(dtype=float)  # noqa: E731
    if not reps:
        return pd.DataFrame(index=df.index), pd.DataFrame(
            columns=["replicate", "status", "lower", "upper", "g_min", "g_max"]
        )
    d = _design(df, _union_totals(per))  # one X for all replicates
    # replicates x records: the frame's one float block, so designs read it in place
    out = np.empty((len(reps), len(df)))
    rows = []
    warm: dict = {}  # Newton starts from the previous replicate's multipliers
    f = None if factor is None else np.asarray(factor, dtype=float)[:, None]
    scaled = None  # one buffer for every chunk's W * factor (a new one per chunk: page faults)
    for start in range(0, len(reps), chunk):
        cols = reps[start : start + chunk]
        W = values(cols)
        if f is not None:
            if scaled is None:
                scaled = np.empty((len(W), min(chunk, len(reps))), order="F")
            W = np.multiply(W, f, out=scaled[:, : len(cols)])  # W may be the caller's buffer
        if not np.all(np.isfinite(W)):
            raise CalibrationError(f"replicate weights {cols} have missing or infinite values")
        Wp = d.aggregate(W)
        for i, c in enumerate(cols):
            g, row = replicate_factors(d, Wp[:, i], per[start + i], c, method, bounds, policy, warm)
            rows.append(row)
            np.multiply(W[:, i], d.expand(g), out=out[start + i])
    return pd.DataFrame(out.T, index=df.index, columns=reps, copy=False), pd.DataFrame(rows)


def replicate_factors(
    d: _Design,
    wp: np.ndarray,
    totals: Mapping[str, Any],
    name: str,
    method: str,
    bounds: tuple[float, float] | None,
    policy: str,
    warm: dict,
) -> tuple[np.ndarray, dict[str, Any]]:
    """The factors g of one replicate weight (wp: its sums on d's rows, profiles or records)
    calibrated to its totals, by the policy when infeasible, and its report row (warm: Newton's
    start, the previous replicate's multipliers, updated)."""
    T = d.target(totals)
    g, why = _solve(d, wp, T, method, bounds, warm)
    status, used = "ok", bounds
    if g is None:
        g, status, used = _fallback(d, wp, T, method, bounds, policy)
        if g is None:
            raise CalibrationInfeasible(
                f"replicate '{name}' cannot be calibrated ({method}): {why}; the "
                f"'{policy}' policy did not help either"
            )
    nz = wp != 0
    return g, {
        "replicate": name,
        "status": status,
        "lower": used[0] if used else np.nan,
        "upper": used[1] if used else np.nan,
        "g_min": float(g[nz].min()) if nz.any() else np.nan,
        "g_max": float(g[nz].max()) if nz.any() else np.nan,
    }


def _union_totals(per: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Totals whose margins hold every category of every replicate (for building X once)."""
    u: dict[str, Any] = {}
    for t in per:
        for col, v in t.items():
            if _is_margin(v):
                u.setdefault(col, {}).update({k: 1.0 for k in v})
            else:
                u[col] = 1.0
    return u


def _fallback(
    d: _Design, wp: np.ndarray, T: np.ndarray, method: str, bounds: Any, policy: str
) -> tuple[np.ndarray | None, str, Any]:
    """Policy for an infeasible replicate: widen the bounds geometrically, or rake. Widening
    starts only when raking (g > 0 unbounded) reaches the totals: otherwise no bounds can."""
    g, _ = _solve(d, wp, T, "raking", None, explain=False)
    if policy == "rake" or bounds is None or g is None:
        return g, "raked" if g is not None else "failed", None
    L, U = bounds
    for k in range(1, 41):
        b = (L / 1.25**k, U * 1.25**k)
        g, _ = _solve(d, wp, T, method, b, explain=False)
        if g is not None:
            return g, "widened", b
    return None, "failed", None
