"""Top-coding by partition: TopcodeStage's records and thresholds table, bit for bit.

- Pass 1 reads each partition's coded columns: the groups (`by` values) it holds with their
  records and block sums of w and w x (sdl_design.survey.blocksum), and per side the candidates of
  the threshold: the k most extreme values (min_count), or the most extreme records (value,
  weight, row) that a weighted percentile can fall on (about twice the tail's share, as
  topcode._percentile_one takes them).
- The driver finds each threshold from the candidates: the k-th most extreme value, or the
  prefix rule on the weighted CDF (the first record, by value and row, whose cumulative weight
  reaches q times the group's weight). When every cumulative weight next to the crossing lies
  further from q W than any summation order can move it, the in-memory stage finds the same
  record; when the candidates do not reach the crossing, pass 1 runs again with twice as
  many; when the crossing is that close, the group's values are gathered (record order) and
  the in-memory function decides.
- Pass 2 sends the coded records (record order) for the replacements (their weighted mean,
  summed one after the other as in memory); the apply pass writes the records.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd

from sdl_design.engine.partitions import Partition, PartitionError, _write_partition, read_partition
from sdl_design.spec import Bound, ReleaseSpec, TopcodeRule
from sdl_design.stages.topcode.method import (
    _check_apart,
    _Groups,
    _sorted_thresholds,
    _thresholds,
    _weights,
    frame_table,
    side_row,
    side_table,
    topcode_summary,
)
from sdl_design.stages.topcode.method import _values as _stage_values
from sdl_design.survey import blocksum
from sdl_design.survey.blocksum import BlockPartial, combine_local

SIDES = ("upper", "lower")


@dataclass(frozen=True)
class TopcodeRequest:
    """The spec's top-coding (stages.topcode): the design weight and each column's rule."""

    weight: str
    rules: tuple[tuple[str, TopcodeRule], ...]

    def columns(self) -> list[str]:
        names = [self.weight]
        for col, rule in self.rules:
            names += [col, *rule.by]
        return list(dict.fromkeys(names))


def topcode_request(spec: ReleaseSpec, columns: Sequence[str]) -> TopcodeRequest:
    """The spec's top-coding on an input with these columns (PartitionError naming the field
    of a column that is not there)."""
    section = spec.stages.active("topcode")
    if section is None:
        raise PartitionError("stages.topcode: the spec has no top-coding stage; enable it")
    req = TopcodeRequest(spec.design.weight, tuple(section.columns.items()))
    for col, rule in req.rules:
        missing = [c for c in (col, *rule.by) if c not in columns]
        if missing:
            raise PartitionError(
                f"stages.topcode.{col}: columns {missing} are not in the input; fix the names"
            )
    return req


def _values(df: pd.DataFrame, col: str, weight: str) -> tuple[np.ndarray, np.ndarray]:
    """The column's values (NaN: missing) and the weights, checked as the stage checks them."""
    try:
        x, w, _, _ = _stage_values(df, col, weight, _weights(df, weight))
    except ValueError as e:
        raise PartitionError(f"stages.topcode.{col}: {e}") from e
    return x, w


def _partial(codes: np.ndarray, x: np.ndarray, n_groups: int, part: Partition, rows: np.ndarray):
    bins = blocksum.block_bins(codes, n_groups, part.start, part.stop, rows)
    return bins.of(x)


def _extreme(order_key: np.ndarray, k: np.ndarray, g: np.ndarray, top: bool) -> np.ndarray:
    """Positions of the k[g] most extreme records of each group g (by value, then row: the
    top ones when top), sorted by (group, value, row)."""
    order = np.lexsort((np.arange(len(g)), order_key, g))
    gs = g[order]
    starts = np.searchsorted(gs, np.arange(len(k)), side="left")
    ends = np.searchsorted(gs, np.arange(len(k)), side="right")
    rank = np.arange(len(order)) - starts[gs]  # from the bottom of its group
    from_top = ends[gs] - 1 - np.arange(len(order))
    keep = (from_top < k[gs]) if top else (rank < k[gs])
    return order[keep]


