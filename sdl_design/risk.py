"""Record-level disclosure risk.

- Risk strata U/D/T/O from the key-profile cell counts (paper 000, section 2.3).
- GenMASSC risk scores r_k = max_y (1 - eta_k(y)) zeta_k(y), eta from Rao's quadratic entropy
  (paper 000, eq. 1-2).
- Model-based risk of sample uniques: Poisson log-linear model on the key cells, fitted by ML
  (known sampling fraction, eq. 3) or pseudo-ML to weighted cell counts (eq. 7), on the table
  itself: the closed form of main effects, IPF of the two-way margins with interactions (no
  design matrix); per-record P(F=1|f=1), E(1/F|f=1) and the global tau1, tau2 (paper 001, eq. 1-4).

Everything groups records by key profile (factorized codes); nothing works on pairs of records.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from itertools import combinations
from typing import Any

import numpy as np
import pandas as pd

from sdl_design.codes import factorize
from sdl_design.keys import coarsen, key_levels
from sdl_design.spec import KeySpec, ReleaseSpec, SensitiveSpec, category_label

STRATA = ("U", "D", "T", "O")
KeyLike = str | KeySpec
SensitiveLike = Mapping[str, Mapping[Any, float]] | Sequence[SensitiveSpec | Mapping[str, Any]]


class RiskInputError(ValueError):
    """Bad input to a risk function; the message names the column or argument and the fix."""


# ---------------------------------------------------------------- key profiles


# the log-linear model's table of key cells, at most (preflight checks it before any work)
MAX_CELLS = 3_000_000


def _key_specs(keys: Sequence[KeyLike]) -> list[KeySpec]:
    if isinstance(keys, (str, KeySpec)):
        keys = [keys]
    if len(keys) == 0:
        raise RiskInputError("keys: no key variables given; list at least one column")
    return [KeySpec(name=k) if isinstance(k, str) else k for k in keys]


def _check_frame(df: pd.DataFrame, columns: Sequence[str], what: str) -> None:
    if not isinstance(df, pd.DataFrame):
        raise RiskInputError(f"df: expected a pandas DataFrame, got {type(df).__name__}")
    if len(df) == 0:
        raise RiskInputError("df: the file has no records; risk needs at least one record")
    missing = [c for c in columns if c not in df.columns]
    if missing:
        cols = ", ".join(map(str, list(df.columns)[:12]))
        raise RiskInputError(
            f"{what}: column(s) {missing} are not in the data; fix the name(s) (columns: {cols}"
            f"{', ...' if df.shape[1] > 12 else ''})"
        )


def _key_codes(df: pd.DataFrame, keys: Sequence[KeyLike]) -> tuple[list[np.ndarray], list[int]]:
    """Per key: codes 0..L-1 of the recoded key (recode applied to distinct values via key_frame)."""
    specs = _key_specs(keys)
    _check_frame(df, [k.name for k in specs], "keys")
    codes, sizes = [], []
    for k in specs:
        c, levels = key_levels(df[k.name], k)
        codes.append(c)
        sizes.append(len(levels))
    return codes, sizes


def _combine(codes: list[np.ndarray], sizes: list[int]) -> np.ndarray:
    """Dense profile codes 0..G-1 from per-key codes (mixed radix, refactorized on overflow)."""
    g = np.zeros(len(codes[0]), dtype=np.int64)
    span = 1
    for c, n_levels in zip(codes, sizes, strict=True):
        if span * n_levels >= 2**62:
            g, uniq = factorize(g)
            span = len(uniq)
        g = g * n_levels + c
        span *= n_levels
    return factorize(g)[0].astype(np.int64)


def profile_codes(df: pd.DataFrame, keys: Sequence[KeyLike]) -> pd.Series:
    """Key-profile code (0..G-1) of each record; records with equal recoded keys share a code."""
    codes, sizes = _key_codes(df, keys)
    return pd.Series(_combine(codes, sizes), index=df.index, name="profile")


def _sizes_of(g: np.ndarray) -> np.ndarray:
    return np.bincount(g)[g]


def cell_sizes(df: pd.DataFrame, keys: Sequence[KeyLike]) -> pd.Series:
    """Each record's cell count: the number of records in the file with its (recoded) key profile."""
    g = profile_codes(df, keys).to_numpy()
    return pd.Series(_sizes_of(g), index=df.index, name="cell_size")


