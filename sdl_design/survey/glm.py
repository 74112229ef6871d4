"""Survey-weighted GLMs: a formula parser for `y ~ a + C(b) + c`, IRLS, design-based SEs.

The fit is R survey's svyglm: maximum (pseudo-)likelihood with the design weight as prior
weight (binomial is quasibinomial there; the coefficients are the same), the Taylor variance
A^-1 B A^-1 with A the weighted Fisher information and B the design covariance of the score
totals (svy.varcoef: svyrecvar of model.matrix * working residual * working weight), and the
replicate variance of refits with each replicate weight, centred on the full-sample fit.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

import numpy as np
import pandas as pd
import scipy.sparse as sp
from scipy.linalg import solve_triangular

from sdl_design.survey.design import dense_codes, distinct_rows, group_indicator

if TYPE_CHECKING:
    from sdl_design.survey.design import SurveyDesign

Family = Literal["gaussian", "binomial"]
FAMILIES = ("gaussian", "binomial")

_NAME = r"[A-Za-z_][A-Za-z0-9_.]*"
_TERM = re.compile(rf"^(?:C\(\s*({_NAME})\s*\)|({_NAME}))$")


class FormulaError(ValueError):
    """A model formula that this parser does not read; the message shows the accepted form."""


@dataclass(frozen=True)
class Term:
    name: str
    categorical: bool  # written C(name); a non-numeric column is categorical either way


@dataclass(frozen=True)
class Formula:
    response: str
    terms: tuple[Term, ...]
    text: str = ""

    @property
    def variables(self) -> list[str]:
        return [self.response, *(t.name for t in self.terms)]


def parse_formula(text: str) -> Formula:
    """'y ~ a + C(b) + c' -> Formula: main effects only, an intercept always."""
    hint = "write 'y ~ a + C(b) + c' (main effects; C(b) for a categorical term)"
    if text.count("~") != 1:
        raise FormulaError(f"formula {text!r}: needs exactly one '~'; {hint}")
    lhs, rhs = (s.strip() for s in text.split("~"))
    if not re.fullmatch(_NAME, lhs):
        raise FormulaError(f"formula {text!r}: the response {lhs!r} is not a column name; {hint}")
    terms: list[Term] = []
    for part in (p.strip() for p in rhs.split("+")):
        if part == "1":
            continue
        m = _TERM.match(part)
        if not m:
            raise FormulaError(f"formula {text!r}: cannot read the term {part!r}; {hint}")
        name = m.group(1) or m.group(2)
        if name in (t.name for t in terms):
            raise FormulaError(f"formula {text!r}: term {name!r} appears twice")
        terms.append(Term(name, categorical=m.group(1) is not None))
    return Formula(lhs, tuple(terms), text)


def _is_categorical(term: Term, s: pd.Series) -> bool:
    return (
        term.categorical
        or isinstance(s.dtype, pd.CategoricalDtype)
        or not (pd.api.types.is_numeric_dtype(s) or pd.api.types.is_bool_dtype(s))
    )


def term_levels(formula: Formula, frames: Sequence[pd.DataFrame]) -> dict[str, list]:
    """Ordered levels of every categorical term over all frames: a Categorical's own category
    order (e.g. age bins), else sorted values; the first level is the reference."""
    out: dict[str, list] = {}
    for t in formula.terms:
        cols = [f[t.name] for f in frames]
        if not _is_categorical(t, cols[0]):
            continue
        seen = pd.unique(pd.concat([c.dropna().astype(object) for c in cols]))
        if isinstance(cols[0].dtype, pd.CategoricalDtype):
            present = set(seen)
            out[t.name] = [v for v in cols[0].cat.categories if v in present]
        else:
            out[t.name] = sorted(seen, key=lambda v: (isinstance(v, str), v))
    return out


def design_matrix(
    df: pd.DataFrame, formula: Formula, levels: dict[str, list]
) -> tuple[np.ndarray, np.ndarray, np.ndarray, list[str]]:
    """X (n x p: intercept, treatment dummies 'b[T.level]' against the first level, numeric
    terms as is), y, the complete-case mask and the column names. Rows with a missing value
    in y or a term (or a level outside `levels`) are zero in X and y and False in the mask."""
    n = len(df)
    y = pd.to_numeric(df[formula.response], errors="coerce").to_numpy(dtype=float)
    ok = np.isfinite(y)
    cols, names = [np.ones(n)], ["Intercept"]
    for t in formula.terms:
        s = df[t.name]
        if t.name in levels:
            lv = levels[t.name]
            codes = pd.Categorical(s.astype(object), categories=lv).codes
            ok &= codes >= 0
            for j, level in enumerate(lv[1:], start=1):
                cols.append((codes == j).astype(float))
                names.append(f"{t.name}[T.{level}]")
        else:
            x = pd.to_numeric(s, errors="coerce").to_numpy(dtype=float)
            ok &= np.isfinite(x)
            cols.append(x)
            names.append(t.name)
    X = np.column_stack(cols)
    X[~ok] = 0.0
    y = np.where(ok, y, 0.0)
    return X, y, ok, names


def independent_columns(gram: np.ndarray, tol: float = 1e-10) -> np.ndarray:
    """Columns kept in order by an incremental Cholesky of X'WX: a column whose residual sum of
    squares on the kept ones is <= tol times its own is aliased (R's NA coefficient)."""
    p = gram.shape[0]
    keep: list[int] = []
    L = np.zeros((p, p))
    for j in range(p):
        d = gram[j, j]
        if not d > 0:
            continue
        k = len(keep)
        c = solve_triangular(L[:k, :k], gram[keep, j], lower=True) if k else np.empty(0)
        r = d - c @ c
        if r > tol * d:
            L[k, :k], L[k, k] = c, np.sqrt(r)
            keep.append(j)
    return np.asarray(keep, dtype=np.int64)


def _logistic(eta: np.ndarray) -> np.ndarray:
    return 0.5 * (1.0 + np.tanh(0.5 * eta))  # 1 / (1 + exp(-eta)) without overflow


def _binomial_deviance(y: np.ndarray, mu: np.ndarray, w: np.ndarray) -> np.ndarray:
    """-2 sum w (y log mu + (1 - y) log(1 - mu)) per column of mu and w (y a vector)."""
    yy = y.reshape(-1, *([1] * (mu.ndim - 1)))
    with np.errstate(divide="ignore", invalid="ignore"):
        ll = np.where(yy > 0, yy * np.log(mu), 0.0) + np.where(
            yy < 1, (1 - yy) * np.log1p(-mu), 0.0
        )
    return -2.0 * (w * ll).sum(axis=0)


def weighted_gram(X: np.ndarray | sp.spmatrix, v: np.ndarray) -> np.ndarray:
    """X' diag(v) X; a sparse X with few columns goes densely a block of rows at a time (a
    p x p result: no scaled copy of X, no sparse product's temporaries)."""
    if sp.issparse(X):
        m, p = X.shape
        if p > 512:
            return np.asarray((X.T @ (sp.diags(v) @ X)).toarray())
        X = sp.csr_matrix(X)
        G = np.zeros((p, p))
        step = max(1, (1 << 21) // max(p, 1))  # ~16 MB of dense rows at a time
        for a in range(0, m, step):
            Xa = X[a : a + step].toarray()
            G += Xa.T @ (Xa * v[a : a + step, None])
        return G
    return X.T @ (X * v[:, None])


def irls(
    X: np.ndarray | sp.spmatrix,
    y: np.ndarray,
    w: np.ndarray,
    family: Family,
    start: np.ndarray | None = None,
    tol: float = 1e-12,
    max_iter: int = 100,
) -> tuple[np.ndarray, np.ndarray, bool, int]:
    """Weighted maximum likelihood (X dense or scipy sparse): beta, mu, converged, iterations.
    Gaussian identity: one weighted least-squares solve. Binomial logit: Newton steps (IRLS)
    from start (default 0), halved while the deviance rises, until its relative change
    |dev - dev_old| / (|dev| + 0.1) is below tol (R's glm criterion)."""
    if family == "gaussian":
        beta = np.linalg.solve(weighted_gram(X, w), X.T @ (w * y))
        return beta, X @ beta, True, 1
    if family != "binomial":
        raise ValueError(f"family must be one of {FAMILIES}, not {family!r}")
    beta = np.zeros(X.shape[1]) if start is None else np.asarray(start, dtype=float)
    mu = _logistic(X @ beta)
    dev = float(_binomial_deviance(y, mu, w))
    for it in range(1, max_iter + 1):
        step = np.linalg.solve(weighted_gram(X, w * mu * (1.0 - mu)), X.T @ (w * (y - mu)))
        t = 1.0
        for _ in range(30):
            b_new = beta + t * step
            mu_new = _logistic(X @ b_new)
            dev_new = float(_binomial_deviance(y, mu_new, w))
            if dev_new <= dev * (1 + 1e-12) + 1e-12:
                break
            t /= 2.0
        done = abs(dev - dev_new) / (abs(dev_new) + 0.1) < tol
        beta, mu, dev = b_new, mu_new, dev_new
        if done:
            return beta, mu, True, it
    return beta, mu, False, max_iter


# above this many terms X' diag(v) X is one matrix product per weight column (_grams)
GRAM_KHATRI_RAO_MAX_TERMS = 24


def _grams(X: np.ndarray, V: np.ndarray) -> np.ndarray:
    """X' diag(V[:, r]) X for every column r of V (R x p x p). Few terms: Khatri-Rao rows of X
    times V, a block of rows at a time (one matrix product per block instead of R); many
    terms (the Khatri-Rao rows would be p^2 long): one product per column."""
    m, p = X.shape
    if p > GRAM_KHATRI_RAO_MAX_TERMS:
        return np.stack([(X * V[:, r, None]).T @ X for r in range(V.shape[1])])
    G = np.zeros((p * p, V.shape[1]))
    step = max(1, (1 << 22) // (p * p))
    for a in range(0, m, step):
        Xa = X[a : a + step]
        G += (Xa[:, :, None] * Xa[:, None, :]).reshape(len(Xa), p * p).T @ V[a : a + step]
    return G.T.reshape(-1, p, p)


def _solve_many(H: np.ndarray, g: np.ndarray) -> np.ndarray:
    try:
        return np.linalg.solve(H, g[..., None])[..., 0]
    except np.linalg.LinAlgError:  # a singular system: NaN for that column only
        out = np.full(g.shape, np.nan)
        for r in range(len(g)):
            try:
                out[r] = np.linalg.solve(H[r], g[r])
            except np.linalg.LinAlgError:
                pass
        return out


def irls_many(
    X: np.ndarray,
    y: np.ndarray,
    W: np.ndarray,
    family: Family,
    start: np.ndarray,
    tol: float = 1e-12,
    max_iter: int = 100,
) -> np.ndarray:
    """irls for every weight column of W (m x R) at once (e.g. refits with each replicate
    weight): R x p coefficients; NaN where a column of X has no weight (R's NA) or the
    system is singular."""
    R = W.shape[1]
    B = np.tile(np.asarray(start, dtype=float), (R, 1))
    dead = ((W.T @ (X * X)) <= 0).any(axis=1)  # a term with no weight in that column
    W = np.where(dead[None, :], 0.0, W)
    if family == "gaussian":
        H = _grams(X, W)
        H[dead] = np.eye(X.shape[1])
        B = _solve_many(H, (X.T @ (W * y[:, None])).T)
    else:
        # a refit that diverges (a separated term in one replicate) goes to NaN, as a singular
        # one does: said by its NaN coefficients, not by warnings
        with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
            mu = _logistic(X @ B.T)
            dev = _binomial_deviance(y, mu, W)
            # each column stops at its own convergence, as irls, after one more Newton step:
            # the deviance criterion leaves the coefficients ~sqrt(tol) from the optimum, and
            # the step (quadratic convergence) takes them to the last bits
            live = np.ones(R, dtype=bool)
            met = np.zeros(R, dtype=bool)
            for _ in range(max_iter):
                a = np.flatnonzero(live)
                Wa, mua = W[:, a], mu[:, a]
                H = _grams(X, Wa * mua * (1.0 - mua))
                H[dead[a]] = np.eye(X.shape[1])
                step = _solve_many(H, (X.T @ (Wa * (y[:, None] - mua))).T)
                t = np.ones(len(a))
                for _ in range(30):
                    b_new = B[a] + t[:, None] * step
                    mu_new = _logistic(X @ b_new.T)
                    dev_new = _binomial_deviance(y, mu_new, Wa)
                    worse = dev_new > dev[a] * (1 + 1e-12) + 1e-12
                    if not worse.any():
                        break
                    t[worse] /= 2.0
                done = np.abs(dev[a] - dev_new) / (np.abs(dev_new) + 0.1) < tol
                B[a], mu[:, a], dev[a] = b_new, mu_new, dev_new
                # a diverged refit (NaN coefficients) stays NaN: no more steps for it
                live[a[(done & met[a]) | ~np.isfinite(b_new).all(axis=1)]] = False
                met[a] = done
                if not live.any():
                    break
    B[dead] = np.nan
    return B


@dataclass
class GLMFit:
    """A survey-weighted GLM on one file: coefficients (NaN where aliased) with Taylor and
    replicate SEs (NaN without replicate weights)."""

    names: list[str]
    coef: np.ndarray
    se_taylor: np.ndarray
    se_replicate: np.ndarray
    vcov_taylor: np.ndarray
    converged: bool
    n_used: int
    replicate_coef: np.ndarray | None = field(default=None, repr=False)  # R x p

    def frame(self) -> pd.DataFrame:
        return pd.DataFrame(
            {"coef": self.coef, "se_taylor": self.se_taylor, "se_replicate": self.se_replicate},
            index=pd.Index(self.names, name="term"),
        )


@dataclass
class GLMCells:
    """A model's complete cases summed by distinct row of (x, y), the likelihood's data: rows
    (m x (p + 1), in order of first appearance), w (their design weights' sums), W (their
    replicate weights' sums, m x R; None without replicates) and the sums of w by (PSU, row)
    (pair_psu, pair_row, pair_w: the data of the score totals by PSU); n_used records."""

    rows: np.ndarray
    w: np.ndarray
    W: np.ndarray | None
    pair_psu: np.ndarray
    pair_row: np.ndarray
    pair_w: np.ndarray
    n_used: int


def glm_cells(
    X: np.ndarray,
    y: np.ndarray,
    ok: np.ndarray,
    w: np.ndarray,
    psu: np.ndarray,
    W: np.ndarray | None = None,
    replicate_totals: Callable[[sp.csr_matrix], np.ndarray] | None = None,
) -> GLMCells:
    """The GLMCells of records (X, y, the complete-case mask ok; w their weights, psu their
    PSU codes) with the replicate weights' sums from W (n x R) or replicate_totals (a design's:
    R x m totals of the columns of an n x m matrix), when either is given."""
    rows = np.flatnonzero(ok)
    U, inv = distinct_rows(np.column_stack([X[rows], y[rows]]))
    m = len(U)
    G = group_indicator(inv, m)  # distinct rows x complete cases
    wr = w[rows]
    Wg = None
    if W is not None:
        Wg = np.asarray(G @ W[rows])
    elif replicate_totals is not None:
        Gn = sp.csr_matrix((np.ones(len(rows)), (rows, inv)), shape=(len(w), m))
        Wg = np.ascontiguousarray(replicate_totals(Gn).T)
    pair, of = dense_codes(psu[rows] * m + inv)
    return GLMCells(
        rows=U,
        w=G @ wr,
        W=Wg,
        pair_psu=pair // m,
        pair_row=pair % m,
        pair_w=group_indicator(of, len(pair)) @ wr,
        n_used=len(rows),
    )


def combine_cells(parts: Sequence[GLMCells]) -> GLMCells:
    """The GLMCells of records in parts (partitions, in record order): rows merged by value in
    order of first appearance, sums added."""
    U, inv = distinct_rows(np.concatenate([c.rows for c in parts]))
    m = len(U)
    G = group_indicator(inv, m)
    starts = np.cumsum([0, *(len(c.rows) for c in parts)])
    row = np.concatenate([inv[a + c.pair_row] for a, c in zip(starts[:-1], parts, strict=True)])
    psu = np.concatenate([c.pair_psu for c in parts])
    pair, of = dense_codes(psu * m + row)
    W = None if parts[0].W is None else G @ np.concatenate([c.W for c in parts])
    return GLMCells(
        rows=U,
        w=G @ np.concatenate([c.w for c in parts]),
        W=W,
        pair_psu=pair // m,
        pair_row=pair % m,
        pair_w=group_indicator(of, len(pair)) @ np.concatenate([c.pair_w for c in parts]),
        n_used=sum(c.n_used for c in parts),
    )


def fit_cells(
    cells: GLMCells,
    names: list[str],
    design: SurveyDesign,
    family: Family,
    replicates: bool = True,
) -> GLMFit:
    """svyglm on a model's cells: the design gives its PSUs (strata, n_h) and replicate scales
    only."""
    U = cells.rows
    p = U.shape[1] - 1
    if family == "binomial" and ((U[:, p] < 0) | (U[:, p] > 1)).any():
        raise ValueError("binomial family: the response must lie in [0, 1] (a 0/1 variable)")
    # svyglm rescales the weights to mean 1 over the complete cases; fit and variance are
    # invariant
    scale = float(cells.w.sum()) / cells.n_used if cells.n_used else 1.0
    wg = cells.w / scale
    keep = independent_columns(weighted_gram(U[:, :p], wg))
    Xg, yg = U[:, keep], U[:, p]
    beta, _, converged, _ = irls(Xg, yg, wg, family)
    mu = _logistic(Xg @ beta) if family == "binomial" else Xg @ beta
    v = mu * (1.0 - mu) if family == "binomial" else np.ones_like(mu)
    A_inv = np.linalg.inv(weighted_gram(Xg, wg * v))
    # the score totals by PSU: sum over its (PSU, row) pairs of w x (y - mu)
    P = sp.csr_matrix(
        (cells.pair_w / scale, (cells.pair_psu, cells.pair_row)), shape=(design.n_psu, len(U))
    )
    zt = np.asarray(P @ (Xg * (yg - mu)[:, None]))
    V = A_inv @ design.psu_covariance(zt) @ A_inv
    coef = np.full(p, np.nan)
    coef[keep] = beta
    se_t = np.full(p, np.nan)
    se_t[keep] = np.sqrt(np.maximum(np.diag(V), 0.0))
    vcov = np.full((p, p), np.nan)
    vcov[np.ix_(keep, keep)] = V
    se_r = np.full(p, np.nan)
    rep = None
    if replicates and design.replicate_weights and cells.W is not None:
        rep = np.full((cells.W.shape[1], p), np.nan)
        rep[:, keep] = irls_many(Xg, yg, cells.W / scale, family, start=beta)
        d = rep - coef[None, :]
        se_r = np.sqrt(design.rscales @ (d * d))
    return GLMFit(names, coef, se_t, se_r, vcov, converged, cells.n_used, rep)


def svyglm(
    X: np.ndarray,
    y: np.ndarray,
    ok: np.ndarray,
    names: list[str],
    design: SurveyDesign,
    family: Family,
    replicates: bool = True,
) -> GLMFit:
    """Fit y ~ X by IRLS with the design weight; Taylor SEs by the sandwich A^-1 B A^-1 (B the
    design covariance of the score totals u_i = w_i x_i (y_i - mu_i), zero for incomplete
    cases, every PSU counted as in a domain) and, with replicate weights and replicates=True,
    replicate SEs of refits (warm-started at the full-sample fit), centred on it (mse).

    The fits run on the distinct rows of (x, y) with summed weights (the likelihood is the
    same; GLMCells), so a model of categorical terms costs its cells, not its records."""
    reps = design.replicate_totals if replicates and design.replicate_weights else None
    cells = glm_cells(X, y, ok, design.w, design.g, replicate_totals=reps)
    return fit_cells(cells, names, design, family, replicates)