def _sides(rule: TopcodeRule) -> Iterator[tuple[str, Bound, bool]]:
    """The rule's sides that are given: (side, bound, whether it is the upper one)."""
    for side in SIDES:
        b = getattr(rule, side)
        if b is not None:
            yield side, b, side == "upper"


@dataclass
class ColumnPass1:
    """One partition's part of a coded column: its groups (by values, local codes), their
    records and block sums of w and w x, the records with a missing value, and per side the
    threshold's candidates."""

    keys: pd.DataFrame
    n_g: np.ndarray
    w: BlockPartial
    wx: BlockPartial
    n_missing: int
    integer: bool
    sides: dict[str, dict[str, Any]]


def topcode_pass1(
    part: Partition, spec: ReleaseSpec, treq: TopcodeRequest, mult: dict[tuple[str, str], int]
) -> dict[str, ColumnPass1]:
    """Pass 1 on one partition (mult: how many times the first round's number of candidates a
    percentile side sends)."""
    df = read_partition(part, treq.columns(), spec)
    rows_all = np.arange(part.start, part.stop, dtype=np.int64)
    out = {}
    for col, rule in treq.rules:
        x, w = _values(df, col, treq.weight)
        ok = ~np.isnan(x)
        by = list(rule.by)
        if by:
            g_all = df.groupby(by, sort=False, dropna=False, observed=True).ngroup()
            g_all = g_all.to_numpy(np.int64)
            n_local = int(g_all.max()) + 1 if len(g_all) else 0
            first = np.unique(g_all, return_index=True)[1]
            keys = df[by].iloc[first].reset_index(drop=True)
        else:
            g_all, n_local, keys = np.zeros(len(x), np.int64), 1, pd.DataFrame(index=[0])
        xv, wv, gv, rows = x[ok], w[ok], g_all[ok], rows_all[ok]
        n_g = np.bincount(gv, minlength=n_local)
        sides = {}
        for side, b, top in _sides(rule):
            if b.value is not None:
                sides[side] = {}
            elif b.min_count is not None:
                k = np.full(n_local, int(b.min_count))
                at = _extreme(xv, k, gv, top)
                sides[side] = {"g": gv[at], "x": xv[at]}
            else:
                q = float(b.percentile) / 100.0
                share = (1.0 - q) if top else q
                k = np.ceil(2.0 * share * n_g).astype(np.int64) + 16
                k = np.minimum(k * mult.get((col, side), 1), n_g)
                at = _extreme(xv, k, gv, top)
                sides[side] = {
                    "g": gv[at], "x": xv[at], "w": wv[at], "row": rows[at],
                    "complete": k >= n_g,
                }  # fmt: skip
        out[col] = ColumnPass1(
            keys=keys,
            n_g=n_g,
            w=_partial(gv, wv, n_local, part, rows),
            wx=_partial(gv, wv * xv, n_local, part, rows),
            n_missing=int((~ok).sum()),
            integer=bool(pd.api.types.is_integer_dtype(df[col])),
            sides=sides,
        )
    return out


def _group_ids(
    keys: Sequence[pd.DataFrame], by: list[str]
) -> tuple[list[np.ndarray], pd.DataFrame]:
    """The groups over every partition, numbered as the stage numbers them (groupby sort=True,
    missing values a group): each partition's local groups' numbers and the groups' keys."""
    if not by:
        return [np.zeros(1, np.int64) for _ in keys], pd.DataFrame(index=[0])
    both = pd.concat(list(keys), ignore_index=True)
    ids = both.groupby(by, sort=True, dropna=False, observed=True).ngroup().to_numpy(np.int64)
    first = np.unique(ids, return_index=True)[1]
    at = np.cumsum([0, *(len(k) for k in keys)])
    return [ids[at[i] : at[i + 1]] for i in range(len(keys))], both.iloc[first].reset_index(
        drop=True
    )


