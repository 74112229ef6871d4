"""Survey quantiles as R's svyquantile (survey 4.x): qrules "math", "school" and "hf7", Woodruff
confidence intervals from the Taylor or replicate SE of the estimated CDF, or intervals from the
replicate quantiles; SE = CI width / (2 t_{1-alpha/2, df}), df = degf() as R."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import numpy as np
import pandas as pd
import scipy.sparse as sp
from scipy import stats

# attribute access at call time: design.py may import this module while it is being imported
import sdl_design.survey.design_base as sdd
from sdl_design.codes import factorize

if TYPE_CHECKING:
    from sdl_design.survey.design import SurveyDesign

QRULES = ("math", "hf1", "school", "hf2", "hf7")
QRule = Literal["math", "hf1", "school", "hf2", "hf7"]
LD = np.longdouble  # R sums and cumsums in long double (x87 80-bit, as numpy's longdouble here)


# ------------------------------------------------------------------ quantile rules
def _discrete(x: np.ndarray, cw: np.ndarray, p: np.ndarray, school: bool) -> np.ndarray:
    """R's qrule_math / qrule_school on sorted x with cumulative weights cw (positive weights):
    k = the last record with cw_k <= p W; F(x_k) = p exactly (p - cw_k / W == 0): x_k (math) or
    (x_k + x_{k+1}) / 2 (school), else x_{k+1}: the smallest x with F(x) >= p. As R (qs, last),
    k = 1 when no cw_k <= p W: then p < w_(1) / W gives x_(2), not x_(1) (kept, to match R)."""
    total = cw[-1]
    low = np.maximum(np.searchsorted(cw, p * total, side="right") - 1, 0)
    nxt = np.minimum(low + 1, len(x) - 1)
    exact = p - cw[low] / total == 0  # R: wlow == 0
    hit = (x[low] + x[nxt]) / 2 if school else x[low]
    return np.where(exact, hit, x[nxt])


def _hf7(x: np.ndarray, cw: np.ndarray, p: np.ndarray) -> np.ndarray:
    """R's qrule_hf7: linear interpolation (R's approx, rule 2) of sorted x at p over
    p_k = (cw_{k-1}) / cw_{n-1}, k = 1..n (cw_0 = 0); Hyndman-Fan 7 for equal weights."""
    n = len(x)
    if n == 1:
        return np.full(p.shape, x[0])
    pk = np.r_[0.0, cw[:-1]] / cw[-2]
    i = np.clip(np.searchsorted(pk, p, side="right") - 1, 0, n - 2)
    j = i + 1
    with np.errstate(invalid="ignore", divide="ignore"):
        val = x[i] + (x[j] - x[i]) * ((p - pk[i]) / (pk[j] - pk[i]))  # R's approx1
    val = np.where(p == pk[j], x[j], np.where(p == pk[i], x[i], val))
    return np.where(p < pk[0], x[0], np.where(p > pk[-1], x[-1], val))


def cumulative(xs: np.ndarray, ws: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The values of the records with a positive weight (sorted ascending) and their cumulative
    weights, summed in long double as R's cumsum (zero weights play no part, as R drops them)."""
    keep = ws > 0
    if keep.all():
        return xs, np.cumsum(ws, dtype=LD).astype(float)
    return xs[keep], np.cumsum(ws[keep], dtype=LD).astype(float)


def quantile_at(x: np.ndarray, cw: np.ndarray, p: np.ndarray, qrule: str) -> np.ndarray:
    """Quantiles at p (NaN where p is NaN) from cumulative(xs, ws)'s values x and weights cw."""
    p = np.asarray(p, dtype=float)
    out = np.full(p.shape, np.nan)
    ok = ~np.isnan(p)
    if not len(x) or not ok.any():
        return out
    if qrule == "hf7":
        out[ok] = _hf7(x, cw, p[ok])
    else:
        out[ok] = _discrete(x, cw, p[ok], school=qrule in ("school", "hf2"))
    return out


def weighted_quantile(xs: np.ndarray, w: np.ndarray, p: np.ndarray, qrule: str) -> np.ndarray:
    """Quantiles at p (NaN where p is NaN) of values xs sorted ascending with weights w >= 0 in
    the same order; zero weights play no part (as R drops them). Cumulative weights and the total
    are summed in long double, as R's cumsum and sum, so that ties F(x_k) = p resolve as in R."""
    return quantile_at(*cumulative(xs, w), p, qrule)


