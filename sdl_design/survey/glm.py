"""Survey-weighted GLMs: a formula parser for `y ~ a + C(b) + c + a:c + b*c`, IRLS,
design-based SEs.

The fit is R survey's svyglm: maximum (pseudo-)likelihood with the design weight as prior
weight (gaussian identity, binomial and quasibinomial logit, poisson log; binomial is
quasibinomial there: the coefficients and the sandwich are the same), the Taylor variance
A^-1 B A^-1 with A the weighted Fisher information and B the design covariance of the score
totals (svy.varcoef: svyrecvar of model.matrix * working residual * working weight), and the
replicate variance of refits with each replicate weight, centred on the full-sample fit.
Fits that do not converge or whose coefficients diverge (separation) are said in
GLMFit.warnings, as R's glm.fit warns.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from itertools import combinations
from typing import TYPE_CHECKING, Literal, Protocol

import numpy as np
import pandas as pd
import scipy.sparse as sp
from scipy.linalg import solve_triangular
from scipy.special import expit

from sdl_design.survey.design import dense_codes, distinct_rows, group_indicator

if TYPE_CHECKING:
    from sdl_design.survey.design import SurveyDesign

Family = Literal["gaussian", "binomial", "quasibinomial", "poisson"]
FAMILIES = ("gaussian", "binomial", "quasibinomial", "poisson")
LOGIT = ("binomial", "quasibinomial")

_NAME = r"[A-Za-z_][A-Za-z0-9_.]*"
_VAR = re.compile(rf"^(?:C\(\s*({_NAME})\s*\)|({_NAME}))$")
_HINT = (
    "write 'y ~ a + C(b) + c' (C(b) for a categorical term), 'a:b' for an interaction and "
    "'a*b' for a + b + a:b"
)


class FormulaError(ValueError):
    """A model formula that this parser does not read; the message shows the accepted form."""


@dataclass(frozen=True)
class Term:
    """A main effect (one variable) or an interaction (the product of several), its
    variables in their order of first appearance in the formula (R's)."""

    variables: tuple[str, ...]

    @property
    def name(self) -> str:
        return ":".join(self.variables)


@dataclass(frozen=True)
class Formula:
    response: str
    terms: tuple[Term, ...]  # R's order: by degree, then as written
    text: str = ""
    categorical: frozenset[str] = frozenset()  # the variables written C(name)

    @property
    def variables(self) -> list[str]:
        """The response, then the terms' variables in order of first appearance."""
        return list(dict.fromkeys([self.response, *(v for t in self.terms for v in t.variables)]))


def _product(text: str, op: str, marked: set[str]) -> list[str]:
    """The variables of 'a:C(b)' (C() marks a categorical variable in `marked`)."""
    out = []
    for part in (x.strip() for x in op.split(":")):
        m = _VAR.match(part)
        if not m:
            raise FormulaError(f"formula {text!r}: cannot read the term {part!r}; {_HINT}")
        name = m.group(1) or m.group(2)
        if m.group(1):
            marked.add(name)
        if name in out:
            raise FormulaError(f"formula {text!r}: {name!r} twice in the term {op.strip()!r}")
        out.append(name)
    return out


def parse_formula(text: str) -> Formula:
    """'y ~ a + C(b) + c' -> Formula, an intercept always; 'a:b' is the interaction (product)
    of a and b, 'a*b' is a + b + a:b (a*b*c every product of a, b and c). Terms are ordered
    as R's: by degree, then as written; a term that a '*' repeats is kept once."""
    if text.count("~") != 1:
        raise FormulaError(f"formula {text!r}: needs exactly one '~'; {_HINT}")
    lhs, rhs = (s.strip() for s in text.split("~"))
    if not re.fullmatch(_NAME, lhs):
        raise FormulaError(f"formula {text!r}: the response {lhs!r} is not a column name; {_HINT}")
    marked: set[str] = set()
    written: list[tuple[frozenset, int]] = []
    found: list[list[str]] = []
    for part in (p.strip() for p in rhs.split("+")):
        if part == "1":
            continue
        ops = [_product(text, op, marked) for op in part.split("*")]
        key = frozenset(frozenset(op) for op in ops), len(ops)
        if key in written:
            raise FormulaError(f"formula {text!r}: term {part!r} appears twice")
        written.append(key)
        for k in range(1, len(ops) + 1):  # a*b: a, b, a:b (R's expansion)
            for combo in combinations(ops, k):
                found.append(list(dict.fromkeys(v for op in combo for v in op)))
    order = {v: i for i, v in enumerate(dict.fromkeys(v for t in found for v in t))}
    if lhs in order:
        raise FormulaError(f"formula {text!r}: the response {lhs!r} is also a term")
    terms = list({frozenset(t): Term(tuple(sorted(t, key=order.get))) for t in found}.values())
    terms.sort(key=lambda t: len(t.variables))  # stable: by degree, then as written
    return Formula(lhs, tuple(terms), text, frozenset(marked))


def _is_categorical(formula: Formula, v: str, s: pd.Series) -> bool:
    return (
        v in formula.categorical
        or isinstance(s.dtype, pd.CategoricalDtype)
        or not (pd.api.types.is_numeric_dtype(s) or pd.api.types.is_bool_dtype(s))
    )


def term_levels(formula: Formula, frames: Sequence[pd.DataFrame]) -> dict[str, list]:
    """Ordered levels of every categorical variable of the terms over all frames: a
    Categorical's own category order (e.g. age bins), else sorted values; the first level is
    the reference."""
    out: dict[str, list] = {}
    for v in formula.variables[1:]:
        cols = [f[v] for f in frames]
        if not _is_categorical(formula, v, cols[0]):
            continue
        seen = pd.unique(pd.concat([c.dropna().astype(object) for c in cols]))
        if isinstance(cols[0].dtype, pd.CategoricalDtype):
            present = set(seen)
            out[v] = [x for x in cols[0].cat.categories if x in present]
        else:
            out[v] = sorted(seen, key=lambda x: (isinstance(x, str), x))
    return out


def contrast_coded(formula: Formula) -> list[tuple[bool, ...]]:
    """For each term and each of its variables, whether a categorical one is coded by
    treatment contrasts (True: its first level dropped) or by an indicator of every level
    (False): R's rule (model.matrix, TermCode) - contrasts when the term without that variable
    is empty (a main effect, with the intercept) or lies within an earlier term."""
    out = []
    for i, t in enumerate(formula.terms):
        before = [set(u.variables) for u in formula.terms[:i]]
        out.append(
            tuple(
                len(t.variables) == 1 or any(set(t.variables) - {v} <= b for b in before)
                for v in t.variables
            )
        )
    return out


def design_matrix(
    df: pd.DataFrame, formula: Formula, levels: dict[str, list]
) -> tuple[np.ndarray, np.ndarray, np.ndarray, list[str]]:
    """X (n x p), y, the complete-case mask and the column names, as R's model.matrix: the
    intercept, then each term's columns - a categorical variable's treatment dummies
    'b[T.level]' against its first level (or, where R's rule codes it by indicators, 'b[level]'
    for every level), a numeric one as is; an interaction's columns the products, its first
    variable varying fastest ('a[T.2]:b[T.m]', 'a[T.2]:x'). Rows with a missing value in y or
    a variable (or a level outside `levels`) are zero in X and y and False in the mask."""
    n = len(df)
    y = pd.to_numeric(df[formula.response], errors="coerce").to_numpy(dtype=float)
    ok = np.isfinite(y)
    values: dict[str, np.ndarray] = {}
    for v in formula.variables[1:]:
        if v in levels:
            values[v] = pd.Categorical(df[v].astype(object), categories=levels[v]).codes
            ok &= values[v] >= 0
        else:
            values[v] = pd.to_numeric(df[v], errors="coerce").to_numpy(dtype=float)
            ok &= np.isfinite(values[v])
    cols, names = [np.ones(n)], ["Intercept"]
    for t, coded in zip(formula.terms, contrast_coded(formula), strict=True):
        tcols, tnames = [np.ones(n)], [""]
        for v, contrast in zip(t.variables, coded, strict=True):
            if v in levels:
                first = 1 if contrast else 0
                fac = [(values[v] == j).astype(float) for j in range(first, len(levels[v]))]
                tag = "T." if contrast else ""
                fnames = [f"{v}[{tag}{lv}]" for lv in levels[v][first:]]
            else:
                fac, fnames = [values[v]], [v]
            # the first variable varies fastest
            tcols = [c * f for f in fac for c in tcols]
            tnames = [f"{a}:{b}" if a else b for b in fnames for a in tnames]
        cols += tcols
        names += tnames
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


def _poisson_deviance(y: np.ndarray, mu: np.ndarray, w: np.ndarray) -> np.ndarray:
    """2 sum w (y log(y / mu) - (y - mu)) per column of mu and w (y a vector)."""
    yy = y.reshape(-1, *([1] * (mu.ndim - 1)))
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        ll = np.where(yy > 0, yy * (np.log(np.where(yy > 0, yy, 1.0)) - np.log(mu)), 0.0)
        return 2.0 * (w * (ll - (yy - mu))).sum(axis=0)


def _check_family(family: str) -> None:
    if family not in FAMILIES:
        raise ValueError(f"family must be one of {FAMILIES}, not {family!r}")


def _fitted(eta: np.ndarray, family: str) -> np.ndarray:
    """The mean at the linear predictor: the inverse link (logit, log or identity)."""
    if family in LOGIT:
        return _logistic(eta)
    if family == "poisson":
        with np.errstate(over="ignore"):
            return np.exp(eta)
    return eta


def _variance(mu: np.ndarray, family: str) -> np.ndarray:
    """The variance function (the IRLS weight per unit prior weight of a canonical link)."""
    if family in LOGIT:
        return mu * (1.0 - mu)
    return mu if family == "poisson" else np.ones_like(mu)


def _deviance(y: np.ndarray, mu: np.ndarray, w: np.ndarray, family: str) -> np.ndarray:
    if family in LOGIT:
        return _binomial_deviance(y, mu, w)
    return _poisson_deviance(y, mu, w)


def irls_terms(eta: np.ndarray, y: np.ndarray, family: str) -> tuple[np.ndarray, np.ndarray]:
    """The IRLS weight per unit prior weight v(mu) and the residual y - mu at the linear
    predictor eta (rows of y, any columns), to the last bits at any eta: a logit's mu and
    1 - mu each as expit, so a separating fit's small probabilities keep their digits."""
    yy = y.reshape(-1, *([1] * (eta.ndim - 1)))
    if family in LOGIT:
        p, q = expit(eta), expit(-eta)  # mu, 1 - mu
        return p * q, yy * q - (1.0 - yy) * p
    if family == "poisson":
        with np.errstate(over="ignore"):
            mu = np.exp(eta)
        return mu, yy - mu
    return np.ones_like(eta), yy - eta


def deviance(eta: np.ndarray, y: np.ndarray, w: np.ndarray, family: str) -> np.ndarray:
    """The deviance at eta per column (rows of zero weight add nothing, whatever their fit):
    logit -2 sum w (y log mu + (1 - y) log(1 - mu)), poisson 2 sum w (y log(y / mu) - (y - mu)),
    gaussian sum w (y - mu)^2."""
    yy = y.reshape(-1, *([1] * (eta.ndim - 1)))
    with np.errstate(over="ignore", invalid="ignore"):
        if family in LOGIT:  # log mu = -log(1 + e^-eta), log(1 - mu) = -log(1 + e^eta)
            ll = -2.0 * (
                np.where(yy > 0, -yy * np.logaddexp(0.0, -eta), 0.0)
                + np.where(yy < 1, -(1.0 - yy) * np.logaddexp(0.0, eta), 0.0)
            )
        elif family == "poisson":
            ylogy = np.where(yy > 0, yy * np.log(np.where(yy > 0, yy, 1.0)), 0.0)
            ll = 2.0 * (ylogy - yy * eta - yy + np.exp(eta))
        else:
            ll = (yy - eta) ** 2
        return np.where(w > 0, w * ll, 0.0).sum(axis=0)


# R's glm.fit warns of fitted values numerically at the boundary: a probability within 10 eps
# of 0 or 1 (its logit link clamps |eta| > 30 to eps) or a rate below 10 eps
LOGIT_MAX_ETA = 30.0
LOG_MIN_ETA = float(np.log(10 * np.finfo(float).eps))


def at_boundary(eta: np.ndarray, family: str) -> np.ndarray:
    """Whether a fitted value (in each column of eta, over its rows) is numerically at the
    boundary, as R's glm.fit judges it: 'fitted probabilities numerically 0 or 1' (logit:
    |eta| > 30), 'fitted rates numerically 0' (log: eta < log(10 eps))."""
    with np.errstate(invalid="ignore"):
        if family in LOGIT:
            return (np.abs(eta) > LOGIT_MAX_ETA).any(axis=0)
        if family == "poisson":
            return (eta < LOG_MIN_ETA).any(axis=0)
    return np.zeros(eta.shape[1:], dtype=bool)


def _start(X: np.ndarray | sp.spmatrix, y: np.ndarray, w: np.ndarray, family: str) -> np.ndarray:
    """Starting coefficients: 0 (logit), else R's first IRLS step from mu = y + 0.1 (poisson)."""
    if family != "poisson":
        return np.zeros(X.shape[1])
    mu = y + 0.1
    z = np.log(mu) + (y - mu) / mu
    return np.linalg.solve(weighted_gram(X, w * mu), X.T @ (w * mu * z))


def _fixed_rows(X: sp.csr_matrix) -> tuple[np.ndarray, np.ndarray] | None:
    """(values, columns) as m x c arrays when every row of X stores c entries, no column twice
    (pmse_matrix's layout), else None."""
    m = X.shape[0]
    c = X.nnz // m if m else 0
    if c == 0 or c * m != X.nnz or not np.array_equal(X.indptr, np.arange(0, X.nnz + 1, c)):
        return None
    if not X.has_canonical_format:
        return None
    return X.data.reshape(m, c), X.indices.reshape(m, c)


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
        fixed = _fixed_rows(X)
        at = np.arange(min(step, m))[:, None] * p  # a block's rows in its flat dense array
        for a in range(0, m, step):
            if fixed is None:
                Xa = X[a : a + step].toarray()
            else:  # the same dense rows, without slicing the CSR
                n = min(step, m - a)
                Xa = np.zeros((n, p))
                Xa.ravel()[at[:n] + fixed[1][a : a + n]] = fixed[0][a : a + n]
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
    Gaussian identity: one weighted least-squares solve. Binomial and quasibinomial logit,
    poisson log: Newton steps (IRLS) from start (default: _start), halved while the deviance
    rises, until its relative change |dev - dev_old| / (|dev| + 0.1) is below tol (R's glm
    criterion)."""
    if family == "gaussian":
        beta = np.linalg.solve(weighted_gram(X, w), X.T @ (w * y))
        return beta, X @ beta, True, 1
    _check_family(family)
    beta = _start(X, y, w, family) if start is None else np.asarray(start, dtype=float)
    mu = _fitted(X @ beta, family)
    dev = float(_deviance(y, mu, w, family))
    for it in range(1, max_iter + 1):
        H = weighted_gram(X, w * _variance(mu, family))
        step = np.linalg.solve(H, X.T @ (w * (y - mu)))
        t = 1.0
        for _ in range(30):
            b_new = beta + t * step
            mu_new = _fitted(X @ b_new, family)
            dev_new = float(_deviance(y, mu_new, w, family))
            if dev_new <= dev * (1 + 1e-12) + 1e-12:
                break
            t /= 2.0
        done = abs(dev - dev_new) / (abs(dev_new) + 0.1) < tol
        beta, mu, dev = b_new, mu_new, dev_new
        if done:
            return beta, mu, True, it
    return beta, mu, False, max_iter


# above this many terms X' diag(v) X is one matrix product per weight column (weighted_grams)
GRAM_KHATRI_RAO_MAX_TERMS = 24


def weighted_grams(X: np.ndarray, V: np.ndarray) -> np.ndarray:
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


# the outcome of a fit (GLMFit.status, replicate_status)
STATUS = ("converged", "boundary", "separated", "not converged", "failed")
# a converged Newton step moves no linear predictor more than this; a diverging fit's steps
# (separation) move some by ~1 each
STEP_TOL = 1e-3


class NewtonData(Protocol):
    """Where the sums of a fit of several weight columns live (irls_columns' data): the rows
    of (X, y) in memory (RowsData) or spread over partitions. The coefficients it is told of
    (start, accept) are the current ones of each column."""

    n_columns: int

    def weight_of_terms(self) -> np.ndarray:
        """W' (X * X): R x p (a term without weight in a column is out of it)."""

    def drop(self, dead: np.ndarray) -> None:
        """The columns dead get no weight from here on."""

    def least_squares(self) -> tuple[np.ndarray, np.ndarray]:
        """X' diag(W_r) X and X' diag(W_r) y: R x p x p and R x p."""

    def start(self, B: np.ndarray) -> np.ndarray:
        """The deviance of every column at B (R x p), its current coefficients."""

    def terms(self, a: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Newton's X' diag(W_r v) X and X' (W_r r) of the columns a at their current fit."""

    def candidate(self, a: np.ndarray, b_new: np.ndarray) -> tuple[np.ndarray, ...]:
        """At b_new (len(a) x p): each column's deviance, the most a weighted row's linear
        predictor moved from the current fit, and whether a fitted value is at its bound."""

    def accept(self, a: np.ndarray) -> None:
        """The last candidate becomes the current fit of the columns a."""

    def boundary(self, at: np.ndarray) -> np.ndarray:
        """at_boundary of the columns at at their current fit."""


class RowsData:
    """NewtonData of rows held in memory: X (m x p), y, W (m x R)."""

    def __init__(self, X: np.ndarray, y: np.ndarray, W: np.ndarray, family: str):
        self.X, self.y, self.W, self.family = X, y, W, family
        self.n_columns = W.shape[1]

    def weight_of_terms(self) -> np.ndarray:
        return self.W.T @ (self.X * self.X)

    def drop(self, dead: np.ndarray) -> None:
        self.W = np.where(dead[None, :], 0.0, self.W)

    def least_squares(self) -> tuple[np.ndarray, np.ndarray]:
        return weighted_grams(self.X, self.W), (self.X.T @ (self.W * self.y[:, None])).T

    def start(self, B: np.ndarray) -> np.ndarray:
        self.eta = self.X @ B.T
        return deviance(self.eta, self.y, self.W, self.family)

    def terms(self, a: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        Wa = self.W[:, a]
        v, r = irls_terms(self.eta[:, a], self.y, self.family)
        return weighted_grams(self.X, Wa * v), (self.X.T @ (Wa * r)).T

    def candidate(self, a: np.ndarray, b_new: np.ndarray) -> tuple[np.ndarray, ...]:
        Wa = self.W[:, a]
        self.eta_new = self.X @ b_new.T
        dev_new = deviance(self.eta_new, self.y, Wa, self.family)
        moved = np.where(Wa > 0, np.abs(self.eta_new - self.eta[:, a]), 0.0).max(axis=0, initial=0)
        return dev_new, moved, at_boundary(self.eta_new, self.family)

    def accept(self, a: np.ndarray) -> None:
        self.eta[:, a] = self.eta_new

    def boundary(self, at: np.ndarray) -> np.ndarray:
        return at_boundary(self.eta[:, at], self.family)


def irls_columns(
    X: np.ndarray,
    y: np.ndarray,
    W: np.ndarray,
    family: Family,
    start: np.ndarray,
    tol: float = 1e-12,
    max_iter: int = 100,
) -> tuple[np.ndarray, np.ndarray]:
    """irls for every weight column of W (m x R) at once, from start (p, or R x p): R x p
    coefficients (NaN where a column of X has no weight, R's NA, or the system is singular)
    and each column's STATUS code (newton_columns)."""
    return newton_columns(RowsData(X, y, W, family), family, start, X.shape[1], tol, max_iter)


def newton_columns(
    data: NewtonData,
    family: Family,
    start: np.ndarray,
    p: int,
    tol: float = 1e-12,
    max_iter: int = 100,
) -> tuple[np.ndarray, np.ndarray]:
    """irls_columns on data (NewtonData: in memory or by partition). A column stops when the
    deviance criterion has held on two steps (the second, Newton's quadratic step, takes the
    coefficients to the last bits) and the last moved no linear predictor of a weighted row
    by STEP_TOL: converged, or boundary when a fitted value is numerically at its bound
    (at_boundary, R's warning). Steps that go on moving once the deviance has settled are
    coefficients diverging (separation: the maximum likelihood estimate does not exist): the
    column stops as separated when a fitted value reaches its bound. Not converged after
    max_iter steps; failed on NaN (singular)."""
    R = data.n_columns
    B = np.broadcast_to(np.asarray(start, dtype=float), (R, p)).copy()
    dead = (data.weight_of_terms() <= 0).any(axis=1)  # a term with no weight in that column
    data.drop(dead)
    state = np.full(R, STATUS.index("not converged"))
    if family == "gaussian":
        H, g = data.least_squares()
        H[dead] = np.eye(p)
        B = _solve_many(H, g)
        state[:] = STATUS.index("converged")
    else:
        _check_family(family)
        with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
            _newton_columns(data, B, dead, state, tol, max_iter)
    state[~np.isfinite(B).all(axis=1) & ~dead] = STATUS.index("failed")
    B[dead] = np.nan
    return B, state


def _newton_columns(
    data: NewtonData,
    B: np.ndarray,
    dead: np.ndarray,
    state: np.ndarray,
    tol: float,
    max_iter: int,
) -> None:
    """newton_columns' Newton steps, halved while a column's deviance rises (B, state in
    place)."""
    dev = data.start(B)
    live = np.ones(len(B), dtype=bool)
    met = np.zeros(len(B), dtype=bool)
    for _ in range(max_iter):
        a = np.flatnonzero(live)
        H, g = data.terms(a)
        H[dead[a]] = np.eye(B.shape[1])
        step = _solve_many(H, g)
        t = np.ones(len(a))
        for _ in range(30):
            b_new = B[a] + t[:, None] * step
            dev_new, moved, bound = data.candidate(a, b_new)
            worse = ~(dev_new <= dev[a] * (1 + 1e-12) + 1e-12)  # (NaN: worse)
            if not worse.any():
                break
            t[worse] /= 2.0
        done = np.abs(dev[a] - dev_new) / (np.abs(dev_new) + 0.1) < tol
        data.accept(a)
        B[a], dev[a] = b_new, dev_new
        settled = done & met[a]
        converged = settled & (moved < STEP_TOL)
        separated = settled & ~converged & bound
        state[a[converged]] = STATUS.index("converged")
        state[a[separated]] = STATUS.index("separated")
        # a NaN refit (singular) stays NaN: no more steps for it
        live[a[converged | separated | ~np.isfinite(b_new).all(axis=1)]] = False
        met[a] = done
        if not live.any():
            break
    at = np.flatnonzero(state == STATUS.index("converged"))
    state[at[data.boundary(at)]] = STATUS.index("boundary")


@dataclass
class GLMFit:
    """A survey-weighted GLM on one file: coefficients (NaN where aliased) with Taylor and
    replicate SEs (NaN without replicate weights); status (STATUS) of the full-sample fit and
    of each replicate refit, and warnings saying which fits did not converge or diverged
    (their SEs are not meaningful; R's glm.fit warns of them)."""

    names: list[str]
    coef: np.ndarray
    se_taylor: np.ndarray
    se_replicate: np.ndarray
    vcov_taylor: np.ndarray
    converged: bool
    n_used: int
    replicate_coef: np.ndarray | None = field(default=None, repr=False)  # R x p
    status: str = "converged"
    replicate_status: np.ndarray | None = field(default=None, repr=False)  # R STATUS names
    warnings: list[str] = field(default_factory=list)

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


def check_response(y: np.ndarray, family: str) -> None:
    _check_family(family)
    if family in LOGIT and ((y < 0) | (y > 1)).any():
        raise ValueError(f"{family} family: the response must lie in [0, 1] (a 0/1 variable)")
    if family == "poisson" and (y < 0).any():
        raise ValueError("poisson family: the response must be >= 0 (a count)")


def _taylor_vcov(
    cells: GLMCells,
    Xg: np.ndarray,
    yg: np.ndarray,
    wg: np.ndarray,
    beta: np.ndarray,
    design: SurveyDesign,
    family: str,
    scale: float,
) -> np.ndarray:
    """A^-1 B A^-1: A the weighted information X' diag(w v(mu)) X, B the design covariance of
    the score totals by PSU (the sum over its (PSU, row) pairs of w x (y - mu))."""
    v, r = irls_terms(Xg @ beta, yg, family)
    A_inv = np.linalg.inv(weighted_gram(Xg, wg * v))
    P = sp.csr_matrix(
        (cells.pair_w / scale, (cells.pair_psu, cells.pair_row)), shape=(design.n_psu, len(Xg))
    )
    zt = np.asarray(P @ (Xg * r[:, None]))
    return A_inv @ design.psu_covariance(zt) @ A_inv


_SAID = {
    "boundary": "fitted {values} numerically {bound}",
    "separated": "the coefficients diverge (separation: fitted {values} numerically {bound})",
    "not converged": "did not converge in {max_iter} iterations",
    "failed": "the fit failed (singular equations)",
}


def fit_warnings(
    names: Sequence[str],
    family: str,
    status: str,
    coef: np.ndarray,
    replicate_status: np.ndarray | None = None,
    replicate_coef: np.ndarray | None = None,
    label: str = "",
    max_iter: int = 100,
) -> list[str]:
    """The warnings of a fit: the full sample's and, for each kind, the replicates' (1-based,
    as R's columns) whose status is not converged, each naming the coefficient that moved most
    (the diverging one); all but boundary (a converged fit with a fitted value at its bound,
    which R's glm.fit warns of) leave SEs that are not meaningful."""
    values, bound = ("rates", "0") if family == "poisson" else ("probabilities", "0 or 1")
    head = f"{label}: " if label else ""
    out = []
    if status != "converged":
        big = names[int(np.argmax(np.abs(np.where(np.isfinite(coef), coef, 0.0))))]
        what = _SAID[status].format(values=values, bound=bound, max_iter=max_iter)
        tail = "" if status == "boundary" else "; its SEs are not meaningful"
        out.append(f"{head}full sample: {what} (largest coefficient {big}){tail}")
    if replicate_status is None or replicate_coef is None:
        return out
    for kind in _SAID:
        at = np.flatnonzero(replicate_status == kind)
        if not len(at):
            continue
        d = np.abs(np.nan_to_num(replicate_coef[at] - coef[None, :], nan=0.0))
        moved = list(dict.fromkeys(names[j] for j in d.argmax(axis=1)))
        which = ", ".join(str(r + 1) for r in at[:10]) + (", ..." if len(at) > 10 else "")
        what = _SAID[kind].format(values=values, bound=bound, max_iter=max_iter)
        tail = "" if kind == "boundary" else "; the replicate SEs are not meaningful"
        out.append(
            f"{head}replicates {which} ({len(at)} of {len(replicate_status)}): {what}; "
            f"moved most: {', '.join(moved[:3])}{tail}"
        )
    return out


@dataclass
class ModelSums:
    """What a survey GLM's fit reads, wherever its records are (a model's cells in memory, or
    its partitions): p terms, n_used complete cases, the independent columns keep, the
    weights' scale (svyglm's mean-1 rescaling) and, on the kept columns, the full sample's
    weight column (NewtonData), a gaussian fit, the start of a Newton fit, the Taylor
    covariance at a fit and the replicate weights' columns (None without them)."""

    p: int
    n_used: int
    keep: np.ndarray
    full: Callable[[], NewtonData]
    gaussian: Callable[[], np.ndarray]
    start: Callable[[], np.ndarray]
    taylor: Callable[[np.ndarray], np.ndarray]
    replicates: Callable[[], NewtonData | None]


def fit_cells(
    cells: GLMCells,
    names: list[str],
    design: SurveyDesign,
    family: Family,
    replicates: bool = True,
    label: str = "",
    max_iter: int = 100,
) -> GLMFit:
    """svyglm on a model's cells: the design gives its PSUs (strata, n_h) and replicate scales
    only. label (e.g. the formula) heads the fit's warnings."""
    U = cells.rows
    p = U.shape[1] - 1
    check_response(U[:, p], family)
    # svyglm rescales the weights to mean 1 over the complete cases; fit and variance are
    # invariant
    scale = float(cells.w.sum()) / cells.n_used if cells.n_used else 1.0
    wg = cells.w / scale
    keep = independent_columns(weighted_gram(U[:, :p], wg))
    Xg, yg = U[:, keep], U[:, p]
    W = None if cells.W is None else cells.W / scale
    sums = ModelSums(
        p,
        cells.n_used,
        keep,
        full=lambda: RowsData(Xg, yg, wg[:, None], family),
        gaussian=lambda: irls(Xg, yg, wg, family)[0],
        start=lambda: _start(Xg, yg, wg, family),
        taylor=lambda beta: _taylor_vcov(cells, Xg, yg, wg, beta, design, family, scale),
        replicates=lambda: None if W is None else RowsData(Xg, yg, W, family),
    )
    return fit_sums(sums, names, design, family, replicates, label, max_iter)


def fit_sums(
    sums: ModelSums,
    names: list[str],
    design: SurveyDesign,
    family: Family,
    replicates: bool = True,
    label: str = "",
    max_iter: int = 100,
) -> GLMFit:
    """svyglm's fit from a model's sums (ModelSums): the full sample's (irls, or Newton's
    from its start), the sandwich's Taylor SEs and, with replicates, the refits of every
    replicate column warm-started at the fit; fit_warnings of the fits that did not converge."""
    p, keep = sums.p, sums.keep
    if family == "gaussian":
        beta, state = sums.gaussian(), STATUS.index("converged")
    else:
        B, st = newton_columns(sums.full(), family, sums.start(), len(keep), max_iter=max_iter)
        beta, state = B[0], int(st[0])
    status = STATUS[state]
    try:
        V = sums.taylor(beta)
    except np.linalg.LinAlgError:
        if status in ("converged", "boundary"):
            raise
        V = np.full((len(keep), len(keep)), np.nan)  # (a diverged fit: said by its warning)
    coef = np.full(p, np.nan)
    coef[keep] = beta
    se_t = np.full(p, np.nan)
    se_t[keep] = np.sqrt(np.maximum(np.diag(V), 0.0))
    vcov = np.full((p, p), np.nan)
    vcov[np.ix_(keep, keep)] = V
    se_r = np.full(p, np.nan)
    rep = rstatus = None
    data = sums.replicates() if replicates and design.replicate_weights else None
    if data is not None:
        rep = np.full((data.n_columns, p), np.nan)
        rep[:, keep], rst = newton_columns(data, family, beta, len(keep), max_iter=max_iter)
        rstatus = np.asarray(STATUS)[rst]
        se_r = design.replicate_se(coef, rep)
    said = fit_warnings(names, family, status, coef, rstatus, rep, label, max_iter)
    converged = status in ("converged", "boundary")
    return GLMFit(names, coef, se_t, se_r, vcov, converged, sums.n_used, rep, status, rstatus, said)


def svyglm(
    X: np.ndarray,
    y: np.ndarray,
    ok: np.ndarray,
    names: list[str],
    design: SurveyDesign,
    family: Family,
    replicates: bool = True,
    label: str = "",
) -> GLMFit:
    """Fit y ~ X by IRLS with the design weight; Taylor SEs by the sandwich A^-1 B A^-1 (B the
    design covariance of the score totals u_i = w_i x_i (y_i - mu_i), zero for incomplete
    cases, every PSU counted as in a domain) and, with replicate weights and replicates=True,
    replicate SEs of refits (warm-started at the full-sample fit), centred on it (mse) or on
    their mean (as the design's replicate_se). Fits that do not converge or diverge are said
    in the result's warnings (label, e.g. the formula, heads them).

    The fits run on the distinct rows of (x, y) with summed weights (the likelihood is the
    same; GLMCells), so a model of categorical terms costs its cells, not its records."""
    reps = design.replicate_totals if replicates and design.replicate_weights else None
    cells = glm_cells(X, y, ok, design.w, design.g, replicate_totals=reps)
    return fit_cells(cells, names, design, family, replicates, label)
