"""Segment/PSU masking by swapping whole segments between PSUs (Park et al., paper 003).

Method 2b (section 3.2, 4): segment pairs chosen sequentially to minimise the relative change
of the Taylor variances of q weighted means (eq. 5, 6a/6b), each candidate swap evaluated by an
exact O(q) update of the PSU totals of the linearized scores (eq. 3-4), never by recomputation
over records. Method 2a (the similarity baseline): closest segment on the matching means.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
import pandas as pd
from scipy.spatial import cKDTree

from sdl_design.codes import factorize
from sdl_design.messages import short_list
from sdl_design.plots import se_ratio_boxplot as boxplot
from sdl_design.psus import Psus, strata_psu
from sdl_design.survey.design import SurveyDesign, design_columns, first_of
from sdl_design.survey.exactsum import grid_exponent, limb_sums, limb_total, value
from sdl_design.utility import (
    broad_characteristics,
    deff_class_summary,
    se_ratio_table,
)

if TYPE_CHECKING:
    from sdl_design.spec import ReleaseSpec

Method = Literal["2a", "2b"]
Scope = Literal["any", "same_stratum", "cross_stratum"]
Criterion = Callable[[np.ndarray | int, np.ndarray], np.ndarray]  # (segment a, partners b)


# ---------------------------------------------------------------- segment aggregates (eq. 3)


@dataclass
class SegmentAggregates:
    """Segment-level aggregates of the q matching characteristics.

    score[j, l] = sum_{k in j} w_k (x_kl - xbar_l) / M  (z_hij of eq. 3, linearized weighted mean);
    mean[j, l] = weighted mean of x_l in segment j (Method 2a).
    """

    matching: list[str]
    segment_labels: np.ndarray  # (n_seg,) original segment label
    seg_psu: np.ndarray  # (n_seg,) PSU index of each segment
    psu_stratum: np.ndarray  # (n_psu,) stratum index of each PSU
    psu_labels: np.ndarray  # (n_psu,) original PSU label
    strata_labels: np.ndarray  # (H,) original stratum label
    score: np.ndarray  # (n_seg, q)
    mean: np.ndarray  # (n_seg, q)
    record_segment: np.ndarray  # (n_records,) segment index of each record

    @property
    def n_h(self) -> np.ndarray:
        return np.bincount(self.psu_stratum, minlength=len(self.strata_labels))

    @property
    def seg_stratum(self) -> np.ndarray:
        return self.psu_stratum[self.seg_psu]


def _matrix(df: pd.DataFrame, cols: Sequence[str], field_name: str) -> np.ndarray:
    out = np.empty((len(df), len(cols)), dtype=float, order="F")  # columns contiguous
    for i, c in enumerate(cols):
        if c not in df.columns:
            raise ValueError(f"{field_name}: column '{c}' is not in the data; fix the name")
        s = df[c]
        if s.dtype == bool:
            s = s.astype(float)
        if not pd.api.types.is_numeric_dtype(s):
            raise ValueError(
                f"{field_name}: column '{c}' is not numeric or binary (dtype {s.dtype}); "
                "use numeric or 0/1 matching characteristics"
            )
        out[:, i] = s.to_numpy(dtype=float, na_value=np.nan)  # missing: NaN (domain means)
    return out


@dataclass
class SegmentPass1:
    """Pass 1 of the segment aggregates on some records (a partition, or the whole file): the
    distinct segments with their stratum and PSU labels, and per matching characteristic the
    bounds of the sums' terms and its range (maxima and counts: the same from any split)."""

    segments: pd.DataFrame  # one row per segment label: segment, stratum, psu
    w_max: float  # largest weight
    wx_max: np.ndarray  # (q,) largest |w x| over observed values
    x_min: np.ndarray  # (q,) smallest observed value (+inf: none)
    x_max: np.ndarray  # (q,) largest observed value (-inf: none)


def _segment_codes(
    df: pd.DataFrame, weight: str, strata: str, psu: str, segment: str
) -> tuple[np.ndarray, pd.DataFrame]:
    """Each record's segment (first-appearance code) and the distinct segments with their
    stratum and PSU; a segment whose records lie in two PSUs is an error."""
    for f, c in (("weight", weight), ("strata", strata), ("psu", psu), ("segment", segment)):
        if c is None or c not in df.columns:
            raise ValueError(f"design.{f}: column {c!r} is not in the data; the swap needs it")
    s_code, s_lab = factorize(df[segment])
    if (s_code < 0).any():
        raise ValueError(
            f"design.segment: {int((s_code < 0).sum())} records have no '{segment}' label; "
            "give every record its segment"
        )
    first = first_of(s_code, len(s_lab))
    h = df[strata].to_numpy()
    p = df[psu].to_numpy()
    h_code = factorize(h)[0]
    p_code = factorize(p)[0]
    if np.any(h_code != h_code[first][s_code]) or np.any(p_code != p_code[first][s_code]):
        raise ValueError(
            f"design.segment: segments of '{segment}' span several PSUs; segment labels must "
            "be nested in PSUs (make them unique across PSUs)"
        )
    table = pd.DataFrame({"segment": s_lab, "stratum": h[first], "psu": p[first]})
    return s_code, table


def _weights(df: pd.DataFrame, weight: str) -> np.ndarray:
    w = df[weight].to_numpy(dtype=float)
    if not np.all(w > 0):
        raise ValueError(f"design.weight: column '{weight}' has weights that are not positive")
    return w


def segment_pass1(
    df: pd.DataFrame, weight: str, strata: str, psu: str, segment: str, matching: Sequence[str]
) -> SegmentPass1:
    """Pass 1 of segment_aggregates on df's records (a map: combine with combine_segment_pass1)."""
    _, table = _segment_codes(df, weight, strata, psu, segment)
    return _pass1(df, weight, matching, table)