# ------------------------------------------------------------------ cells: a variable in a domain
@dataclass
class _Cell:
    """One variable in one domain: its non-missing records sorted by value (stable, as R's
    order), their sampling weights, the quantiles q, cut_p = #records with x <= q_p and the
    cumulative weights of its records with a positive weight (cumulative)."""

    order: np.ndarray  # record indices, sorted by value
    xs: np.ndarray
    ws: np.ndarray
    q: np.ndarray
    cut: np.ndarray
    cum: tuple[np.ndarray, np.ndarray]

    @property
    def rows(self) -> np.ndarray:
        """The record indices in data order."""
        return np.sort(self.order)


def _column(design: SurveyDesign, col: str) -> np.ndarray:
    if col not in design.df.columns:
        raise sdd.DesignError(f"quantile: column '{col}' is not in the data")
    s = design.df[col]
    if not (pd.api.types.is_numeric_dtype(s) or pd.api.types.is_bool_dtype(s)):
        raise sdd.DesignError(f"quantile: column '{col}' is not numeric")
    return s.to_numpy(dtype=float, na_value=np.nan)


def _by_cell(co: np.ndarray, L: int) -> tuple[np.ndarray | None, np.ndarray]:
    """Records sorted by value with cells co (-1: in none) put in cell order, each cell's still
    by value: the permutation (None: already so, one cell holding them all) and the L + 1
    bounds of the cells in it. A radix sort (numpy's stable sort of int16)."""
    small = np.int16 if L < 2**15 else np.int64
    inside = co >= 0
    if inside.all():
        at = None if L == 1 else np.argsort(co.astype(small), kind="stable")
        counts = np.bincount(co, minlength=L)
    else:
        kept = np.flatnonzero(inside)
        at = kept[np.argsort(co[kept].astype(small), kind="stable")]
        counts = np.bincount(co[kept], minlength=L)
    return at, np.r_[0, np.cumsum(counts)]


def sorted_cells(
    xo: np.ndarray,
    wo: np.ndarray,
    co: np.ndarray,
    L: int,
    probs: np.ndarray,
    qrule: str,
    index: np.ndarray,
) -> list[_Cell]:
    """quantile_cells from one variable's non-missing records sorted by value (stable): their
    values xo, weights wo, cells co (-1: in none) and record indices (index). One radix sort
    of the cells; each cell's arrays are views of one gather."""
    probs = np.asarray(probs, dtype=float)
    at, bounds = _by_cell(co, L)
    xs, ws, order = (xo, wo, index) if at is None else (xo[at], wo[at], index[at])
    out = []
    for a, b in zip(bounds[:-1].tolist(), bounds[1:].tolist(), strict=True):
        cum = cumulative(xs[a:b], ws[a:b])
        q = quantile_at(*cum, probs, qrule)
        cut = np.searchsorted(xs[a:b], q, side="right") if b > a else np.zeros(len(probs), int)
        out.append(_Cell(order[a:b], xs[a:b], ws[a:b], q, cut, cum))
    return out


def quantile_cells(
    x: np.ndarray,
    w: np.ndarray,
    codes: np.ndarray,
    L: int,
    probs: np.ndarray,
    qrule: str,
    by_value: np.ndarray | None = None,
) -> list[_Cell]:
    """One variable (x, NaN: missing) in domains 0..L-1 (codes; -1: in none): each domain's
    non-missing records sorted by value (stable), their weights w, the quantiles at probs and
    the cuts (R's na.rm = TRUE). One sort of the values (by_value: np.argsort(x,
    kind="stable") when known), then a radix sort of their domains (sorted_cells)."""
    o = np.argsort(x, kind="stable") if by_value is None else by_value
    o = o[~np.isnan(x[o]) & (codes[o] >= 0)]
    return sorted_cells(x[o], w[o], codes[o], L, probs, qrule, o)


def cell_quantiles(
    xo: np.ndarray, wo: np.ndarray, co: np.ndarray, L: int, probs: np.ndarray, qrule: str
) -> np.ndarray:
    """quantile_cells' quantiles alone (L x P), from the non-missing records sorted by value
    (stable): their values xo, weights wo and cells co (-1: in none). A radix sort of the cells
    and a gather per call: the value sort and the missing values are the caller's, once per
    variable for every domain coding."""
    probs = np.asarray(probs, dtype=float)
    at, bounds = _by_cell(co, L)
    xs, ws = (xo, wo) if at is None else (xo[at], wo[at])
    out = np.empty((L, len(probs)))
    for c, (a, b) in enumerate(zip(bounds[:-1].tolist(), bounds[1:].tolist(), strict=True)):
        out[c] = weighted_quantile(xs[a:b], ws[a:b], probs, qrule)
    return out