def _strata_of(sizes: np.ndarray) -> pd.Categorical:
    return pd.Categorical.from_codes(np.minimum(sizes, 4) - 1, categories=list(STRATA))


def risk_strata(df: pd.DataFrame, keys: Sequence[KeyLike]) -> pd.Series:
    """Risk stratum of each record: U (unique), D (double), T (triple), O (4 or more records)."""
    sizes = cell_sizes(df, keys).to_numpy()
    return pd.Series(_strata_of(sizes), index=df.index, name="stratum")


# ---------------------------------------------------------------- GenMASSC scores (paper 000)


def _label(v: Any) -> str:
    """Category label used to match data values with sensitivity keys (1, 1.0, '1' and '1.0'
    agree): the one rule of spec.category_label, shared with the spec's data check."""
    return category_label(v)


def _sensitive_specs(sensitive: SensitiveLike) -> list[SensitiveSpec]:
    if isinstance(sensitive, Mapping):
        out = []
        for name, scores in sensitive.items():
            if isinstance(scores, SensitiveSpec):
                out.append(scores)
            elif isinstance(scores, Mapping):
                out.append(SensitiveSpec(name=name, sensitivity=dict(scores)))
            else:
                raise RiskInputError(
                    f"sensitive['{name}']: expected a mapping {{category: score}}, "
                    f"got {type(scores).__name__}"
                )
        specs = out
    else:
        specs = [s if isinstance(s, SensitiveSpec) else SensitiveSpec(**s) for s in sensitive]
    if not specs:
        raise RiskInputError(
            "sensitive: no sensitive variables given; map at least one column to its "
            "{category: sensitivity score}"
        )
    return specs


def _sensitive_codes(df: pd.DataFrame, s: SensitiveSpec) -> tuple[np.ndarray, list[str]]:
    """Category codes of a sensitive variable (binned first when s.bins is set) and their labels."""
    col = df[s.name]
    if s.bins is not None:
        col = coarsen(col, s.bins)
    raw, uniq = factorize(col, use_na_sentinel=False)
    labels = [_label(v) for v in uniq]
    lab_codes, cats = factorize(pd.Series(labels, dtype=object))
    cats = [str(c) for c in cats]
    listed = {_label(k) for k in s.sensitivity}
    unlisted = [c for c in cats if c not in listed]
    if unlisted:
        hint = " (values outside the bins)" if "out_of_range" in unlisted else ""
        hint += " (missing values: impute them or list 'nan')" if "nan" in unlisted else ""
        raise RiskInputError(
            f"sensitive['{s.name}']: categories {unlisted[:8]} of column '{s.name}' have no "
            f"sensitivity score{hint}; add them to its sensitivity map (listed: {sorted(listed)})"
        )
    return lab_codes.astype(np.int64)[raw], cats


def _distance_matrix(name: str, cats: list[str], dist: Any) -> np.ndarray:
    """Lambda over the observed categories: default 1 off the diagonal, 0 on it."""
    q = len(cats)
    if dist is None:
        return 1.0 - np.eye(q)
    if isinstance(dist, pd.DataFrame):
        dist = {_label(i): {_label(j): dist.loc[i, j] for j in dist.columns} for i in dist.index}
    elif isinstance(dist, Mapping):
        dist = {_label(i): {_label(j): v for j, v in row.items()} for i, row in dist.items()}
    else:
        raise RiskInputError(
            f"distances['{name}']: give a square DataFrame or a nested mapping "
            "{category: {category: distance}}"
        )
    lam = np.zeros((q, q))
    for a, ca in enumerate(cats):
        for b, cb in enumerate(cats):
            if a == b:
                continue
            v = dist.get(ca, {}).get(cb, dist.get(cb, {}).get(ca))
            if v is None:
                raise RiskInputError(
                    f"distances['{name}']: no distance between categories '{ca}' and '{cb}'; add it"
                )
            lam[a, b] = float(v)
    if not np.all((lam >= 0) & (lam <= 1)) or not np.allclose(lam, lam.T):
        raise RiskInputError(
            f"distances['{name}']: distances must lie in [0, 1] and be symmetric; fix the matrix"
        )
    for c in cats:
        d = dist.get(c, {}).get(c)
        if d is not None and float(d) != 0.0:
            raise RiskInputError(
                f"distances['{name}']: the distance of category '{c}' to itself must be 0"
            )
    return lam