def _pass1(
    df: pd.DataFrame, weight: str, matching: Sequence[str], table: pd.DataFrame
) -> SegmentPass1:
    w = _weights(df, weight)
    x = _matrix(df, matching, "stages.swap.matching")
    q = x.shape[1]
    x_min, x_max, wx_max = np.full(q, np.inf), np.full(q, -np.inf), np.zeros(q)
    buf = np.empty(len(x))
    for j in range(q):  # a column at a time: contiguous, one buffer
        xj = x[:, j]
        obs = ~np.isnan(xj)
        if obs.all():  # plain max/min (nanmax/nanmin are several times slower)
            x_min[j], x_max[j] = xj.min(initial=np.inf), xj.max(initial=-np.inf)
            np.abs(xj, out=buf)
        else:
            x_min[j], x_max[j] = (
                np.fmin.reduce(xj, initial=np.inf),
                np.fmax.reduce(xj, initial=-np.inf),
            )
            np.abs(np.where(obs, xj, 0.0), out=buf)
        buf *= w
        wx_max[j] = buf.max(initial=0.0)
    return SegmentPass1(table, float(w.max(initial=0.0)), wx_max, x_min, x_max)


def combine_segment_pass1(partials: Sequence[SegmentPass1]) -> SegmentPass1:
    """The whole file's pass 1 from its partitions' (in any order)."""
    seg = pd.concat([p.segments for p in partials], ignore_index=True).drop_duplicates()
    if seg["segment"].duplicated().any():
        raise ValueError(
            "design.segment: segments span several PSUs; segment labels must be nested in "
            "PSUs (make them unique across PSUs)"
        )
    return SegmentPass1(
        segments=seg.reset_index(drop=True),
        w_max=max(p.w_max for p in partials),
        wx_max=np.max([p.wx_max for p in partials], axis=0),
        x_min=np.min([p.x_min for p in partials], axis=0),
        x_max=np.max([p.x_max for p in partials], axis=0),
    )


@dataclass
class SegmentDesign:
    """The segments in label order with their PSU and stratum (PSUs numbered in (stratum, PSU
    label) order), and the grids of the exact sums (weights, then w x of each characteristic)."""

    segment_labels: np.ndarray
    seg_psu: np.ndarray
    psu_stratum: np.ndarray
    psu_labels: np.ndarray
    strata_labels: np.ndarray
    grid: np.ndarray  # (2q,) grid exponents of sdl_design.survey.exactsum


def segment_design(pass1: SegmentPass1, matching: Sequence[str]) -> SegmentDesign:
    """Label tables and sum grids from the combined pass 1; checks strata and characteristics."""
    seg = pass1.segments
    order, s_lab = factorize(seg["segment"], sort=True)
    by_label = np.empty(len(order), dtype=np.int64)
    by_label[order] = np.arange(len(order))
    seg = seg.iloc[by_label]
    h_code, h_lab = factorize(seg["stratum"], sort=True)
    seg_psu, psu_stratum, psu_labels = _psu_codes(h_code, seg["psu"].to_numpy())
    n_h = np.bincount(psu_stratum, minlength=len(h_lab))
    if np.any(n_h < 2):
        raise ValueError(
            f"design.strata: {int(np.sum(n_h < 2))} strata have a single PSU; collapse them first"
        )
    none = ~(pass1.x_min <= pass1.x_max)
    if none.any():
        bad = [c for c, k in zip(matching, none, strict=True) if k]
        raise ValueError(f"stages.swap.matching: {bad} have no observed value; remove them")
    const = pass1.x_max - pass1.x_min == 0
    if const.any():
        bad = [c for c, k in zip(matching, const, strict=True) if k]
        raise ValueError(f"stages.swap.matching: {bad} are constant; remove them")
    q = len(matching)
    grid = grid_exponent(np.r_[np.full(q, pass1.w_max), pass1.wx_max])
    return SegmentDesign(
        np.asarray(s_lab), seg_psu, psu_stratum, psu_labels, np.asarray(h_lab), grid
    )


def segment_pass2(
    df: pd.DataFrame,
    weight: str,
    segment: str,
    matching: Sequence[str],
    design: SegmentDesign,
    codes: np.ndarray | None = None,
    n_groups: int | None = None,
) -> np.ndarray:
    """Exact limb sums (3, segments, 2q) of w 1{x observed} and w x by segment on df's records
    (a map: partitions' sums add with exactsum.add_limbs_at). codes: each record's segment index
    when known (else looked up from its label), among n_groups (default: every segment)."""
    if codes is None:
        codes = pd.Index(design.segment_labels).get_indexer(df[segment])
        if (codes < 0).any():
            raise ValueError(f"design.segment: a '{segment}' label is not in the segment table")
    w = _weights(df, weight)
    x = _matrix(df, matching, "stages.swap.matching")
    q = x.shape[1]
    G = len(design.segment_labels) if n_groups is None else n_groups
    obs = ~np.isnan(x)
    if obs.all():  # every column's w 1{observed} is w: its sums once
        wx = np.multiply(w[:, None], x, order="F")  # columns contiguous for limb_sums
        w_sums = limb_sums(codes, w, G, design.grid[:1])
        return np.concatenate(
            [np.repeat(w_sums, q, axis=2), limb_sums(codes, wx, G, design.grid[q:])], axis=2
        )
    terms = np.empty((len(df), 2 * q), order="F")
    np.multiply(w[:, None], obs, out=terms[:, :q])
    np.multiply(terms[:, :q], np.where(obs, x, 0.0), out=terms[:, q:])
    return limb_sums(codes, terms, G, design.grid)