def _cells(
    design: SurveyDesign, cols: list[str], probs: np.ndarray, by: str | None, qrule: str
) -> tuple[list, list[list[_Cell]]]:
    """Domain levels and the cells [variable][level]; records missing the variable (or the
    domain) are dropped: R's na.rm = TRUE, per variable. One sort per variable for all domains."""
    if by is None:
        levels, codes = [None], np.zeros(design.n, dtype=np.int64)
    else:
        if by not in design.df.columns:
            raise sdd.DesignError(f"quantile: domain column '{by}' is not in the data")
        codes, uniq = factorize(design.df[by], sort=True)  # missing domain: -1, no domain
        levels = list(uniq)
    cells = [
        quantile_cells(_column(design, col), design.w, codes, len(levels), probs, qrule)
        for col in cols
    ]
    return levels, cells


def _segments(cell: _Cell) -> tuple[np.ndarray, np.ndarray]:
    """(seg, o): sorted record i falls in segment seg_i = #{k: cut_(k) <= i} of the sorted cuts
    cut_(k) = cut[o[k]]; the records with x <= q_p are the segments 0..k where o[k] = p."""
    o = np.argsort(cell.cut, kind="stable")
    seg = np.searchsorted(cell.cut[o], np.arange(len(cell.xs)), side="right")
    return seg, o


def _cdf(cell: _Cell, divide_first: bool) -> np.ndarray:
    """F(q_p) = sum_{x_i <= q_p} w_i / W as R's svymean of x <= q: Taylor designs sum w_i / W,
    replicate designs divide sum w_i by W (long double sums, as R's colSums)."""
    W = float(np.sum(cell.ws, dtype=LD))
    if not divide_first and len(cell.cum[1]) == len(cell.ws):  # no zero weight: the same sums
        c = cell.cum[1]
    else:
        c = np.cumsum(cell.ws / W if divide_first else cell.ws, dtype=LD).astype(float)
    F = np.where(cell.cut > 0, c[np.maximum(cell.cut - 1, 0)], 0.0)
    return F if divide_first else F / W