@dataclass
class ColumnPlan:
    """A coded column on the whole file: its groups, their records and weights, the records
    with a missing value, and per side the thresholds (NaN: a group without values)."""

    keys: pd.DataFrame
    ids: list[np.ndarray]  # per partition: its local groups' numbers
    n_g: np.ndarray
    w_g: np.ndarray
    tot_before: np.ndarray
    n_missing: int
    integer: bool
    thresholds: dict[str, np.ndarray]


@dataclass
class Pending:
    """What the thresholds still need: more candidates for some sides, or the values of
    groups whose crossing is too close to call from the candidates."""

    more: set[tuple[str, str]]  # (column, side): twice the candidates
    gather: dict[tuple[str, str], list[int]]


def _percentile(
    x: np.ndarray,
    w: np.ndarray,
    row: np.ndarray,
    part: np.ndarray,
    incomplete: set[int],
    n: int,
    W: float,
    q: float,
    top: bool,
) -> tuple[str, float]:
    """The prefix rule on one group from its candidates (part: each one's partition;
    incomplete: the partitions that sent only some of their records): ("ok", t), ("more",
    nan) when the crossing lies beyond the candidates, ("close", nan) when a cumulative
    weight next to it is within any summation order's rounding of q W."""
    order = np.lexsort((row, x))
    x, w, part = x[order], w[order], part[order]
    qW = q * W
    tol = 10.0 * n * np.finfo(float).eps * W  # beyond any summation order's rounding
    if top:  # every record above a candidate past the lowest one of an incomplete partition
        # is a candidate: its cumulative weight is W minus the weight above it
        lo = max((int(np.argmax(part == p)) for p in incomplete), default=0)
        above = np.concatenate([np.cumsum(w[::-1])[::-1][1:], [0.0]])
        cw = W - above
        reach = np.flatnonzero(cw[lo:] >= qW)
        if not len(reach):
            return "close", float("nan")
        i = lo + int(reach[0])
        if i == lo and incomplete and cw[i] - w[i] >= qW - tol:
            return "more", float("nan")  # the crossing may lie below the candidates
    else:  # every record below a candidate before the highest one of an incomplete partition
        hi = min(
            (len(part) - 1 - int(np.argmax(part[::-1] == p)) for p in incomplete),
            default=len(part) - 1,
        )
        cw = np.cumsum(w)
        reach = np.flatnonzero(cw[: hi + 1] >= qW)
        if not len(reach):
            return ("more" if incomplete else "close"), float("nan")
        i = int(reach[0])
    if abs(cw[i] - qW) <= tol or qW - (cw[i] - w[i]) <= tol:
        return "close", float("nan")
    return "ok", float(x[i])