def aggregates_from_sums(
    design: SegmentDesign,
    limbs: np.ndarray,
    matching: Sequence[str],
    record_segment: np.ndarray | None = None,
) -> SegmentAggregates:
    """SegmentAggregates from the exact segment sums S_w, S_wx (eq. 3): the score of segment j
    is (S_wx,j - xbar S_w,j) / W, the sum of its records' linearized scores w (x - xbar) / W of
    the weighted (domain) mean xbar = S_wx / W; its mean is S_wx,j / S_w,j."""
    q = len(matching)
    seg_w = value(limbs[..., :q], design.grid[:q])
    seg_wx = value(limbs[..., q:], design.grid[q:])
    total = limb_total(limbs)
    wsum = value(total[:, :q], design.grid[:q])
    xbar = value(total[:, q:], design.grid[q:]) / wsum
    score = (seg_wx - xbar * seg_w) / wsum  # z_hij of eq. 3
    mean = np.where(seg_w > 0, seg_wx / np.where(seg_w > 0, seg_w, 1.0), xbar)
    return SegmentAggregates(
        matching=list(matching),
        segment_labels=design.segment_labels,
        seg_psu=design.seg_psu,
        psu_stratum=design.psu_stratum,
        psu_labels=design.psu_labels,
        strata_labels=design.strata_labels,
        score=score,
        mean=mean,
        record_segment=np.empty(0, dtype=np.int64) if record_segment is None else record_segment,
    )


def segment_aggregates(
    df: pd.DataFrame,
    weight: str,
    strata: str,
    psu: str,
    segment: str,
    matching: Sequence[str],
) -> SegmentAggregates:
    """Segment scores and means of the matching characteristics; checks the design nesting.
    The sums are exact (sdl_design.survey.exactsum): a partitioned file gives the same aggregates."""
    s_code, table = _segment_codes(df, weight, strata, psu, segment)
    design = segment_design(_pass1(df, weight, matching, table), matching)
    rank = np.empty(len(table), dtype=np.int64)  # first-appearance code -> label order
    rank[:] = pd.Index(design.segment_labels).get_indexer(table["segment"])
    codes = rank[s_code]
    limbs = segment_pass2(df, weight, segment, matching, design, codes)
    return aggregates_from_sums(design, limbs, matching, codes)


