"""The file that would be published against the confidential original, each under its own design.

The original is read with its strata, PSUs and replicate weights; the released file exactly as
a user of the public README reads it: its published (pseudo) strata and PSUs and its published
replicate weights, with the spec's weight and replicate method. Both are SurveyDesigns
(`SurveyDesign.from_spec`). Four parts:

- domain estimates: every study variable (mean, or proportion for a 0/1 variable, and total)
  overall, by each analysis domain and by each pair of domains, and the median and quartiles
  of every continuous one (R's svyquantile: Woodruff SEs) overall and by each domain; estimate
  and SE on both files, relative bias, standardized bias (released - original) / SE_original,
  the CI overlap of Karr, Kohnen, Oganian, Reiter and Sanil (2006) and the SE ratio;
- analysis models: survey-weighted GLMs (sdl_design.survey.glm) on both files, coefficient by
  coefficient;
- general utility: the propensity-score pMSE ratio of Snoke, Raab, Nowok, Dibben and
  Slavkovic (2018);
- disclosure risk of the published file: a re-identification attack with the intruder's keys.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from itertools import combinations
from typing import Any, Literal

import numpy as np
import pandas as pd
import scipy.sparse as sp
from scipy.stats import norm

from sdl_design.attack import IntruderKey, attack_battery, intruder_key
from sdl_design.codes import factorize
from sdl_design.keys import bin_codes, bin_labels, coarsen
from sdl_design.leaks import psu_recoverable
from sdl_design.spec import KeySpec, ReleaseSpec
from sdl_design.stage import gate
from sdl_design.stages.massc.measures import delta_measures
from sdl_design.survey.design import (
    DesignError,
    SurveyDesign,
    dense_codes,
    first_of,
    group_indicator,
    pair_replicate_totals,
    replicate_options,
    resolve_replicates,
)
from sdl_design.survey.glm import (
    FormulaError,
    GLMFit,
    design_matrix,
    independent_columns,
    irls,
    parse_formula,
    svyglm,
    term_levels,
    weighted_gram,
)
from sdl_design.survey.quantiles import (
    _degf,
    cdf_replicate,
    cdf_taylor,
    gram_rank,
    psu_degf,
    segment_totals,
    sorted_cells,
    woodruff,
)

Variance = Literal["taylor", "replicate"]
DomainArg = str | Sequence[str]


# ---------------------------------------------------------------- Karr et al. (2006) CI overlap


def ci_overlap(
    est_a: np.ndarray,
    se_a: np.ndarray,
    est_b: np.ndarray,
    se_b: np.ndarray,
    level: float = 0.95,
) -> np.ndarray:
    """Karr et al. (2006) overlap of the level-CIs (L_a, U_a) = est_a -/+ z se_a and (L_b, U_b):

        J = 1/2 [ (U - L) / (U_a - L_a) + (U - L) / (U_b - L_b) ],  L = max(L_a, L_b),
                                                                    U = min(U_a, U_b),

    and J = 0 when the intervals are disjoint (U < L). J = 1 for identical intervals, J < 1
    otherwise (for nested intervals J = (1 + w_inner / w_outer) / 2). For two normal intervals
    with equal SE s and estimates d apart, J = 1 - d / (2 z s) while d <= 2 z s. A zero-width
    interval's term is 1 when it lies in the other interval and 0 otherwise; a missing
    estimate or SE gives 0 (the file cannot answer the question)."""
    z = float(norm.ppf(0.5 + level / 2.0))
    a, sa, b, sb = (np.asarray(v, dtype=float) for v in (est_a, se_a, est_b, se_b))
    la, ua, lb, ub = a - z * sa, a + z * sa, b - z * sb, b + z * sb
    inter = np.minimum(ua, ub) - np.maximum(la, lb)
    with np.errstate(divide="ignore", invalid="ignore"):
        ta = np.where(ua > la, inter / (ua - la), (inter >= 0).astype(float))
        tb = np.where(ub > lb, inter / (ub - lb), (inter >= 0).astype(float))
    out = np.where(inter >= 0, 0.5 * (ta + tb), 0.0)
    return np.where(np.isfinite(out), out, 0.0)


# ---------------------------------------------------------------- designs and codings


def file_design(
    df: pd.DataFrame, spec: ReleaseSpec, replicates: bool = True, design: Any = None
) -> SurveyDesign:
    """The design a user reads off df with the names of `design` (default the spec's design
    section): weight, the strata and PSU columns that are declared and present (no strata: one
    stratum; no PSU: each record its own PSU), replicate weights when present, fpc (and ssu,
    fpc2) when present, the declared lonely_psu rule. The segment (never published) plays no
    part in a variance and is left out."""
    d = (design or spec.design).model_copy(update={"segment": None})
    strata = d.strata if d.strata in df.columns else None
    psu = d.psu if d.psu in df.columns else None
    rs = d.replicate_weights
    rw = resolve_replicates(df.columns, rs.columns) if (replicates and rs) else []
    rw = [c for c in rw if c in df.columns]
    # the finite population corrections where the file has their columns (the input; a public
    # file never carries them), and the lonely-PSU rule the spec declares
    declared = {f: getattr(d, f) for f in ("fpc", "ssu", "fpc2") if getattr(d, f)}
    fpc = declared if all(c in df.columns for c in declared.values()) else {}
    try:
        return SurveyDesign(
            df,
            d.weight,
            strata=strata,
            psu=psu,
            replicate_weights=rw or None,
            lonely_psu=d.lonely_psu,
            **fpc,
            **(replicate_options(rs) if rw else {}),
        )
    except DesignError:  # e.g. jkn replicates without the PSUs they delete: unusable
        return SurveyDesign(df, d.weight, strata=strata, psu=psu, lonely_psu=d.lonely_psu, **fpc)


def gate_variance(
    spec: ReleaseSpec, released_columns: Sequence[str], design_released: Any = None
) -> Variance:
    """The SE the gates compare (issue 34 item 3): the producer's replicate SE when the input
    comes with replicate weights and the released file (read with design_released, default
    the spec's design) carries replicate weights too; else Taylor's with the strata/PSUs."""
    rs = (design_released or spec.design).replicate_weights
    if spec.design.replicate_weights is None or rs is None:
        return "taylor"
    return "replicate" if resolve_replicates(list(released_columns), rs.columns) else "taylor"


def _key_specs(spec: ReleaseSpec) -> dict[str, KeySpec]:
    return {k.name: k for k in spec.variables.keys}


@dataclass
class Coding:
    """One variable on several files: integer codes per file into one category list."""

    codes: list[np.ndarray]
    categories: list

    def series(self, f: int, index: pd.Index, missing: bool = True) -> pd.Series:
        """File f as a Categorical Series ('missing' as NaN when missing is False)."""
        cats = self.categories
        c = self.codes[f]
        if not missing and "missing" in cats:
            m = cats.index("missing")
            c = np.where(c == m, -1, c)
            c = np.where(c > m, c - 1, c)
            cats = [x for x in cats if x != "missing"]
        return pd.Series(pd.Categorical.from_codes(c, categories=cats), index=index)


def published_coding(
    frames: Sequence[pd.DataFrame], name: str, keys: Mapping[str, KeySpec]
) -> Coding:
    """Column `name` of each frame coded into one category list across frames: a key in its
    published coding (keys.coarsen: bins in bin order, map values sorted), any other column as
    is (sorted values). Missing values are the last category, 'missing'; categories no file
    uses are left out."""
    k = keys.get(name)
    if k is not None and k.bins is not None:
        cats: list = [*bin_labels(k.bins), "out_of_range", "missing"]
        codes = []
        for f in frames:  # raw values or bin labels (a published file)
            c = bin_codes(f[name], k.bins)
            codes.append(np.where(c < 0, len(cats) - 1, c))
    else:
        vals = [
            coarsen(f[name], None, k.map) if k is not None and k.map else f[name] for f in frames
        ]
        allv = pd.concat(vals, ignore_index=True)
        try:
            c, u = factorize(allv, sort=True)
        except TypeError:  # mixed types: sort as text
            c, u = factorize(allv.astype(str).where(allv.notna()), sort=True)
        cats = [*u.tolist(), "missing"]
        c = np.where(c < 0, len(u), c)
        bounds = np.cumsum([0, *(len(v) for v in vals)])
        codes = [c[bounds[j] : bounds[j + 1]] for j in range(len(frames))]
    used = np.zeros(len(cats), dtype=bool)
    for c in codes:
        used[c] = True
    remap = np.cumsum(used) - 1
    return Coding(
        [remap[c].astype(np.int64) for c in codes],
        [x for x, u in zip(cats, used, strict=True) if u],
    )


def _domain_list(
    domains: Sequence[DomainArg] | None, keys: list[str], pairs: bool = True
) -> list[tuple[str, ...]]:
    """Overall, each domain and (pairs True) each pair of domains (crossings with the union of
    their variables), without repeats."""
    given = [(d,) if isinstance(d, str) else tuple(d) for d in (domains or keys)]
    crossed = [tuple(dict.fromkeys(a + b)) for a, b in combinations(given, 2)] if pairs else []
    out: list[tuple[str, ...]] = [()]
    seen: set[frozenset] = {frozenset()}
    for g in [*given, *crossed]:
        if frozenset(g) not in seen:
            seen.add(frozenset(g))
            out.append(g)
    return out


def _cells(
    coded: Sequence[Coding], sizes: Sequence[int]
) -> tuple[list[np.ndarray], list[str], int]:
    """Cell codes of a crossing on every file (shared codes; the cells observed in some file),
    labels 'a, b' and the number of cells. No variables: one cell 'all'."""
    codes = [np.zeros(m, dtype=np.int64) for m in sizes]
    if not coded:
        return codes, ["all"], 1
    for var in coded:
        m = len(var.categories)
        codes = [c * m + v for c, v in zip(codes, var.codes, strict=True)]
    uniq, inv = dense_codes(np.concatenate(codes))
    bounds = np.cumsum([0, *sizes])
    out = [inv[bounds[f] : bounds[f + 1]].astype(np.int64) for f in range(len(sizes))]
    rest, parts = uniq.copy(), []
    for var in reversed(coded):
        cats = np.asarray([str(c) for c in var.categories], dtype=object)
        parts.append(cats[rest % len(cats)])
        rest //= len(cats)
    labels = [", ".join(t) for t in zip(*reversed(parts), strict=True)]
    return out, labels, len(uniq)


# ---------------------------------------------------------------- domain estimates


@dataclass
class _Study:
    """Study columns on one file: values with NaN set to 0 (Y0), non-missing indicators (M)."""

    names: list[str]
    kinds: list[str]  # "mean" | "proportion"
    Y0: np.ndarray  # n x k
    M: np.ndarray  # n x k


@dataclass(frozen=True)
class StudyPlan:
    """How the study variables become columns on every file: a numeric one as it is (kind
    'proportion' when its values in the first file are all 0/1, else 'mean'), a categorical
    one as one 0/1 column per category ('var=cat', missing where the variable is)."""

    variables: tuple[tuple[str, str | None, tuple], ...]  # (name, numeric kind | None, cats)

    @property
    def names(self) -> list[str]:
        return [
            n
            for v, kind, cats in self.variables
            for n in ([v] if kind else [f"{v}={c}" for c in cats])
        ]

    @property
    def kinds(self) -> list[str]:
        return [
            k
            for _, kind, cats in self.variables
            for k in ([kind] if kind else ["proportion"] * len(cats))
        ]

    @property
    def continuous(self) -> list[str]:
        """The numeric study variables that are not 0/1 (kind 'mean'): their quantiles too."""
        return [v for v, kind, _ in self.variables if kind == "mean"]

    def continuous_values(self, f: pd.DataFrame) -> np.ndarray:
        """The file's continuous study variables (n x k, missing values NaN)."""
        cols = [pd.to_numeric(f[v], errors="coerce").to_numpy(dtype=float) for v in self.continuous]
        return np.column_stack(cols) if cols else np.zeros((len(f), 0))

    def study(self, f: pd.DataFrame) -> _Study:
        """The file's study columns (Y0, M)."""
        cols = []
        for v, kind, cats in self.variables:
            if kind:
                cols.append(pd.to_numeric(f[v], errors="coerce").to_numpy(dtype=float))
                continue
            missing = f[v].isna()
            for c in cats:
                cols.append(np.where(missing, np.nan, (f[v] == c).to_numpy(dtype=float)))
        Y = np.column_stack(cols) if cols else np.zeros((0, 0))
        M = np.isfinite(Y)
        return _Study(self.names, self.kinds, np.where(M, Y, 0.0), M.astype(float))


def study_kind(s: pd.Series) -> str | None:
    """A study variable's kind on the first file: 'proportion' (numeric, every finite value
    0 or 1), 'mean' (numeric), None (categorical)."""
    if not (pd.api.types.is_numeric_dtype(s) or pd.api.types.is_bool_dtype(s)):
        return None
    x = pd.to_numeric(s, errors="coerce").to_numpy(dtype=float)
    return "proportion" if np.isin(x[np.isfinite(x)], (0.0, 1.0)).all() else "mean"


def study_plan(frames: Sequence[pd.DataFrame], study: Sequence[str]) -> StudyPlan:
    """The StudyPlan of the files (categories: the values of every file, sorted as text)."""
    out = []
    for v in study:
        kind = study_kind(frames[0][v])
        cats = (
            ()
            if kind
            else tuple(sorted(pd.unique(pd.concat([f[v].dropna() for f in frames])), key=str))
        )
        out.append((v, kind, cats))
    return StudyPlan(tuple(out))


@dataclass
class _Pairs:
    """One file's records summed by pair of (PSU, factor group) and profile of the domain
    variables: every domain's cells are unions of profiles, so each domain's sums come from
    these pairs instead of the records."""

    psu: np.ndarray  # PSU of each pair
    grp: np.ndarray | None  # factor group of each pair (row of the design's F); None: none
    prof: np.ndarray  # profile of each pair
    S: np.ndarray  # pairs x 4k: sums of w y, w m, m and |w y|
    prof_rec: np.ndarray  # profile of each record


def _file_pairs(design: SurveyDesign, st: _Study, prof_rec: np.ndarray, n_prof: int) -> _Pairs:
    """The pair sums of one file (one pass over its records)."""
    k = st.Y0.shape[1]
    fac = design.factor_groups
    # factor groups refined by PSU (a group normally lies in one PSU; the PSU is kept exact)
    key = design.g if fac is None else fac[0] * design.n_psu + design.g
    grp_u, grp_rec = dense_codes(key)
    pair, of = dense_codes(grp_rec * n_prof + prof_rec)
    A = group_indicator(of, len(pair))  # pairs x records
    w = design.w[:, None]
    wY = w * st.Y0
    S = np.empty((len(pair), 4 * k))
    S[:, :k] = A @ wY
    S[:, k : 2 * k] = A @ (w * st.M)
    S[:, 2 * k : 3 * k] = A @ st.M
    S[:, 3 * k :] = A @ np.abs(wY, out=wY)
    g = grp_u[pair // n_prof]
    return _Pairs(
        psu=g if fac is None else g % design.n_psu,
        grp=None if fac is None else g // design.n_psu,
        prof=pair % n_prof,
        S=S,
        prof_rec=prof_rec,
    )


def domain_estimates_of(
    design: SurveyDesign,
    st: _Study,
    pairs: _Pairs,
    cell_of_prof: np.ndarray,
    L: int,
    replicates: bool,
    profile_replicates: np.ndarray | None = None,
) -> dict[str, np.ndarray]:
    """Means (ratios to the non-missing weight: domain estimation over the non-missing records)
    and totals of every study variable in every cell (cell_of_prof: each profile's cell),
    arrays L x k, with Taylor SEs and (when replicates and the design has them) replicate SEs.
    profile_replicates: the replicate totals of (y, m) by profile (R x profiles x 2k), when
    they were summed elsewhere (by partition); the design then gives only its PSUs and scales.

    From the file's pair sums: the PSU x cell sums of w y, w m and m (counted, not sorted);
    the PSU totals of the linearized scores, z = w d m (y - R_d) / X_d for means and w d m y
    for totals, follow from them and go to the design's with-replacement kernel as one sparse
    PSUs x (cells x 2 x variables) matrix; replicate totals are F' (factor group x cell sums).
    A mean whose cell has non-missing records in one PSU only has Taylor SE 0 (set exactly,
    not left at rounding level)."""
    k = st.Y0.shape[1]
    cell = cell_of_prof[pairs.prof]
    pair, of = dense_codes(pairs.psu * L + cell)  # (PSU, cell) pairs; the pair of each pair
    pg, pc = pair // L, pair % L
    T = group_indicator(of, len(pair)) @ pairs.S
    Sy, Sm, Sn, Sa = (T[:, j * k : (j + 1) * k] for j in range(4))
    Cp = sp.csr_matrix((np.ones(len(pc)), (pc, np.arange(len(pc)))), shape=(L, len(pc)))
    Ty, Tm, cnt, Ta = (np.asarray(Cp @ a) for a in (Sy, Sm, Sn, Sa))
    npsu = np.asarray(Cp @ (Sn > 0).astype(float))
    with np.errstate(divide="ignore", invalid="ignore"):
        R = Ty / Tm
        zm = np.where(Sm > 0, (Sy - R[pc] * Sm) / Tm[pc], 0.0)
    kk = 2 * k
    zt = sp.csr_matrix(
        (
            np.concatenate([zm, Sy], axis=1).ravel(),
            (pc[:, None] * kk + np.arange(kk)[None, :]).ravel(),
            np.r_[0, np.cumsum(np.bincount(pg, minlength=design.n_psu) * kk)],
        ),
        shape=(design.n_psu, L * kk),
    )
    var = design.psu_variance(zt).reshape(L, 2, k)
    se_mean = np.sqrt(var[:, 0])
    with np.errstate(divide="ignore", invalid="ignore"):
        tiny = se_mean <= 1e-10 * Ta / Tm  # rounding level of the cell's mean |y|
    se_mean[(npsu <= 1) | tiny] = 0.0
    out = {"n": cnt, "mean": R, "se_mean": se_mean, "total": Ty, "se_total": np.sqrt(var[:, 1])}
    if replicates and design.replicate_weights:
        fac = None if profile_replicates is not None else design.factor_groups
        if profile_replicates is not None:
            n_rep, P = profile_replicates.shape[:2]
            C = sp.csr_matrix((np.ones(P), (cell_of_prof, np.arange(P))), shape=(L, P))
            by_prof = profile_replicates.transpose(1, 0, 2).reshape(P, n_rep * kk)
            t = np.asarray(C @ by_prof).reshape(L, n_rep, kk).transpose(1, 0, 2)
        elif fac is not None:
            t = pair_replicate_totals(fac[2], pairs.grp, cell, pairs.S[:, :kk], L)
        else:  # factors not constant on groups: W_c' y_c over the records of each cell
            Y2 = np.concatenate([st.Y0, st.M], axis=1)
            t = design.replicate_cell_totals(Y2, cell_of_prof[pairs.prof_rec], L)
        t = t.reshape(-1, L, 2, k)
        with np.errstate(divide="ignore", invalid="ignore"):
            dm = (t[:, :, 0] / t[:, :, 1] - R[None]).reshape(len(t), -1)
        dt = (t[:, :, 0] - Ty[None]).reshape(len(t), -1)
        se_rep = np.sqrt(design.rscales @ (dm * dm)).reshape(L, k)
        with np.errstate(divide="ignore", invalid="ignore"):
            se_rep[se_rep <= 1e-10 * Ta / Tm] = 0.0  # rounding level, as Taylor's above
        out["se_rep_mean"] = se_rep
        out["se_rep_total"] = np.sqrt(design.rscales @ (dt * dt)).reshape(L, k)
    return out


# the quantiles of every continuous study variable: the statistic's name and its probability
QUANTILES = {"q25": 0.25, "median": 0.5, "q75": 0.75}
QUANTILE_RULE = "math"  # R's svyquantile default: the smallest x with F(x) >= p
MEAN_STATISTICS = ("mean", "proportion")  # the statistics whose SE ratios are gated


def domain_quantiles_of(
    design: SurveyDesign,
    variables: Sequence[SortedVariable],
    g: np.ndarray,
    codes: np.ndarray,
    L: int,
    variance: Variance,
    level: float = 0.95,
    replicate: Sequence[tuple[np.ndarray, np.ndarray]] | None = None,
) -> dict[str, np.ndarray]:
    """The QUANTILES of every continuous study variable (variables: each one's records sorted
    by value, sorted_variables) in every cell (codes: each profile's, -1 none), as
    survey_quantile gives them (R's svyquantile with na.rm=TRUE: over the cell's non-missing
    records; qrule "math"; Woodruff interval at level with the cell's degrees of freedom, SE
    its width / 2 t): n (L x k), estimate and se (L x k x P). g: the records' PSU codes in the
    design. variance "replicate": the SE of the CDF at the quantile from the replicate weights
    (centred on the full-sample CDF) and the cell's df from their rank: the replicate totals
    by segment and the Gram of the replicate weights by cell are `replicate`'s (one (T, grams)
    per variable, summed by partition) or else the design's."""
    probs = np.array(list(QUANTILES.values()))
    P, k = len(probs), len(variables)
    out = {"n": np.zeros((L, k)), "estimate": np.full((L, k, P), np.nan)}
    out["se"] = out["estimate"].copy()
    cache: dict = {}
    for j, v in enumerate(variables):
        cells = sorted_cells(v.x, v.w, codes[v.profile], L, probs, QUANTILE_RULE, v.index)
        n = np.array([len(c.order) for c in cells], dtype=float)
        if variance == "taylor":
            F, seF = cdf_taylor(design, cells, P, g)
            dfs = [psu_degf(design, g[c.order]) for c in cells]
        elif replicate is None:
            F, seF = cdf_replicate(segment_totals(design, cells, P), cells, P, design.rscales)
            dfs = [_degf(design, c.rows, "replicate", cache) for c in cells]
        else:
            T, grams = replicate[j]
            F, seF = cdf_replicate(T, cells, P, design.rscales)
            dfs = [_gram_degf(G, cache) for G in grams]
        dfs = np.where(n > 0, dfs, np.nan)
        est, se, _, _ = woodruff(cells, F, seF, dfs, 1.0 - level, QUANTILE_RULE)
        out["n"][:, j], out["estimate"][:, j], out["se"][:, j] = n, est, se
    return out


def _gram_degf(G: np.ndarray, cache: dict) -> float:
    """rank(G) - 1, the replicate df of a cell from its Gram, once per distinct Gram (the
    study variables without missing values share their cells' Grams)."""
    key = ("gram", hashlib.blake2b(np.ascontiguousarray(G).tobytes(), digest_size=16).digest())
    if key not in cache:
        cache[key] = gram_rank(G) - 1.0
    return cache[key]


@dataclass
class SortedVariable:
    """One continuous variable's records with a value, sorted by it (stable): their values,
    weights, profiles and record indices (quantile cells in any grouping of the profiles)."""

    x: np.ndarray
    w: np.ndarray
    profile: np.ndarray
    index: np.ndarray


def sorted_variables(X: np.ndarray, w: np.ndarray, profile: np.ndarray) -> list[SortedVariable]:
    """Each column of X (records x k, NaN missing) as a SortedVariable: one sort per variable
    for every grouping of the records' profiles (indices and profiles < records: int32 while
    they fit)."""
    small = np.int32 if len(w) < 2**31 else np.int64
    out = []
    for j in range(X.shape[1]):
        o = np.argsort(X[:, j], kind="stable")
        o = o[~np.isnan(X[o, j])]
        out.append(SortedVariable(X[o, j], w[o], profile[o].astype(small), o.astype(small)))
    return out


def _profiles(
    coding: Mapping[str, Coding], sizes: Sequence[int]
) -> tuple[list[np.ndarray], list[int], dict[str, Coding]]:
    """Each file's records coded by their profile on the coded variables (dense, per file), the
    number of profiles of each file, and each variable's Coding of the profiles (its code at
    each profile of each file)."""
    prof_rec, firsts = [], []
    for f, n in enumerate(sizes):
        prof = np.zeros(n, dtype=np.int64)
        for c in coding.values():
            prof = dense_codes(prof * len(c.categories) + c.codes[f])[1]
        first = first_of(prof, int(prof.max(initial=-1)) + 1)
        prof_rec.append(prof)
        firsts.append(first)
    at = {
        v: Coding([c.codes[f][firsts[f]] for f in range(len(sizes))], c.categories)
        for v, c in coding.items()
    }
    return prof_rec, [len(x) for x in firsts], at


def _compare(
    est_o: np.ndarray, se_o: np.ndarray, est_r: np.ndarray, se_r: np.ndarray, level: float
) -> dict[str, np.ndarray]:
    diff = est_r - est_o
    with np.errstate(divide="ignore", invalid="ignore"):
        rel = diff / np.abs(est_o)
        std = np.where(diff == 0, 0.0, diff / se_o)
        ratio = np.where(se_r == se_o, 1.0, se_r / se_o)
    return {
        "relative_bias": rel,
        "std_bias": std,
        "ci_overlap": ci_overlap(est_o, se_o, est_r, se_r, level),
        "se_ratio": ratio,
    }


# ---------------------------------------------------------------- pMSE (Snoke et al. 2018)


def pmse_ratio(
    a: pd.DataFrame,
    b: pd.DataFrame,
    categorical: Sequence[str],
    numeric: Sequence[str],
) -> dict[str, float]:
    """Propensity-score mean squared error of telling b from a (Snoke, Raab, Nowok, Dibben and
    Slavkovic 2018): stack the two files, fit a logistic model of membership in b on main
    effects (treatment dummies of the categorical columns; numeric columns as is, missing values
    set to the mean plus a missing indicator), pMSE = mean_i (p_i - c)^2 with c = n_b / N.

    pmse_ratio divides by the null expectation for two independent samples of one population,
    (k - 1) c (1 - c) / N with k the number of (non-aliased) parameters: under that null
    p_i - c ~ c (1 - c) x_i' (b - b0) with Cov(b) = (c (1 - c) X'X)^-1, so sum_i (p_i - c)^2 ~
    c (1 - c) chi2_{k-1} (the intercept takes one degree: mean p_i = c). Two random halves of a
    file give ~1 (tests/test_assess.py). pmse_ratio_snoke divides by the expectation printed in
    Snoke et al. and used by synthpop, (k - 1)(1 - c)^2 c / N, which is meant for synthetic data
    drawn from a model of the original and reads 1 / (1 - c) (2 for halves) at this null."""
    N, nb = len(a) + len(b), len(b)
    both = pd.concat([a, b], ignore_index=True)
    levels = {v: factorize(both[v], sort=True, use_na_sentinel=False)[1] for v in categorical}
    stats = {}
    for v in numeric:
        x = _numeric(both[v])
        seen = x[np.isfinite(x)]
        if len(seen):
            stats[v] = (seen.mean(), seen.std(), len(seen) < len(x))
    layout = pmse_layout(categorical, levels, numeric, stats)
    X = pmse_matrix(both, layout)
    del both
    y = np.r_[np.zeros(len(a)), np.ones(nb)]
    keep = independent_columns(weighted_gram(X, np.ones(N)))
    if len(keep) < X.shape[1]:
        X = X[:, keep]
    beta, p, converged, _ = irls(X, y, np.ones(N), "binomial", max_iter=PMSE_MAX_ITER)
    c = nb / N
    return pmse_metrics(float(np.mean((p - c) ** 2)), len(keep), N, nb, converged)


PMSE_MAX_ITER = 50  # IRLS steps of the pMSE's propensity model


@dataclass(frozen=True)
class PmseLayout:
    """The columns of the pMSE's propensity model: the intercept, treatment dummies of each
    categorical column with more than one level (against its first), each numeric column
    standardized (missing values at the mean, then a missing indicator when any is missing)."""

    categorical: tuple[tuple[str, pd.Index], ...]
    numeric: tuple[tuple[str, float, float, bool], ...]  # column, mean, sd, any missing
    p: int


def _numeric(s: pd.Series) -> np.ndarray:
    return pd.to_numeric(s, errors="coerce").to_numpy(dtype=float)


def pmse_layout(
    categorical: Sequence[str],
    levels: dict[str, Any],
    numeric: Sequence[str],
    stats: dict[str, tuple[float, float, bool]],
) -> PmseLayout:
    """The model's columns from the files' levels (sorted, a missing value last) and the
    numeric columns' mean, SD and whether any value is missing (a column missing everywhere
    has no stats and no column)."""
    cat = tuple((v, pd.Index(levels[v])) for v in categorical if len(levels[v]) > 1)
    num = tuple((v, *stats[v]) for v in numeric if v in stats)
    p = 1 + sum(len(lv) - 1 for _, lv in cat) + sum(1 + int(m) for *_, m in num)
    return PmseLayout(cat, num, p)


def pmse_matrix(df: pd.DataFrame, layout: PmseLayout) -> sp.csr_matrix:
    """The model matrix of df's records as CSR with one stored entry per row and block (a
    dummy block's entry is its level's column, an explicit 0 at the reference level): (value,
    column) of each block first, then written straight into the row-major arrays CSR keeps
    (no stacking copies)."""
    N = len(df)
    blocks: list[tuple[Any, Any]] = [(1.0, 0)]  # the intercept
    p = 1
    for v, lv in layout.categorical:
        each, distinct = factorize(df[v], use_na_sentinel=False)  # each distinct value once
        codes = lv.get_indexer(distinct)[each]
        if (codes < 0).any():
            raise ValueError(f"pMSE: a value of {v} is not among the files' levels")
        blocks.append((codes > 0, p + np.maximum(codes - 1, 0)))
        p += len(lv) - 1
    for v, mu, sd, has_missing in layout.numeric:
        x = _numeric(df[v])
        miss = ~np.isfinite(x)
        blocks.append(((np.where(miss, mu, x) - mu) / (sd or 1.0), p))
        p += 1
        if has_missing:
            blocks.append((miss, p))
            p += 1
    c = len(blocks)
    data, index = np.empty((N, c)), np.empty((N, c), dtype=np.int32)
    for j, (value, col) in enumerate(blocks):
        data[:, j], index[:, j] = value, col
    del blocks
    return sp.csr_matrix(
        (data.reshape(-1), index.reshape(-1), np.arange(0, N * c + 1, c, dtype=np.int64)),
        shape=(N, layout.p),
    )


def pmse_metrics(pmse: float, k: int, N: int, nb: int, converged: bool) -> dict[str, float]:
    """pmse_ratio's metrics from the pMSE (mean (p_i - c)^2) and the model's k parameters."""
    c = nb / N
    null = (k - 1) * c * (1 - c) / N
    snoke = (k - 1) * (1 - c) ** 2 * c / N
    return {
        "pmse": pmse,
        "pmse_null": null,
        "pmse_ratio": pmse / null if null > 0 else float("nan"),
        "pmse_ratio_snoke": pmse / snoke if snoke > 0 else float("nan"),
        "pmse_k": float(k),
        "pmse_converged": float(converged),
    }


# ---------------------------------------------------------------- re-identification


def reidentification(original_keys: pd.DataFrame, released_keys: pd.DataFrame) -> dict[str, float]:
    """The intruder matches each record's key profile from the original file (the published
    coding) to the released file's profiles. For a record whose label is in the released file
    and whose released profile equals its original one, the matching cell holds F >= 1
    released records, one of them the true one: it is matched correctly with probability 1/F.
    Returns the expected correct matches sum 1/F, their rate per original record, and the
    share of the original sample uniques (cells of size 1 in the original) that are correctly
    and uniquely (F = 1) matched."""
    if not released_keys.index.is_unique or not original_keys.index.is_unique:
        raise ValueError("reidentification: index labels must be unique in both files")
    cols = list(original_keys.columns)
    both = pd.concat([original_keys[cols], released_keys[cols]], ignore_index=True)
    prof = np.zeros(len(both), dtype=np.int64)
    for c in cols:  # profile ids, one key at a time (missing values are a value)
        codes = factorize(both[c], use_na_sentinel=False)[0]
        prof = np.unique(prof * (int(codes.max(initial=0)) + 1) + codes, return_inverse=True)[1]
    po, pr = prof[: len(original_keys)], prof[len(original_keys) :]
    G = int(prof.max()) + 1 if len(prof) else 0
    F = np.bincount(pr, minlength=G)
    n_orig = np.bincount(po, minlength=G)
    pos = released_keys.index.get_indexer(original_keys.index)  # -1: not released
    kept = pos >= 0
    same = np.zeros(len(po), dtype=bool)
    same[kept] = pr[pos[kept]] == po[kept]
    Fi = F[po]
    expected = float(np.sum(1.0 / Fi[same]))
    unique = n_orig[po] == 1
    hit = unique & same & (Fi == 1)
    n_unique = int(unique.sum())
    return {
        "reid_expected_matches": expected,
        "reid_expected_match_rate": expected / len(po) if len(po) else 0.0,
        "reid_sample_uniques": float(n_unique),
        "reid_unique_matches": float(hit.sum()),
        "reid_share": float(hit.sum() / n_unique) if n_unique else 0.0,
    }


# ---------------------------------------------------------------- the assessment


@dataclass
class Assessment:
    """Domain estimates and model coefficients on both files, and the scalar metrics."""

    domain_estimates: pd.DataFrame
    model_coefficients: pd.DataFrame
    metrics: dict[str, float]
    params: dict[str, Any] = field(default_factory=dict)

    @property
    def tables(self) -> dict[str, pd.DataFrame]:
        return {
            "domain_estimates": self.domain_estimates,
            "model_coefficients": self.model_coefficients,
        }

    def worst(self, n: int = 20, reliable_only: bool = True) -> pd.DataFrame:
        """The n estimates with the largest |standardized bias| over the whole table (missing
        values last); only reliable ones (enough original records, SE > 0) by default."""
        t = self.domain_estimates
        if reliable_only:
            t = t[t["reliable"]]
        order = np.argsort(-np.nan_to_num(t["std_bias"].abs().to_numpy(), nan=-1.0), kind="stable")
        return t.iloc[order[:n]]


def _model_specs(models: Sequence[Any] | None) -> list[tuple[str, str]]:
    out = []
    for m in models or []:
        if isinstance(m, str):
            out.append((m, "gaussian"))
        elif isinstance(m, Mapping):
            out.append((m["formula"], m.get("family", "gaussian")))
        elif isinstance(m, tuple):
            out.append((m[0], m[1]))
        else:
            out.append((m.formula, m.family))
    return out


MODEL_COLUMNS = [
    "model",
    "family",
    "term",
    "coef_original",
    "se_original",
    "coef_released",
    "se_released",
    "ci_overlap",
    "std_diff",
    "se_ratio",
]


def model_rows(
    text: str, family: str, fo: GLMFit, fr: GLMFit, variance: Variance, level: float
) -> pd.DataFrame:
    """One model's coefficients on both files, compared (the model_coefficients rows)."""
    se_o = fo.se_replicate if variance == "replicate" else fo.se_taylor
    se_r = fr.se_replicate if variance == "replicate" else fr.se_taylor
    cmp = _compare(fo.coef, se_o, fr.coef, se_r, level)
    return pd.DataFrame(
        {
            "model": text,
            "family": family,
            "term": fo.names,
            "coef_original": fo.coef,
            "se_original": se_o,
            "coef_released": fr.coef,
            "se_released": se_r,
            "ci_overlap": cmp["ci_overlap"],
            "std_diff": cmp["std_bias"],
            "se_ratio": cmp["se_ratio"],
            "se_taylor_original": fo.se_taylor,
            "se_taylor_released": fr.se_taylor,
            "se_replicate_original": fo.se_replicate,
            "se_replicate_released": fr.se_replicate,
            "n_original": fo.n_used,
            "n_released": fr.n_used,
            "converged": fo.converged and fr.converged,
            "warnings": model_warnings(fo, fr),
        }
    )


def model_warnings(fo: GLMFit, fr: GLMFit) -> str | float:
    """The fits' warnings (GLMFit.warnings: not converged, diverged) of one model on the
    original and the released file, in one text; NaN when there are none."""
    said = [f"{f}: {w}" for f, fit in (("original", fo), ("released", fr)) for w in fit.warnings]
    return "; ".join(said) if said else np.nan


def model_metrics(coefs: pd.DataFrame) -> dict[str, float]:
    """The models' metrics: the smallest CI overlap and largest |std diff| of a coefficient."""
    if not len(coefs):
        return {}
    return {
        "model_overlap_min": float(coefs["ci_overlap"].min()),
        "model_std_diff_max_abs": float(coefs["std_diff"].abs().max()),
    }


def _fit_models(
    original: pd.DataFrame,
    released: pd.DataFrame,
    designs: tuple[SurveyDesign, SurveyDesign],
    models: list[tuple[str, str]],
    keys: Mapping[str, KeySpec],
    variance: Variance,
    replicates: bool,
    level: float,
) -> pd.DataFrame:
    rows = []
    for text, family in models:
        fits = model_fits([original, released], designs, text, family, keys, replicates)
        rows.append(model_rows(text, family, *fits, variance, level))
    return pd.concat(rows, ignore_index=True) if rows else pd.DataFrame(columns=MODEL_COLUMNS)


def model_fits(
    frames: Sequence[pd.DataFrame],
    designs: Sequence[SurveyDesign],
    text: str,
    family: str,
    keys: Mapping[str, KeySpec],
    replicates: bool = True,
) -> list[GLMFit]:
    """One declared model fitted on each file under its design (categorical terms in their
    published coding, with the same levels on every file); a singular fit is a FormulaError
    that names the model and its largest term, not a linear-algebra traceback."""
    f = parse_formula(text)
    data = [pd.DataFrame(index=x.index) for x in frames]
    for v in f.variables:
        cat = v in f.categorical
        s = frames[0][v]
        numeric = pd.api.types.is_numeric_dtype(s) or pd.api.types.is_bool_dtype(s)
        if v != f.response and (cat or not numeric):
            coded = published_coding(frames, v, keys)
            for j, d in enumerate(data):
                d[v] = coded.series(j, d.index, missing=False)
        else:
            for d, x in zip(data, frames, strict=True):
                d[v] = x[v]
    lv = term_levels(f, data)
    fits: list[GLMFit] = []
    for d, des in zip(data, designs, strict=True):
        X, y, ok, names = design_matrix(d, f, lv)
        try:
            if X.shape[1] > int(np.count_nonzero(ok)):  # more coefficients than records
                raise np.linalg.LinAlgError("singular")  # (X'WX of rank < p: no need to fit)
            fits.append(svyglm(X, y, ok, names, des, family, replicates=replicates))
        except np.linalg.LinAlgError:
            big = max(lv.items(), key=lambda kv: len(kv[1]), default=("", []))
            raise FormulaError(
                f"utility.models: '{text}' cannot be fitted: its equations are singular "
                f"({len(X)} records, {X.shape[1]} coefficients; '{big[0]}' has {len(big[1])} "
                "levels); coarsen that term (bins or map) or drop it from the model"
            ) from None
    return fits


def _quantiles(x: np.ndarray, prefix: str, qs: Mapping[str, float]) -> dict[str, float]:
    x = x[np.isfinite(x)]
    if not len(x):
        return {}
    return {f"{prefix}_{name}": float(np.percentile(x, q)) for name, q in qs.items()}


def _table_block(
    g: tuple[str, ...],
    labels: Sequence[str],
    names: Sequence[str],
    statistic: str | Sequence[str],
    values: dict[str, Sequence[np.ndarray | None]],
) -> dict[str, np.ndarray]:
    """One statistic of the study variables `names` in the cells (labels) of grouping g, the
    domain_table's rows: values maps n, estimate, se_taylor, se_replicate to (original,
    released) arrays L x k (se_replicate (None, None): no replicate SEs)."""
    L, k = len(labels), len(names)
    block = {
        "variable": np.tile(np.asarray(names, dtype=object), L),
        "statistic": np.broadcast_to(np.asarray(statistic, dtype=object), (L, k)).ravel(),
        "domain": np.full(L * k, " x ".join(g) if g else "all", dtype=object),
        "level": np.repeat(np.asarray(labels, dtype=object), k),
    }
    for name, pair in values.items():
        for side, a in zip(("original", "released"), pair, strict=True):
            if a is not None:
                block[f"{name}_{side}"] = np.asarray(a, dtype=float).ravel()
    return block


def domain_table(
    cells: Sequence[tuple[tuple[str, ...], list[str], int, list[dict[str, np.ndarray]]]],
    names: Sequence[str],
    kinds: Sequence[str],
    has_rep: bool,
    variance: Variance,
    min_n: int,
    level: float,
    quantiles: Sequence[tuple[tuple[str, ...], list[str], int, list[dict[str, np.ndarray]]]] = (),
    continuous: Sequence[str] = (),
) -> pd.DataFrame:
    """The domain estimates table: for each grouping (its variables, cell labels, L cells and
    domain_estimates_of on the original and the released file) the means and totals of every
    study variable in every cell, side by side, then for each grouping of `quantiles`
    (domain_quantiles_of on both files) the QUANTILES of the continuous study variables (their
    SE in the column of `variance`, the other NaN), with their comparison (_compare) and
    whether the estimate is reliable (n_original >= min_n and a positive original SE)."""
    blocks = []
    for g, labels, _, res in cells:
        for stat in ("mean", "total"):
            values = {
                "n": [r["n"] for r in res],
                "estimate": [r[stat] for r in res],
                "se_taylor": [r[f"se_{stat}"] for r in res],
                "se_replicate": [r[f"se_rep_{stat}"] if has_rep else None for r in res],
            }
            blocks.append(_table_block(g, labels, names, kinds if stat == "mean" else stat, values))
    for g, labels, _, res in quantiles:
        for j, stat in enumerate(QUANTILES):
            se = [r["se"][:, :, j] for r in res]
            none = [np.full_like(s, np.nan) for s in se]
            values = {
                "n": [r["n"] for r in res],
                "estimate": [r["estimate"][:, :, j] for r in res],
                "se_taylor": se if variance == "taylor" else none,
                "se_replicate": [None, None],
            }
            if has_rep:
                values["se_replicate"] = se if variance == "replicate" else none
            blocks.append(_table_block(g, labels, continuous, stat, values))
    # an empty cell: mean and quantiles NaN, total 0 with SE 0
    est = pd.DataFrame({c: np.concatenate([b[c] for b in blocks]) for c in blocks[0]})
    se_o = est[f"se_{variance}_original"].to_numpy()
    se_r = est[f"se_{variance}_released"].to_numpy()
    est.insert(8, "se_original", se_o)
    est.insert(10, "se_released", se_r)
    cmp = _compare(
        est["estimate_original"].to_numpy(), se_o, est["estimate_released"].to_numpy(), se_r, level
    )
    # nothing to compare: neither file has the estimate, or neither has its SE (a quantile
    # whose Woodruff interval is cut off at 0 or 1, a cell without degrees of freedom)
    none = est["estimate_original"].isna() & est["estimate_released"].isna()
    none |= np.isnan(se_o) & np.isnan(se_r)
    cmp["ci_overlap"] = np.where(none, np.nan, cmp["ci_overlap"])
    for name, col in cmp.items():
        est[name] = col
    est["reliable"] = (est["n_original"] >= min_n) & (se_o > 0)
    return est


def domain_metrics(est: pd.DataFrame, has_rep: bool, variance: Variance) -> dict[str, float]:
    """The domain estimates' metrics over the reliable ones: CI overlap quantiles and the share
    more than 2 original SEs off (means, proportions, totals and quantiles), SE-ratio quantiles
    of means and proportions (and of their replicate SEs beside Taylor's). The quantiles' SE
    ratios are reported apart (se_ratio_quantile_*), not gated: a Woodruff SE is the width of
    the CDF's interval mapped through the data's own steps, so it jumps with the values that
    happen to lie near the interval's ends (heaped incomes, whole household sizes) much more
    than the SE of a mean moves."""
    rel = est[est["reliable"]]
    ov = rel["ci_overlap"].to_numpy()
    means = rel["statistic"].isin(MEAN_STATISTICS)
    metrics: dict[str, float] = {
        "n_estimates": float(len(est)),
        "n_reliable": float(len(rel)),
        **_quantiles(ov, "overlap", {"median": 50, "p5": 5, "p10": 10, "min": 0}),
        "share_abs_std_bias_gt2": float((rel["std_bias"].abs() > 2).mean()) if len(rel) else 0.0,
        # SE ratios of means and proportions: a total of a calibration control has Taylor SE 0
        # on calibrated weights by construction, which says nothing of the treatment
        **_quantiles(
            rel.loc[means, "se_ratio"].to_numpy(), "se_ratio", {"p10": 10, "median": 50, "p90": 90}
        ),
        **_quantiles(
            rel.loc[rel["statistic"].isin(QUANTILES), "se_ratio"].to_numpy(),
            "se_ratio_quantile",
            {"p10": 10, "median": 50, "p90": 90},
        ),
    }
    if has_rep and variance == "taylor":
        rm = rel[means]
        with np.errstate(divide="ignore", invalid="ignore"):
            rr = (rm["se_replicate_released"] / rm["se_replicate_original"]).to_numpy()
        metrics |= _quantiles(rr, "se_ratio_replicate", {"p10": 10, "median": 50, "p90": 90})
    return metrics


def assess(
    original: pd.DataFrame,
    released: pd.DataFrame,
    spec: ReleaseSpec,
    domains: Sequence[DomainArg] | None = None,
    models: Sequence[Any] | None = None,
    variance: Variance = "taylor",
    replicates: bool = True,
    min_n: int = 30,
    level: float = 0.95,
    pmse: bool = True,
    reid: bool = True,
    design_released: Any = None,
) -> Assessment:
    """Assess the released file against the original, each under its own design.

    domains: names (a key in its published coding, see keys.coarsen) or lists of names (a
    crossing); every pair of them is crossed too. Default: every key and every pair of keys.
    The continuous study variables' quartiles (QUANTILES) are estimated overall and by each
    domain (not by the pairs), their SEs Woodruff's from the `variance` SE of the CDF.
    models: {formula, family} mappings, (formula, family) tuples or objects with those fields
    (formula 'y ~ a + C(b) + c'; a categorical key term in its published coding).
    variance: the SE that overlap, standardized bias and SE ratio use ("taylor" with the
    strata/PSUs, or "replicate"); replicate SEs are reported beside when replicates is True and
    both files have replicate weights. An estimate is reliable when its original cell has at
    least min_n non-missing records and a positive SE; the metrics are over reliable ones.
    design_released: the design section the released file is read with (default the spec's;
    a pseudo design built for the public file, sdl_design.stage.public_design).
    """
    keys = _key_specs(spec)
    key_names = list(keys)
    _check_assess_columns(original, released, spec, key_names)
    des, has_rep = _assess_designs(original, released, spec, variance, replicates, design_released)
    frames = [original, released]

    # ------------------------------------------------ domain estimates
    domains, models = _utility_defaults(spec, domains, models)
    groupings = _domain_list(domains, key_names)
    singles = _domain_list(domains, key_names, pairs=False)  # the quantiles' groupings
    coding = _groupings_coding(frames, groupings, keys)
    est = _domain_estimates(
        frames, des, spec.variables.study, groupings, coding, has_rep, variance, min_n, level,
        singles,
    )  # fmt: skip

    # ------------------------------------------------ models
    coefs = _fit_models(
        original, released, des, _model_specs(models), keys, variance, has_rep, level
    )
    described = [_describe(d) for d in des]
    del des  # the designs' replicate matrices are not needed past here

    # ------------------------------------------------ metrics
    metrics = domain_metrics(est, has_rep, variance)
    metrics |= model_metrics(coefs)
    common = released.index.intersection(original.index)
    metrics |= {
        "n_original": float(len(original)),
        "n_released": float(len(released)),
        "share_retained": len(common) / len(original) if len(original) else 0.0,
    }
    if pmse:
        metrics |= _pmse_of_files(original, released, spec, frames, coding, keys)
    if reid:
        ko, kr = _published_keys(original, released, frames, coding, keys)
        metrics |= reidentification(ko, kr)
    params = {
        "variance": variance,
        "replicates": bool(has_rep),
        "min_n": min_n,
        "level": level,
        "domains": [list(g) for g in groupings[1:]],
        "models": [{"formula": t, "family": f} for t, f in _model_specs(models)],
        "design_original": described[0],
        "design_released": described[1],
    }
    return Assessment(est, coefs, metrics, params)


def _check_assess_columns(
    original: pd.DataFrame, released: pd.DataFrame, spec: ReleaseSpec, key_names: list[str]
) -> None:
    """Both files hold the weight, the keys and the study variables (else ValueError)."""
    need = [spec.design.weight, *key_names, *spec.variables.study]
    for name, f in (("original", original), ("released", released)):
        gone = [c for c in need if c not in f.columns]
        if gone:
            raise ValueError(
                f"assess: the {name} file has no column {gone}; it needs the weight, keys and study variables"
            )


def _assess_designs(
    original: pd.DataFrame,
    released: pd.DataFrame,
    spec: ReleaseSpec,
    variance: Variance,
    replicates: bool,
    design_released: Any,
) -> tuple[tuple[SurveyDesign, SurveyDesign], bool]:
    """Each file's design (the released file's read with design_released) and whether both
    carry replicate weights (replicates True); variance 'replicate' needs them."""
    des = (
        file_design(original, spec, replicates),
        file_design(released, spec, replicates, design_released),
    )
    has_rep = replicates and all(d.replicate_weights for d in des)
    if variance == "replicate" and not has_rep:
        raise DesignError("variance='replicate' needs replicate weights on both files")
    return des, has_rep


def _groupings_coding(
    frames: list[pd.DataFrame], groupings: list[tuple[str, ...]], keys: dict[str, KeySpec]
) -> dict[str, list[pd.Series]]:
    """The published coding (on both files) of every variable of the domain groupings."""
    coding: dict[str, list[pd.Series]] = {}
    for g in groupings:
        for v in g:
            if v not in coding:
                coding[v] = published_coding(frames, v, keys)
    return coding


def _utility_defaults(
    spec: ReleaseSpec, domains: Sequence[DomainArg] | None, models: Sequence[Any] | None
) -> tuple[Sequence[DomainArg] | None, Sequence[Any] | None]:
    """domains and models, from the spec's utility section when not given and it has one."""
    utility = getattr(spec, "utility", None)
    if domains is None and utility is not None:
        domains = getattr(utility, "domains", None)
    if models is None and utility is not None:
        models = getattr(utility, "models", None)
    return domains, models


def _domain_estimates(
    frames: list[pd.DataFrame],
    des: tuple[SurveyDesign, SurveyDesign],
    study: Sequence[str],
    groupings: list[tuple[str, ...]],
    coding: dict[str, list[pd.Series]],
    has_rep: bool,
    variance: Variance,
    min_n: int,
    level: float,
    quantile_groupings: Sequence[tuple[str, ...]] = (),
) -> pd.DataFrame:
    """The domain_table of the study variables' estimates in every cell of every grouping,
    and of the continuous ones' quantiles in every cell of quantile_groupings (overall and
    each domain), on both files each under its design (cells on the published key coding)."""
    plan = study_plan(frames, study)
    studies = [plan.study(f) for f in frames]
    names, kinds = studies[0].names, studies[0].kinds
    prof_rec, n_prof, at = _profiles(coding, [len(f) for f in frames])
    pairs = [
        _file_pairs(d, st, p, m) for d, st, p, m in zip(des, studies, prof_rec, n_prof, strict=True)
    ]
    values = [plan.continuous_values(f) for f in frames] if plan.continuous else []
    variables = [
        sorted_variables(X, d.w, p) for X, d, p in zip(values, des, prof_rec, strict=False)
    ]
    cells, quantiles = [], []
    for g in groupings:
        codes, labels, L = _cells([at[v] for v in g], n_prof)
        res = [
            domain_estimates_of(d, st, pr, c, L, has_rep)
            for d, st, pr, c in zip(des, studies, pairs, codes, strict=True)
        ]
        cells.append((g, labels, L, res))
        if values and g in quantile_groupings:
            q = [
                domain_quantiles_of(d, v, d.g, c, L, variance, level)
                for d, v, c in zip(des, variables, codes, strict=True)
            ]
            quantiles.append((g, labels, L, q))
    return domain_table(
        cells, names, kinds, has_rep, variance, min_n, level, quantiles, plan.continuous
    )


def _published_keys(
    original: pd.DataFrame,
    released: pd.DataFrame,
    frames: list[pd.DataFrame],
    coding: dict[str, list[pd.Series]],
    keys: dict[str, KeySpec],
) -> tuple[pd.DataFrame, pd.DataFrame]:
    """The keys' codes in their published coding on the original and on the released file."""
    kc = {v: coding.get(v) or published_coding(frames, v, keys) for v in keys}
    ko = pd.DataFrame({v: c.codes[0] for v, c in kc.items()}, index=original.index)
    kr = pd.DataFrame({v: c.codes[1] for v, c in kc.items()}, index=released.index)
    return ko, kr


def _pmse_of_files(
    original: pd.DataFrame,
    released: pd.DataFrame,
    spec: ReleaseSpec,
    frames: list[pd.DataFrame],
    coding: dict[str, list[pd.Series]],
    keys: dict[str, KeySpec],
) -> dict[str, float]:
    """pmse_ratio of the two files on the published keys and the study variables (the
    non-numeric ones as categories)."""
    key_names = list(keys)
    study_num = [v for v in spec.variables.study if v not in key_names]
    a, b = _published_keys(original, released, frames, coding, keys)
    num = [v for v in study_num if pd.api.types.is_numeric_dtype(original[v])]
    for v in study_num:
        a[v], b[v] = original[v], released[v]
    return pmse_ratio(a, b, key_names + [v for v in study_num if v not in num], num)


def _describe(d: SurveyDesign) -> str:
    s = f"{d.n} records, {len(d.n_h)} strata, {d.n_psu} PSUs"
    if d.replicate_weights:
        s += f", {len(d.replicate_weights)} {d.method} replicate weights"
    return s


# ---------------------------------------------------------------- the stage


def column_record(spec: ReleaseSpec, ctx: Any, published: list[str]) -> dict[str, Any]:
    """What leaves: the published columns by role (as the spec declares them) and every column
    of the input that is not published, with why (for the report and the public README)."""
    d, v = spec.design, spec.variables
    reps = set(spec.replicate_columns(ctx.original))
    pub = ctx.public_design()  # a stage's pseudo design names its own columns
    pub_reps = pub.replicate_weights.resolve(list(published)) if pub.replicate_weights else []
    role_of: dict[str, str] = {}
    for role, cols in (
        ("replicate weight", pub_reps),
        ("stratum", [pub.strata]),
        ("PSU", [pub.psu]),
        ("direct identifier", v.direct_identifiers),
        ("replicate weight", sorted(reps)),
        ("weight", [d.weight]),
        ("stratum", [getattr(d, "strata", None)]),
        ("PSU", [getattr(d, "psu", None)]),
        ("segment", [getattr(d, "segment", None)]),
        ("household", [getattr(d, "household", None)]),
        ("key", v.key_names),
        ("sensitive", [s.name for s in v.sensitive]),
        ("study", v.study),
        ("other, kept", v.other.keep),
        ("other, dropped", v.other.drop),
    ):
        for c in cols:
            if c:
                role_of.setdefault(c, role)
    by_stage = {c: r.name for r in ctx.previous for c in r.drop_public}
    why = {
        "direct identifier": "direct identifier (variables.direct_identifiers)",
        "other, dropped": "declared not for publication (variables.other.drop)",
        "segment": "segment label: geography below the PSU",
        "household": "household identifier",
        "stratum": "original design label (published only when masked or design.publish_design_labels)",
        "PSU": "original design label (published only when masked or design.publish_design_labels)",
        "replicate weight": "original replicate weight, replaced by those of the public design",
    }
    keep = set(published)
    dropped = {}
    for c in ctx.original.columns:
        if c in keep or str(c).startswith("__"):
            continue
        role = role_of.get(c, "")
        reason = why.get(role) or (
            f"dropped by the {by_stage[c]} stage" if c in by_stage else "not published"
        )
        dropped[str(c)] = reason
    roles: dict[str, list[str]] = {}
    for c in published:
        if not str(c).startswith("__"):
            roles.setdefault(role_of.get(c, "other, kept"), []).append(str(c))
    return {"published_columns": roles, "dropped_columns": dropped}


class Attacks(dict):
    """The attack battery's metrics (a dict) with its table of attacks."""

    table: pd.DataFrame


def published_attacks(
    original: pd.DataFrame,
    released: pd.DataFrame,
    spec: ReleaseSpec,
    public: Any,
    masked_design: bool = True,
) -> tuple[Attacks, IntruderKey]:
    """The intruder's attacks on the published file (sdl_design.attack.attack_battery), each
    published record linked to its original record by its index label. public: the design
    section the file is published with (its strata/PSU labels and replicate weights);
    masked_design False with design.publish_design_labels: the labels are the original ones,
    which an intruder knows whatever intruder.design_labels_unknown says."""
    d = spec.design
    labels = [c for c in (public.strata, public.psu) if c and c in released.columns]
    reps = (
        public.replicate_weights.resolve(list(released.columns)) if public.replicate_weights else []
    )
    original_labels = not masked_design and spec.design.publish_design_labels
    key = intruder_key(spec, released, labels, [public.weight, *reps], original_labels)
    link = original.index.get_indexer(released.index)
    if (link < 0).any():
        raise ValueError("assess: a published record has no original record (index labels)")
    orig_labels = [c for c in (d.strata, d.psu) if c and c in original.columns]
    sensitive = [s.name for s in spec.variables.sensitive]
    m, table = attack_battery(original, released, link, key, orig_labels, public.weight, sensitive)
    out = Attacks(m)
    out.table = table
    return out, key


def published_delta(
    original: pd.DataFrame, released: pd.DataFrame, spec: ReleaseSpec
) -> dict[str, float]:
    """MASSC's delta (paper 000, eq. 3-6) of the published file against the original keys, for
    any release: d(2) = the record is published (index label kept), d(1) = its published key
    profile differs from its original one (in the published coding), r = the larger GenMASSC
    score of its original and published profile. With no sensitive variable every record
    scores zeta = 1 (disclosure of the identity alone). Returns delta_published and its parts."""

    keys = spec.variables.keys
    names = [k.name for k in keys]
    sensitive = list(spec.variables.sensitive)
    if not sensitive:  # identity disclosure alone: one constant sensitive category, score 1
        sensitive = {"__identity": {1: 1.0}}
    pos = released.index.get_indexer(original.index)
    kept = pos >= 0
    treated = original.copy(deep=False)  # the columns below are replaced, not written into
    cols = names + [c for c in _sensitive_names(sensitive) if c in released.columns]
    # each record's published value when it is published, else its original one: one take
    # from the two columns end to end (no object copy per record)
    take = np.where(kept, pos, len(released) + np.arange(len(original)))
    for c in cols:
        both = pd.concat([released[c], original[c]], ignore_index=True)
        treated[c] = pd.Series(both.array.take(take), index=treated.index, name=c)
    if isinstance(sensitive, dict):
        original = original.assign(__identity=1)
        treated = treated.assign(__identity=1)
    coded = {n: published_coding([original, treated], n, _key_specs(spec)) for n in names}
    changed = np.zeros(len(original), dtype=bool)
    for c in coded.values():
        changed |= c.codes[0] != c.codes[1]
    dm = delta_measures(original, treated, changed, kept, keys, sensitive, "max")
    return {f"{k}_published": v for k, v in dm.metrics.items()}


def _sensitive_names(sensitive: Any) -> list[str]:
    return list(sensitive) if isinstance(sensitive, dict) else [s.name for s in sensitive]


def _epsilon_published(est: pd.DataFrame) -> float:
    """Information loss of the published file: the largest relative error of an overall study
    total (paper 000's epsilon, eq. 7, realized on the published file against the original)."""
    t = est[(est["domain"] == "all") & (est["statistic"] == "total")]
    o, r = t["estimate_original"].to_numpy(), t["estimate_released"].to_numpy()
    ok = np.abs(o) > 0
    return float(np.max(np.abs(r[ok] - o[ok]) / np.abs(o[ok]))) if ok.any() else 0.0


def _worst_text(worst: pd.DataFrame, n: int = 5) -> str:
    """The worst estimates in words, for a failed gate."""
    parts = [
        f"{w.statistic} of {w.variable} in {w.domain} = {w.level}: {w.estimate_released:.4g} "
        f"published vs {w.estimate_original:.4g} original ({w.std_bias:+.1f} SE)"
        for w in worst.head(n).itertuples()
    ]
    return "worst estimates: " + "; ".join(parts) if parts else ""


def _worst_se_text(est: pd.DataFrame, n: int = 5) -> str:
    """The estimates whose published SE is furthest from the original one (means, proportions)."""
    t = est[est["reliable"] & est["statistic"].isin(MEAN_STATISTICS) & (est["se_ratio"] > 0)]
    t = t.iloc[np.argsort(-np.abs(np.log(t["se_ratio"].to_numpy())), kind="stable")[:n]]
    parts = [
        f"SE ratio {w.se_ratio:.2f} for the {w.statistic} of {w.variable} in {w.domain} = {w.level}"
        for w in t.itertuples()
    ]
    return "worst estimates: " + "; ".join(parts) if parts else ""


def _worst_terms(coefs: pd.DataFrame, n: int = 3) -> str:
    if not len(coefs):
        return ""
    t = coefs.sort_values("ci_overlap").head(n)
    return "worst coefficients: " + "; ".join(
        f"{r.term} in {r.model}: {r.coef_released:.3g} published vs {r.coef_original:.3g} "
        f"original (overlap {r.ci_overlap:.2f})"
        for r in t.itertuples()
    )


def _psu_leak(
    released: pd.DataFrame, original: pd.DataFrame, spec: ReleaseSpec, public: Any
) -> dict:
    """{'psu_recoverable': share of the original PSUs the published replicate weights' zero
    patterns give away (sdl_design.leaks.psu_recoverable)}; empty without replicates or PSUs.
    public: the design section of the published file (its replicate columns)."""

    d = spec.design
    reps = (
        public.replicate_weights.resolve(list(released.columns)) if public.replicate_weights else []
    )
    if not reps or not d.psu or d.psu not in original.columns:
        return {}
    psu = factorize(original[d.psu], use_na_sentinel=False)[0].astype(np.int64)
    if d.strata and d.strata in original.columns:  # PSU labels are unique within strata
        h = factorize(original[d.strata], use_na_sentinel=False)[0]
        psu = h * (int(psu.max(initial=0)) + 1) + psu
    psu = pd.Series(psu, index=original.index)
    return {"psu_recoverable": psu_recoverable(released, psu, reps)}


# One sentence per gate: what it protects against and why its limit is what it is (the report
# shows it beside the gate). Overlap J of two equal-width 95% CIs whose centres are d SEs apart
# is 1 - d / 3.92: J 0.9 is a shift of about 0.4 SE, J 0.5 of about 2 SEs.
GATE_WHY = {
    "overlap_median": "Protects the typical domain estimate an analyst computes: at the median the "
    "published and survey 95% intervals must overlap by at least {limit} (Karr et al. 2006; 1 is "
    "identical), i.e. masking moves a typical estimate by at most about {shift:.1f} of its SE.",
    "overlap_p5": "Protects the estimates masking moved most: all but 5% must keep an overlap of "
    "at least {limit}, i.e. a shift of at most about {shift:.1f} SEs, so no sizeable group of "
    "domains changes by more than its own sampling error.",
    "beyond_2se": "Protects against systematic bias: at most {limit:.0%} of the domain estimates "
    "may move more than 2 survey SEs, the share of a 95% interval's misses that sampling noise "
    "alone would give.",
    "model_overlap": "Protects the declared models: every coefficient's published and survey 95% "
    "intervals must overlap by at least {limit}, i.e. no coefficient moves more than about "
    "{shift:.1f} SEs.",
    "se_ratio": "Protects variance estimation with the published design: 80% of the estimates' "
    "SEs must be within [{lo}, {hi}] times the survey's (gates.se_ratio), so intervals from the "
    "public file are neither falsely narrow nor needlessly wide.",
    "epsilon": "Protects the study totals: the largest relative error of an overall total must be "
    "at most {limit} (paper 000's epsilon, eq. 7; gates.epsilon_max).",
    "xi": "Protects against an intruder who knows a survey unique's values on the intruder's key "
    "and claims the one published record that matches (exact match; nearest neighbour on the "
    "continuous columns they may know): at most xi = {limit} of the survey's sample uniques may be "
    "re-identified, the bound PRB proves for each post-randomized record (paper 002; gates.xi, "
    "under 1/2) applied to the whole published file.",
    "delta": "Protects against re-identification of the records treatment left as they were: "
    "delta (paper 000, eq. 3-6) averages the risk scores of the records neither substituted nor "
    "subsampled away, measured here on the published file, and must be at most gates.delta_max "
    "= {limit}, the average risk the spec accepts.",
    "psu": "Protects the masked design: records sharing a set of zero replicate weights were "
    "sampled in one original PSU, so this share of the original PSUs can be regrouped (which "
    "records were sampled together, never the PSU's label or place); {limit:.0%} "
    "(gates.max_psu_recoverable) is acceptable because a regrouped PSU names no one by itself, "
    "it needs outside knowledge of who lives there, which the design-label attack measures "
    "(internal/assess/attacks.csv), while at least {kept:.0%} of the original PSUs stay hidden.",
    "unique": "Protects against singling out: at most {limit:.1%} of published records may be "
    "unique on the intruder's key (gates.max_unique_share), the records an intruder can single "
    "out and link without knowing who is in the sample.",
}


def _shift(overlap: float) -> float:
    """The shift in SEs of two equal-width 95% CIs that overlap by `overlap` (Karr's J)."""
    return max(0.0, 1.0 - overlap) * 2 * 1.959964


def assessment_gates(
    m: Mapping[str, float],
    spec: ReleaseSpec,
    worst: str = "",
    worst_terms: str = "",
    worst_se: str = "",
) -> list:
    """The gates on the published file against the original (names say what is compared)."""

    g, u = spec.gates, spec.gates.utility
    out = [
        gate(
            "utility: median CI overlap of domain estimates",
            m.get("overlap_median", np.nan),
            u.overlap_median_min,
            explain=worst,
            why=GATE_WHY["overlap_median"].format(
                limit=u.overlap_median_min, shift=_shift(u.overlap_median_min)
            ),
            ideal=1.0,
        ),
        gate(
            "utility: 5th percentile CI overlap of domain estimates",
            m.get("overlap_p5", np.nan),
            u.overlap_p5_min,
            explain=worst,
            why=GATE_WHY["overlap_p5"].format(
                limit=u.overlap_p5_min, shift=_shift(u.overlap_p5_min)
            ),
            ideal=1.0,
        ),
        gate(
            "utility: share of domain estimates more than 2 original SEs off",
            m["share_abs_std_bias_gt2"],
            upper=u.share_beyond_2se_max,
            explain=worst,
            why=GATE_WHY["beyond_2se"].format(limit=u.share_beyond_2se_max),
            ideal=0.0,
        ),
    ]
    if "model_overlap_min" in m:
        out.append(
            gate(
                "utility: smallest CI overlap of a model coefficient",
                m["model_overlap_min"],
                u.model_overlap_min,
                explain=worst_terms,
                why=GATE_WHY["model_overlap"].format(
                    limit=u.model_overlap_min, shift=_shift(u.model_overlap_min)
                ),
                ideal=1.0,
            )
        )
    if g.se_ratio is not None:
        lo, hi = g.se_ratio
        out.append(
            gate(
                "utility: 10th percentile of published/original SE ratios",
                m.get("se_ratio_p10", np.nan),
                lo,
                hi,
                explain=worst_se,
                why=GATE_WHY["se_ratio"].format(lo=lo, hi=hi),
                ideal=1.0,
            )
        )
        out.append(
            gate(
                "utility: 90th percentile of published/original SE ratios",
                m.get("se_ratio_p90", np.nan),
                lo,
                hi,
                explain=worst_se,
                why=GATE_WHY["se_ratio"].format(lo=lo, hi=hi),
                ideal=1.0,
            )
        )
    if g.epsilon_max is not None:
        out.append(
            gate(
                "utility: epsilon, largest relative error of a study total",
                m["epsilon_published"],
                upper=g.epsilon_max,
                why=GATE_WHY["epsilon"].format(limit=g.epsilon_max),
                ideal=0.0,
            )
        )
    return out + _risk_gates(m, spec)


def _risk_gates(m: Mapping[str, float], spec: ReleaseSpec) -> list:
    """The risk gates on the published file against the original."""

    g, out = spec.gates, []
    if g.xi is not None:
        out.append(
            gate(
                "risk: share of original sample uniques re-identified (worst exact-match attack)",
                m.get("reid_share_worst", m.get("reid_share", 0.0)),
                upper=g.xi,
                explain=_attack_text(m),
                why=GATE_WHY["xi"].format(limit=g.xi),
                ideal=0.0,
            )
        )
    if g.delta_max is not None and "delta_published" in m:
        out.append(
            gate(
                "risk: delta (MASSC) of the published file against the original keys",
                m["delta_published"],
                upper=g.delta_max,
                why=GATE_WHY["delta"].format(limit=g.delta_max),
                ideal=0.0,
            )
        )
    if "psu_recoverable" in m:
        out.append(
            gate(
                "risk: share of original PSUs given away by replicate-weight zero patterns",
                m["psu_recoverable"],
                upper=g.max_psu_recoverable,
                explain="records sharing a set of zero replicate weights are one original PSU: "
                "publish replicate weights built for masked PSUs (stages.swap), not the originals",
                why=GATE_WHY["psu"].format(
                    limit=g.max_psu_recoverable, kept=1 - g.max_psu_recoverable
                ),
                ideal=0.0,
            )
        )
    if g.max_unique_share is not None:
        out.append(
            gate(
                "risk: share of published records unique on the intruder's key",
                m["unique_share_published"],
                upper=g.max_unique_share,
                why=GATE_WHY["unique"].format(limit=g.max_unique_share),
                ideal=0.0,
            )
        )
    return out


def _attack_text(m: Mapping[str, float]) -> str:
    """The exact-match attacks in words, for the risk gate."""
    parts = [
        f"{what}: {m[f'reid_share{s}']:.1%} of {m[f'reid_sample_uniques{s}']:.0f} sample uniques "
        f"(precision {m[f'reid_precision{s}']:.1%})"
        for what, s in (
            ("declared keys", "_keys"),
            ("intruder's key", ""),
            ("with the design labels", "_design"),
        )
        if f"reid_share{s}" in m
    ]
    return "; ".join(parts)


def _notes(m: Mapping[str, float], worst: pd.DataFrame) -> list[str]:
    notes = [
        f"{int(m['n_reliable'])} reliable domain estimates of the study variables (of "
        f"{int(m['n_estimates'])}): median CI overlap {m.get('overlap_median', np.nan):.3f}, 5th "
        f"percentile {m.get('overlap_p5', np.nan):.3f}; {m['share_abs_std_bias_gt2']:.1%} more than 2 "
        f"original SEs off; published/original SE ratio 10th-90th percentile "
        f"{m.get('se_ratio_p10', np.nan):.3f}-{m.get('se_ratio_p90', np.nan):.3f}.",
        f"Published file: {int(m['n_released'])} of {int(m['n_original'])} records; "
        f"{m['unique_share_published']:.1%} sample uniques on the keys; "
        f"{m.get('reid_share_worst', 0.0):.1%} of the original sample uniques re-identified "
        f"(worst attack: {_attack_text(m)}); "
        f"pMSE ratio {m.get('pmse_ratio', np.nan):.2f}.",
    ]
    if "model_overlap_min" in m:
        notes.append(
            f"Analysis models: smallest coefficient CI overlap {m['model_overlap_min']:.3f}, "
            f"largest |standardized difference| {m['model_std_diff_max_abs']:.2f}."
        )
    if len(worst):
        w = worst.iloc[0]
        notes.append(
            f"Worst estimate: {w['statistic']} of {w['variable']} in {w['domain']} = {w['level']}: "
            f"{w['estimate_released']:.4g} published vs {w['estimate_original']:.4g} original "
            f"({w['std_bias']:+.1f} original SEs)."
        )
    return notes