@dataclass
class _Scores:
    score: np.ndarray  # r_k, eq. 2
    eta: dict[str, np.ndarray]  # per sensitive variable, per profile
    zeta: dict[str, np.ndarray]


def profile_eta_zeta(
    counts: np.ndarray,
    m: np.ndarray,
    scores: np.ndarray,
    lam: np.ndarray,
    pair_norm: np.ndarray,
) -> tuple[np.ndarray, np.ndarray]:
    """eta (eq. 1) and zeta (the mean sensitivity) of each key profile from its records' counts
    per sensitive category (profiles x categories, in the categories' order of appearance):
    functions of the counts alone, so a profile table gives the records' bits."""
    # sum_{j<j'} lambda = n'Lambda n / 2 per profile; eq. 1: eta = 1/2 * C(m,2)^-1 * that
    quad = np.einsum("gi,ij,gj->g", counts, lam, counts)
    eta = quad / pair_norm  # 0 for uniques (eq. 1: eta := 0 when m = 1)
    total = np.zeros(len(m))
    for j in range(counts.shape[1]):  # category by category: the same sum for any table
        total += counts[:, j] * scores[j]
    return eta, total / m  # zeta: the profile's mean sensitivity


def _genmassc(
    df: pd.DataFrame,
    g: np.ndarray,
    sensitive: SensitiveLike,
    distances: Mapping[str, Any] | None,
) -> _Scores:
    specs = _sensitive_specs(sensitive)
    _check_frame(df, [s.name for s in specs], "sensitive")
    distances = dict(distances or {})
    unknown = set(distances) - {s.name for s in specs}
    if unknown:
        raise RiskInputError(
            f"distances: {sorted(unknown)} are not sensitive variables; remove them or add them "
            "to sensitive"
        )
    n_g = int(g.max()) + 1
    m = np.bincount(g, minlength=n_g).astype(float)
    pair_norm = np.where(m >= 2, 2.0 * m * (m - 1.0), np.inf)  # eta = n'Lambda n / (2 m (m-1))
    r = np.zeros(len(g))
    eta_all, zeta_all = {}, {}
    for s in specs:
        c, cats = _sensitive_codes(df, s)
        q = len(cats)
        table = {_label(k): float(v) for k, v in s.sensitivity.items()}
        score_c = np.array([table[cat] for cat in cats])
        lam = _distance_matrix(s.name, cats, distances.get(s.name))
        counts = np.bincount(g * q + c, minlength=n_g * q).reshape(n_g, q).astype(float)
        eta, zeta = profile_eta_zeta(counts, m, score_c, lam, pair_norm)
        r = np.maximum(r, ((1.0 - eta) * zeta)[g])  # eq. 2
        eta_all[s.name], zeta_all[s.name] = eta, zeta
    return _Scores(r, eta_all, zeta_all)


def genmassc_scores(
    df: pd.DataFrame,
    keys: Sequence[KeyLike],
    sensitive: SensitiveLike,
    distances: Mapping[str, Any] | None = None,
) -> pd.Series:
    """GenMASSC risk score r_k = max_y (1 - eta_k(y)) zeta_k(y) of each record (paper 000, eq. 1-2).

    sensitive: {column: {category: score}} or a list of SensitiveSpec (bins categorize a
    continuous variable; scores are looked up by bin label). distances: {column: Lambda} with
    Lambda a square DataFrame or nested mapping over categories (default 1 off the diagonal).
    """
    g = profile_codes(df, keys).to_numpy()
    res = _genmassc(df, g, sensitive, distances)
    return pd.Series(res.score, index=df.index, name="risk_score")


# ---------------------------------------------------------------- log-linear model (paper 001)