def topcode_plan(
    partials: Sequence[dict[str, ColumnPass1]],
    treq: TopcodeRequest,
    n_rows: int,
    gathered: dict[tuple[str, str, int], tuple[np.ndarray, np.ndarray]] | None = None,
) -> tuple[dict[str, ColumnPlan], Pending]:
    """On the driver: each column's groups and thresholds from pass 1 (gathered: the values
    and weights, record order, of the groups too close to call), and what is still needed."""

    plans, pending = {}, Pending(set(), {})
    for col, rule in treq.rules:
        parts = [q[col] for q in partials]
        ids, keys = _group_ids([p.keys for p in parts], list(rule.by))
        G = len(keys)
        n_g = np.zeros(G, np.int64)
        for p, i in zip(parts, ids, strict=True):
            np.add.at(n_g, i, p.n_g)
        w_g = combine_local([p.w for p in parts], ids, G, n_rows)
        thresholds = {}
        for side, b, top in _sides(rule):
            t = np.full(G, np.nan)
            if b.value is not None:
                t[n_g > 0] = float(b.value)
            elif b.min_count is not None:
                k = int(b.min_count)
                g = np.concatenate([i[p.sides[side]["g"]] for p, i in zip(parts, ids, strict=True)])
                x = np.concatenate([p.sides[side]["x"] for p in parts])
                for j in np.flatnonzero(n_g > 0):
                    v = np.sort(x[g == j])
                    t[j] = v[max(len(v) - k, 0)] if top else v[min(k - 1, len(v) - 1)]
            else:
                q = float(b.percentile) / 100.0
                cand = {c: [] for c in ("g", "x", "w", "row", "part")}
                incomplete = np.zeros((len(parts), G), dtype=bool)
                for k, (p, i) in enumerate(zip(parts, ids, strict=True)):
                    s = p.sides[side]
                    cand["g"].append(i[s["g"]])
                    cand["part"].append(np.full(len(s["g"]), k))
                    for c in ("x", "w", "row"):
                        cand[c].append(s[c])
                    incomplete[k, i] = ~s["complete"]
                g, x, w, row, pid = (
                    np.concatenate(cand[c]) for c in ("g", "x", "w", "row", "part")
                )
                for j in np.flatnonzero(n_g > 0):
                    key = (col, side, int(j))
                    if gathered is not None and key in gathered:
                        xv, wv = gathered[key]
                        if rule.by:  # the stage's sorted path: cumulative weights by group
                            o = np.argsort(xv, kind="stable")
                            z = np.zeros(len(xv), np.int64)
                            t[j] = _sorted_thresholds(xv[o], wv[o], z, 1, b, side)[0]
                        else:  # its partial sort, then the full one
                            n = np.array([len(xv)])
                            grp = _Groups(xv, wv, None, 1, n, np.zeros(1), keys)
                            t[j] = _thresholds(grp, b, side)[0]
                        continue
                    at = g == j
                    status, v = _percentile(
                        x[at], w[at], row[at], pid[at], set(np.flatnonzero(incomplete[:, j])),
                        int(n_g[j]), float(w_g[j]), q, top,
                    )  # fmt: skip
                    if status == "ok":
                        t[j] = v
                    elif status == "more":
                        pending.more.add((col, side))
                    else:
                        pending.gather.setdefault((col, side), []).append(int(j))
            thresholds[side] = t
        if "upper" in thresholds and "lower" in thresholds and not pending.more:
            try:
                _check_apart(thresholds["upper"], thresholds["lower"], keys, list(rule.by), col)
            except ValueError as e:
                raise PartitionError(f"stages.topcode.{col}: {e}") from e
        plans[col] = ColumnPlan(
            keys,
            ids,
            n_g,
            w_g,
            combine_local([p.wx for p in parts], ids, G, n_rows),
            sum(p.n_missing for p in parts),
            all(p.integer for p in parts),
            thresholds,
        )
    return plans, pending


@dataclass(frozen=True)
class TopcodeInputs:
    """What the passes after the thresholds read besides their partition: the spec, the
    request, each column's plan and the partitions' numbers by their first record."""

    spec: ReleaseSpec | None
    treq: TopcodeRequest
    plans: dict[str, ColumnPlan]
    starts: dict[int, int]


def _columns(
    part: Partition, ti: TopcodeInputs, df: pd.DataFrame
) -> Iterator[tuple[str, np.ndarray, np.ndarray, np.ndarray, np.ndarray]]:
    """Each coded column of the partition's records df: its name, values (NaN: missing),
    weights, groups (the whole file's numbering) and whether present."""
    index = ti.starts[part.start]
    for col, rule in ti.treq.rules:
        x, w = _values(df, col, ti.treq.weight)
        if rule.by:
            g = df.groupby(list(rule.by), sort=False, dropna=False, observed=True).ngroup()
            g = ti.plans[col].ids[index][g.to_numpy(np.int64)]
        else:
            g = np.zeros(len(df), np.int64)
        yield col, x, w, g, ~np.isnan(x)


def _hits(side: str, x: np.ndarray, t: np.ndarray, g: np.ndarray, ok: np.ndarray) -> np.ndarray:
    """The present values at or beyond their group's threshold (NaN threshold: none)."""
    with np.errstate(invalid="ignore"):
        return ok & ((x >= t[g]) if side == "upper" else (x <= t[g]))


