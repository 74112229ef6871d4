"""MASSC (Singh 2009, paper 000): micro-agglomeration, substitution, subsampling, calibration.

- Risk strata U/D/T/O (risk.py), optionally merged (e.g. D, T, O -> NU as in the worked example).
- Substitution partners (Step II): nearest donor profile on keys and main sensitive variables,
  distances standardized by Rao's quadratic entropy p' Lambda p of the donor set, at least one
  key changed, donors restricted to records sharing given columns. The search runs on distinct
  profiles, level by level over the sets S of keys that change (existence of a donor in a block
  by inclusion-exclusion of profile counts), never on pairs of records.
- Optimal rates psi_h (eq. 9 under the bias constraint 8a) and phi_h (eq. 10 under the variance
  constraint 8b), SLSQP from a feasible point found by a monotone 1-D search.
- Stratified SRSWOR (systematic selection on a random order: exact inclusion rates), or nested
  within PSUs with probabilities proportional to the stratum rates (section 5).
- Post-treatment risk delta (eq. 3-6) and information loss epsilon (eq. 7, 8a, 8b).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from itertools import combinations
from typing import Any, Literal

import numpy as np
import pandas as pd
from scipy.optimize import minimize

from sdl_design.keys import coarsen, key_frame
from sdl_design.risk import STRATA, _key_codes, genmassc_scores, profile_codes, risk_strata
from sdl_design.spec import KeySpec, SensitiveSpec

KeyLike = str | KeySpec


class MasscError(ValueError):
    """Bad input to a MASSC step; the message names the argument or column and the fix."""


class MasscInfeasible(MasscError):
    """The rate constraints cannot be met within the bounds: says which constraint and by how much."""


# ---------------------------------------------------------------- Step I: risk strata


def massc_strata(
    df: pd.DataFrame,
    keys: Sequence[KeyLike],
    merge: Mapping[str, str] | None = None,
    substrata: Sequence[str] = (),
    k: int = 2,
    min_records: int = 30,
    rng: np.random.Generator | None = None,
) -> pd.Series:
    """Risk stratum of each record (U, D, T, O from risk.risk_strata), merged by `merge`
    (e.g. {"D": "NU", "T": "NU", "O": "NU"}), each split into at most k substrata "S:1".."S:k"
    by k-means on the standardized `substrata` variables (at most one substratum per
    min_records records). Returns a string Series."""
    s = risk_strata(df, keys).astype(str)
    if merge:
        bad = set(merge) - set(STRATA)
        if bad:
            raise MasscError(f"merge: {sorted(bad)} are not risk strata; use keys of {STRATA}")
        s = s.map(lambda v: merge.get(v, v))
    if substrata:
        s = _split_substrata(df, s, list(substrata), k, min_records, rng)
    return s.rename("massc_stratum")


def _split_substrata(
    df: pd.DataFrame,
    strata: pd.Series,
    cols: list[str],
    k: int,
    min_records: int,
    rng: np.random.Generator | None,
) -> pd.Series:
    """k-means (scipy kmeans2, k-means++ start) within each stratum; substrata are numbered by
    increasing centroid of the first variable so labels do not depend on the start."""
    from scipy.cluster.vq import kmeans2

    missing = [c for c in cols if c not in df.columns]
    if missing:
        raise MasscError(f"stages.massc.substrata.variables: {missing} are not in the data")
    try:
        x = df[cols].to_numpy(dtype=float)
    except (TypeError, ValueError) as e:
        raise MasscError(
            f"stages.massc.substrata.variables: {cols} must be numeric ({e}); recode them"
        ) from e
    if np.isnan(x).any():
        raise MasscError("stages.massc.substrata.variables have missing values; impute them")
    sd = x.std(axis=0)
    x = (x - x.mean(axis=0)) / np.where(sd > 0, sd, 1.0)
    rng = rng if rng is not None else np.random.default_rng(0)
    out = strata.to_numpy(dtype=object).copy()
    codes, levels = pd.factorize(strata, sort=True)
    for j, label in enumerate(levels):
        rows = np.flatnonzero(codes == j)
        kk = min(k, len(rows) // min_records)
        if kk < 2:
            continue
        centroid, lab = kmeans2(x[rows], kk, minit="++", rng=rng)
        used = np.unique(lab)
        rank = np.empty(kk, dtype=np.int64)
        rank[used[np.argsort(centroid[used, 0], kind="stable")]] = np.arange(len(used))
        out[rows] = [f"{label}:{r + 1}" for r in rank[lab]]
    return pd.Series(out, index=strata.index, dtype=object).astype(str)


# ---------------------------------------------------------------- Step II: substitution partners


def _key_specs(keys: Sequence[KeyLike]) -> list[KeySpec]:
    return [KeySpec(name=k) if isinstance(k, str) else k for k in keys]


def _sens_specs(sensitive: Any) -> list[SensitiveSpec]:
    if not sensitive:
        return []
    if isinstance(sensitive, Mapping):
        return [SensitiveSpec(name=k, sensitivity=dict(v)) for k, v in sensitive.items()]
    return [s if isinstance(s, SensitiveSpec) else SensitiveSpec(**s) for s in sensitive]


def _codes(s: pd.Series) -> np.ndarray:
    return pd.factorize(s, use_na_sentinel=False)[0].astype(np.int64)


def _combine(cols: Sequence[np.ndarray], n: int) -> np.ndarray:
    """Dense codes of the combination of integer code columns (empty list: all zero)."""
    g = np.zeros(n, dtype=np.int64)
    for c in cols:
        span = int(c.max()) + 1 if len(c) else 1
        gmax = int(g.max()) + 1 if len(g) else 1
        if gmax * span >= 2**62:
            g = pd.factorize(g)[0].astype(np.int64)
            gmax = int(g.max()) + 1
        g = g * span + c
    return pd.factorize(g)[0].astype(np.int64)


def _gini(codes: np.ndarray, group: np.ndarray, n_groups: int) -> np.ndarray:
    """p' Lambda p = 1 - sum_c p_c^2 (Lambda = 1 off the diagonal) of codes within each group."""
    n_c = int(codes.max()) + 1
    cnt = np.bincount(group * n_c + codes, minlength=n_groups * n_c).reshape(n_groups, n_c)
    tot = cnt.sum(axis=1, keepdims=True)
    p = cnt / np.maximum(tot, 1)
    return 1.0 - (p**2).sum(axis=1)