@dataclass
class PoissonFit:
    """Fitted Poisson log-linear model on the full key table (cells in empty margins fixed at 0)."""

    mu: np.ndarray  # fitted mean of every cell of the full table (of every row given)
    beta: np.ndarray  # reference-coded coefficients of the used design columns (at the corner
    # cells: NaN or infinite where a corner cell is out of the fit)
    n_cells: int  # cells in the fit (those in no empty two-way margin)
    n_params: int  # used columns of the reference-coded design
    iterations: int  # IPF sweeps (1: the closed form of a main-effects model)
    converged: bool
    deviance: float


def _margin(t: np.ndarray, axes: tuple[int, ...]) -> np.ndarray:
    """Margin of table t on the given axes, the other axes kept with length 1 (broadcasts back)."""
    return t.sum(axis=tuple(i for i in range(t.ndim) if i not in axes), keepdims=True)


def _margin_sets(n_keys: int, pairs: Sequence[tuple[int, int]]) -> list[tuple[int, ...]]:
    """The model's sufficient margins: each two-way term's, and each key's outside every term."""
    in_pair = {j for p in pairs for j in p}
    return [tuple(p) for p in pairs] + [(j,) for j in range(n_keys) if j not in in_pair]


def _independence(y: np.ndarray) -> np.ndarray:
    """Closed-form ML fit of the main-effects model with a constant offset: the score equations
    (eq. 3/7) fit every one-way margin, so mu_k = N prod_j (y_j(k_j) / N), N the table's total."""
    n = float(y.sum())
    if n <= 0:
        return np.zeros(y.shape)
    shares = [_margin(y, (j,)).ravel() / n for j in range(y.ndim)]
    return n * functools.reduce(np.multiply.outer, shares)


def _ipf(
    y: np.ndarray,
    start: np.ndarray | float,
    pairs: Sequence[tuple[int, int]],
    tol: float,
    sweeps: int,
) -> tuple[np.ndarray, int, bool]:
    """ML fit of log mu = log start + x'beta by iterative proportional fitting: the fitted margins
    of the model's terms equal the observed ones (the score equations X'(y - mu) = 0, eq. 3/7).
    A cell in an empty observed margin gets 0. Converged when the largest relative move of a
    fitted margin in a sweep, over one minus its rate of decrease (the moves still to come),
    is at most tol."""
    margins = _margin_sets(y.ndim, pairs)
    observed = [_margin(y, m) for m in margins]
    mu = np.array(np.broadcast_to(start, y.shape), dtype=float)
    prev = np.inf
    for sweep in range(1, sweeps + 1):
        worst = 0.0
        for m, obs in zip(margins, observed, strict=True):
            fitted = _margin(mu, m)
            ratio = np.divide(obs, fitted, out=np.zeros_like(obs), where=(obs > 0) & (fitted > 0))
            worst = max(worst, float(np.abs(ratio[obs > 0] - 1.0).max(initial=0.0)))
            mu *= ratio
        if worst <= tol * (1.0 - min(worst / prev, 0.99)):
            return mu, sweep, True
        prev = worst
    return mu, sweeps, False


def _model_cells(
    y: np.ndarray, start: np.ndarray | float, pairs: Sequence[tuple[int, int]]
) -> np.ndarray | None:
    """Cells in the fit: a start (the rows given) and no empty observed two-way margin; None: all."""
    keep = np.asarray(start) > 0 if np.ndim(start) else None
    for a, b in pairs:
        on = _margin(y, (a, b)) > 0
        if not on.all():
            keep = on if keep is None else keep & on
    return None if keep is None else np.broadcast_to(keep, y.shape)