# ------------------------------------------------------------------ SE of the CDF at the quantiles
def cdf_taylor(
    design: SurveyDesign, cells: list[_Cell], P: int, g: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """F and its Taylor SE (cells x P): scores z_i = w_i (1{x_i <= q_p} - F_p) / W_d on the
    domain's records (0 elsewhere); PSU totals zt = (PSU sums of w 1{x <= q} - F * PSU sums of
    w) / W_d, one psu_variance (PSUs with replacement in strata) for all cells and p. g: each
    record's PSU code (default the design's; by partition the records are not the design's)."""
    g_all = design.g if g is None else g
    F, zt = np.full((len(cells), P), np.nan), np.zeros((design.n_psu, len(cells) * P))
    for c, cell in enumerate(cells):
        if not len(cell.xs):
            continue
        seg, o = _segments(cell)
        g = g_all[cell.order]
        M = np.bincount(g * (P + 1) + seg, cell.ws, design.n_psu * (P + 1))
        M = M.reshape(design.n_psu, P + 1)
        S = np.empty((design.n_psu, P))
        S[:, o] = np.cumsum(M[:, :P], axis=1)  # PSU sums of w over x <= q_p
        F[c] = _cdf(cell, divide_first=True)
        W = float(np.sum(cell.ws, dtype=LD))
        zt[:, c * P : (c + 1) * P] = (S - F[c] * M.sum(axis=1)[:, None]) / W
    se = np.sqrt(design.psu_variance(zt)).reshape(len(cells), P)
    return F, se


def segment_totals(design: SurveyDesign, cells: list[_Cell], P: int) -> np.ndarray:
    """The replicate totals of each cell's segments between its sorted cuts (P + 1 columns a
    cell, the last up to the domain total): R x cells (P + 1), one replicate_totals."""
    rr, cc, col = [], [], 0
    for cell in cells:
        seg, _ = _segments(cell)
        rr.append(cell.order)
        cc.append(col + seg)
        col += P + 1
    z = sp.csc_matrix(
        (np.ones(sum(map(len, rr))), (np.concatenate(rr), np.concatenate(cc))),
        shape=(design.n, col),
    )
    return design.replicate_totals(z)


def cdf_replicate(
    T: np.ndarray, cells: list[_Cell], P: int, rscales: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """F and its replicate SE (cells x P) from the segments' replicate totals T (R x cells
    (P + 1), segment_totals): F_r = sum_{x <= q} W_ir / sum W_ir over the domain, SE^2 =
    sum_r rscale_r (F_r - F)^2 (centred on F, R's mse = TRUE; replicates where the domain has
    no weight are left out, as R's svrVar)."""
    F, se = np.full((len(cells), P), np.nan), np.full((len(cells), P), np.nan)
    for c, cell in enumerate(cells):
        if not len(cell.xs):
            continue
        _, o = _segments(cell)
        Tc = np.cumsum(T[:, c * (P + 1) : (c + 1) * (P + 1)], axis=1)
        Fr = np.empty((T.shape[0], P))
        with np.errstate(invalid="ignore", divide="ignore"):
            Fr[:, o] = Tc[:, :P] / Tc[:, P:]
        F[c] = _cdf(cell, divide_first=False)
        se[c] = np.sqrt(np.nansum(rscales[:, None] * (Fr - F[c]) ** 2, axis=0))
    return F, se


def _cdf_replicate(design: SurveyDesign, cells: list[_Cell], P: int) -> tuple[np.ndarray, ...]:
    """F and its replicate SE (cells x P): cdf_replicate of the segments' replicate totals."""
    return cdf_replicate(segment_totals(design, cells, P), cells, P, design.rscales)


def _quantile_replicate_se(
    design: SurveyDesign, cell: _Cell, probs: np.ndarray, qrule: str
) -> np.ndarray:
    """SE of the quantiles from the replicate quantiles (R's interval.type "quantile"): the qrule
    under every replicate weight, SE^2 = sum_r rscale_r (q_r - q)^2 (NaN replicates left out)."""
    if not len(cell.xs):
        return np.full(len(probs), np.nan)
    Wr = sdd.take_rows(design.W, cell.order)  # sorted records x R
    reps = np.stack(
        [weighted_quantile(cell.xs, Wr[:, r], probs, qrule) for r in range(Wr.shape[1])]
    )
    return np.sqrt(np.nansum(design.rscales[:, None] * (reps - cell.q) ** 2, axis=0))


# ------------------------------------------------------------------ degrees of freedom
def qr_rank(A: np.ndarray, tol: float = 1e-5) -> int:
    """Rank of A (n x R) as R's qr(A, tol)$rank: gram_rank of A'A."""
    return gram_rank(A.T @ A, tol)


def gram_rank(G: np.ndarray, tol: float = 1e-5) -> int:
    """Rank of A as R's qr(A, tol)$rank (LINPACK dqrdc2, limited pivoting) from its Gram matrix
    G = A'A: columns in order, one counts when the norm of its part orthogonal to the columns
    counted before it is >= tol times its norm. That squared orthogonal norm is the diagonal
    of the Schur complement of the counted columns, S_jj = g_jj - g_Kj' G_KK^-1 g_Kj: each
    counted column is eliminated from the columns after it (one rank-1 update)."""
    S = np.array(G, dtype=float)
    g = np.diag(S).copy()
    R = len(g)
    kept = 0
    for j in range(R):
        r2 = S[j, j]
        if g[j] > 0 and r2 >= tol * tol * g[j]:
            kept += 1
            if j + 1 < R:
                c = S[j + 1 :, j] / r2
                S[j + 1 :, j + 1 :] -= np.outer(c, S[j, j + 1 :])
    return kept


def _replicate_gram(design: SurveyDesign, rows: np.ndarray) -> np.ndarray:
    """W_d'W_d (R x R) of the replicate analysis weights of rows: F' diag(s) F with s_g the sum
    of w_i^2 over the rows in factor group g when the factors W_i / w_i are constant on groups
    (G x R^2, not n x R^2), else the product of the rows' weights."""
    fg = design.factor_groups
    if fg is None:
        Wd = sdd.take_rows(design.W, rows)
        return Wd.T @ Wd
    codes, G, F = fg
    s = np.bincount(codes[rows], design.w[rows] ** 2, minlength=G)
    return (F * s[:, None]).T @ F


def psu_degf(design: SurveyDesign, g: np.ndarray) -> float:
    """R's degf() of the Taylor design restricted to some records, from their PSU codes g:
    PSUs - strata holding them (degf.survey.design2)."""
    psus = np.bincount(g, minlength=design.n_psu) > 0
    return float(np.count_nonzero(psus) - len(np.unique(design.psu_h[psus])))


def _degf(design: SurveyDesign, rows: np.ndarray, kind: str, cache: dict) -> float:
    """R's degf() of the design restricted to rows: Taylor, PSUs - strata holding the records
    (degf.survey.design2); replicate, rank(replicate analysis weights of the rows) - 1 (R's
    `[.svyrep.design` recomputes it for every subset)."""
    key = hashlib.blake2b(rows.tobytes(), digest_size=16).digest()
    if key not in cache:
        if not len(rows):
            cache[key] = np.nan
        elif kind == "taylor":
            cache[key] = psu_degf(design, design.g[rows])
        else:
            cache[key] = float(gram_rank(_replicate_gram(design, rows)) - 1)
    return cache[key]


# ------------------------------------------------------------------ intervals and the estimator
def _crit(alpha: float, df: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """t quantiles at alpha/2 and 1 - alpha/2 on df degrees of freedom (normal where df is
    infinite), as R's qt(., df) in confint and svyquantile's qcrit; NaN where df <= 0."""
    inf = np.isinf(df)
    fin = np.where(inf | ~(df > 0), np.nan, df)
    with np.errstate(invalid="ignore"):
        lo = np.where(inf, stats.norm.ppf(alpha / 2), stats.t.ppf(alpha / 2, fin))
        hi = np.where(inf, stats.norm.ppf(1 - alpha / 2), stats.t.ppf(1 - alpha / 2, fin))
    return lo, hi


def _woodruff(cell: _Cell, p_lo: np.ndarray, p_hi: np.ndarray, qrule: str) -> np.ndarray:
    """Woodruff bounds: the qrule at the CDF's bounds p_lo = F + t_{a/2} SE(F) and
    p_hi = F + t_{1-a/2} SE(F); NaN when p_lo < 0 or p_hi > 1 (as R's woodruffCI)."""
    p = np.r_[np.where(p_lo < 0, np.nan, p_lo), np.where(p_hi > 1, np.nan, p_hi)]
    return quantile_at(*cell.cum, p, qrule).reshape(2, -1)


def woodruff(
    cells: list[_Cell], F: np.ndarray, seF: np.ndarray, dfs: np.ndarray, alpha: float, qrule: str
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Estimates, SEs and Woodruff bounds (cells x P) from F = F(q) and SE(F) (cells x P) and
    each cell's degrees of freedom: bounds Q(F + t_{a/2} SE(F)), Q(F + t_{1-a/2} SE(F)),
    SE = (upper - lower) / (2 t_{1-a/2})."""
    t_lo, t_hi = _crit(alpha, dfs)
    est = np.stack([c.q for c in cells])
    p_lo, p_hi = F + seF * t_lo[:, None], F + seF * t_hi[:, None]
    b = np.stack([_woodruff(c, p_lo[i], p_hi[i], qrule) for i, c in enumerate(cells)])
    lower, upper = b[:, 0], b[:, 1]
    return est, (upper - lower) / (2 * t_hi[:, None]), lower, upper


def _check(
    design: SurveyDesign,
    probs: np.ndarray,
    variance: str | None,
    alpha: float,
    qrule: str,
    interval: str,
) -> str:
    """The variance kind ("taylor" or "replicate"), after checking the arguments."""
    kind = variance or ("replicate" if design.replicate_weights else "taylor")
    if kind not in ("taylor", "replicate"):
        raise sdd.DesignError(f"quantile: variance must be 'taylor' or 'replicate', not {kind!r}")
    if kind == "replicate" and not design.replicate_weights:
        raise sdd.DesignError("quantile: variance='replicate' needs replicate weights")
    if kind == "replicate" and not getattr(design, "mse", True):
        raise sdd.DesignError(
            "quantile: replicate SEs of quantiles centre on the full-sample estimate "
            "(mse=True); this design has mse=False: use mse=True or variance='taylor'"
        )
    if qrule not in QRULES:
        raise sdd.DesignError(f"quantile: qrule must be one of {QRULES}, not {qrule!r}")
    if interval not in ("woodruff", "quantile"):
        raise sdd.DesignError(
            f"quantile: interval must be 'woodruff' or 'quantile', not {interval!r}"
        )
    if interval == "quantile" and kind != "replicate":
        raise sdd.DesignError("quantile: interval='quantile' needs replicate variance")
    if not len(probs) or not ((probs >= 0) & (probs <= 1)).all():
        raise sdd.DesignError("quantile: probs must be in [0, 1]")
    if not 0 < alpha < 1:
        raise sdd.DesignError("quantile: alpha must be in (0, 1)")
    return kind


def survey_quantile(
    design: SurveyDesign,
    cols: str | Sequence[str],
    probs: float | Sequence[float],
    by: str | None = None,
    variance: Literal["taylor", "replicate"] | None = None,
    alpha: float = 0.05,
    qrule: QRule = "math",
    *,
    interval: Literal["woodruff", "quantile"] = "woodruff",
    df: float | None = None,
) -> pd.DataFrame:
    """Survey quantiles of cols at probs (by domain), as R survey 4.x svyquantile(..., na.rm=TRUE).

    Estimate: qrule of the weighted CDF F(x) = sum_{x_i <= x} w_i / W. "math" (= "hf1", R's
    default): the smallest x with F(x) >= p (but, as R, the second smallest when p < w_(1) / W:
    see _discrete); "school" (= "hf2"): the mean of the two values where F(x_k) = p exactly;
    "hf7": linear interpolation over p_k = cw_{k-1} / cw_{n-1}.
    interval "woodruff" (R's interval.type "mean", its default for both kinds of design):
    [Q(F - t SE(F)), Q(F + t SE(F))], F = F(q_p) and SE(F) the Taylor (with-replacement PSUs in
    strata) or replicate SE of the mean of 1{x <= q_p}; NaN bound when its p is outside [0, 1].
    interval "quantile" (replicate only): q +- t sqrt(sum_r rscale_r (q_r - q)^2), q_r the qrule
    under replicate weight r. Replicate SEs centre on the full-sample estimate (R's mse=TRUE;
    R's default, option survey.replicates.mse, centres on the replicates' mean).
    se = (upper - lower) / (2 t), t = t_{1-alpha/2, df}; df = R's
    degf() of the domain's records with the variable (Taylor: PSUs - strata; replicate: rank of
    the replicate weights - 1), or the df given (np.inf: normal).

    Records missing a variable are dropped for that variable (R's na.rm=TRUE, here per variable,
    not across cols); a domain is its records with the other PSUs counting zero. Returns a frame
    indexed by (variable, prob[, by]) with estimate, se, ci_lower, ci_upper (NaN for a domain
    without records).
    """
    cols = [cols] if isinstance(cols, str) else list(cols)
    probs = np.atleast_1d(np.asarray(probs, dtype=float))
    kind = _check(design, probs, variance, alpha, qrule, interval)
    levels, grid = _cells(design, cols, probs, by, qrule)
    cells = [cell for row in grid for cell in row]
    cache: dict = {}
    dfs = np.array(
        [
            np.nan
            if not len(c.order)
            else float(df)
            if df is not None
            else _degf(design, c.rows, kind, cache)
            for c in cells
        ]
    )
    if interval == "quantile":
        _, t_hi = _crit(alpha, dfs)
        est = np.stack([c.q for c in cells])
        s = np.stack([_quantile_replicate_se(design, c, probs, qrule) for c in cells])
        lower, upper = est + (-s) * t_hi[:, None], est + s * t_hi[:, None]
        se = (upper - lower) / (2 * t_hi[:, None])
    else:
        cdf = cdf_taylor if kind == "taylor" else _cdf_replicate
        F, seF = cdf(design, cells, len(probs))
        est, se, lower, upper = woodruff(cells, F, seF, dfs, alpha, qrule)
    shape = (len(cols), len(levels), len(probs))

    def lay(a: np.ndarray) -> np.ndarray:  # (variable, level, prob) -> (variable, prob, level)
        return a.reshape(shape).transpose(0, 2, 1).ravel()

    names = ["variable", "prob"] + ([] if by is None else [by])
    parts = [cols, probs.tolist()] + ([] if by is None else [levels])
    index = pd.MultiIndex.from_product(parts, names=names)
    out = {"estimate": lay(est), "se": lay(se), "ci_lower": lay(lower), "ci_upper": lay(upper)}
    return pd.DataFrame(out, index=index)


class Quantiles:
    """SurveyDesign.quantile (a mixin: this module sits below sdl_design.survey.design):
    survey_quantile with the design as its first argument."""

    quantile = survey_quantile