@dataclass
class Donors:
    """Substitution partner of every record (row positions), and how far it is."""

    donor: np.ndarray  # row position of the donor record, -1 when no donor exists
    distance: np.ndarray  # standardized distance to the donor profile (inf when none)
    n_changed: np.ndarray  # keys that differ between recipient and donor (0 when none)
    n_profiles: int  # distinct search profiles (restriction x keys x sensitive categories)
    by_level: dict[int, int] = field(default_factory=dict)  # records by number of keys changed


def find_donors(
    df: pd.DataFrame,
    keys: Sequence[KeyLike],
    sensitive: Any = (),
    importance: Mapping[str, float] | None = None,
    restrictions: Sequence[str] = (),
    rng: np.random.Generator | int | None = 0,
    chunk: int = 200_000,
) -> Donors:
    """Nearest donor for every record (paper 000, Step II).

    Distance between recipient and donor profiles: sum over keys and sensitive variables y of
    importance_y * lambda(y_i, y_i') / (p_y' Lambda_y p_y) with lambda = 1 for different
    categories, p_y the category shares in the donor set (records sharing `restrictions`).
    At least one key differs. Ties: fewest keys changed, then key order, then sensitive
    categories in order of appearance. Among the records of the eligible donor profiles of the
    chosen block the donor is drawn at random (proportional to profile size) with rng.
    """
    rng = np.random.default_rng(rng)
    n = len(df)
    specs = _key_specs(keys)
    if not specs:
        raise MasscError("keys: give at least one key variable for the donor search")
    sens = _sens_specs(sensitive)
    for c in list(restrictions) + [s.name for s in sens]:
        if c not in df.columns:
            raise MasscError(f"column '{c}' (restrictions/sensitive) is not in the data; fix it")
    importance = dict(importance or {})
    names = [k.name for k in specs] + [s.name for s in sens]
    unknown = set(importance) - set(names)
    if unknown:
        raise MasscError(
            f"importance: {sorted(unknown)} are neither keys nor sensitive variables; "
            f"use names from {names}"
        )
    kc, _ = _key_codes(df, specs)
    sc = [_codes(coarsen(df[s.name], s.bins) if s.bins is not None else df[s.name]) for s in sens]
    r_rec = _combine([_codes(df[c]) for c in restrictions], n)
    s_rec = _combine(sc, n)  # combined sensitive code
    pid = _combine([r_rec, *kc, s_rec], n)  # search profile of each record
    n_p = int(pid.max()) + 1
    first = np.full(n_p, n, dtype=np.int64)
    np.minimum.at(first, pid, np.arange(n))
    K = len(specs)
    r_p = r_rec[first]
    k_p = np.stack([c[first] for c in kc], axis=1)
    s_p = s_rec[first]
    n_s = int(s_rec.max()) + 1
    size_p = np.bincount(pid, minlength=n_p)
    n_r = int(r_rec.max()) + 1
    if n_r * n_s * n_s > 50_000_000:
        raise MasscError(
            f"sensitive: {n_s} combinations of sensitive categories in {n_r} donor sets are too "
            "many for the donor search; give continuous sensitive variables coarser bins or use "
            "fewer sensitive variables"
        )
    chunk = max(1000, min(chunk, 20_000_000 // n_s))
    # standardized unit distances per donor set (eq. in Step II)
    with np.errstate(divide="ignore"):
        cost_k = np.stack(
            [importance.get(k.name, 1.0) / _gini(kc[i], r_rec, n_r) for i, k in enumerate(specs)],
            axis=1,
        )  # (n_r, K)
        ds = np.zeros((n_r, n_s, n_s))
        if sens:
            s_first = np.full(n_s, n, dtype=np.int64)
            np.minimum.at(s_first, s_rec, np.arange(n))
            for j, s in enumerate(sens):
                c_j = importance.get(s.name, 1.0) / _gini(sc[j], r_rec, n_r)
                cat = sc[j][s_first]
                diff = (cat[:, None] != cat[None, :]).astype(float)
                ds += np.where(diff[None] > 0, c_j[:, None, None], 0.0)
    ds = np.nan_to_num(ds, nan=np.inf)
    # group codes of profiles on (restriction, keys in U) for every subset U that is needed
    group_cache: dict[tuple[int, ...], tuple[np.ndarray, np.ndarray]] = {}

    def groups(u: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
        if u not in group_cache:
            g = _combine([r_p, *[k_p[:, i] for i in u]], n_p)
            cnt = np.bincount(g * n_s + s_p, minlength=(int(g.max()) + 1) * n_s).reshape(-1, n_s)
            group_cache[u] = (g, cnt)
        return group_cache[u]

    best = np.full(n_p, np.inf)
    best_set = np.full(n_p, -1, dtype=np.int64)
    best_s = np.full(n_p, -1, dtype=np.int64)
    subsets = [S for j in range(1, K + 1) for S in combinations(range(K), j)]
    for si, S in enumerate(subsets):
        comp = tuple(i for i in range(K) if i not in S)
        c_s = cost_k[:, list(S)].sum(axis=1)[r_p]  # key part of the distance
        active = np.flatnonzero(best > c_s)
        if len(active) == 0:
            continue
        terms = []
        for t in range(len(S) + 1):
            for T in combinations(S, t):
                u = tuple(sorted(comp + T))
                terms.append(((-1) ** t, *groups(u)))
        for a in range(0, len(active), chunk):
            idx = active[a : a + chunk]
            e = np.zeros((len(idx), n_s), dtype=np.int64)
            for sign, g, cnt in terms:
                e += sign * cnt[g[idx]]
            cand = np.where(e > 0, c_s[idx, None] + ds[r_p[idx], s_p[idx], :], np.inf)
            j = np.argmin(cand, axis=1)
            val = cand[np.arange(len(idx)), j]
            upd = val < best[idx]
            best[idx[upd]] = val[upd]
            best_set[idx[upd]] = si
            best_s[idx[upd]] = j[upd]
    # choose a donor profile per recipient profile within its (block, sensitive) cell
    donor_p = np.full(n_p, -1, dtype=np.int64)
    for si in np.unique(best_set[best_set >= 0]):
        S = subsets[si]
        comp = tuple(i for i in range(K) if i not in S)
        g, _ = groups(comp)
        rec_all = np.flatnonzero(best_set == si)
        right_all = pd.DataFrame({"dp": np.arange(n_p), "g": g, "s": s_p})
        for a in range(0, len(rec_all), 20_000):  # bounded merges (profile pairs of a block)
            rec = rec_all[a : a + 20_000]
            left = pd.DataFrame({"rp": rec, "g": g[rec], "s": best_s[rec]})
            right = right_all[right_all["g"].isin(np.unique(g[rec]))]
            pairs = left.merge(right, on=["g", "s"], how="inner")
            rp, dp = pairs["rp"].to_numpy(), pairs["dp"].to_numpy()
            ok = np.ones(len(pairs), dtype=bool)
            for i in S:
                ok &= k_p[rp, i] != k_p[dp, i]
            rp, dp = rp[ok], dp[ok]
            race = -np.log(rng.random(len(rp))) / size_p[dp]  # weighted draw: exponential race
            order = np.lexsort((race, rp))
            rp, dp = rp[order], dp[order]
            head = np.r_[True, rp[1:] != rp[:-1]]
            donor_p[rp[head]] = dp[head]
    # a random record of the donor profile for every record
    by_pid = np.argsort(pid, kind="stable")
    start = np.r_[0, np.cumsum(size_p)[:-1]]
    dp_rec = donor_p[pid]
    has = dp_rec >= 0
    donor = np.full(n, -1, dtype=np.int64)
    off = np.floor(rng.random(int(has.sum())) * size_p[dp_rec[has]]).astype(np.int64)
    donor[has] = by_pid[start[dp_rec[has]] + off]
    n_changed = np.zeros(n, dtype=np.int64)
    n_changed[has] = (
        np.stack([c[has] != c[donor[has]] for c in kc], axis=1).sum(axis=1) if has.any() else 0
    )
    lev = np.bincount(n_changed, minlength=K + 1)
    return Donors(
        donor=donor,
        distance=best[pid],
        n_changed=n_changed,
        n_profiles=n_p,
        by_level={i: int(lev[i]) for i in range(K + 1)},
    )


def substitute(
    df: pd.DataFrame, donor: np.ndarray, selected: np.ndarray, columns: Sequence[str]
) -> pd.DataFrame:
    """B^(1): selected records take all key-related `columns` of their donor (IVs only, never SVs)."""
    missing = [c for c in columns if c not in df.columns]
    if missing:
        raise MasscError(f"substitution columns {missing} are not in the data; fix the names")
    selected = np.asarray(selected, dtype=bool)
    if (donor[selected] < 0).any():
        raise MasscError("selected records without a donor; select only records with donor >= 0")
    out = df.copy(deep=False)  # new arrays for the substituted columns only
    idx = np.arange(len(df))
    idx[selected] = donor[selected]
    for c in columns:
        out[c] = df[c].take(idx).set_axis(df.index)
    return out


# ---------------------------------------------------------------- selection (stratified SRSWOR)


def select(groups: np.ndarray, pi: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Systematic selection on a random order within each group: record k in with probability
    exactly pi_k; the group sample size is the floor or ceiling of sum pi. With pi constant in a
    group this is SRSWOR with randomly rounded size; with groups = PSUs and pi = the stratum
    rates it is the nested pps selection of section 5."""
    groups = np.asarray(groups)
    pi = np.asarray(pi, dtype=float)
    if np.any((pi < 0) | (pi > 1)):
        raise MasscError("rates must lie in [0, 1]")
    n = len(pi)
    g = pd.factorize(groups)[0]
    order = np.lexsort((rng.random(n), g))
    gs, ps = g[order], pi[order]
    c = np.cumsum(ps)
    head = np.r_[True, gs[1:] != gs[:-1]]
    base = np.maximum.accumulate(np.where(head, c - ps, -np.inf))
    c_in = c - base  # cumulative sum within the group
    u = rng.random(int(g.max()) + 1 if n else 0)[gs]
    hit = np.floor(c_in - u + 1e-12) > np.floor(c_in - ps - u + 1e-12)
    out = np.zeros(n, dtype=bool)
    out[order] = hit
    return out


# ---------------------------------------------------------------- study variables z (section 2.4)


@dataclass
class StudyVariables:
    """z = y * 1{domain = category}: study variables (and the count) over key domains."""

    study: list[str]  # numeric columns; "_count" is the constant 1
    domains: dict[str, list[str]]  # key -> category labels ("" -> whole file)
    keys: list[KeySpec]

    @property
    def labels(self) -> list[tuple[str, str, str]]:
        return [(y, d, c) for y in self.study for d, cats in self.domains.items() for c in cats]

    def _dom_codes(self, df: pd.DataFrame) -> dict[str, np.ndarray]:
        out = {}
        kf = key_frame(df, [k for k in self.keys if k.name in self.domains])
        for d, cats in self.domains.items():
            if d == "":
                out[d] = np.zeros(len(df), dtype=np.int64)
            else:
                out[d] = pd.Categorical(kf[d].astype(str), categories=cats).codes.astype(np.int64)
        return out

    def _y(self, df: pd.DataFrame) -> dict[str, np.ndarray]:
        return {
            y: (np.ones(len(df)) if y == "_count" else df[y].to_numpy(dtype=float))
            for y in self.study
        }

    def frame_parts(self, df: pd.DataFrame) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
        return self._y(df), self._dom_codes(df)

    def totals(self, df: pd.DataFrame, weight: np.ndarray) -> np.ndarray:
        """Weighted totals of every z (in the order of labels)."""
        ys, ds = self.frame_parts(df)
        out = []
        for y in self.study:
            for d, cats in self.domains.items():
                c = ds[d]
                ok = c >= 0
                out.append(np.bincount(c[ok], weights=(ys[y] * weight)[ok], minlength=len(cats)))
        return np.concatenate(out) if out else np.zeros(0)


def study_variables(
    df: pd.DataFrame,
    keys: Sequence[KeyLike],
    study: Sequence[str],
    max_levels: int = 10,
    min_records: int = 30,
    count: bool = True,
) -> StudyVariables:
    """Study variables for the rates and epsilon: each study column (and the record count) in
    total and within each category of the keys with at most max_levels categories (domains
    with fewer than min_records records are left out)."""
    missing = [c for c in study if c not in df.columns]
    if missing:
        raise MasscError(f"study: columns {missing} are not in the data; fix variables.study")
    specs = _key_specs(keys)
    kf = key_frame(df, specs)
    domains: dict[str, list[str]] = {"": [""]}
    for k in specs:
        vc = kf[k.name].astype(str).value_counts()
        if len(vc) <= max_levels:
            domains[k.name] = sorted(vc.index[vc >= min_records].tolist())
    ys = (["_count"] if count else []) + list(study)
    return StudyVariables(ys, domains, specs)


def _moments(
    h: np.ndarray,
    n_h: int,
    a: np.ndarray,
    da: np.ndarray,
    b: np.ndarray | None,
    db: np.ndarray | None,
    n_c: int,
) -> tuple[np.ndarray, np.ndarray]:
    """Per stratum x category sums and sums of squares of u = a 1{da = c} - b 1{db = c}."""
    m = n_h * n_c
    oka = da >= 0
    ia = h[oka] * n_c + da[oka]
    s1 = np.bincount(ia, weights=a[oka], minlength=m)
    s2 = np.bincount(ia, weights=a[oka] ** 2, minlength=m)
    if b is not None:
        okb = db >= 0
        ib = h[okb] * n_c + db[okb]
        s1 -= np.bincount(ib, weights=b[okb], minlength=m)
        s2 += np.bincount(ib, weights=b[okb] ** 2, minlength=m)
        same = okb & (da == db)
        s2 -= 2 * np.bincount(h[same] * n_c + db[same], weights=(a * b)[same], minlength=m)
    return s1.reshape(n_h, n_c), s2.reshape(n_h, n_c)


def _s2(s1: np.ndarray, s2: np.ndarray, nh: np.ndarray) -> np.ndarray:
    """S^2 = (sum u^2 - N ubar^2) / (N - 1) per stratum (rows)."""
    nn = nh[:, None].astype(float)
    with np.errstate(invalid="ignore", divide="ignore"):
        out = (s2 - s1**2 / nn) / (nn - 1)
    return np.where(nn > 1, np.maximum(out, 0.0), 0.0)


@dataclass
class ZMoments:
    """Per stratum (rows) and study variable z (columns) quantities of eq. 8a/8b."""

    labels: list[tuple[str, str, str]]
    strata: list[str]
    N: np.ndarray  # N_h(0)
    theta: np.ndarray  # theta_z = sum z w over B(0)
    V: np.ndarray  # sum_k nu_hk, nu = (z~ - z) w
    S2_nu: np.ndarray
    S2_zstar: np.ndarray | None = None

    def bias_msq(self, psi: np.ndarray) -> np.ndarray:
        """Mean squared conditional bias (8a) of each z."""
        psi = np.asarray(psi, dtype=float)[:, None]
        return (self.N[:, None] * (1 - psi) * psi * self.S2_nu).sum(0) + (self.V * psi).sum(0) ** 2

    def variance(self, phi: np.ndarray) -> np.ndarray:
        """Conditional variance (8b) of each z."""
        if self.S2_zstar is None:
            raise MasscError("S2_zstar is not set: compute it from the substituted file first")
        phi = np.asarray(phi, dtype=float)[:, None]
        return (self.N[:, None] * (1 / phi - 1) * self.S2_zstar).sum(0)


@dataclass
class ZParts:
    """Study values y and domain codes of B(0) and of its all-substituted copy (cached)."""

    y0: dict[str, np.ndarray]
    d0: dict[str, np.ndarray]
    y1: dict[str, np.ndarray]
    d1: dict[str, np.ndarray]

    @classmethod
    def of(cls, b0: pd.DataFrame, tilde: pd.DataFrame, zvars: StudyVariables) -> ZParts:
        y0, d0 = zvars.frame_parts(b0)
        y1, d1 = zvars.frame_parts(tilde)
        return cls(y0, d0, y1, d1)


def z_moments(
    b0: pd.DataFrame,
    tilde: pd.DataFrame | None,
    strata: pd.Series | np.ndarray,
    weight: str | np.ndarray,
    zvars: StudyVariables,
    substituted: np.ndarray | None = None,
    parts: ZParts | None = None,
    base: ZMoments | None = None,
) -> ZMoments:
    """theta_z, sum nu, S2_nu (eq. 8a) and, given the substitution indicators d(1),
    S2 of z* w (eq. 8b). tilde: B(0) with every record's key-related variables from its partner.
    parts: cached values (then tilde may be None); base: moments of an earlier call whose theta,
    V and S2_nu are reused (only S2 of z* is computed)."""
    h_codes, h_labels = pd.factorize(pd.Series(np.asarray(strata)), sort=True)
    n_h = len(h_labels)
    N = np.bincount(h_codes, minlength=n_h)
    w = b0[weight].to_numpy(dtype=float) if isinstance(weight, str) else np.asarray(weight, float)
    p = parts if parts is not None else ZParts.of(b0, tilde, zvars)
    th, V, S2v, S2z = [], [], [], []
    sel = None if substituted is None else np.asarray(substituted, dtype=bool)
    for y in zvars.study:
        for d, cats in zvars.domains.items():
            nc = len(cats)
            if base is None:
                t1, _ = _moments(h_codes, n_h, w * p.y0[y], p.d0[d], None, None, nc)
                th.append(t1.sum(0))
                s1, s2 = _moments(h_codes, n_h, w * p.y1[y], p.d1[d], w * p.y0[y], p.d0[d], nc)
                V.append(s1)
                S2v.append(_s2(s1, s2, N))
            if sel is not None:
                ys = np.where(sel, p.y1[y], p.y0[y])
                ds = np.where(sel, p.d1[d], p.d0[d])
                a1, a2 = _moments(h_codes, n_h, w * ys, ds, None, None, nc)
                S2z.append(_s2(a1, a2, N))
    return ZMoments(
        labels=zvars.labels,
        strata=[str(s) for s in h_labels],
        N=N.astype(float),
        theta=base.theta if base is not None else np.concatenate(th),
        V=base.V if base is not None else np.concatenate(V, axis=1),
        S2_nu=base.S2_nu if base is not None else np.concatenate(S2v, axis=1),
        S2_zstar=np.concatenate(S2z, axis=1) if sel is not None else None,
    )


# ---------------------------------------------------------------- optimal rates (eq. 9, 10)


@dataclass
class Rates:
    rates: np.ndarray  # per stratum
    objective: float  # disclosure cost of eq. 9 or 10, divided by N(0)
    constraint: float  # max over z of the relative constraint at the solution
    bound: float  # alpha or beta
    binding: int  # index of the z with the largest relative value
    method: str  # "upper bound", "SLSQP", "1-D search", "lower bound"


def _rel(values: np.ndarray, theta: np.ndarray) -> np.ndarray:
    return values / theta**2


def optimal_psi(
    m: ZMoments,
    alpha: float,
    psi_max: float = 0.25,
    psi_min: float = 1e-6,
    cost: np.ndarray | None = None,
    min_theta: float = 0.0,
) -> Rates:
    """eq. 9: min sum_h a_h N_h (1 - psi_h)/psi_h s.t. max_z (8a)/theta_z^2 <= alpha,
    psi_min <= psi_h <= psi_max."""
    keep = np.abs(m.theta) > min_theta
    th, N, S2, V = m.theta[keep], m.N, m.S2_nu[:, keep], m.V[:, keep]
    a = np.ones(len(N)) if cost is None else np.asarray(cost, float)
    scale = 1.0 / N.sum()

    def g(p):
        pp = p[:, None]
        return _rel((N[:, None] * (1 - pp) * pp * S2).sum(0) + (V * pp).sum(0) ** 2, th)

    def jac_g(p):
        pp = p[:, None]
        bias = (V * pp).sum(0)
        d = N[:, None] * (1 - 2 * pp) * S2 + 2 * bias[None, :] * V
        return (d / th**2).T

    def f(p):
        return scale * float((a * N * (1 - p) / p).sum())

    def df(p):
        return -scale * a * N / p**2

    return _solve(
        g,
        jac_g,
        f,
        df,
        alpha,
        lo=psi_min,
        hi=psi_max,
        increasing=True,
        name="(8a) bias",
        labels=[lab for lab, k in zip(m.labels, keep, strict=True) if k],
        keep=keep,
        dim=len(N),
    )


def optimal_phi(
    m: ZMoments,
    beta: float,
    phi_min: float = 0.5,
    phi_max: float = 0.999,
    cost: np.ndarray | None = None,
    min_theta: float = 0.0,
) -> Rates:
    """eq. 10: min sum_h a_h N_h phi_h/(1 - phi_h) s.t. max_z (8b)/theta_z^2 <= beta,
    phi_min <= phi_h <= phi_max (< 1)."""
    if m.S2_zstar is None:
        raise MasscError("S2_zstar is not set: compute z_moments with the substitution indicators")
    keep = np.abs(m.theta) > min_theta
    th, N, S2 = m.theta[keep], m.N, m.S2_zstar[:, keep]
    a = np.ones(len(N)) if cost is None else np.asarray(cost, float)
    scale = 1.0 / N.sum()

    def g(p):
        return _rel((N[:, None] * (1 / p[:, None] - 1) * S2).sum(0), th)

    def jac_g(p):
        return (-N[:, None] * S2 / p[:, None] ** 2 / th**2).T

    def f(p):
        return scale * float((a * N * p / (1 - p)).sum())

    def df(p):
        return scale * a * N / (1 - p) ** 2

    return _solve(
        g,
        jac_g,
        f,
        df,
        beta,
        lo=phi_min,
        hi=phi_max,
        increasing=False,
        name="(8b) variance",
        labels=[lab for lab, k in zip(m.labels, keep, strict=True) if k],
        keep=keep,
        dim=len(N),
    )


def _solve(g, jac_g, f, df, bound, lo, hi, increasing, name, labels, keep, dim) -> Rates:
    """Minimize f under max g <= bound in the box [lo, hi]^H. f is monotone towards the
    constraint's bad side, so the cheapest corner is tried first, then a 1-D monotone search on
    the ray to the safe corner gives a feasible start for SLSQP."""
    cheap, safe = (hi, lo) if increasing else (lo, hi)
    x_cheap, x_safe = np.full(dim, cheap), np.full(dim, safe)
    n_z = len(np.atleast_1d(g(x_cheap)))

    def result(x, method):
        gv = g(x)
        j = int(np.argmax(gv)) if len(gv) else 0
        z = int(np.flatnonzero(keep)[j]) if len(gv) else -1
        return Rates(x, f(x), float(gv.max()) if len(gv) else 0.0, bound, z, method)

    if n_z == 0 or g(x_cheap).max() <= bound:
        return result(x_cheap, "bound" if n_z else "no constraint")
    gs = g(x_safe)
    if gs.max() > bound:
        j = int(np.argmax(gs))
        raise MasscInfeasible(
            f"constraint {name} cannot be met: at the safest rates ({safe:g} in every stratum) "
            f"the relative value for z={labels[j]} is {gs[j]:.6g} > bound {bound:.6g} "
            f"(excess {gs[j] - bound:.6g}); raise epsilon or alpha_share, or widen the rate bounds"
        )

    def towards_safe(x: np.ndarray) -> np.ndarray:
        """Closest feasible point on the segment from x to the safe corner (monotone in t)."""
        if g(x).max() <= bound:
            return x
        t_lo, t_hi = 0.0, 1.0  # t=0: x (infeasible), t=1: safe corner (feasible)
        for _ in range(100):
            t = 0.5 * (t_lo + t_hi)
            if g(x + t * (x_safe - x)).max() <= bound:
                t_hi = t
            else:
                t_lo = t
        return x + t_hi * (x_safe - x)

    x0 = towards_safe(x_cheap)
    best, method = x0, "1-D search"
    if dim > 1:
        res = minimize(
            f,
            x0,
            jac=df,
            method="SLSQP",
            bounds=[(lo, hi)] * dim,
            constraints=[
                {
                    "type": "ineq",
                    "fun": lambda x: 1.0 - g(x) / bound,
                    "jac": lambda x: -jac_g(x) / bound,
                }
            ],
            options={"maxiter": 500, "ftol": 1e-14},
        )
        x = np.clip(res.x, lo, hi)
        if np.all(np.isfinite(x)):
            x = towards_safe(x)
            if f(x) < f(x0):
                best, method = x, "SLSQP"
    return result(best, method)


# ---------------------------------------------------------------- post-treatment risk (eq. 3-6)


@dataclass
class DeltaMeasures:
    delta_k: np.ndarray  # eq. 3, per record of B(0)
    appearance: np.ndarray  # "u", "d", "t", "o" or "" (does not appear) per record
    by_appearance: pd.DataFrame  # n_records, total, delta_bar (divisor N(0)) for u, d, t, o
    profiles: pd.DataFrame  # per original profile: N_p, delta_p (eq. 4)
    delta: float  # max of delta_u, delta_d, delta_t, delta_o

    @property
    def metrics(self) -> dict[str, float]:
        t = self.by_appearance.set_index("appearance")["delta_bar"]
        return {
            "delta": self.delta,
            **{f"delta_{a}": float(t[a]) for a in "udto"},
            "delta_profile_max": float(self.profiles["delta_p"].max()),
        }


def delta_measures(
    b0: pd.DataFrame,
    treated: pd.DataFrame,
    substituted: np.ndarray,
    retained: np.ndarray,
    keys: Sequence[KeyLike],
    sensitive: Any,
    risk_basis: Literal["original", "treated", "max"] = "max",
) -> DeltaMeasures:
    """delta_k = (1 - d_k(1)) d_k(2) r_k(2) (eq. 3), averaged over records of B(0) by how their
    (original) key profile appears in B(2) (u, d, t, o; divisor N(0)), and by profile (eq. 4).

    treated: B(1) (all N records, after substitution); retained: d(2). r(2): "treated" is the
    GenMASSC score of the record in B(2) (text of section 2.3), "original" the pre-treatment
    score r(0) (what Table 3 lists), "max" the larger of the two (default, conservative).
    """
    specs = _key_specs(keys)
    n = len(b0)
    d1 = np.asarray(substituted, dtype=bool)
    d2 = np.asarray(retained, dtype=bool)
    both = pd.concat(
        [key_frame(b0, specs).astype(str), key_frame(treated, specs).astype(str)],
        ignore_index=True,
    )
    codes = profile_codes(both, [k.name for k in specs]).to_numpy()
    p0, p2 = codes[:n], codes[n:]
    cnt2 = np.bincount(p2[d2], minlength=int(codes.max()) + 1)
    app = cnt2[p0]
    labels = np.array(["", "u", "d", "t", "o"], dtype=object)[np.minimum(app, 4)]
    r0 = genmassc_scores(b0, specs, sensitive).to_numpy()
    r2 = np.zeros(n)
    if d2.any():
        r2[d2] = genmassc_scores(treated[d2], specs, sensitive).to_numpy()
    r = {"original": r0, "treated": r2, "max": np.maximum(r0, r2)}[risk_basis]
    delta_k = (~d1) * d2 * r  # eq. 3
    rows = []
    for a in "udto":
        m = labels == a
        rows.append((a, int(m.sum()), float(delta_k[m].sum()), float(delta_k[m].sum() / n)))
    by_app = pd.DataFrame(rows, columns=["appearance", "n_records", "total", "delta_bar"])
    n_p = np.bincount(p0)
    t_p = np.bincount(p0, weights=delta_k, minlength=len(n_p))
    present = np.flatnonzero(n_p > 0)
    prof = pd.DataFrame(
        {"profile": present, "N_p": n_p[present], "delta_p": t_p[present] / n_p[present]}
    )
    return DeltaMeasures(
        delta_k=delta_k,
        appearance=labels,
        by_appearance=by_app,
        profiles=prof,
        delta=float(by_app["delta_bar"].max()),
    )


# ---------------------------------------------------------------- information loss


def information_loss(m: ZMoments, psi: np.ndarray, phi: np.ndarray) -> pd.DataFrame:
    """Per z: theta, (8a), (8b) and RRMSE = sqrt((8a) + (8b)) / |theta| (eq. 7)."""
    b = m.bias_msq(psi)
    v = m.variance(phi)
    with np.errstate(divide="ignore", invalid="ignore"):  # undefined (NaN) when theta_z = 0
        rr = np.where(m.theta != 0, np.sqrt(b + v) / np.abs(m.theta), np.nan)
    return pd.DataFrame(
        {
            "variable": [lab[0] for lab in m.labels],
            "domain": [lab[1] for lab in m.labels],
            "category": [lab[2] for lab in m.labels],
            "theta": m.theta,
            "bias_msq_8a": b,
            "variance_8b": v,
            "rrmse": rr,
        }
    )


def epsilon_from_replications(
    estimates: np.ndarray, truth: np.ndarray, labels: Sequence[tuple[str, str, str]]
) -> tuple[float, pd.DataFrame]:
    """Empirical RRMSE of each z over R replications of the whole treatment; epsilon = max."""
    from sdl_design.utility import rrmse

    est = np.atleast_2d(np.asarray(estimates, dtype=float))
    truth = np.asarray(truth, dtype=float)
    ok = np.abs(truth) > 0
    rr = np.full(len(truth), np.nan)
    rr[ok] = rrmse(est[:, ok], truth[ok])
    tab = pd.DataFrame(
        {
            "variable": [lab[0] for lab in labels],
            "domain": [lab[1] for lab in labels],
            "category": [lab[2] for lab in labels],
            "truth": truth,
            "mean_estimate": est.mean(axis=0),
            "rrmse": rr,
        }
    )
    return (float(np.nanmax(rr)) if ok.any() else 0.0), tab


# ---------------------------------------------------------------- the whole treatment


@dataclass
class MasscConfig:
    """Everything a MASSC run needs besides the data and the Generator."""

    keys: list[KeySpec]
    sensitive: list[SensitiveSpec]
    study: list[str]
    weight: str
    substitute_columns: list[str]  # key-related variables taken from the donor
    psi_max: float = 0.25
    psi_min: float = 1e-6
    phi_min: float = 0.5
    phi_max: float = 0.999
    epsilon: float = 0.15
    alpha_share: float = 0.5
    importance: dict[str, float] = field(default_factory=dict)
    restrictions: list[str] = field(default_factory=list)
    strata_merge: dict[str, str] | None = None
    substrata: list[str] = field(default_factory=list)  # k-means variables within each stratum
    substrata_k: int = 2
    substrata_min_records: int = 30
    nest: tuple[str, str] | None = None  # (design strata, PSU): nested selection (section 5)
    cost: Literal["risk", "equal"] = "risk"  # a_h: mean pre-treatment risk score, or 1
    risk_basis: Literal["original", "treated", "max"] = "max"
    max_levels: int = 10
    min_records: int = 30

    # alpha + beta = epsilon^2 (eq. 7), a hair inside so that sqrt(alpha + beta) <= epsilon
    # survives floating-point rounding at the gate
    @property
    def alpha(self) -> float:
        return self.alpha_share * self.epsilon**2 * (1 - 1e-9)

    @property
    def beta(self) -> float:
        return (1.0 - self.alpha_share) * self.epsilon**2 * (1 - 1e-9)


@dataclass
class MasscPlan:
    """Deterministic part of a run (given its Generator): strata, partners, rates psi."""

    strata: np.ndarray  # stratum label per record
    labels: list[str]  # strata in rate order
    h: np.ndarray  # stratum index per record
    donors: Donors
    tilde: pd.DataFrame  # B(0) with every record's key-related variables from its partner
    zvars: StudyVariables
    parts: ZParts
    moments: ZMoments
    cost: np.ndarray
    psi: Rates


@dataclass
class MasscTreatment:
    substituted: np.ndarray  # d(1) (records actually changed)
    retained: np.ndarray  # d(2)
    b1: pd.DataFrame  # all records after substitution
    phi: Rates
    factor: np.ndarray  # 1/phi_h per record
    moments: ZMoments  # with S2 of z*


def _cfg_check(df: pd.DataFrame, cfg: MasscConfig) -> None:
    need = [cfg.weight, *cfg.substitute_columns, *cfg.restrictions, *cfg.study]
    need += [k.name for k in cfg.keys] + [s.name for s in cfg.sensitive]
    if cfg.nest:
        need += list(cfg.nest)
    missing = sorted({c for c in need if c not in df.columns})
    if missing:
        raise MasscError(f"columns {missing} named by the MASSC config are not in the data")
    keys = {k.name for k in cfg.keys}
    if not keys <= set(cfg.substitute_columns):
        raise MasscError(
            f"substitute_columns must include every key ({sorted(keys)}): a substituted record "
            "takes all key-related variables of its donor"
        )
    if not 0 < cfg.psi_min < cfg.psi_max <= 1 or not 0 < cfg.phi_min < cfg.phi_max < 1:
        raise MasscError("rate bounds: need 0 < psi_min < psi_max <= 1, 0 < phi_min < phi_max < 1")


def massc_plan(df: pd.DataFrame, cfg: MasscConfig, rng: np.random.Generator) -> MasscPlan:
    """Step I and II: risk strata, substitution partners, optimal psi (eq. 9)."""
    _cfg_check(df, cfg)
    strata = massc_strata(
        df,
        cfg.keys,
        cfg.strata_merge,
        cfg.substrata,
        cfg.substrata_k,
        cfg.substrata_min_records,
        rng,
    ).to_numpy()
    h, labels = pd.factorize(pd.Series(strata), sort=True)
    donors = find_donors(df, cfg.keys, cfg.sensitive, cfg.importance, cfg.restrictions, rng)
    has = donors.donor >= 0
    need = list(dict.fromkeys([*cfg.substitute_columns, *cfg.study]))
    tilde = substitute(
        df[need], np.where(has, donors.donor, np.arange(len(df))), has, cfg.substitute_columns
    )
    zvars = study_variables(df, cfg.keys, cfg.study, cfg.max_levels, cfg.min_records)
    parts = ZParts.of(df, tilde, zvars)
    mom = z_moments(df, None, strata, cfg.weight, zvars, parts=parts)
    if cfg.cost == "risk" and cfg.sensitive:
        r0 = genmassc_scores(df, cfg.keys, cfg.sensitive).to_numpy()
        cost = np.maximum(np.bincount(h, weights=r0) / np.bincount(h), 0.01)
    else:
        cost = np.ones(len(labels))
    psi = optimal_psi(mom, cfg.alpha, cfg.psi_max, cfg.psi_min, cost)
    return MasscPlan(
        strata, [str(x) for x in labels], h, donors, tilde, zvars, parts, mom, cost, psi
    )


def _groups(df: pd.DataFrame, plan: MasscPlan, cfg: MasscConfig) -> np.ndarray:
    if cfg.nest:
        return _combine([_codes(df[cfg.nest[0]]), _codes(df[cfg.nest[1]])], len(df))
    return plan.h


def massc_treat(
    df: pd.DataFrame,
    plan: MasscPlan,
    cfg: MasscConfig,
    rng: np.random.Generator,
    phi: np.ndarray | None = None,
) -> MasscTreatment:
    """Steps II-III: substitution at psi_h, optimal phi (eq. 10, unless given), subsampling."""
    groups = _groups(df, plan, cfg)
    sel = select(groups, plan.psi.rates[plan.h], rng)
    d1 = sel & (plan.donors.donor >= 0)
    b1 = substitute(df, plan.donors.donor, d1, cfg.substitute_columns)
    mom = z_moments(
        df, None, plan.strata, cfg.weight, plan.zvars, d1, parts=plan.parts, base=plan.moments
    )
    if phi is None:
        rates = optimal_phi(mom, cfg.beta, cfg.phi_min, cfg.phi_max, plan.cost)
    else:
        phi = np.asarray(phi, dtype=float)
        g = mom.variance(phi) / mom.theta**2
        rates = Rates(
            phi, float("nan"), float(np.nanmax(g)), cfg.beta, int(np.nanargmax(g)), "given"
        )
    d2 = select(groups, rates.rates[plan.h], rng)
    return MasscTreatment(d1, d2, b1, rates, 1.0 / rates.rates[plan.h], mom)


def rates_table(plan: MasscPlan, tr: MasscTreatment) -> pd.DataFrame:
    """Per stratum: N_h, cost a_h, psi_h, phi_h and the realized counts."""
    h = plan.h
    nh = np.bincount(h, minlength=len(plan.labels))
    return pd.DataFrame(
        {
            "stratum": plan.labels,
            "N": nh,
            "cost_a": plan.cost,
            "psi": plan.psi.rates,
            "phi": tr.phi.rates,
            "n_no_donor": np.bincount(h, weights=plan.donors.donor < 0, minlength=len(nh)),
            "n_substituted": np.bincount(h, weights=tr.substituted, minlength=len(nh)),
            "n_retained": np.bincount(h, weights=tr.retained, minlength=len(nh)),
        }
    ).astype({"n_no_donor": int, "n_substituted": int, "n_retained": int})


def check_edits(df: pd.DataFrame, edits: Sequence[Any]) -> None:
    """Raise MasscError when the treated file breaks an edit rule (sdl_design.edits.failing_rows)."""
    if not edits:
        return
    try:
        from sdl_design.edits import failing_rows
    except ImportError:
        return
    bad = failing_rows(df, edits)
    if isinstance(bad, pd.DataFrame):
        n_bad = len(bad)
        detail = bad.head(5).to_dict("records")
    else:
        arr = np.asarray(bad)
        n_bad = int(arr.sum()) if arr.dtype == bool else len(arr)
        detail = None
    if n_bad:
        raise MasscError(
            f"substitution broke {n_bad} edit checks (e.g. {detail}); add the variables these "
            "edits tie to the keys to the substituted (key-related) columns, or restrict donors"
        )


# ---------------------------------------------------------------- Step IV: calibration


def _coarsened(df: pd.DataFrame, controls: Sequence[KeyLike]) -> tuple[pd.DataFrame, list[str]]:
    specs = _key_specs(controls)
    recoded = [k for k in specs if k.bins is not None or k.map is not None]
    if not recoded:
        return df, [k.name for k in specs]
    out = df.copy()
    kf = key_frame(df, recoded)
    for k in recoded:
        out[k.name] = kf[k.name]
    return out, [k.name for k in specs]


def _shift_totals(t: Any, add: Any, sub: Any) -> Any:
    """t + add - sub for control totals (numbers or {category: total} margins)."""
    if isinstance(t, Mapping):
        cats = set(t) | set(add) | set(sub)
        return {c: t.get(c, 0.0) + add.get(c, 0.0) - sub.get(c, 0.0) for c in cats}
    return float(t) + float(add) - float(sub)


def calibrate_treated(
    b2: pd.DataFrame,
    weight: str,
    factor: np.ndarray,
    original: pd.DataFrame,
    controls: Sequence[KeyLike],
    method: str = "logit",
    bounds: tuple[float, float] | None = None,
    replicate_columns: Sequence[str] = (),
    policy: str = "widen",
    b0: pd.DataFrame | None = None,
) -> tuple[pd.DataFrame, dict[str, pd.DataFrame], dict[str, float]]:
    """Step IV: weights w/phi of the retained records calibrated to the original file's control
    totals; each replicate weight divided by phi and recalibrated to its own replicate's
    controls. Replicate r's controls are those of B(0) (b0: the MASSC input, whose replicate
    weights belong to the released design) moved by the difference between the original and
    B(0) full-sample totals, T_r = T_r(B0) + T(original) - T(B0): equal to the original's
    replicate totals when earlier stages left weights and controls alone. No controls: weights
    and replicates are only divided by phi. Returns the frame, report tables, metrics."""
    base = b2[weight].to_numpy(dtype=float) * factor
    out = b2.copy()
    tables: dict[str, pd.DataFrame] = {}
    reps = list(replicate_columns)
    if not controls:
        w_cal = base
        out[weight] = base
        for c in reps:
            out[c] = b2[c].to_numpy(dtype=float) * factor
    else:
        from sdl_design.calibration import calibrate, calibrate_replicates, control_totals

        work, names = _coarsened(b2, controls)
        orig, _ = _coarsened(original, controls)
        work = work.assign(**{weight: base})
        totals = control_totals(orig, weight, names)
        w_cal = np.asarray(calibrate(work, weight, totals, method=method, bounds=bounds), float)
        out[weight] = w_cal
        if reps:
            src, _ = _coarsened(b0 if b0 is not None else original, controls)
            t_src = control_totals(src, weight, names)
            per_rep = [
                {v: _shift_totals(t_r[v], totals[v], t_src[v]) for v in names}
                for t_r in control_totals(src, reps, names)
            ]
            rep_in = work[names].copy()
            for c in reps:
                rep_in[c] = b2[c].to_numpy(dtype=float) * factor
            cal, report = calibrate_replicates(rep_in, reps, per_rep, method, bounds, policy)
            for c in reps:
                out[c] = np.asarray(cal[c], dtype=float)
            tables["replicate_calibration"] = pd.DataFrame(report)
    adj = w_cal / base
    final = w_cal / b2[weight].to_numpy(dtype=float)
    q = [0, 1, 5, 50, 95, 99, 100]
    tables["weight_factors"] = pd.DataFrame(
        {
            "percentile": q,
            "calibration_factor": np.percentile(adj, q),
            "total_factor": np.percentile(final, q),
        }
    )
    metrics = {
        "calibration_factor_min": float(adj.min()),
        "calibration_factor_max": float(adj.max()),
        "weight_factor_max": float(final.max()),
        "weight_sum_ratio": float(w_cal.sum() / original[weight].sum()),
    }
    return out, tables, metrics


def replication_seed(seed: int, r: int) -> np.random.SeedSequence:
    """SeedSequence of replication r: depends on (seed, r) only, not on chunking or runner."""
    import zlib

    return np.random.SeedSequence(entropy=int(seed), spawn_key=(zlib.crc32(b"massc-rep"), int(r)))