def topcode_gather(
    part: Partition, ti: TopcodeInputs, want: dict[tuple[str, str], list[int]]
) -> dict[tuple[str, str, int], tuple[np.ndarray, np.ndarray]]:
    """The values and weights (record order) of the groups whose threshold the candidates
    cannot decide (want: (column, side) -> groups) on one partition."""
    df = read_partition(part, ti.treq.columns(), ti.spec)
    out = {}
    for col, x, w, g, ok in _columns(part, ti, df):
        for (c, side), groups in want.items():
            if c != col:
                continue
            for j in groups:
                at = ok & (g == j)
                out[(col, side, j)] = (x[at], w[at])
    return out


def topcode_coded(
    part: Partition, ti: TopcodeInputs
) -> dict[tuple[str, str], dict[str, np.ndarray]]:
    """Pass 2: each side's coded records (at or beyond their group's threshold), in record
    order: group, weight, value."""
    df = read_partition(part, ti.treq.columns(), ti.spec)
    out = {}
    for col, x, w, g, ok in _columns(part, ti, df):
        for side, t in ti.plans[col].thresholds.items():
            hit = _hits(side, x, t, g, ok)
            out[(col, side)] = {"g": g[hit], "w": w[hit], "x": x[hit]}
    return out


@dataclass
class Coding:
    """Each column's replacements per side and group, and whether it stays an integer."""

    rep: dict[str, dict[str, np.ndarray]]
    rows: dict[str, list[dict[str, Any]]]
    integer: dict[str, bool]


def _seqsums(g: np.ndarray, v: np.ndarray, n_groups: int) -> np.ndarray:
    """Sums by group, one addition after the other in record order (np.bincount's)."""
    return np.bincount(g, weights=v, minlength=n_groups)


def topcode_coding(
    coded: Sequence[dict[tuple[str, str], dict[str, np.ndarray]]],
    treq: TopcodeRequest,
    plans: dict[str, ColumnPlan],
) -> Coding:
    """On the driver: the replacements (the coded records' weighted mean, or the threshold)
    and each side's table columns (topcode.side_row), from the coded records in record order."""

    rep, rows, integer = {}, {}, {}
    for col, rule in treq.rules:
        plan = plans[col]
        G = len(plan.keys)
        rep[col], rows[col] = {}, []
        ints = plan.integer and plan.n_missing == 0
        for side, t in plan.thresholds.items():
            b: Bound = getattr(rule, side)
            parts = [c[(col, side)] for c in coded]
            g, w, x = (np.concatenate([p[k] for p in parts]) for k in ("g", "w", "x"))
            wc = _seqsums(g, w, G)
            sc = _seqsums(g, w * x, G)
            with np.errstate(invalid="ignore", divide="ignore"):
                r = sc / wc if b.replace == "mean" else t.copy()
            after = _seqsums(g, w * r[g], G)
            n_coded = np.bincount(g, minlength=G).astype(np.int64)
            rep[col][side] = r
            rows[col].append(side_row(side, b, t, r, plan.n_g, plan.w_g, n_coded, wc, sc, after))
            used = r[n_coded > 0]
            ints = ints and bool(np.all(used == np.round(used)))
        integer[col] = ints
    return Coding(rep, rows, integer)


def topcode_apply(
    part: Partition, ti: TopcodeInputs, coding: Coding, folder: str
) -> dict[str, Any]:
    """The partition's records with each coded column's values replaced, written to folder;
    the block sums of w x after coding (by group, and of every column) and of w."""
    df = read_partition(part, None, ti.spec)
    out = df.copy(deep=False)
    rows_all = np.arange(part.start, part.stop, dtype=np.int64)
    w_all = df[ti.treq.weight].to_numpy(dtype=float)
    sums: dict[str, Any] = {}
    for col, x, w, g, ok in _columns(part, ti, df):
        plan = ti.plans[col]
        new = x.copy()
        for side, t in plan.thresholds.items():
            hit = _hits(side, x, t, g, ok)
            new[hit] = coding.rep[col][side][g[hit]]
        values = pd.Series(new, index=df.index, name=col, copy=False)
        if coding.integer[col]:
            values = values.astype(df[col].dtype)
        out[col] = values
        G = len(plan.keys)
        sums[col] = {
            "after": _partial(g[ok], w[ok] * new[ok], G, part, rows_all[ok]),
            "before_all": _total_partial(w_all * x, part),
            "after_all": _total_partial(w_all * new, part),
        }
    sums["__w"] = _total_partial(w_all, part)
    _write_partition(out, part, folder)
    return sums


