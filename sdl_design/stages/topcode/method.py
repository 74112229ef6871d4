"""Top and bottom coding (paper 004, Cox 2000: top-coding as a displacing mask, t_ij = min(x_ij, T_j)).

Thresholds, per group when `by` is given:
- percentile p: the weighted percentile Q_w(p), the smallest value v with
  sum(w_i : x_i <= v) >= (p / 100) * sum(w_i)  (the inverse of the weighted CDF);
- value: a fixed number;
- min_count k: the value of the k-th largest record (upper) or k-th smallest (lower), so that at
  least k records are coded together (all of the group when it has fewer than k records).
Coded records: x >= T (upper) and x <= T (lower); missing values are never coded.
Replacement: the threshold T, or the weighted mean of the coded values, which keeps the weighted
total of the group exactly (sum of w * mean over the coded records = sum of w * x).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd
from pydantic import ValidationError

from sdl_design.describe import fmt
from sdl_design.spec import Bound, TopcodeRule
from sdl_design.stage import StageResult
from sdl_design.survey import blocksum
from sdl_design.survey.blocksum import group_sum

if TYPE_CHECKING:
    from sdl_design.stage import StageResult

SIDES = ("upper", "lower")
TABLE_COLUMNS = [
    "side",
    "rule",
    "parameter",
    "replace",
    "threshold",
    "replacement",
    "n",
    "n_coded",
    "weight_coded",
    "share_coded",
    "coded_total_before",
    "coded_total_after",
    "total_before",
    "total_after",
]


@dataclass
class TopcodeResult:
    """The coded column (same index and name) and one table row per group and side."""

    values: pd.Series
    table: pd.DataFrame
    coded: pd.Series  # 1 top-coded, -1 bottom-coded, 0 untouched (internal: never publish)


def weighted_percentile(x: Sequence[float], w: Sequence[float] | None, p: float) -> float:
    """Q_w(p): the smallest x with weighted CDF >= p/100 (missing x ignored)."""
    if not 0 < p < 100:
        raise ValueError(f"weighted_percentile: p must be > 0 and < 100 (got {p})")
    x = np.asarray(x, dtype=float)
    w = np.ones_like(x) if w is None else np.asarray(w, dtype=float)
    ok = ~np.isnan(x)
    grp = _Groups(x[ok], w[ok], None, 1, np.array([int(ok.sum())]), np.zeros(1), pd.DataFrame())
    return float(_thresholds(grp, Bound(percentile=p), "lower")[0])


def _seqsum(v: np.ndarray) -> float:
    """Sum in index order, one addition after the other (the rounding of np.bincount)."""
    return float(np.cumsum(v)[-1]) if len(v) else 0.0


def _percentile_one(xv: np.ndarray, wv: np.ndarray, q: float) -> float | None:
    """Q_w(100 q) of one group without a full sort: only the records on the percentile's side
    of a cut are sorted (the top ones for q >= 1/2, the bottom ones otherwise).

    The value is that of the prefix rule over the fully sorted group (the first position
    whose cumulative weight reaches q times the total; ties in any order give the same value).
    None when the part needed grows over half the group, or when a cumulative weight lies
    within the rounding of the summation order of q times the total: the full sort decides.
    """
    n = len(xv)
    total = float(wv.sum())
    tol = 8.0 * n * np.finfo(float).eps * total  # bound on the summation-order rounding
    top = q >= 0.5
    qt = q * total
    m = int(np.ceil(2.0 * (1.0 - q if top else q) * n)) + 16
    while 2 * m <= n:
        idx = _tail(xv, m, top)
        inside = float(wv[idx].sum())
        base = total - inside if top else 0.0  # weight below the part
        if len(idx) and ((base < qt - tol) if top else (inside > qt + tol)):
            order = idx[np.argsort(xv[idx], kind="stable")]
            cw = base + np.cumsum(wv[order])
            i = min(int(np.count_nonzero(cw < qt)), len(idx) - 1)
            if abs(cw[i] - qt) <= tol or (i > 0 and qt - cw[i - 1] <= tol):
                return None
            return float(xv[order[i]])
        m *= 2
    return None


def _tail(xv: np.ndarray, m: int, top: bool) -> np.ndarray:
    """Positions of about m of the largest (top) or smallest values, every value beyond a
    cut taken from a strided sample (ascending positions; one comparison pass, no sort of
    the group); the m extreme ones by a partition when the sample misjudges the cut."""
    n = len(xv)
    s = xv[:: max(1, n // 4096)]
    k = min(len(s), max(1, -(-m * len(s) // n)))  # sample values beyond the cut
    if top:
        idx = np.flatnonzero(xv >= np.partition(s, len(s) - k)[len(s) - k])
    else:
        idx = np.flatnonzero(xv <= np.partition(s, k - 1)[k - 1])
    if len(idx) <= 2 * m:
        return idx
    part = np.argpartition(xv, n - m if top else m - 1)
    return part[n - m :] if top else part[:m]


def _bound(b: Bound | Mapping[str, Any] | None, column: str, side: str) -> Bound | None:
    if b is None or isinstance(b, Bound):
        return b
    try:
        return Bound.model_validate(dict(b))
    except ValidationError as e:
        msgs = "; ".join(
            f"{'.'.join(map(str, err['loc'])) or 'bound'}: {err['msg'].removeprefix('Value error, ')}"
            for err in e.errors()
        )
        raise ValueError(f"topcode '{column}' {side}: {msgs}") from None


def _thresholds(grp: _Groups, bound: Bound, side: str) -> np.ndarray:
    """Per-group thresholds (NaN for an empty group). A fixed value needs no sort; one group
    selects by partition (min_count) or partition and a partial sort (percentile); groups
    sort once by (group, value)."""
    has = grp.n_g > 0
    out = np.full(grp.n_groups, np.nan)
    if bound.value is not None:
        out[has] = float(bound.value)
        return out
    if grp.gv is None and has[0]:
        n = len(grp.xv)
        if bound.min_count is not None:
            k = int(bound.min_count)
            i = max(n - k, 0) if side == "upper" else min(k - 1, n - 1)
            out[0] = np.partition(grp.xv, i)[i]
            return out
        t = _percentile_one(grp.xv, grp.wv, float(bound.percentile) / 100.0)
        if t is not None:
            out[0] = t
            return out
    xs, ws, gs = grp.sorted()
    return _sorted_thresholds(xs, ws, gs, grp.n_groups, bound, side)


def _sorted_thresholds(
    xs: np.ndarray, ws: np.ndarray, gs: np.ndarray, n_groups: int, bound: Bound, side: str
) -> np.ndarray:
    """Per-group thresholds; xs, ws, gs sorted by (group, value). NaN for an empty group."""
    n_g = np.bincount(gs, minlength=n_groups)
    starts = np.concatenate([[0], np.cumsum(n_g)[:-1]]).astype(np.int64)
    ends = starts + n_g
    out = np.full(n_groups, np.nan)
    has = n_g > 0
    if bound.min_count is not None:
        k = int(bound.min_count)
        idx = (
            np.maximum(ends - k, starts)
            if side == "upper"
            else np.minimum(starts + k - 1, ends - 1)
        )
    else:
        q = float(bound.percentile) / 100.0
        cw = pd.Series(ws).groupby(gs).cumsum().to_numpy()  # within-group cumulative weight
        total = np.zeros(n_groups)
        total[has] = cw[ends[has] - 1]
        below = cw < q * total[gs]  # a prefix of each group: cw increases within a group
        idx = np.minimum(
            starts + np.bincount(gs, weights=below, minlength=n_groups).astype(np.int64), ends - 1
        )
    out[has] = xs[idx[has]]
    return out


def topcode(
    df: pd.DataFrame,
    column: str,
    weight: str | None = None,
    upper: Bound | Mapping[str, Any] | None = None,
    lower: Bound | Mapping[str, Any] | None = None,
    by: Sequence[str] | None = None,
) -> TopcodeResult:
    """Top- (upper) and bottom- (lower) code df[column], with thresholds per group of `by`.

    upper / lower: a spec Bound or a dict such as {"percentile": 99.5, "replace": "mean"},
    {"value": 60}, {"min_count": 10, "replace": "mean"}. weight: column of positive weights
    (None: every record weighs 1).
    """
    by = list(by or [])
    _check_columns(df, column, by, weight)
    return _topcode(df, column, _weights(df, weight), weight, upper, lower, by)


def _topcode(
    df: pd.DataFrame,
    column: str,
    wts: Weights | None,
    weight: str | None,
    upper: Bound | Mapping[str, Any] | None,
    lower: Bound | Mapping[str, Any] | None,
    by: list[str],
    label: bool = False,
) -> TopcodeResult:
    """topcode with the weights already read (_weights), columns already checked; label: the
    table's first column 'column' holds the column's name (topcode_frame's table)."""
    ub, lb = _bound(upper, column, "upper"), _bound(lower, column, "lower")
    if ub is None and lb is None:
        raise ValueError(f"topcode '{column}': give upper, lower or both")
    s = df[column]
    x, w, ok, wx = _values(df, column, weight, wts)
    grp, tot_before = _grouped(df, by, x, w, ok)
    bounds = [(side, b) for side, b in (("upper", ub), ("lower", lb)) if b is not None]
    thr = {side: _thresholds(grp, b, side) for side, b in bounds}
    if "upper" in thr and "lower" in thr:
        _check_apart(thr["upper"], thr["lower"], grp.keys, by, column)

    new = grp.xv.copy()
    flag = np.zeros(len(grp.xv), np.int8)
    rows = [_code_side(grp, side, b, thr[side], new, flag) for side, b in bounds]
    (tot_after,) = grp.sums([(new, grp.wv)])  # block sums: the same bits by partition
    table = side_table(rows, tot_before, tot_after, grp.keys, by, column if label else None)

    if ok is None:
        out, fl = new, flag
    else:
        out = x.copy()
        out[ok] = new
        fl = np.zeros(len(x), np.int8)
        fl[ok] = flag
    values = pd.Series(out, index=df.index, name=column, copy=False)
    if pd.api.types.is_integer_dtype(s) and ok is None and np.all(out == np.round(out)):
        values = values.astype(s.dtype)
    return TopcodeResult(
        values=values, table=table, coded=pd.Series(fl, index=df.index, name=column, copy=False)
    )


def _check_columns(df: pd.DataFrame, column: str, by: list[str], weight: str | None) -> None:
    """Every named column is in the data."""
    for c, what in (
        [(column, "column")]
        + [(c, "by column") for c in by]
        + ([(weight, "weight")] if weight else [])
    ):
        if c not in df.columns:
            raise ValueError(
                f"topcode '{column}': {what} '{c}' is not in the data; fix the name "
                f"(columns: {', '.join(map(str, df.columns[:12]))}{', ...' if df.shape[1] > 12 else ''})"
            )


Weights = tuple[np.ndarray, bool, float]
Terms = list[tuple[np.ndarray, np.ndarray | None]]  # (x, w): the terms x, or w * x


def _weights(df: pd.DataFrame, weight: str | None) -> Weights | None:
    """The weights as floats (NaN for missing), whether all are finite and > 0, and their sum
    (None: no weight column), read once for every coded column."""
    if not weight:
        return None
    s = df[weight]
    if not pd.api.types.is_numeric_dtype(s):
        s = pd.to_numeric(s, errors="coerce")
    w = s.to_numpy(dtype=float, na_value=np.nan)
    total = float(w.sum())
    # NaN: min is NaN; inf: the sum is (a finite overflow only sends it to the full check)
    return w, bool(len(w) == 0 or (w.min() > 0 and np.isfinite(total))), total


def _values(
    df: pd.DataFrame, column: str, weight: str | None, wts: Weights | None
) -> tuple[np.ndarray, np.ndarray, np.ndarray | None, float]:
    """The column as floats (NaN for missing), the weights (checked > 0 where x is present),
    the mask of present values (None when none is missing) and sum(w x) (when none is)."""
    s = df[column]
    if not (pd.api.types.is_numeric_dtype(s) and not pd.api.types.is_bool_dtype(s)):
        raise ValueError(
            f"topcode '{column}': the column is not numeric ({s.dtype}); only numbers can be top-coded"
        )
    x = s.to_numpy(dtype=float, na_value=np.nan)
    w = np.ones(len(x)) if wts is None else wts[0]
    wx = float(np.einsum("i,i->", w, x))  # one pass, no BLAS; NaN when a value is missing
    ok = None
    if not np.isfinite(wx):
        ok = ~np.isnan(x)
        ok = None if ok.all() else ok
    if wts is None:
        return x, w, ok, wx
    all_good = wts[1]
    if not all_good:
        bad = ~(np.isfinite(w) & (w > 0))
        if ok is not None:
            bad &= ok
        if bad.any():
            raise ValueError(
                f"topcode '{column}': {int(bad.sum())} records have a weight '{weight}' that is "
                "missing or not positive; every weight must be > 0"
            )
    return x, w, ok, wx


@dataclass
class _Groups:
    """The non-missing values with their weights and group codes (gv None: one group); per
    group: records, weight and the `by` values. `sorted` sorts by (group, value) once."""

    xv: np.ndarray
    wv: np.ndarray
    gv: np.ndarray | None
    n_groups: int
    n_g: np.ndarray
    w_g: np.ndarray
    keys: pd.DataFrame
    _sorted: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None
    rows: np.ndarray | None = None  # the file's rows of the values (None: all, in order)
    n_rows: int = 0  # records of the file

    def sums(self, terms: Terms) -> list[np.ndarray]:
        """Group sums of each term (x, or w * x: (x, w); one per value) in block sums over the
        file's rows (sdl_design.survey.blocksum: the same bits by partition)."""
        n_rows = max(self.n_rows, len(terms[0][0]))
        if self.gv is None:
            return _one_group_sums(terms, n_rows, self.rows)
        return [
            group_sum(self.gv, x if w is None else w * x, self.n_groups, n_rows, self.rows)
            for x, w in terms
        ]

    def sorted(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """xs, ws, gs: values, weights and group codes sorted by (group, value), stable."""
        if self._sorted is None:
            if self.gv is None:
                order = np.argsort(self.xv, kind="stable")
                gs = np.zeros(len(order), np.int64)
            else:
                order = np.lexsort((self.xv, self.gv))
                gs = self.gv[order]
            self._sorted = (self.xv[order], self.wv[order], gs)
        return self._sorted


def _grouped(
    df: pd.DataFrame,
    by: list[str],
    x: np.ndarray,
    w: np.ndarray,
    ok: np.ndarray | None,
) -> tuple[_Groups, np.ndarray]:
    """Group codes of the records (gv None without `by`) and the non-missing values, with
    each group's records and weight; and each group's weighted total of x."""
    xv, wv = (x, w) if ok is None else (x[ok], w[ok])
    if not by:
        grp = _Groups(xv, wv, None, 1, np.array([len(xv)]), np.zeros(1), pd.DataFrame(index=[0]))
    else:
        g_all = df.groupby(by, sort=True, dropna=False, observed=True).ngroup().to_numpy(np.int64)
        n_groups = int(g_all.max()) + 1 if len(g_all) else 0
        first = np.unique(g_all, return_index=True)[1]
        keys = df[by].iloc[first].reset_index(drop=True)
        gv = g_all if ok is None else g_all[ok]
        n_g = np.bincount(gv, minlength=n_groups)
        grp = _Groups(xv, wv, gv, n_groups, n_g, np.zeros(n_groups), keys)
    grp.rows, grp.n_rows = (None if ok is None else np.flatnonzero(ok)), len(x)
    grp.w_g, total = grp.sums([(wv, None), (xv, wv)])  # the two in one pass (one group)
    return grp, total


def _check_apart(
    upper: np.ndarray, lower: np.ndarray, keys: pd.DataFrame, by: list[str], column: str
) -> None:
    """The upper threshold lies above the lower one in every group."""
    clash = upper <= lower
    if clash.any():
        i = int(np.flatnonzero(clash)[0])
        where = "" if not by else f" in group {keys.iloc[i].to_dict()}"
        raise ValueError(
            f"topcode '{column}': the upper threshold {upper[i]:g} is not above the lower "
            f"threshold {lower[i]:g}{where}; move the bounds apart"
        )


def _code_side(
    grp: _Groups, side: str, b: Bound, t: np.ndarray, new: np.ndarray, flag: np.ndarray
) -> dict[str, Any]:
    """Code one side with thresholds t per group: writes the replacements into new and +1/-1
    into flag (records at or beyond t), returns that side's table columns (one row per group).
    Sums run in record order (np.bincount's rounding), over the coded records only for one
    group."""
    xv, wv, gv, n_groups = grp.xv, grp.wv, grp.gv, grp.n_groups
    if gv is None:  # one group: the few coded records by index
        hit = np.flatnonzero(xv >= t[0] if side == "upper" else xv <= t[0])  # NaN t: none
        wh = wv[hit]
        wc = np.array([_seqsum(wh)])
        sc = np.array([_seqsum(wh * xv[hit])])
        with np.errstate(invalid="ignore", divide="ignore"):
            rep = sc / wc if b.replace == "mean" else t.copy()  # mean: total-preserving
        new[hit] = rep[0]
        flag[hit] = 1 if side == "upper" else -1
        after = np.array([_seqsum(wh * new[hit])])
        n_coded = np.array([len(hit)], np.int64)
    else:
        coded = (xv >= t[gv]) if side == "upper" else (xv <= t[gv])  # NaN threshold: False
        wc = np.bincount(gv, weights=wv * coded, minlength=n_groups)
        sc = np.bincount(gv, weights=wv * xv * coded, minlength=n_groups)
        with np.errstate(invalid="ignore", divide="ignore"):
            rep = sc / wc if b.replace == "mean" else t.copy()  # mean: total-preserving
        new[coded] = rep[gv[coded]]
        flag[coded] = 1 if side == "upper" else -1
        after = np.bincount(gv, weights=wv * new * coded, minlength=n_groups)
        n_coded = np.bincount(gv, weights=coded, minlength=n_groups).astype(np.int64)
    return side_row(side, b, t, rep, grp.n_g, grp.w_g, n_coded, wc, sc, after)


def side_row(
    side: str,
    b: Bound,
    t: np.ndarray,
    rep: np.ndarray,
    n_g: np.ndarray,
    w_g: np.ndarray,
    n_coded: np.ndarray,
    wc: np.ndarray,
    sc: np.ndarray,
    after: np.ndarray,
) -> dict[str, Any]:
    """One side's table columns (one row per group) from its thresholds t, replacements rep
    and the groups' sums: records n_g and weight w_g; coded records, their weight wc and
    totals before (sc) and after."""
    rule = next(k for k in ("percentile", "value", "min_count") if getattr(b, k) is not None)
    return dict(
        {
            "side": side,
            "rule": rule,
            "parameter": float(getattr(b, rule)),
            "replace": b.replace,
            "threshold": t,
            "replacement": np.where(wc > 0, rep, np.nan),
            "n": n_g,
            "n_coded": n_coded,
            "weight_coded": wc,
            "share_coded": np.divide(wc, w_g, out=np.zeros(len(w_g)), where=w_g > 0),
            "coded_total_before": sc,
            "coded_total_after": after,
        }
    )


def side_table(
    rows: list[dict[str, Any]],
    tot_before: np.ndarray,
    tot_after: np.ndarray,
    keys: pd.DataFrame,
    by: list[str],
    column: str | None,
) -> pd.DataFrame:
    """A column's thresholds table from its sides' rows (side_row) and its groups' weighted
    totals before and after (column: the table's first column 'column', when given)."""
    for r in rows:
        r["total_before"] = tot_before
        r["total_after"] = tot_after
    if by:
        parts = [pd.concat([keys, pd.DataFrame(r)], axis=1) for r in rows]
        table = pd.concat(parts, ignore_index=True)[by + TABLE_COLUMNS]
        if column is not None:
            table.insert(0, "column", column)
        return table
    # one row per side, built at once (small frames cost more in pandas than in numpy)
    first = {"column": [column] * len(rows)} if column is not None else {}
    return pd.DataFrame(first | {c: [_item(r[c]) for r in rows] for c in TABLE_COLUMNS})


def _item(v: Any) -> Any:
    """The one value of a one-group table column (a scalar or a length-1 array)."""
    return v[0] if isinstance(v, np.ndarray) else v


def topcode_frame(
    df: pd.DataFrame,
    rules: Mapping[str, TopcodeRule | Mapping[str, Any]],
    weight: str | None = None,
) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Apply a rule per column (thresholds from the input values); the coded frame and one
    table of every column's thresholds (first column 'column')."""
    out = df.copy(deep=False)  # copy-on-write: new arrays only for coded columns
    tables = []
    wts: Weights | None = None  # the weights, read once for every column
    for col, rule in rules.items():
        if not isinstance(rule, TopcodeRule):
            try:
                rule = TopcodeRule.model_validate(dict(rule))
            except ValidationError as e:
                raise ValueError(
                    f"topcode '{col}': {'; '.join(err['msg'] for err in e.errors())}"
                ) from None
        _check_columns(df, col, list(rule.by), weight)
        if wts is None:
            wts = _weights(df, weight)
        res = _topcode(df, col, wts, weight, rule.upper, rule.lower, list(rule.by), label=True)
        out[col] = res.values
        tables.append(res.table)
    return out, frame_table(tables)


def frame_table(tables: list[pd.DataFrame]) -> pd.DataFrame:
    """The columns' thresholds tables as topcode_frame's one table."""
    if len(tables) == 1:
        return tables[0]
    table = (
        pd.concat(tables, ignore_index=True)
        if tables
        else pd.DataFrame(columns=["column", *TABLE_COLUMNS])
    )
    cols = ["column"] + [c for c in table.columns if c != "column"]
    return table[cols]


def topcode_summary(
    rules: Mapping[str, TopcodeRule],
    table: pd.DataFrame,
    w_total: float,
    totals: Mapping[str, tuple[float, float]],
) -> tuple[dict[str, float], dict[str, dict], list[str]]:
    """The stage's metrics, parameters and notes from its thresholds table, the weight total
    and each column's weighted total before and after."""
    metrics: dict[str, float] = {}
    params: dict[str, dict] = {}
    notes: list[str] = []
    for col, rule in rules.items():
        t = table[table["column"] == col]
        params[col] = {"by": list(rule.by)}
        for side in ("upper", "lower"):
            ts = t[t["side"] == side]
            if ts.empty:
                continue
            bound = getattr(rule, side).model_dump(exclude_none=True)
            thresholds = [float(v) for v in ts["threshold"]]
            params[col][side] = {**bound, "threshold": thresholds if rule.by else thresholds[0]}
            n = int(ts["n_coded"].sum())
            share = float(ts["weight_coded"].sum() / w_total)
            metrics[f"{col}.n_{side}"] = float(n)
            metrics[f"{col}.share_{side}"] = share
            notes.append(_coding_note(col, side, bound, rule.by, thresholds, n, share))
        before, after = totals[col]
        metrics[f"{col}.total_ratio"] = after / before if before else float("nan")
    return metrics, params, notes


def _block_total(x: np.ndarray) -> float:
    """The sum of x over the file, missing terms left out, in block sums (sdl_design.survey.blocksum:
    the same bits by partition)."""
    if not np.isnan(np.add.reduce(x)):  # no term is missing (NaN: one is, or inf - inf)
        return float(_one_group_sums([(x, None)], len(x))[0][0])
    ok = ~np.isnan(x)
    return float(_one_group_sums([(x[ok], None)], len(x), np.flatnonzero(ok))[0][0])


def _one_group_sums(terms: Terms, n_rows: int, rows: np.ndarray | None = None) -> list[np.ndarray]:
    """group_sum of each term with every record in group 0, bit for bit (a length-1 array
    each), without the block codes: each block's terms added one after the other, the blocks
    in order. rows: the terms' rows (ascending, default their positions) in a file of n_rows
    records."""
    nb, block = blocksum.n_blocks(n_rows), blocksum.BLOCK  # read at the call (tests shrink it)
    starts = np.arange(nb + 1, dtype=np.int64) * block
    n = len(terms[0][0])
    edges = np.minimum(starts, n) if rows is None else np.searchsorted(rows, starts)
    full = np.flatnonzero(edges[1:] > edges[:-1])  # blocks with terms
    segs = [
        (x[lo:hi], None if w is None else w[lo:hi])
        for x, w in terms
        for lo, hi in zip(edges[full].tolist(), edges[full + 1].tolist(), strict=True)
    ]
    per = np.zeros((len(terms), nb))
    per[:, full] = _chain_sums(segs).reshape(len(terms), len(full))
    return [np.cumsum(p)[-1:] if nb > 1 else p for p in per]


def _chain_sums(segs: Terms) -> np.ndarray:
    """The sum of each segment's terms (x, or w * x) added one after the other from +0.0 (as
    bincount adds), two segments at a time: the real and imaginary parts of one complex
    cumulative sum, whose additions are those of each part alone (the shorter one continued
    with +0.0, which changes no sum but -0.0, and the + 0.0 at the end makes that +0.0)."""
    out = np.zeros(len(segs))
    c = np.empty(max((len(x) for x, _ in segs), default=0), complex)
    parts = c.view(float).reshape(-1, 2)
    for i in range(0, len(segs), 2):
        pair = segs[i : i + 2]
        m = max(len(x) for x, _ in pair)
        for j, (x, w) in enumerate(pair + [(np.zeros(0), None)] * (2 - len(pair))):
            col = parts[:, j]
            if w is None:
                col[: len(x)] = x
            else:
                np.multiply(w, x, out=col[: len(x)])
            col[len(x) : m] = 0.0
        if m:
            np.cumsum(c[:m], out=c[:m])
            out[i : i + len(pair)] = parts[m - 1, : len(pair)]
    return out + 0.0


def _coding_note(
    col: str, side: str, bound: dict, by: Sequence[str], thresholds: list, n: int, share: float
) -> str:
    if "percentile" in bound:
        rule = f"the {bound['percentile']:g}th weighted percentile"
    elif "min_count" in bound:
        rule = f"the value of the {bound['min_count']}-th most extreme record"
    else:
        rule = f"the fixed value {bound['value']:g}"
    where = f" within groups of {', '.join(by)}" if by else ""
    thr = (
        f"{np.nanmin(thresholds):,.6g} to {np.nanmax(thresholds):,.6g}"
        if by
        else f"{thresholds[0]:,.6g}"
    )
    how = (
        "their weighted mean (weighted totals preserved)"
        if bound["replace"] == "mean"
        else "the threshold"
    )
    kind = "top" if side == "upper" else "bottom"
    return (
        f"{col}: {kind}-coded at {rule}{where} (threshold {thr}); "
        f"{n} records ({100 * share:.2f}% of the weighted count) replaced by {how}."
    )


def topcodes(res: StageResult) -> list[tuple[str, int, str]]:
    """(column, records coded, sentence) for every coded side of every top-coded column."""
    t = res.tables.get("thresholds")
    if t is None or not len(t):
        return []
    out = []
    for row in t.itertuples():
        n = int(row.n_coded)
        word = "top-coded" if row.side == "upper" else "bottom-coded"
        rep = getattr(row, "replacement", np.nan)
        if row.replace == "mean" and n and pd.notna(rep):
            how = f"; those values replaced by their weighted mean {fmt(rep)} (total preserved)"
        elif n:
            how = "; those values set to the threshold"
        else:
            how = ""
        out.append(
            (
                row.column,
                n,
                f"{word} at {fmt(row.threshold)}: {n} record{'s' if n != 1 else ''}{how}",
            )
        )
    return out
