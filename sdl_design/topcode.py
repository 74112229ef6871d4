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
from typing import Any

import numpy as np
import pandas as pd
from pydantic import ValidationError

from sdl_design.spec import Bound, TopcodeRule

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
    order = np.argsort(x[ok], kind="stable")
    t = _thresholds(
        x[ok][order],
        w[ok][order],
        np.zeros(int(ok.sum()), np.int64),
        1,
        Bound(percentile=p),
        "lower",
    )
    return float(t[0])


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


def _thresholds(
    xs: np.ndarray, ws: np.ndarray, gs: np.ndarray, n_groups: int, bound: Bound, side: str
) -> np.ndarray:
    """Per-group thresholds; xs, ws, gs sorted by (group, value). NaN for an empty group."""
    n_g = np.bincount(gs, minlength=n_groups)
    starts = np.concatenate([[0], np.cumsum(n_g)[:-1]]).astype(np.int64)
    ends = starts + n_g
    out = np.full(n_groups, np.nan)
    has = n_g > 0
    if bound.value is not None:
        out[has] = float(bound.value)
        return out
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
    ub, lb = _bound(upper, column, "upper"), _bound(lower, column, "lower")
    if ub is None and lb is None:
        raise ValueError(f"topcode '{column}': give upper, lower or both")
    s = df[column]
    x, w = _values(df, column, weight)
    ok = ~np.isnan(x)
    grp = _grouped(df, by, x, w, ok)
    bounds = [(side, b) for side, b in (("upper", ub), ("lower", lb)) if b is not None]
    thr = {side: _thresholds(grp.xs, grp.ws, grp.gs, grp.n_groups, b, side) for side, b in bounds}
    if "upper" in thr and "lower" in thr:
        _check_apart(thr["upper"], thr["lower"], grp.keys, by, column)

    new = grp.xv.copy()
    flag = np.zeros(len(grp.xv), np.int8)
    rows = [_code_side(grp, side, b, thr[side], new, flag) for side, b in bounds]
    tot_before = np.bincount(grp.gv, weights=grp.wv * grp.xv, minlength=grp.n_groups)
    tot_after = np.bincount(grp.gv, weights=grp.wv * new, minlength=grp.n_groups)
    table = []
    for r in rows:
        r["total_before"] = tot_before
        r["total_after"] = tot_after
        table.append(pd.concat([grp.keys, r], axis=1) if by else r)
    table = pd.concat(table, ignore_index=True)[by + TABLE_COLUMNS]

    out = x.copy()
    out[ok] = new
    values = pd.Series(out, index=df.index, name=column)
    if pd.api.types.is_integer_dtype(s) and ok.all() and np.all(out == np.round(out)):
        values = values.astype(s.dtype)
    fl = np.zeros(len(x), np.int8)
    fl[ok] = flag
    return TopcodeResult(
        values=values, table=table, coded=pd.Series(fl, index=df.index, name=column)
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


def _values(df: pd.DataFrame, column: str, weight: str | None) -> tuple[np.ndarray, np.ndarray]:
    """The column as floats (NaN for missing) and the weights (checked > 0 where x is present)."""
    s = df[column]
    if not (pd.api.types.is_numeric_dtype(s) and not pd.api.types.is_bool_dtype(s)):
        raise ValueError(
            f"topcode '{column}': the column is not numeric ({s.dtype}); only numbers can be top-coded"
        )
    x = s.to_numpy(dtype=float, na_value=np.nan)
    if not weight:
        return x, np.ones(len(x))
    w = pd.to_numeric(df[weight], errors="coerce").to_numpy(dtype=float, na_value=np.nan)
    bad = ~np.isnan(x) & ~(np.isfinite(w) & (w > 0))
    if bad.any():
        raise ValueError(
            f"topcode '{column}': {int(bad.sum())} records have a weight '{weight}' that is "
            "missing or not positive; every weight must be > 0"
        )
    return x, w


@dataclass
class _Groups:
    """The non-missing values with their weights and group codes, as given (xv, wv, gv) and
    sorted by (group, value) (xs, ws, gs); per group: records, weight and the `by` values."""

    xv: np.ndarray
    wv: np.ndarray
    gv: np.ndarray
    xs: np.ndarray
    ws: np.ndarray
    gs: np.ndarray
    n_groups: int
    n_g: np.ndarray
    w_g: np.ndarray
    keys: pd.DataFrame


def _grouped(
    df: pd.DataFrame, by: list[str], x: np.ndarray, w: np.ndarray, ok: np.ndarray
) -> _Groups:
    """Group codes of the records (one group without `by`) and the sorted non-missing values."""
    if by:
        g_all = df.groupby(by, sort=True, dropna=False, observed=True).ngroup().to_numpy(np.int64)
        n_groups = int(g_all.max()) + 1 if len(g_all) else 0
        first = np.unique(g_all, return_index=True)[1]
        keys = df[by].iloc[first].reset_index(drop=True)
    else:
        g_all = np.zeros(len(x), np.int64)
        n_groups = 1
        keys = pd.DataFrame(index=[0])
    xv, wv, gv = x[ok], w[ok], g_all[ok]
    order = np.lexsort((xv, gv))
    return _Groups(
        xv=xv,
        wv=wv,
        gv=gv,
        xs=xv[order],
        ws=wv[order],
        gs=gv[order],
        n_groups=n_groups,
        n_g=np.bincount(gv, minlength=n_groups),
        w_g=np.bincount(gv, weights=wv, minlength=n_groups),
        keys=keys,
    )


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
) -> pd.DataFrame:
    """Code one side with thresholds t per group: writes the replacements into new and +1/-1
    into flag (records at or beyond t), returns that side's table rows (one per group)."""
    xv, wv, gv, n_groups = grp.xv, grp.wv, grp.gv, grp.n_groups
    coded = (xv >= t[gv]) if side == "upper" else (xv <= t[gv])  # NaN threshold: False
    wc = np.bincount(gv, weights=wv * coded, minlength=n_groups)
    sc = np.bincount(gv, weights=wv * xv * coded, minlength=n_groups)
    with np.errstate(invalid="ignore", divide="ignore"):
        rep = sc / wc if b.replace == "mean" else t.copy()  # mean: total-preserving
    new[coded] = rep[gv[coded]]
    flag[coded] = 1 if side == "upper" else -1
    after = np.bincount(gv, weights=wv * new * coded, minlength=n_groups)
    rule = next(k for k in ("percentile", "value", "min_count") if getattr(b, k) is not None)
    return pd.DataFrame(
        {
            "side": side,
            "rule": rule,
            "parameter": float(getattr(b, rule)),
            "replace": b.replace,
            "threshold": t,
            "replacement": np.where(wc > 0, rep, np.nan),
            "n": grp.n_g,
            "n_coded": np.bincount(gv, weights=coded, minlength=n_groups).astype(np.int64),
            "weight_coded": wc,
            "share_coded": np.divide(wc, grp.w_g, out=np.zeros(n_groups), where=grp.w_g > 0),
            "coded_total_before": sc,
            "coded_total_after": after,
        }
    )