def _psu_codes(h_code: np.ndarray, psu: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """PSU index of every record, numbered in (stratum, PSU label) order, with each PSU's
    stratum index and label: one integer key h * (PSU labels) + label code, factorized."""
    l_code, l_lab = factorize(psu, sort=True)
    if (l_code < 0).any() or (h_code < 0).any():  # missing labels: the pairs themselves
        p_code, p_uniq = factorize(pd.MultiIndex.from_arrays([h_code, psu]), sort=True)
        return (
            p_code,
            np.asarray(p_uniq.get_level_values(0), dtype=np.int64),
            np.asarray(p_uniq.get_level_values(1)),
        )
    m = max(len(l_lab), 1)
    p_code, key = factorize(h_code.astype(np.int64) * m + l_code, sort=True)
    return p_code, key // m, np.asarray(l_lab)[key % m]


def _rowsum(out: np.ndarray, code: np.ndarray, vals: np.ndarray) -> None:
    """out[g] += sum of vals rows with code g (one bincount per column)."""
    for j in range(vals.shape[1]):
        out[:, j] += np.bincount(code, weights=vals[:, j], minlength=out.shape[0])


# ---------------------------------------------------------------- variance state (eq. 2, 4, 5)


class VarianceState:
    """Taylor variances of the q means under the current segment-to-PSU assignment.

    With PSU totals t_hi of the scores, v = sum_h n_h/(n_h-1) sum_i (t_hi - tbar_h)^2 (eq. 2, any
    n_h). Swapping segments a (PSU p_a) and b (PSU p_b) moves e = s_a - s_b from p_a to p_b, so the
    variance changes by an exact O(q) amount (eq. 4-5); `delta` evaluates it for many candidate
    partners in one numpy operation, `apply` commits a swap.
    """

    def __init__(self, agg: SegmentAggregates):
        self.score = agg.score
        self.psu_stratum = agg.psu_stratum
        self.seg_psu = agg.seg_psu.copy()
        n_h = agg.n_h.astype(float)
        self.n_h = n_h
        self.c = n_h / (n_h - 1.0)
        self.t = np.zeros((len(agg.psu_stratum), agg.score.shape[1]))
        np.add.at(self.t, self.seg_psu, agg.score)
        self.tbar = np.zeros((len(n_h), agg.score.shape[1]))
        np.add.at(self.tbar, self.psu_stratum, self.t)
        self.tbar /= n_h[:, None]
        self.v0 = self.full_variance()
        self.v = self.v0.copy()

    def full_variance(self) -> np.ndarray:
        """v from the current PSU totals (a recomputation, for checks)."""
        dev = self.t - self.tbar[self.psu_stratum]
        return (self.c[self.psu_stratum][:, None] * dev**2).sum(axis=0)

    def delta(self, a: np.ndarray | int, b: np.ndarray) -> np.ndarray:
        """Change of the q variances if segment a swaps with each segment b (shape b.shape + (q,)).

        a has shape b.shape[:-1] (or is a scalar); a and b must lie in different PSUs.
        Same stratum:  dv = 2 c_h e (dev_b - dev_a + e)                (eq. 4, first case)
        Different:     dv = 2 e (c_b dev_b - c_a dev_a + e)            (eq. 4, second case)
        with e = s_a - s_b, dev = t_hi - tbar_h of the current PSU, c_h = n_h/(n_h-1).
        """
        a = np.asarray(a)[..., None]
        pa, pb = self.seg_psu[a], self.seg_psu[b]
        ha, hb = self.psu_stratum[pa], self.psu_stratum[pb]
        e = self.score[a] - self.score[b]
        dev_a = self.t[pa] - self.tbar[ha]  # t_hi - tbar_h of the two PSUs only
        dev_b = self.t[pb] - self.tbar[hb]
        ca, cb = self.c[ha][..., None], self.c[hb][..., None]
        cross = 2.0 * e * (cb * dev_b - ca * dev_a + e)
        same = 2.0 * ca * e * (dev_b - dev_a + e)
        return np.where((ha == hb)[..., None], same, cross)

    def frozen(self) -> FrozenVariance:
        """The state as it is now, for many delta evaluations before the next apply."""
        return FrozenVariance(self)

    def apply(self, a: int, b: int) -> np.ndarray:
        """Swap segments a and b; returns the change of the variances (O(q))."""
        dv = self.delta(np.asarray(a), np.asarray([b]))[0]
        pa, pb = self.seg_psu[a], self.seg_psu[b]
        ha, hb = self.psu_stratum[pa], self.psu_stratum[pb]
        e = self.score[a] - self.score[b]
        self.t[pa] -= e
        self.t[pb] += e
        self.tbar[ha] -= e / self.n_h[ha]
        self.tbar[hb] += e / self.n_h[hb]
        self.seg_psu[a], self.seg_psu[b] = pb, pa
        self.v += dv
        return dv


class FrozenVariance:
    """A VarianceState between two swaps: each segment's score, stratum, dev = t_hi - tbar_h of
    its PSU and c_h gathered once, so that delta reads one row per partner instead of chaining
    segment -> PSU -> stratum (the same values, bit for bit, as VarianceState.delta)."""

    def __init__(self, state: VarianceState):
        self.v, self.v0, self.score = state.v, state.v0, state.score
        h = state.psu_stratum[state.seg_psu]
        self.h = h
        self.dev = state.t[state.seg_psu] - state.tbar[h]  # t_hi - tbar_h, per segment
        self.c = state.c[h]

    def delta(self, a: np.ndarray | int, b: np.ndarray) -> np.ndarray:
        """VarianceState.delta (eq. 4): the cross-stratum case for every pair, then the
        same-stratum one where the partners share a stratum."""
        a = np.asarray(a)[..., None]
        e = self.score[b]
        np.subtract(self.score[a], e, out=e)  # e = s_a - s_b
        dev_a, dev_b = self.dev[a], self.dev[b]
        ca = self.c[a][..., None]
        inner = self.c[b][..., None] * dev_b
        inner -= ca * dev_a
        inner += e
        out = 2.0 * e
        out *= inner  # eq. 4, second case: 2 e (c_b dev_b - c_a dev_a + e)
        same = np.broadcast_to(self.h[a] == self.h[b], b.shape)
        if same.any():  # eq. 4, first case
            ca_s = np.broadcast_to(ca, (*b.shape, 1))[same]
            e_s, da_s = e[same], np.broadcast_to(dev_a, out.shape)[same]
            out[same] = 2.0 * ca_s * e_s * (dev_b[same] - da_s + e_s)
        return out


# ---------------------------------------------------------------- candidate partners


def _candidate_lists(
    feat: np.ndarray,
    seg_psu: np.ndarray,
    seg_stratum: np.ndarray,
    scope: Scope,
    k: int,
    n_dims: int = 5,
) -> np.ndarray:
    """(n_seg, k) candidate partners of each segment (-1 = none), nearest first.

    Near neighbours in a feature space where the criterion is small for near segments, found
    with a k-d tree on the leading principal components (O(n log n)); the criterion itself is
    then evaluated exactly on them. Same PSU never; scope restricts the strata. The k valid
    partners are the first valid ones among the kq nearest; a first query of k + max(16, k/4)
    nearest (the k-NN cost grows with k) finds them for most segments, the others are
    queried again with kq (the nearer neighbours come first in both: the same lists).
    """
    n = len(feat)
    f = feat - feat.mean(axis=0)
    if f.shape[1] > n_dims:
        _, _, vt = np.linalg.svd(f, full_matrices=False)
        f = f @ vt[:n_dims].T
    out = np.full((n, k), -1, dtype=np.int64)
    groups = (
        [np.flatnonzero(seg_stratum == h) for h in np.unique(seg_stratum)]
        if scope == "same_stratum"
        else [np.arange(n)]
    )
    for members in groups:
        m = len(members)
        kq = min(m, 2 * k + 1 if scope != "cross_stratum" else 4 * k + 1)
        if kq < 2:
            continue
        tree = cKDTree(f[members])
        rank = np.empty(m, dtype=np.int64)  # each member's place in the tree's leaf order
        rank[tree.indices] = np.arange(m)
        local = np.arange(m)  # the members whose k partners are not found yet
        rows = members
        k1 = min(kq, k + max(16, k // 4))
        for kk in (k1, kq) if k1 < kq else (kq,):
            idx = members[_query_in_tree_order(tree, f[members], local, rank, kk)]
            me = rows[:, None]
            valid = seg_psu[idx] != seg_psu[me]
            if scope == "cross_stratum":
                valid &= seg_stratum[idx] != seg_stratum[me]
            done = np.ones(len(rows), bool) if kk == kq else valid.sum(axis=1) >= k
            order = np.argsort(~valid[done], axis=1, kind="stable")[:, :k]
            take = np.take_along_axis(idx[done], order, axis=1)
            ok = np.take_along_axis(valid[done], order, axis=1)
            out[rows[done], : take.shape[1]] = np.where(ok, take, -1)
            rows, local = rows[~done], local[~done]
            if not len(rows):
                break
    return out


def _query_in_tree_order(
    tree: cKDTree, points: np.ndarray, local: np.ndarray, rank: np.ndarray, k: int
) -> np.ndarray:
    """tree.query of points[local] for their k nearest (indices into points, len(local) x k),
    asked in the tree's leaf order so that neighbouring queries walk the same nodes (52,357
    segments, k = 80: 2.6 -> 1.8-2.1 s); each point's answer does not depend on the order."""
    order = np.argsort(rank[local], kind="stable")
    _, idx = tree.query(points[local[order]], k=k, workers=-1)  # split over the cores
    out = np.empty((len(local), k), dtype=np.int64)
    out[order] = np.asarray(idx).reshape(len(local), k)
    return out


# ---------------------------------------------------------------- Method 2a / 2b (steps 1-4)


@dataclass
class SwapPlan:
    """The pairs chosen and the variance state after all swaps."""

    pairs: list[tuple[int, int, float, int]]  # (segment a, segment b, criterion, step r)
    state: VarianceState
    d1: np.ndarray  # initial best criterion of each segment (step 1)
    n_evaluations: int = 0
    n_fallback: int = 0
    target_pairs: int = 0


def plan_swaps(
    agg: SegmentAggregates,
    rate: float,
    rng: np.random.Generator,
    method: Method = "2b",
    max_share: float = 0.5,
    cumulative: bool = False,
    scope: Scope = "any",
    n_candidates: int = 64,
) -> SwapPlan:
    """Choose segment pairs by Method 2b (D*_2b, eq. 6a/6b) or 2a (D*_2a) with the constraints.

    rate is the share of segments that change PSU (a pair moves two segments).
    """
    state = VarianceState(agg)
    n = len(agg.segment_labels)
    feat, std = _features(agg, state, method)
    if scope not in ("any", "same_stratum", "cross_stratum"):
        raise ValueError(f"stages.swap.scope: {scope!r} is not any, same_stratum, cross_stratum")
    k = max(1, min(n_candidates, n - 1))
    cands = _candidate_lists(feat, agg.seg_psu, agg.seg_stratum, scope, k)
    crit = _criterion(state, std, cumulative)
    m_p = np.bincount(agg.seg_psu, minlength=len(agg.psu_stratum))
    d1 = _initial_criterion(_criterion(state.frozen(), std, cumulative), cands)
    order = _swap_order(agg.seg_psu, m_p, d1, rate, rng)
    target = int(round(rate * n / 2.0))
    pairs, n_eval, n_fallback = _choose_pairs(
        agg, state, crit, cands, order, m_p, target, max_share, scope
    )
    return SwapPlan(pairs, state, d1, int((cands >= 0).sum()) + n_eval, n_fallback, target)


def _features(
    agg: SegmentAggregates, state: VarianceState, method: Method
) -> tuple[np.ndarray, np.ndarray | None]:
    """Feature space of the candidate search and, for Method 2a, the standardized segment means
    (None for 2b): scores scaled by the original SEs (2b) or the standardized means (2a)."""
    if method == "2b":
        return agg.score / np.sqrt(state.v0), None
    if method == "2a":
        sd = agg.mean.std(axis=0)
        std = agg.mean / np.where(sd > 0, sd, 1.0)
        return std, std
    raise ValueError(f"stages.swap.method: {method!r} is not '2a' or '2b'")


def _criterion(
    state: VarianceState | FrozenVariance, std: np.ndarray | None, cumulative: bool
) -> Criterion:
    """crit(a, b): the criterion of swapping segment a with each segment b, against the current
    state: D*_2a on the standardized means std, else D*_2b (eq. 6a, or 6b when cumulative)."""

    def crit(a: np.ndarray | int, b: np.ndarray) -> np.ndarray:
        if std is not None:  # D*_2a: sum_l |xbar_l,jr - xbar_l,j| (standardized)
            return np.abs(std[np.asarray(a)[..., None]] - std[b]).sum(axis=-1)
        dv = state.delta(a, b)
        if cumulative:  # eq. 6b with c_l = 1/v(xbar_l|S)
            return (np.abs(state.v + dv - state.v0) / state.v0).sum(axis=-1)
        np.abs(dv, out=dv)
        dv /= state.v0
        return dv.sum(axis=-1)  # D*_2b,r (eq. 6a, c_l = 1/v(xbar_l|S))

    return crit


def _initial_criterion(crit: Criterion, cands: np.ndarray) -> np.ndarray:
    """Step 1: each segment's smallest D*_1 over its candidate partners (inf without any)."""
    n = len(cands)
    d1 = np.full(n, np.inf)
    for s in range(0, n, 256):  # blocks of 256 segments: the temporaries stay in cache
        cc = cands[s : s + 256]
        val = crit(np.arange(s, s + len(cc)), np.where(cc >= 0, cc, 0))
        val[cc < 0] = np.inf
        d1[s : s + len(cc)] = val.min(axis=1)
    return d1


def _swap_order(
    psu0: np.ndarray, m_p: np.ndarray, d1: np.ndarray, rate: float, rng: np.random.Generator
) -> np.ndarray:
    """Steps 2-3: the best-ranked segments of each PSU form the pool and the swap set is sampled
    from it; the chosen segments come first in ascending D*_1 across PSUs, then the rest of the
    pools, then every other segment (only used when constraints left the target short)."""
    n = len(psu0)
    k_p = rate / 2.0 * m_p
    pool_p = np.minimum(m_p, np.ceil(2.0 * k_p - 1e-9)).astype(int)
    choose_p = np.floor(k_p).astype(int) + (rng.random(len(m_p)) < k_p - np.floor(k_p))
    choose_p = np.minimum(choose_p, pool_p)
    u = rng.random(n)
    rank = _rank_within(psu0, d1, u)
    in_pool = rank < pool_p[psu0]
    r2 = _rank_within(psu0, np.where(in_pool, u, np.inf), np.zeros(n))
    chosen = in_pool & (r2 < choose_p[psu0])
    return np.concatenate(
        [
            _sorted(np.flatnonzero(chosen), d1),
            _sorted(np.flatnonzero(in_pool & ~chosen), d1),
            _sorted(np.flatnonzero(~in_pool), d1),
        ]
    )


def _choose_pairs(
    agg: SegmentAggregates,
    state: VarianceState,
    crit: Criterion,
    cands: np.ndarray,
    order: np.ndarray,
    m_p: np.ndarray,
    target: int,
    max_share: float,
    scope: Scope,
) -> tuple[list[tuple[int, int, float, int]], int, int]:
    """Step 4: partners found sequentially against the current state, each swap applied to it;
    at most max_share of a PSU's segments swapped. Returns the pairs, the criterion evaluations
    and the searches over every eligible segment (near candidates all taken)."""
    psu0, strat0 = agg.seg_psu, agg.seg_stratum
    cap = np.floor(max_share * m_p + 1e-9).astype(int)
    count = np.zeros(len(m_p), dtype=int)
    swapped = np.zeros(len(psu0), dtype=bool)
    pairs: list[tuple[int, int, float, int]] = []
    n_eval = n_fallback = 0
    for a in order:
        if len(pairs) >= target:
            break
        pa = psu0[a]
        if swapped[a] or count[pa] >= cap[pa]:
            continue
        c = cands[a]
        c = c[c >= 0]
        c = c[~swapped[c] & (count[psu0[c]] < cap[psu0[c]])]
        if c.size == 0:  # all near candidates taken: search every eligible segment
            ok = ~swapped & (count[psu0] < cap[psu0]) & (psu0 != pa)
            if scope == "same_stratum":
                ok &= strat0 == strat0[a]
            elif scope == "cross_stratum":
                ok &= strat0 != strat0[a]
            c = np.flatnonzero(ok)
            if c.size == 0:
                continue
            n_fallback += 1
        val = crit(a, c)
        n_eval += c.size
        j = int(np.argmin(val))
        b = int(c[j])
        state.apply(int(a), b)
        swapped[a] = swapped[b] = True
        count[pa] += 1
        count[psu0[b]] += 1
        pairs.append((int(a), b, float(val[j]), len(pairs) + 1))
    return pairs, n_eval, n_fallback


def _rank_within(group: np.ndarray, key: np.ndarray, tie: np.ndarray) -> np.ndarray:
    """0-based rank of key within each group (ties broken by tie)."""
    order = np.lexsort((tie, key, group))
    g = group[order]
    start = np.r_[0, np.flatnonzero(np.diff(g)) + 1]
    first = np.repeat(start, np.diff(np.r_[start, len(g)]))
    rank = np.empty(len(group), dtype=np.int64)
    rank[order] = np.arange(len(g)) - first
    return rank


def _sorted(idx: np.ndarray, key: np.ndarray) -> np.ndarray:
    return idx[np.argsort(key[idx], kind="stable")]


# ---------------------------------------------------------------- pseudo labels


def pseudo_labels(
    agg: SegmentAggregates, seg_psu: np.ndarray, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray]:
    """Pseudo-stratum and pseudo-PSU label of every record: strata numbered 1..H and PSUs 1..n_h
    within stratum, both in random order, so the labels reveal nothing of the originals."""
    stratum_of_psu, label_of_psu = _psu_pseudo_labels(agg, rng)
    rec_psu = seg_psu[agg.record_segment]
    return stratum_of_psu[rec_psu], label_of_psu[rec_psu]


def _psu_pseudo_labels(
    agg: SegmentAggregates, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray]:
    """Pseudo-stratum and pseudo-PSU label of every PSU (see pseudo_labels)."""
    H = len(agg.strata_labels)
    stratum_label = rng.permutation(H) + 1
    psu_label = (
        _rank_within(
            agg.psu_stratum, rng.random(len(agg.psu_stratum)), np.zeros(len(agg.psu_stratum))
        )
        + 1
    )
    return stratum_label[agg.psu_stratum], psu_label


# ---------------------------------------------------------------- the public entry point


@dataclass
class SwapResult:
    """Masked frame, the (confidential) swap map and the SE ratios by characteristic."""

    data: pd.DataFrame
    pairs: pd.DataFrame
    se_ratios: pd.DataFrame
    variance: pd.DataFrame  # matching characteristics: Taylor variance before/after (O(1) state)
    params: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)


def swap_segments(
    df: pd.DataFrame,
    design: Any,
    matching: Sequence[str],
    rate: float,
    method: Method = "2b",
    seed: int | np.random.Generator = 0,
    max_share: float = 0.5,
    cumulative: bool = False,
    scope: Scope = "any",
    replicate_method: str | None = None,
    rho: float | None = None,
    characteristics: pd.DataFrame | None = None,
    n_candidates: int = 64,
    original_se: pd.DataFrame | None = None,
) -> SwapResult:
    """Mask PSUs by swapping segments (Method 2b or the 2a baseline); rebuild replicate weights.

    rate: share of segments that change PSU; max_share: at most this share of a PSU's segments
    swapped; scope: partners from any stratum, the same stratum only, or other strata only.
    `.data` has the rows and index of df with the design's strata and PSU columns holding
    relabelled pseudo labels and, when the design has replicate weights (or replicate_method is
    given), replicate weights rebuilt for the pseudo design. characteristics: frame from
    `sdl_design.utility.broad_characteristics` (default: built from df); original_se: the
    original side of the SE table (utility.original_domain_se of df, design, characteristics)
    when already computed, e.g. for the baseline method.
    """

    _check_rates(rate, max_share)
    rng = seed if isinstance(seed, np.random.Generator) else np.random.default_rng(seed)
    dc = design_columns(design)
    if dc["segment"] is None:
        raise ValueError("design.segment: the swap needs a segment column (SSU) in the design")
    agg = segment_aggregates(df, dc["weight"], dc["strata"], dc["psu"], dc["segment"], matching)
    rep_method = replicate_method or dc["method"]
    rep_rho = rho if rho is not None else dc["rho"]
    plan, masking = plan_masking(
        agg,
        dc,
        rng,
        rep_method,
        rep_rho,
        rate=rate,
        method=method,
        max_share=max_share,
        cumulative=cumulative,
        scope=scope,
        n_candidates=n_candidates,
    )
    data, new_rw, notes = apply_masking(df, dc, agg.record_segment, masking)
    rscales = masking.rscales

    if characteristics is None:
        characteristics = broad_characteristics(df, design=dc)
    se = se_ratio_table(
        df,
        data,
        dc,
        new_rw or dc["replicate_weights"],
        characteristics,
        rep_method,
        rep_rho,
        original_se=original_se,
        masked_rscales=rscales,  # known from the rebuild: not derived again from the weights
    )
    se["matching"] = se["variable"].isin(list(matching)) & (se["domain"] == "all")
    settings = {
        "method": method,
        "rate": rate,
        "max_share": max_share,
        "cumulative": cumulative,
        "scope": scope,
    }
    params = {**settings, **plan_counts(agg, plan), "replicate_method": rep_method}
    if len(plan.pairs) < plan.target_pairs:
        notes.append(
            f"only {len(plan.pairs)} of {plan.target_pairs} target pairs found under the "
            f"constraints (max_share={max_share}, scope={scope})"
        )
    pairs = swap_pairs(agg, plan, method, cumulative)
    return SwapResult(data, pairs, se, matching_variance(plan, matching), params, notes)


def _check_rates(rate: float, max_share: float) -> None:
    """0 < rate <= max_share <= 1."""
    if not 0.0 < rate <= 1.0:
        raise ValueError(f"stages.swap.rate: {rate} must be in (0, 1]")
    if not 0.0 < max_share <= 1.0:
        raise ValueError(f"stages.swap.max_share: {max_share} must be in (0, 1]")
    if rate > max_share + 1e-12:
        raise ValueError(
            f"stages.swap.rate ({rate}) is above stages.swap.max_share ({max_share}): "
            "no PSU may swap more than max_share of its segments; lower rate or raise max_share"
        )


@dataclass
class Masking:
    """What the swap decides from the segment aggregates alone (small tables, no records): the
    PSU of each segment after the swaps, the pseudo stratum and PSU labels of each PSU, and the
    replicate factors of the pseudo design (PSUs x R; None without a replicate method)."""

    seg_psu: np.ndarray
    psu_h: np.ndarray
    psu_p: np.ndarray
    factors: pd.DataFrame | None = None
    rscales: np.ndarray | None = None
    method: str | None = None


def plan_masking(
    agg: SegmentAggregates,
    dc: dict[str, Any],
    rng: np.random.Generator,
    rep_method: str | None = None,
    rep_rho: float | None = None,
    **swaps: Any,
) -> tuple[SwapPlan, Masking]:
    """The swaps (plan_swaps with the settings `swaps`: rate, method, max_share, ...), then the
    pseudo labels and replicate factors: the same Generator draws in the same order whether
    the records are in memory or in partitions."""
    plan = plan_swaps(agg, rng=rng, **swaps)
    psu_h, psu_p = _psu_pseudo_labels(agg, rng)
    masking = Masking(plan.state.seg_psu.copy(), psu_h, psu_p)
    if rep_method is not None:
        masking.factors, masking.rscales = replicate_factors(
            dc, psu_h, psu_p, rep_method, rep_rho, rng
        )
        masking.method = rep_method
    return plan, masking


def apply_masking(
    df: pd.DataFrame, dc: dict[str, Any], record_segment: np.ndarray, masking: Masking
) -> tuple[pd.DataFrame, list[str], list[str]]:
    """df (all of it or a partition: record_segment gives each record's segment index) with
    pseudo strata and PSUs and, given replicate factors, the pseudo design's replicate weights;
    the new replicate columns and the notes."""
    rec_psu = masking.seg_psu[record_segment]  # PSU of every record after the swaps
    data = df.copy(deep=False)  # copy-on-write: new arrays for strata, PSU
    data[dc["strata"]] = masking.psu_h[rec_psu]
    data[dc["psu"]] = masking.psu_p[rec_psu]
    if masking.factors is None:
        return data, [], []
    data, new_rw, note = _rebuild_replicates(data, dc, rec_psu, masking.factors, masking.method)
    return data, new_rw, [note]


def swap_pairs(
    agg: SegmentAggregates, plan: SwapPlan, method: Method, cumulative: bool
) -> pd.DataFrame:
    """The (confidential) swap map: one row per pair with original labels and the criterion."""
    a = np.array([p[0] for p in plan.pairs], dtype=np.int64)
    b = np.array([p[1] for p in plan.pairs], dtype=np.int64)
    pa, pb = agg.seg_psu[a], agg.seg_psu[b]
    pairs = pd.DataFrame(
        {
            "step": [p[3] for p in plan.pairs],
            "segment_a": agg.segment_labels[a],
            "segment_b": agg.segment_labels[b],
            "stratum_a": agg.strata_labels[agg.psu_stratum[pa]],
            "psu_a": agg.psu_labels[pa],
            "stratum_b": agg.strata_labels[agg.psu_stratum[pb]],
            "psu_b": agg.psu_labels[pb],
            "criterion": [p[2] for p in plan.pairs],
        }
    )
    pairs.attrs["criterion"] = "D*_2a (standardized)" if method == "2a" else "D*_2b (eq. 6a)"
    if method == "2b" and cumulative:
        pairs.attrs["criterion"] = "D*_2b cumulative (eq. 6b)"
    return pairs


def matching_variance(plan: SwapPlan, matching: Sequence[str]) -> pd.DataFrame:
    """Taylor variance of each matching characteristic before and after, and the SE ratio."""
    variance = pd.DataFrame(
        {"v_original": plan.state.v0, "v_masked": plan.state.v},
        index=pd.Index(list(matching), name="variable"),
    )
    variance["se_ratio"] = np.sqrt(variance["v_masked"] / variance["v_original"])
    return variance


def plan_counts(agg: SegmentAggregates, plan: SwapPlan) -> dict[str, Any]:
    """Segments, pairs (found and targeted), share swapped and the search's counts."""
    n_seg = len(agg.segment_labels)
    return {
        "n_segments": n_seg,
        "n_pairs": len(plan.pairs),
        "target_pairs": plan.target_pairs,
        "n_swapped": 2 * len(plan.pairs),
        "share_swapped": 2 * len(plan.pairs) / n_seg,
        "candidate_evaluations": plan.n_evaluations,
        "fallback_searches": plan.n_fallback,
    }


def replicate_factors(
    dc: dict[str, Any],
    psu_h: np.ndarray,
    psu_p: np.ndarray,
    method: str,
    rho: float | None,
    rng: np.random.Generator,
) -> tuple[pd.DataFrame, np.ndarray]:
    """Replicate factors (PSUs x R) of the pseudo design, with their scale factors (the
    bootstrap draws its resamples from rng, the swap stage's Generator; the other methods draw
    nothing).

    The replicate factors are constant within PSUs for every method SurveyDesign builds, so
    they are built once on a design of one unit-weight record per PSU and each record gets w
    times its PSU's row: the values of with_replicates on the full file, without its records x
    PSUs factor matrix.
    """

    h, p, wc = dc["strata"], dc["psu"], dc["weight"]
    one_per_psu = pd.DataFrame({h: psu_h, p: psu_p, wc: np.ones(len(psu_h))})
    design = SurveyDesign(one_per_psu, weight=wc, strata=h, psu=p)
    f = design.with_replicates(method, rho=rho, seed=rng)
    return f, np.asarray(f.attrs["rscales"], dtype=float)


def _rebuild_replicates(
    data: pd.DataFrame, dc: dict[str, Any], rec_psu: np.ndarray, f: pd.DataFrame, method: str
) -> tuple[pd.DataFrame, list[str], str]:
    """Replicate weights w times the factors of each record's PSU replace the original ones."""
    w = data[dc["weight"]].to_numpy(dtype=float)
    # replicates x records, C order (pandas' block layout: the frame keeps it without a copy
    # and W = its transpose is the Fortran array SurveyDesign multiplies with)
    wt = np.take(np.ascontiguousarray(f.to_numpy().T), rec_psu, axis=1)
    wt *= w
    reps = pd.DataFrame(wt.T, index=data.index, columns=f.columns, copy=False)
    old = list(dc["replicate_weights"])
    note = rebuild_note(old, reps.shape[1], method)
    if len(old) == reps.shape[1]:
        reps = reps.set_axis(old, axis=1)
    else:
        clash = [c for c in reps.columns if c in data.columns and c not in old]
        if clash:
            raise ValueError(f"rebuilt replicate columns {clash[:3]} clash with data columns")
    cols = list(data.columns)
    at = cols.index(old[0]) if old else len(cols)  # new columns where the old ones began
    keep = [c for c in cols if c not in set(old)]
    at = len([c for c in cols[:at] if c not in set(old)])
    data = pd.concat([data[keep[:at]], reps, data[keep[at:]]], axis=1)
    return data, list(reps.columns), note


def rebuild_note(old: Sequence[str], R: int, method: str) -> str:
    """What the rebuild of R replicate weights did to the old ones (in place when as many)."""
    if len(old) == R:
        return f"replicate weights {old[0]}..{old[-1]} rebuilt in place ({method}, {len(old)})"
    return (
        f"{len(old)} original replicate weights dropped; {R} {method} replicate "
        "weights added for the pseudo design"
    )


# ---------------------------------------------------------------- report figure (Figure 2)


def se_ratio_boxplot(ratios: dict[str, pd.DataFrame], column: str = "ratio") -> bytes:
    """PNG of side-by-side box plots of SE ratios by original design-effect class, one box per
    method in each class (the paper's Figure 2). ratios: method -> se_ratios frame."""

    return boxplot({f"Method {k}": v for k, v in ratios.items()}, column=column)


def swap_design_problems(spec: ReleaseSpec, df: pd.DataFrame) -> list[str]:
    """The preflight of the swap: it moves whole segments between PSUs of a stratified design
    (segments nested in PSUs; 2 PSUs per stratum for brr and fay replicates)."""
    d, st = spec.design, spec.stages.swap
    out = []
    if not d.segment:
        out.append(
            "design.segment: stages.swap is enabled but the design names no segment column; the "
            "swap moves whole segments (SSUs) between PSUs: name the segment column in "
            "design.segment, or set stages.swap.enabled: false"
        )
    if not getattr(d, "strata", None) or not getattr(d, "psu", None):
        out.append(
            "stages.swap: the swap needs design.strata and design.psu (it swaps segments between "
            "PSUs within strata); name them, or set stages.swap.enabled: false"
        )
    cols = strata_psu(spec, df)
    if cols is None:
        return out
    strata, psu = cols
    if d.segment and d.segment in df.columns and not df[d.segment].isna().any():
        pairs = df[[strata, psu, d.segment]].drop_duplicates()
        n_psu = pairs.groupby(d.segment, sort=True, observed=True).size()
        spans = n_psu[n_psu > 1]
        if len(spans):
            out.append(
                f"design.segment: {len(spans)} segments of '{d.segment}' lie in more than one PSU "
                f"(e.g. {short_list(list(spans.index), 8)}); segments must be nested in PSUs: give each "
                f"segment a label unique across PSUs (e.g. '{psu}' and '{d.segment}' combined)"
            )
    if st.replicate_method in ("brr", "fay"):
        p = Psus(df, strata, psu)
        bad = p.n_h != 2
        if bad.any():
            out.append(
                f"stages.swap.replicate_method: {st.replicate_method} needs exactly 2 PSUs per "
                f"stratum; strata {p.strata(bad)} of '{strata}' have "
                f"{short_list(sorted(set(p.n_h[bad].tolist())), 8)}: use jkn or bootstrap"
            )
    return out


def _class_summary(se: pd.DataFrame, column: str, method: str, variance: str) -> pd.DataFrame:
    """SE-ratio summary by design-effect class in the form of paper 003 Table 1."""

    t = deff_class_summary(se[column], se["deff"])
    t.index.name = "statistic"
    return t.reset_index().assign(method=method, variance=variance)