def _coefficients(
    mu: np.ndarray,
    start: np.ndarray | float,
    keep: np.ndarray | None,
    pairs: Sequence[tuple[int, int]],
) -> np.ndarray:
    """Reference-coded beta of the used design columns (intercept, main effects, two-way terms),
    read off eta = log(mu / start) at the corner cells (every other key at its first level): a
    term's coefficient is the inclusion-exclusion sum of eta over its keys (not finite where
    the term is not identified: a cell of it with mu 0)."""
    out = [np.zeros(0)]
    start = np.broadcast_to(start, mu.shape)
    for t in [(), *((j,) for j in range(mu.ndim)), *(tuple(p) for p in pairs)]:
        corner = tuple(slice(None) if i in t else 0 for i in range(mu.ndim))
        with np.errstate(divide="ignore", invalid="ignore"):
            eta = np.atleast_1d(np.log(mu[corner]) - np.log(start[corner]))
            if len(t) == 1:
                eta = eta[1:] - eta[0]
            elif len(t) == 2:
                eta = eta[1:, 1:] - eta[1:, :1] - eta[:1, 1:] + eta[0, 0]
        used = np.ones(eta.shape, dtype=bool)
        if keep is not None:
            on = np.atleast_1d((_margin(keep, t) > 0).reshape(np.shape(mu[corner])))
            used = on[(slice(1, None),) * len(t)] if t else on
        if len(t) == 2 and t[0] > t[1]:  # the design's columns: the first key of the pair major
            eta, used = eta.T, used.T
        out.append(eta[used])
    return np.concatenate(out)


def _deviance(y: np.ndarray, mu: np.ndarray) -> float:
    pos = y > 0
    return float(2.0 * (np.sum(y[pos] * np.log(y[pos] / mu[pos])) - (y.sum() - mu.sum())))


def fit_cells(
    y: np.ndarray,
    start: np.ndarray | float = 1.0,
    pairs: Sequence[tuple[int, int]] = (),
    tol: float = 1e-12,
    max_iter: int = 1000,
) -> PoissonFit:
    """ML fit of log mu_k = log start_k + x_k'beta to the table y (shape: the keys' levels;
    paper 001 eq. 3 with start = pi, eq. 7 with start 1): main effects and the two-way terms of
    pairs. Main effects with a constant start: the closed form N prod_j (y_j / N); otherwise IPF
    of the terms' margins. mu, beta, deviance as the IRLS fit of the reference-coded design gives
    them at convergence (cells in an empty two-way margin out of the fit, with mu 0)."""
    y = np.asarray(y, dtype=float)
    if not pairs and np.ndim(start) == 0:
        mu, sweeps, converged = _independence(y), 1, True
    else:
        mu, sweeps, converged = _ipf(y, start, pairs, tol, max_iter)
    keep = _model_cells(y, start, pairs)
    beta = _coefficients(mu, start, keep, pairs)
    n_cells = y.size if keep is None else int(keep.sum())
    return PoissonFit(mu.ravel(), beta, n_cells, len(beta), sweeps, converged, _deviance(y, mu))


def fit_poisson_loglinear(
    y: np.ndarray,
    cell_codes: list[np.ndarray],
    sizes: list[int],
    pairs: Sequence[tuple[int, int]] = (),
    offset: np.ndarray | float = 0.0,
    tol: float = 1e-12,
    max_iter: int = 1000,
    ridge: float = 0.0,
) -> PoissonFit:
    """ML fit of log(mu_k) = offset_k + x_k'beta to cell counts y (score equation, paper 001 eq. 3/7).

    The rows (cells of the key table by cell_codes) are summed into the full table, exp(offset)
    into the start table (cells with no row are out of the fit); fit_cells fits it and each row
    gets its share exp(offset_k) / start of its cell's mu. max_iter: IPF sweeps at most; ridge:
    unused (the former IRLS's; the margins need no ridge).
    """
    y = np.asarray(y, dtype=float)
    shape = tuple(int(s) for s in sizes)
    k_all = int(np.prod(shape))
    cell = table_cells(cell_codes, shape)
    if np.ndim(offset) == 0 and len(y) == k_all and np.array_equal(cell, np.arange(k_all)):
        return fit_cells(y.reshape(shape), float(np.exp(offset)), pairs, tol, max_iter)
    e_off = np.broadcast_to(np.exp(np.asarray(offset, dtype=float)), y.shape)
    start = np.bincount(cell, weights=e_off, minlength=k_all)
    table = np.bincount(cell, weights=y, minlength=k_all).reshape(shape)
    fit = fit_cells(table, start.reshape(shape), pairs, tol, max_iter)
    fit.mu = fit.mu[cell] * e_off / start[cell]
    return fit