def _total_partial(x: np.ndarray, part: Partition) -> BlockPartial:
    ok = ~np.isnan(x)
    rows = np.arange(part.start, part.stop, dtype=np.int64)[ok]
    return _partial(np.zeros(int(ok.sum()), np.int64), x[ok], 1, part, rows)


def topcode_result(
    treq: TopcodeRequest,
    plans: dict[str, ColumnPlan],
    coding: Coding,
    applied: Sequence[dict[str, Any]],
    n_rows: int,
) -> tuple[pd.DataFrame, dict[str, float], dict[str, dict], list[str]]:
    """The stage's thresholds table, metrics, parameters and notes (topcode_summary's)."""

    tables, totals = [], {}
    for col, rule in treq.rules:
        plan = plans[col]
        G = len(plan.keys)
        after = combine_local(
            [a[col]["after"] for a in applied], [np.arange(G)] * len(applied), G, n_rows
        )
        tables.append(
            side_table(coding.rows[col], plan.tot_before, after, plan.keys, list(rule.by), col)
        )
        one = [np.zeros(1, np.int64)] * len(applied)
        totals[col] = (
            float(combine_local([a[col]["before_all"] for a in applied], one, 1, n_rows)[0]),
            float(combine_local([a[col]["after_all"] for a in applied], one, 1, n_rows)[0]),
        )
    one = [np.zeros(1, np.int64)] * len(applied)
    w_total = float(combine_local([a["__w"] for a in applied], one, 1, n_rows)[0])
    table = frame_table(tables)
    metrics, params, notes = topcode_summary(dict(treq.rules), table, w_total, totals)
    return table, metrics, params, notes


def partition_numbers(parts: Sequence[Partition]) -> dict[int, int]:
    """Each partition's number by its first record."""
    return {p.start: i for i, p in enumerate(parts)}


def run_topcode(
    run_map: Callable[..., list],
    parts: Sequence[Partition],
    spec: ReleaseSpec | None,
    treq: TopcodeRequest,
    folder: str,
) -> dict[str, Any]:
    """Top-coding of the partitions into folder with a runner's map (run_map(fn, parts,
    *args, what=...) -> results in partition order): the thresholds (rounds of candidates,
    then the values of groups too close to call), the coded records, the writing; the
    table, metrics, parameters and notes, the rounds and the groups gathered."""
    n_rows, starts = parts[-1].stop, partition_numbers(parts)
    mult: dict[tuple[str, str], int] = {}
    rounds = 0
    while True:
        rounds += 1
        first = run_map(topcode_pass1, parts, spec, treq, mult, what="topcode pass 1")
        plans, pending = topcode_plan(first, treq, n_rows)
        if not pending.more:
            break
        mult = {**mult, **{k: mult.get(k, 1) * 2 for k in pending.more}}
    gathered: dict = {}
    if pending.gather:  # crossings too close to call from the candidates: the stage's rule
        ti = TopcodeInputs(spec, treq, plans, starts)
        got = run_map(
            topcode_gather, parts, ti, pending.gather, what="topcode values of close groups"
        )
        gathered = {
            k: (np.concatenate([g[k][0] for g in got]), np.concatenate([g[k][1] for g in got]))
            for k in got[0]
        }
        plans, _ = topcode_plan(first, treq, n_rows, gathered)
    ti = TopcodeInputs(spec, treq, plans, starts)
    coded = run_map(topcode_coded, parts, ti, what="topcode pass 2")
    coding = topcode_coding(coded, treq, plans)
    applied = run_map(topcode_apply, parts, ti, coding, folder, what="topcode")
    table, metrics, params, notes = topcode_result(treq, plans, coding, applied, n_rows)
    return {
        "table": table,
        "metrics": metrics,
        "params": params,
        "notes": notes,
        "rounds": rounds,
        "groups_gathered": len(gathered),
    }
