"""Study variables z (section 2.4) and their per-stratum moments for (8a) and (8b)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import pandas as pd

from sdl_design.codes import factorize
from sdl_design.keys import key_frame, key_levels
from sdl_design.spec import KeySpec
from sdl_design.stages.massc.common import KeyLike, MasscError, _key_specs
from sdl_design.survey.blocksum import BlockPartial, block_bins, block_codes, group_sum, n_blocks
from sdl_design.survey.design import SurveyDesign


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
        by_name = {k.name: k for k in self.keys}
        for d, cats in self.domains.items():
            if d == "":
                out[d] = np.zeros(len(df), dtype=np.int64)
            else:  # the category of each record's label as text (-1: not a domain category)
                codes, levels = key_levels(df[d], by_name[d])
                pos = pd.Index(cats).get_indexer([str(v) for v in levels]).astype(np.int64)
                out[d] = pos[codes]
        return out

    def _y(self, df: pd.DataFrame) -> dict[str, np.ndarray]:
        """Values of each study variable; a missing value counts 0 (totals over the non-missing
        records, never NaN)."""
        return {
            y: (np.ones(len(df)) if y == "_count" else np.nan_to_num(df[y].to_numpy(dtype=float)))
            for y in self.study
        }

    def frame_parts(self, df: pd.DataFrame) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
        return self._y(df), self._dom_codes(df)

    def totals(self, df: pd.DataFrame, weight: np.ndarray) -> np.ndarray:
        """Weighted totals of every z (in the order of labels)."""
        ys, ds = self.frame_parts(df)
        return self.totals_of(ys, ds, weight)

    def totals_of(
        self, ys: dict[str, np.ndarray], ds: dict[str, np.ndarray], weight: np.ndarray
    ) -> np.ndarray:
        """totals() from the study values and domain codes of the records (frame_parts)."""
        return self._totals(lambda y: ys[y], lambda d: ds[d], weight)

    def _totals(self, y_of, d_of, weight: np.ndarray) -> np.ndarray:
        """totals_of with the values of study variable y from y_of(y) and the domain codes of
        domain d from d_of(d), made one at a time."""
        sums = {key: bins.sum(x) for key, bins, x in self.total_terms(y_of, d_of, weight)}
        return self.totals_from(sums)

    def total_terms(
        self, y_of, d_of, weight: np.ndarray
    ) -> Iterator[tuple[tuple[str, str, str], _Bins, np.ndarray]]:
        """The group sums of the totals: (key, bins, terms), one study variable at a time."""
        n = len(weight)
        # once per domain: records outside the categories (-1) in a bin of their own, dropped
        # (each total still sums its records in record order, without a copy of them per y)
        bins = {}
        for d, cats in self.domains.items():
            c = d_of(d)
            bins[d] = _Bins(np.where(c >= 0, c, len(cats)), None, len(cats) + 1, n)
        for y in self.study:
            wy = y_of(y) * weight  # once per study variable
            for d in self.domains:
                yield (y, d, "total"), bins[d], wy

    def totals_from(self, sums: dict[tuple[str, str, str], np.ndarray]) -> np.ndarray:
        """The totals (in the order of labels) from the sums of total_terms."""
        out = [
            sums[(y, d, "total")][: len(cats)]
            for y in self.study
            for d, cats in self.domains.items()
        ]
        return np.concatenate(out) if out else np.zeros(0)

    def sampling_variance(self, df: pd.DataFrame, design: SurveyDesign) -> np.ndarray:
        """Taylor sampling variance of every total (in the order of labels) in the design of df
        (records of df in the design's order): PSUs with replacement within strata, from PSU
        totals in block sums (sdl_design.survey.blocksum)."""
        if design.n != len(df):
            raise MasscError(
                f"the design has {design.n} records, the file {len(df)}: give the design of df"
            )
        ys, ds = self.frame_parts(df)
        terms = self.psu_terms(ys, ds, design.w, design.g, design.n_psu)
        return self.variance_from({key: bins.sum(x) for key, bins, x in terms}, design)

    def psu_terms(
        self,
        ys: dict[str, np.ndarray],
        ds: dict[str, np.ndarray],
        w: np.ndarray,
        g: np.ndarray,
        n_psu: int,
    ) -> Iterator[tuple[tuple[str, str, str], _Bins, np.ndarray]]:
        """The group sums of the PSU totals of every z: (key, bins, terms), g each record's PSU
        (0..n_psu-1, the design's codes)."""
        n = len(w)
        bins = {}
        for d, cats in self.domains.items():
            c = ds[d]
            ok = c >= 0
            bins[d] = (ok, _Bins(g[ok] * len(cats) + c[ok], ok, n_psu * len(cats), n))
        for y in self.study:
            wy = w * ys[y]
            for d in self.domains:
                ok, b = bins[d]
                yield (y, d, "psu"), b, wy[ok]

    def variance_from(
        self, sums: dict[tuple[str, str, str], np.ndarray], design: SurveyDesign
    ) -> np.ndarray:
        """The Taylor variances from the sums of psu_terms (design: its PSU kernel)."""
        out = [
            design.psu_variance(sums[(y, d, "psu")].reshape(design.n_psu, len(cats)))
            for y in self.study
            for d, cats in self.domains.items()
        ]
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


def _s2(s1: np.ndarray, s2: np.ndarray, nh: np.ndarray) -> np.ndarray:
    """S^2 = (sum u^2 - N ubar^2) / (N - 1) per stratum (rows)."""
    nn = nh[:, None].astype(float)
    with np.errstate(invalid="ignore", divide="ignore"):
        out = (s2 - s1**2 / nn) / (nn - 1)
    return np.where(nn > 1, np.maximum(out, 0.0), 0.0)


class _Bins:
    """The group codes (0..m-1) of the records `mask` selects (None: all) in a file of n
    records, and their sums in block order (sdl_design.survey.blocksum: the same bits by partition)."""

    def __init__(self, codes: np.ndarray, mask: np.ndarray | None, m: int, n: int):
        self.codes, self.mask, self.m, self.n = codes, mask, m, n
        self._coded: np.ndarray | None = None
        self._at, self._part = -1, None

    def _rows(self) -> np.ndarray | None:
        return None if self.mask is None else np.flatnonzero(self.mask)

    def sum(self, x: np.ndarray) -> np.ndarray:
        if self._coded is None and n_blocks(self.n) > 1:
            self._coded = block_codes(self.codes, self._rows(), self.m)
        return group_sum(self.codes, x, self.m, self.n, coded=self._coded)

    def partial(self, x: np.ndarray, start: int) -> BlockPartial:
        """The sum's BlockPartial when these are the records start..start+n-1 of a file."""
        if self._at != start:  # once for every study variable summed in these bins
            rows = start + (np.arange(self.n) if self.mask is None else self._rows())
            self._at = start
            self._part = block_bins(self.codes, self.m, start, start + self.n, rows)
        return self._part.of(x)


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
    # squared scale D_z of each z's constraints: (8a) <= alpha D_z, (8b) <= beta D_z. None:
    # theta_z^2 (eq. 9, 10 as written); else e.g. the original sampling variance of theta_z
    denom: np.ndarray | None = None

    @property
    def scale2(self) -> np.ndarray:
        """D_z: theta_z^2 unless denom is set."""
        return self.theta**2 if self.denom is None else self.denom

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

    def take(self, rows: slice | np.ndarray) -> ZParts:
        """The parts of the records `rows`."""
        parts = (self.y0, self.d0, self.y1, self.d1)
        return ZParts(*({k: v[rows] for k, v in part.items()} for part in parts))

    def treated(self, substituted: np.ndarray, rows: np.ndarray) -> TreatedParts:
        """frame_parts of B(1)'s records `rows` (B(1): the substituted records take their
        partner's values), without the frame: a study variable's values made when asked for."""
        return TreatedParts(self, np.asarray(substituted, dtype=bool), np.asarray(rows))

    def treated_totals(
        self, zvars: StudyVariables, substituted: np.ndarray, rows: np.ndarray, w: np.ndarray
    ) -> np.ndarray:
        """zvars.totals_of of B(1)'s records `rows` (w: their weights), one study variable's
        values at a time."""
        t = self.treated(substituted, rows)
        return zvars._totals(t.y, t.d, w)


@dataclass
class TreatedParts:
    """The study values and domain codes of B(1)'s records `rows` (ZParts.treated), each made
    when asked for: a pass holds one study variable's, not all of them (two replication lanes
    at 1M records held 427 MiB of them at MASSC's peak). Pickled with its own records' values
    only (a partition's first records, sent to the driver)."""

    parts: ZParts
    sel: np.ndarray  # substituted, every record of parts
    rows: np.ndarray

    def y(self, name: str) -> np.ndarray:
        return np.where(self.sel, self.parts.y1[name], self.parts.y0[name])[self.rows]

    def d(self, name: str) -> np.ndarray:
        return np.where(self.sel, self.parts.d1[name], self.parts.d0[name])[self.rows]

    def take(self, rows: slice | np.ndarray) -> TreatedParts:
        """The view of the records `rows` of this one."""
        return TreatedParts(self.parts, self.sel, self.rows[rows])

    def __reduce__(self) -> tuple:
        own = self.parts.take(self.rows)
        return (TreatedParts, (own, self.sel[self.rows], np.arange(len(self.rows))))


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
    h_codes, h_labels = factorize(pd.Series(np.asarray(strata)), sort=True)
    n_h = len(h_labels)
    N = np.bincount(h_codes, minlength=n_h)
    w = b0[weight].to_numpy(dtype=float) if isinstance(weight, str) else np.asarray(weight, float)
    p = parts if parts is not None else ZParts.of(b0, tilde, zvars)
    sel = None if substituted is None else np.asarray(substituted, dtype=bool)
    terms = moment_terms(p, zvars, h_codes, n_h, w, sel, base is None)
    sums = {key: bins.sum(x) for key, bins, x in terms}
    return moments_of(sums, zvars, N, [str(x) for x in h_labels], sel is not None, base)


def moment_terms(
    p: ZParts,
    zvars: StudyVariables,
    h_codes: np.ndarray,
    n_h: int,
    w: np.ndarray,
    sel: np.ndarray | None,
    plan: bool = True,
) -> Iterator[tuple[tuple[str, str, str], _Bins, np.ndarray]]:
    """The group sums z_moments reads, one study variable at a time: (key, bins, terms) with
    key (y, domain, what); plan: those of theta, V and S2_nu (eq. 8a); sel given: those of S2
    of w z* (eq. 8b). h_codes: each record's stratum (0..n_h-1)."""
    n = len(h_codes)
    cells = {}  # per domain, once for every study variable: records in a category, their bin
    if sel is not None:
        for d, cats in zvars.domains.items():
            ds = np.where(sel, p.d1[d], p.d0[d])
            ok = ds >= 0
            cells[d] = (ok, _Bins(h_codes[ok] * len(cats) + ds[ok], ok, n_h * len(cats), n))
    bins = {}  # per domain, once for every study variable: the (stratum, category) bins
    if plan:
        for d, cats in zvars.domains.items():
            nc, m = len(cats), n_h * len(cats)
            d0, d1 = p.d0[d], p.d1[d]
            ok0, ok1 = d0 >= 0, d1 >= 0
            same = ok0 & (d1 == d0)
            bins[d] = (
                ok0,
                _Bins(h_codes[ok0] * nc + d0[ok0], ok0, m, n),
                ok1,
                _Bins(h_codes[ok1] * nc + d1[ok1], ok1, m, n),
                same,
                _Bins(h_codes[same] * nc + d0[same], same, m, n),
            )
    for y in zvars.study:
        if plan:  # sums and sums of squares of u = a1 1{d1 = c} - a0 1{d0 = c}
            a0, a1 = w * p.y0[y], w * p.y1[y]
            for d in zvars.domains:
                ok0, i0, ok1, i1, same, isame = bins[d]
                b0, b1 = a0[ok0], a1[ok1]
                yield (y, d, "a0"), i0, b0
                yield (y, d, "a1"), i1, b1
                yield (y, d, "a1^2"), i1, b1**2
                yield (y, d, "a0^2"), i0, b0**2
                yield (y, d, "a1 a0"), isame, (a1 * a0)[same]
        if sel is not None:  # sums and sums of squares of w z* per stratum x category
            wys = w * np.where(sel, p.y1[y], p.y0[y])  # w z*, once per y
            for d in zvars.domains:
                ok, ia = cells[d]
                a = wys[ok]
                yield (y, d, "z"), ia, a
                yield (y, d, "z^2"), ia, a**2


def moments_of(
    sums: dict[tuple[str, str, str], np.ndarray],
    zvars: StudyVariables,
    N: np.ndarray,
    strata: list[str],
    treated: bool,
    base: ZMoments | None = None,
) -> ZMoments:
    """ZMoments from the group sums of moment_terms (N: records per stratum; treated: the sums
    of S2 of w z* are there; base: the moments whose theta, V and S2_nu are reused)."""
    n_h = len(strata)
    th, V, S2v, S2z = [], [], [], []
    for y in zvars.study:
        for d, cats in zvars.domains.items():
            nc = len(cats)
            if base is None:
                t1 = sums[(y, d, "a0")]
                th.append(t1.reshape(n_h, nc).sum(0))
                s1 = sums[(y, d, "a1")] - t1
                s2 = sums[(y, d, "a1^2")].copy()
                s2 += sums[(y, d, "a0^2")]
                s2 -= 2 * sums[(y, d, "a1 a0")]
                s1, s2 = s1.reshape(n_h, nc), s2.reshape(n_h, nc)
                V.append(s1)
                S2v.append(_s2(s1, s2, N))
            if treated:
                z1 = sums[(y, d, "z")].reshape(n_h, nc)
                z2 = sums[(y, d, "z^2")].reshape(n_h, nc)
                S2z.append(_s2(z1, z2, N))
    return ZMoments(
        labels=zvars.labels,
        strata=list(strata),
        N=np.asarray(N).astype(float),
        theta=base.theta if base is not None else np.concatenate(th),
        V=base.V if base is not None else np.concatenate(V, axis=1),
        S2_nu=base.S2_nu if base is not None else np.concatenate(S2v, axis=1),
        S2_zstar=np.concatenate(S2z, axis=1) if treated else None,
        denom=base.denom if base is not None else None,
    )