@dataclass
class LoglinearRisk:
    """Model-based risk of sample uniques (paper 001, eq. 1 and 4)."""

    tau1: float  # sum over sample uniques of P(F=1|f=1)
    tau2: float  # sum over sample uniques of E(1/F|f=1)
    p_unique: pd.Series  # per record P(F=1|f=1); NaN unless the record is a sample unique
    e_inv_f: pd.Series  # per record E(1/F|f=1); NaN unless a sample unique
    lam: pd.Series  # per record fitted lambda_k of its cell (expected population count)
    n_unique: int
    fit: PoissonFit
    method: str  # "pseudo-ML" (weights, eq. 7), "ML" (known pi, eq. 3)
    info: dict[str, float] = field(default_factory=dict)

    @property
    def records(self) -> pd.DataFrame:
        return pd.DataFrame(
            {"lambda": self.lam, "p_unique": self.p_unique, "e_inv_f": self.e_inv_f}
        )


def interaction_pairs(
    names: Sequence[str], interactions: bool | Sequence[tuple[str, str]] | None
) -> list[tuple[int, int]]:
    """The log-linear model's two-way terms as pairs of key positions: all pairs (True), none
    (False or None), or the listed pairs of key names."""
    if interactions is True:
        return list(combinations(range(len(names)), 2))
    if interactions is False or interactions is None:
        return []
    pos = {nm: i for i, nm in enumerate(names)}
    pairs = []
    for p in interactions:
        if len(p) != 2 or p[0] not in pos or p[1] not in pos or p[0] == p[1]:
            raise RiskInputError(
                f"interactions: {p!r} is not a pair of two different keys from {list(names)}"
            )
        pairs.append(tuple(sorted((pos[p[0]], pos[p[1]]))))
    return sorted(set(pairs))


def table_cells(codes: Sequence[np.ndarray], sizes: Sequence[int]) -> np.ndarray:
    """Each record's cell in the full table of key cells (mixed radix, the last key fastest)."""
    strides = np.cumprod([1, *sizes[::-1]])[:-1][::-1].astype(np.int64)
    cell = np.zeros(len(codes[0]), dtype=np.int64)
    for c, s in zip(codes, strides, strict=True):
        cell += c * s
    return cell


def fit_table(
    f: np.ndarray,
    y: np.ndarray | None,
    sizes: Sequence[int],
    pairs: Sequence[tuple[int, int]],
    pi: float | None,
) -> tuple[PoissonFit, np.ndarray, str]:
    """(fit, lambda of every cell, method) of the full key table: pseudo-ML to the weighted
    counts y (eq. 7) when given, else ML to the counts f with offset log(pi) (eq. 3)."""
    shape = tuple(int(s) for s in sizes)
    if y is not None:
        fit = fit_cells(np.asarray(y, dtype=float).reshape(shape), 1.0, pairs)
        return fit, fit.mu, "pseudo-ML"
    fit = fit_cells(np.asarray(f, dtype=float).reshape(shape), float(pi), pairs)
    return fit, fit.mu / pi, "ML"  # lambda_hat = mu_hat / pi (eq. 3)