def topcode_frame(
    df: pd.DataFrame,
    rules: Mapping[str, TopcodeRule | Mapping[str, Any]],
    weight: str | None = None,
) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Apply a rule per column (thresholds from the input values); the coded frame and one
    table of every column's thresholds (first column 'column')."""
    out = df.copy(deep=False)  # copy-on-write: new arrays only for coded columns
    tables = []
    for col, rule in rules.items():
        if not isinstance(rule, TopcodeRule):
            try:
                rule = TopcodeRule.model_validate(dict(rule))
            except ValidationError as e:
                raise ValueError(
                    f"topcode '{col}': {'; '.join(err['msg'] for err in e.errors())}"
                ) from None
        res = topcode(df, col, weight, upper=rule.upper, lower=rule.lower, by=rule.by)
        out[col] = res.values
        tables.append(res.table.assign(column=col))
    table = (
        pd.concat(tables, ignore_index=True)
        if tables
        else pd.DataFrame(columns=["column", *TABLE_COLUMNS])
    )
    cols = ["column"] + [c for c in table.columns if c != "column"]
    return out, table[cols]


class TopcodeStage:
    """Stage: top- and bottom-coding of the columns of spec.stages.topcode with the design
    weight (deterministic)."""

    name = "topcode"
    replications = 0

    def __init__(self, rules: Mapping[str, TopcodeRule], weight: str):
        self.rules, self.weight = dict(rules), weight

    @classmethod
    def from_spec(cls, spec: Any) -> TopcodeStage | None:
        section = spec.stages.active("topcode")
        return None if section is None else cls(section.columns, spec.design.weight)

    def run(self, df: pd.DataFrame, ctx: Any) -> Any:
        from sdl_design.stage import StageResult

        w = df[self.weight].to_numpy(dtype=float)
        w_total = float(w.sum())
        out, table = topcode_frame(df, self.rules, self.weight)
        metrics: dict[str, float] = {}
        params: dict[str, dict] = {}
        notes: list[str] = []
        for col, rule in self.rules.items():
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
            before = float(np.nansum(w * df[col].to_numpy(dtype=float)))
            after = float(np.nansum(w * out[col].to_numpy(dtype=float)))
            metrics[f"{col}.total_ratio"] = after / before if before else float("nan")
        return StageResult(
            name=self.name,
            data=out,
            params=params,
            metrics=metrics,
            tables={"thresholds": table},
            report_tables=["thresholds"],
            notes=notes,
        )


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