def unique_risk(
    lam: np.ndarray, w: np.ndarray | None, pi: float | None, unique: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """P(F=1|f=1) and E(1/F|f=1) of records with their cell's lambda (NaN unless unique):
    pi_hat = 1/w with weights (eq. 7), else the known pi."""
    if w is not None:
        one_minus_pi = np.clip(1.0 - 1.0 / w, 0.0, None)  # pi_hat = f/F_hat = 1/w for uniques
    else:
        one_minus_pi = np.full(len(lam), 1.0 - pi)
    nu = lam * one_minus_pi  # F | f=1 ~ 1 + Poisson(lambda (1 - pi)), eq. 2
    p1 = np.exp(-nu)  # eq. 4 (the paper's sign typo corrected)
    e_inv = np.where(nu > 1e-12, -np.expm1(-nu) / np.where(nu > 1e-12, nu, 1.0), 1.0 - nu / 2)
    return np.where(unique, p1, np.nan), np.where(unique, e_inv, np.nan)


def loglinear_risk(
    df: pd.DataFrame,
    keys: Sequence[KeyLike],
    weight: str | None = None,
    interactions: bool | Sequence[tuple[str, str]] = False,
    pi: float | None = None,
    max_cells: int = MAX_CELLS,
    _codes: tuple[list[np.ndarray], list[int]] | None = None,
) -> LoglinearRisk:
    """tau1, tau2 and per-record P(F=1|f=1), E(1/F|f=1) for sample uniques (paper 001, eq. 1-7).

    F_k ~ Poisson(lambda_k), log lambda_k = x_k'beta on the full table of key cells (main effects;
    interactions=True adds all two-way terms, or give a list of key pairs).
    weight: pseudo-ML fit to the weighted counts F_hat_k (eq. 7), pi_hat = 1/w for uniques.
    Without weight: ML fit to f_k with offset log(pi) (eq. 3), pi the known sampling fraction;
    pi=None there means the file is the population (pi = 1: every sample unique is unique).
    The fit (fit_table, fit_cells) works on the table: closed form for main effects, else IPF.
    """
    specs = _key_specs(keys)
    codes, sizes = _codes if _codes is not None else _key_codes(df, specs)
    names = [k.name for k in specs]
    if weight is not None:
        if pi is not None:
            raise RiskInputError("pi: give either weight (pseudo-ML) or pi (ML), not both")
        _check_frame(df, [weight], "weight")
        w = pd.to_numeric(df[weight], errors="coerce").to_numpy(dtype=float)
        bad = int((~np.isfinite(w) | (w <= 0)).sum())
        if bad:
            raise RiskInputError(
                f"weight: {bad} records have a missing or non-positive weight in column "
                f"'{weight}'; every weight must be > 0"
            )
    else:
        pi = 1.0 if pi is None else float(pi)
        if not 0.0 < pi <= 1.0:
            raise RiskInputError(f"pi: the sampling fraction must lie in (0, 1], got {pi}")
        w = None
    pairs = interaction_pairs(names, interactions)
    k_all = int(np.prod(np.array(sizes, dtype=float)))
    if k_all > max_cells:
        raise RiskInputError(
            f"keys: the full table of key cells has {k_all:,} cells (levels {dict(zip(names, sizes, strict=True))}),"
            f" more than max_cells={max_cells:,}; coarsen keys (bins or map) or drop a key"
        )
    cell = table_cells(codes, sizes)
    f = np.bincount(cell, minlength=k_all)
    y = None if w is None else np.bincount(cell, weights=w, minlength=k_all)  # F_hat_k, eq. 7
    fit, lam_cell, method = fit_table(f, y, sizes, pairs, pi)
    unique = f[cell] == 1
    lam = lam_cell[cell]
    p1, e_inv = unique_risk(lam, w, pi, unique)
    return LoglinearRisk(
        tau1=float(np.nansum(p1)),
        tau2=float(np.nansum(e_inv)),
        p_unique=pd.Series(p1, index=df.index, name="p_unique"),
        e_inv_f=pd.Series(e_inv, index=df.index, name="e_inv_f"),
        lam=pd.Series(lam, index=df.index, name="lambda"),
        n_unique=int(unique.sum()),
        fit=fit,
        method=method,
        info={
            "table_cells": float(k_all),
            "model_cells": float(fit.n_cells),
            "observed_cells": float((f > 0).sum()),
            "n_params": float(fit.n_params),
            "iterations": float(fit.iterations),
            "converged": float(fit.converged),
        },
    )


# ---------------------------------------------------------------- record table and summaries


def risk_summary(records: pd.DataFrame) -> dict[str, pd.DataFrame]:
    """Tables by risk stratum and by key-profile size from a record table with columns
    profile, cell_size, stratum, risk_score (and p_unique, e_inv_f when the model ran)."""
    need = ["profile", "cell_size", "stratum", "risk_score"]
    missing = [c for c in need if c not in records.columns]
    if missing:
        raise RiskInputError(f"records: columns {missing} are missing; build it with risk_profile")
    n = len(records)
    agg = {
        "n_records": ("cell_size", "size"),
        "n_profiles": ("profile", "nunique"),
        "mean_score": ("risk_score", "mean"),
        "max_score": ("risk_score", "max"),
    }
    extra = {}
    if "p_unique" in records.columns:
        extra = {"tau1": ("p_unique", "sum"), "tau2": ("e_inv_f", "sum")}
    by_stratum = (
        records.groupby("stratum", observed=False).agg(**agg, **extra).reindex(list(STRATA))
    )
    by_stratum["n_records"] = by_stratum["n_records"].fillna(0).astype(int)
    by_stratum["n_profiles"] = by_stratum["n_profiles"].fillna(0).astype(int)
    by_stratum.insert(1, "share_records", by_stratum["n_records"] / n)
    by_size = records.groupby("cell_size").agg(**agg).sort_index()
    return {
        "by_stratum": by_stratum.rename_axis("stratum").reset_index(),
        "by_profile_size": by_size.rename_axis("profile_size").reset_index(),
    }


def cell_metrics(n: int, n_profiles: int, counts: np.ndarray) -> dict[str, float]:
    """risk_profile's count metrics: records, profiles, and the records in cells of 1, 2, 3
    and 4 or more records (counts[1], ..., counts[4])."""
    return {
        "n_records": float(n),
        "n_profiles": float(n_profiles),
        "n_unique": float(counts[1]),
        "unique_share": float(counts[1] / n),
        "n_double": float(counts[2]),
        "n_triple": float(counts[3]),
        "n_other": float(counts[4]),
    }


@dataclass
class RiskProfile:
    """Risk of one file: the record table (internal only), summaries and global measures."""

    records: pd.DataFrame
    by_stratum: pd.DataFrame
    by_profile_size: pd.DataFrame
    metrics: dict[str, float]
    loglinear: LoglinearRisk | None = None


def risk_profile(
    df: pd.DataFrame,
    keys: Sequence[KeyLike],
    sensitive: SensitiveLike | None = None,
    weight: str | None = None,
    distances: Mapping[str, Any] | None = None,
    interactions: bool | Sequence[tuple[str, str]] = False,
    loglinear: bool = True,
    pi: float | None = None,
) -> RiskProfile:
    """Strata, GenMASSC scores and log-linear risk of any file (original or treated)."""
    codes, sizes = _key_codes(df, keys)
    g = _combine(codes, sizes)
    m = _sizes_of(g)
    records = pd.DataFrame({"profile": g, "cell_size": m, "stratum": _strata_of(m)}, index=df.index)
    has_sens = sensitive is not None and len(sensitive) > 0
    if has_sens:
        records["risk_score"] = _genmassc(df, g, sensitive, distances).score
    else:
        records["risk_score"] = np.nan
    ll = None
    if loglinear:
        ll = loglinear_risk(
            df, keys, weight=weight, interactions=interactions, pi=pi, _codes=(codes, sizes)
        )
        records["p_unique"] = ll.p_unique
        records["e_inv_f"] = ll.e_inv_f
    tabs = risk_summary(records)
    n = len(df)
    metrics = cell_metrics(n, int(g.max()) + 1, np.bincount(np.minimum(m, 4), minlength=5))
    if has_sens:
        r = records["risk_score"].to_numpy()
        metrics.update(
            mean_score=float(r.mean()),
            max_score=float(r.max()),
            n_score_1=float((r >= 1.0 - 1e-12).sum()),
        )
    if ll is not None:
        metrics.update(tau1=ll.tau1, tau2=ll.tau2)
        metrics["tau1_share"] = ll.tau1 / n
        metrics["tau2_share"] = ll.tau2 / n
    return RiskProfile(records, tabs["by_stratum"], tabs["by_profile_size"], metrics, ll)


def key_cell_problems(spec: ReleaseSpec, df: pd.DataFrame) -> list[str]:
    """The log-linear table: at most MAX_CELLS cells of the keys' published levels
    (loglinear_risk refuses more, after the work before it)."""
    keys = [k for k in spec.variables.keys if k.name in df.columns]
    sizes = {k.name: len(key_levels(df[k.name], k)[1]) for k in keys}
    cells = float(np.prod(np.array(list(sizes.values()), dtype=float)))
    if cells <= MAX_CELLS:
        return []
    worst = max(sizes, key=sizes.get)
    return [
        f"variables.keys: the keys' full table would have {cells:,.0f} cells (levels {sizes}), "
        f"more than the risk stage's {MAX_CELLS:,}; coarsen '{worst}' ({sizes[worst]:,} "
        "levels) with bins or map, or drop a key"
    ]
