"""The PRB stage by partition (paper 002): the cells, the transition matrices and the
post-randomization, a partition at a time (sdl_design.engine.partitions reads the partitions)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd
import scipy.sparse as sp

from sdl_design.blas import single_blas_thread
from sdl_design.edits import check_edits
from sdl_design.engine.partitions import (
    Partition,
    PartitionError,
    _lookup,
    _write_partition,
    read_partition,
)
from sdl_design.stages.prb.method import (
    EDIT_HINT,
    TRANSITION_COLUMNS,
    PrbRequest,
    _partition_codes,
    block_flows,
    block_risk,
    default_combos,
    m0,
    prb_cells,
    prb_draws,
    prb_frames,
    prb_request,
    theta0,
    transition_categories,
    transition_rows,
)
from sdl_design.survey import blocksum
from sdl_design.survey.blocksum import BlockPartial
from sdl_design.survey.design import SurveyDesign, replicate_options, resolve_replicates

if TYPE_CHECKING:
    from sdl_design.spec import ReleaseSpec


# ---------------------------------------------------------------- PRB (paper 002)


def prb_stage_request(spec: ReleaseSpec) -> tuple[PrbRequest, Any]:
    """The spec's PRB request (as PrbStage asks post_randomize) and its stages.prb section."""

    st = spec.stages.active("prb")
    if st is None:
        raise PartitionError("stages.prb: the spec has no active PRB stage; enable it")
    declared = spec.utility.domain_list(spec.variables.key_names)
    req = prb_request(
        st.variables, spec.design.weight, st.partition, st.method, prb_cells(spec, st), declared
    )
    return req, st


def _prb_columns(req: PrbRequest) -> list[str]:
    return list(dict.fromkeys([*req.variables, req.weight, *req.partition]))


@dataclass
class PrbPass1:
    """A partition's distinct cells of X_C (published coding) with their counts, its
    distinct partition-set values and each variable of C's distinct values."""

    cells: pd.DataFrame
    sets: pd.DataFrame
    values: dict[str, pd.Series]


def prb_pass1(part: Partition, spec: ReleaseSpec, req: PrbRequest) -> PrbPass1:
    """Pass 1 of PRB on one partition: its cells with their counts and its partition sets."""
    df = read_partition(part, _prb_columns(req), spec)
    coded, pf = prb_frames(df, req)
    g = coded.groupby(req.names, sort=True, dropna=False, observed=True)
    values = {v: df[v].dropna().drop_duplicates() for v in req.variables}
    return PrbPass1(g.size().reset_index(name="__t"), pf.drop_duplicates(), values)


@dataclass
class PrbTables:
    """The whole input's cells in cell-code order with their counts t, and its partition sets
    in set order (their values and labels), as post_randomize numbers them on the whole file."""

    cells: pd.DataFrame
    sets: pd.DataFrame
    labels: list[str]
    levels: dict[str, pd.Index]  # each variable of C's values, sorted (its categories)


def combine_prb_pass1(partials: Sequence[PrbPass1], req: PrbRequest) -> PrbTables:
    """The whole input's cells (counts added) and partition sets, in post_randomize's order."""
    cells = pd.concat([p.cells for p in partials], ignore_index=True)
    cells = (
        cells.groupby(req.names, sort=True, dropna=False, observed=True)["__t"].sum().reset_index()
    )
    sets = pd.concat([p.sets for p in partials], ignore_index=True).drop_duplicates()
    _, values, labels = _partition_codes(sets.reset_index(drop=True))
    levels = {}
    for v in req.variables:
        got = pd.concat([p.values[v] for p in partials], ignore_index=True).drop_duplicates()
        levels[v] = pd.Index(got).sort_values()  # (a categorical's: in its categories' order)
    return PrbTables(cells, values, labels, levels)


def prb_pass2(
    part: Partition, spec: ReleaseSpec, req: PrbRequest, tables: PrbTables
) -> pd.DataFrame:
    """The partition's singleton/doubleton units (cells with t <= 2 in the whole input): their
    global row, cell, partition set, weight and values of the set C."""
    df = read_partition(part, _prb_columns(req), spec)
    coded, pf = prb_frames(df, req)
    cell = _lookup(coded, tables.cells[req.names], "PRB cell (stages.prb)")
    t = tables.cells["__t"].to_numpy()
    sd = np.flatnonzero(t[cell] <= 2)
    units = df.iloc[sd][req.variables].reset_index(drop=True)
    return units.assign(
        __row=df.index.to_numpy()[sd],
        __cell=cell[sd],
        __part=_lookup(pf.iloc[sd], tables.sets, "PRB partition set (stages.prb)"),
        __w=df[req.weight].to_numpy(dtype=float)[sd],
    )


@single_blas_thread()  # as the in-memory stage runs (sdl_design.blas)
def prb_plan(
    req: PrbRequest,
    xi: float,
    tuned: bool,
    tables: PrbTables,
    units: Sequence[pd.DataFrame],
    rng: np.random.Generator,
) -> tuple[pd.DataFrame, dict[str, Any]]:
    """On the driver, from the units alone: the blocks and IFPR draws (prb_draws with the PRB
    stage's Generator); returns the moved records' new values of C (indexed by global row: a
    record of the destination cell in the same block gives all of them) and the metrics,
    among them the exact identification risk of eq. 2.2 from the blocks' counts."""
    u = pd.concat(list(units), ignore_index=True)
    draws = prb_draws(
        u["__part"].to_numpy(), u["__cell"].to_numpy(), u["__w"].to_numpy(),
        tables.sets, tables.labels, xi, theta0(xi), req.method, tuned, rng,
    )  # fmt: skip
    new = u[req.variables].iloc[draws.src].set_axis(u["__row"].to_numpy()[draws.moved])
    new = new.sort_index()
    risk = block_risk(pd.Series(draws.block), u["__cell"].to_numpy(), draws.theta)
    metrics = {
        "theta": draws.theta,
        "m0": float(m0(xi)),
        "max_risk": float(risk["risk"].max()) if len(risk) else 0.0,
        "n_blocks": float(risk["block"].nunique()) if len(risk) else 0.0,
        "n_units": float(len(u)),
        "n_changed": float((draws.dest != u["__cell"].to_numpy()).sum()),
        "n_moved": float(len(new)),
    }
    out = {"metrics": metrics, "merges": draws.merges, "notes": draws.notes, "risk": risk}
    part = draws.group[u["__part"].to_numpy()]  # merged partition sets
    return new, out | {"units": u, "block": draws.block, "dest": draws.dest, "part": part}


@single_blas_thread()
def prb_baseline(
    req: PrbRequest, xi: float, tables: PrbTables, plan: dict[str, Any], rng: np.random.Generator
) -> pd.DataFrame:
    """The other method (NZY beside PRB, PRB beside NZY) at PRB's theta on the same units,
    the stage's Generator drawn on: the moved records' new values of C (as prb_plan's)."""
    u = plan["units"]
    other = "nzy" if req.method == "prb" else "prb"
    draws = prb_draws(
        u["__part"].to_numpy(), u["__cell"].to_numpy(), u["__w"].to_numpy(),
        tables.sets, tables.labels, xi, plan["metrics"]["theta"], other, False, rng,
    )  # fmt: skip
    new = u[req.variables].iloc[draws.src].set_axis(u["__row"].to_numpy()[draws.moved])
    return new.sort_index()


def prb_apply(
    part: Partition, spec: ReleaseSpec, req: PrbRequest, new: pd.DataFrame, folder: str
) -> str:
    """The partition with its moved records' values of C replaced (as post_randomize takes
    them from their donors), edit rules checked, written to folder (whole or not at all)."""

    df = read_partition(part, None, spec)
    mine = new.loc[(new.index >= part.start) & (new.index < part.stop)]
    data = df.copy(deep=False)
    if len(mine):
        take = np.arange(len(df))
        take[mine.index.to_numpy() - part.start] = len(df) + np.arange(len(mine))
        for c in req.variables:
            both = pd.concat([df[c], mine[c].astype(df[c].dtype)], ignore_index=True)
            data[c] = pd.Series(both.array.take(take), index=df.index, name=c)
    check_edits(data, spec.edits, "PRB output", EDIT_HINT)
    return _write_partition(data, part, folder)


@dataclass
class PrbTransitions:
    """What the partitions need for expected_transitions' category sums: each cell's category
    on every cell variable (with the categories), the in-block flows (the driver's, from the
    units) and what each block unit keeps in its own category (by global row)."""

    names: list[str]
    codes: list[np.ndarray]
    cats: list[list]
    flows: list[np.ndarray]
    keep: pd.DataFrame  # global row -> one column per cell variable


def prb_transition_request(
    tables: PrbTables, plan: dict[str, Any], req: PrbRequest
) -> PrbTransitions:
    """On the driver: expected_transitions' in-block part from the units and their blocks
    (prb_plan's), on the whole input's cells (tables)."""

    u, block = plan["units"], np.asarray(plan["block"], dtype=np.int64)
    cv = tables.cells[req.names]
    theta = float(plan["metrics"]["theta"])
    cell, w = u["__cell"].to_numpy(), u["__w"].to_numpy(dtype=float)
    codes, cats, flows, keep = [], [], [], {}
    for v in req.names:
        c, k = transition_categories(cv, v)
        f, kept = block_flows(c, cell, block, w, theta, len(k))
        codes.append(c)
        cats.append(k)
        flows.append(f)
        keep[v] = kept
    return PrbTransitions(
        list(req.names), codes, cats, flows, pd.DataFrame(keep, index=u["__row"].to_numpy())
    )


def prb_transition_pass(
    part: Partition, spec: ReleaseSpec, req: PrbRequest, tables: PrbTables, tr: PrbTransitions
) -> list[tuple[BlockPartial, BlockPartial, np.ndarray]]:
    """Map: the partition's part of expected_transitions' category sums, per cell variable:
    the block sums of the weight and of the weight kept in its category, and the records."""
    df = read_partition(part, _prb_columns(req), spec)
    coded, _ = prb_frames(df, req)
    cell = _lookup(coded, tables.cells[req.names], "PRB cell (stages.prb)")
    rows = df.index.to_numpy(dtype=np.int64)
    w = df[req.weight].to_numpy(dtype=float)
    mine = tr.keep.loc[(tr.keep.index >= part.start) & (tr.keep.index < part.stop)]
    at = mine.index.to_numpy() - part.start
    out = []
    for j, v in enumerate(tr.names):
        a = tr.codes[j][cell]
        k = len(tr.cats[j])
        bins = blocksum.block_bins(a, k, part.start, part.stop, rows)
        d = w.copy()
        d[at] = mine[v].to_numpy()
        out.append((bins.of(w), bins.of(d), np.bincount(a, minlength=k)))
    return out


def prb_doc_tables(
    tr: PrbTransitions,
    partials: Sequence[list],
    n_rows: int,
    plan: dict[str, Any],
    new: pd.DataFrame,
    req: PrbRequest,
) -> dict[str, pd.DataFrame]:
    """On the driver: PrbStage's `transitions` (expected_transitions, the same bits) and
    `changed_by_variable` (records and share whose value of each variable of C changed: only
    moved records change, compared with their values as units) from the partitions' sums."""

    rows = []
    for j, v in enumerate(tr.names):
        k = len(tr.cats[j])
        total = blocksum.combine_partials([p[j][0] for p in partials], k, n_rows)
        kept = blocksum.combine_partials([p[j][1] for p in partials], k, n_rows)
        n = np.sum([p[j][2] for p in partials], axis=0)
        rows.append(transition_rows(v, tr.cats[j], tr.flows[j], kept, total, n))
    transitions = (
        pd.concat(rows, ignore_index=True) if rows else pd.DataFrame(columns=TRANSITION_COLUMNS)
    )
    before = plan["units"].set_index("__row").loc[new.index]
    changed = []
    for v in req.variables:
        x0, x1 = before[v], new[v]
        ch = ((x0 != x1) & ~(x0.isna() & x1.isna())).to_numpy(dtype=bool)
        changed.append(
            {
                "variable": v,
                "n_changed": int(ch.sum()),
                "share_changed": int(ch.sum()) / n_rows if n_rows else 0.0,
            }
        )
    return {"transitions": transitions, "changed_by_variable": pd.DataFrame(changed)}


# ---------------------------------------------------------------- Tables 1/4 and 6 (paper 002)


ROW = "__row"  # the label of a record as its own PSU (a design without PSUs)


@dataclass
class PrbCountsRequest:
    """What the partitions need for the weighted counts of C's categories (Tables 1/4: the
    input and PRB's output, with replicate totals) and the TVD of the joint distributions of
    combos of C (Table 6: the input, PRB's output and the baseline's): each variable's
    categories, the moved records' new values of each method (by global row), the input
    design's replicate weights and the labels of its PSUs."""

    levels: dict[str, pd.Index]
    combos: list[tuple[str, ...]]
    moved: dict[str, pd.DataFrame]  # method -> new values of C, by global row
    replicates: list[str]
    labels: list[str]


@dataclass
class PrbCounts:
    """A partition's part: the input's records, weight and replicate weights (R x categories)
    by category of each variable, and its distinct joint cells of each combo with their
    weights; per method, the same of its moved records' changes (their new category less
    their old); the maxima of the replicate weights by PSU."""

    counts: dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]]
    joint: list[tuple[np.ndarray, np.ndarray]]
    changes: dict[str, tuple[dict[str, tuple], list[tuple[np.ndarray, np.ndarray]]]]
    psus: pd.DataFrame


def prb_counts_request(
    spec: ReleaseSpec, columns: Sequence[str], tables: PrbTables, moved: dict[str, pd.DataFrame]
) -> PrbCountsRequest:
    """On the driver: the request of prb_counts_pass (the TVD of pairs and triples of the
    first five variables of C, as the in-memory Table 6)."""
    d = spec.design
    reps = resolve_replicates(columns, d.replicate_weights.columns) if d.replicate_weights else []
    combos = default_combos(list(tables.levels)[:5])
    radix = [np.prod([len(tables.levels[c]) + 1 for c in combo], dtype=float) for combo in combos]
    if radix and max(radix) > 2.0**62:
        raise PartitionError("stages.prb.variables: too many categories to cross for the TVD")
    # the units the replicate scales are read from: PSUs, else records (ROW: the global row)
    labels = [c for c in (d.strata, d.psu or ROW) if c] if reps else []
    return PrbCountsRequest(tables.levels, combos, moved, reps, labels)


def prb_counts_pass(
    part: Partition, spec: ReleaseSpec, req: PrbRequest, cq: PrbCountsRequest
) -> PrbCounts:
    """Map: the partition's weighted counts by category and joint cells of the input, and the
    changes each method's moved records make to them (PrbCounts)."""
    cols = list(dict.fromkeys([*cq.levels, req.weight, *cq.replicates, *cq.labels]))
    df = read_partition(part, [c for c in cols if c != ROW], spec)
    if ROW in cq.labels:  # a design without PSUs: each record its own
        df = df.assign(**{ROW: df.index.to_numpy()})
    w = df[req.weight].to_numpy(dtype=float)
    W = df[cq.replicates].to_numpy(dtype=float) if cq.replicates else np.zeros((len(df), 0))
    codes = {v: cq.levels[v].get_indexer(df[v]) for v in cq.levels}
    counts = _by_category(codes, cq, w, W)
    joint = [_joint(codes, combo, cq, w) for combo in cq.combos]
    changes = {}
    for name, moved in cq.moved.items():
        mine = moved.loc[(moved.index >= part.start) & (moved.index < part.stop)]
        at = mine.index.to_numpy() - part.start
        # each moved record twice: its old category with weight -w, its new one with +w
        both = {v: np.r_[codes[v][at], cq.levels[v].get_indexer(mine[v])] for v in cq.levels}
        sw = np.r_[-w[at], w[at]]
        by_cat = (  # Tables 1/4: PRB's output only
            _by_category(
                both, cq, sw, np.r_[-W[at], W[at]], np.r_[-np.ones(len(at)), np.ones(len(at))]
            )
            if name == req.method
            else {}
        )
        changes[name] = (by_cat, [_joint(both, combo, cq, sw) for combo in cq.combos])
    psus = pd.DataFrame()
    if cq.replicates:
        psus = df[cq.labels + cq.replicates].groupby(cq.labels, sort=False).max().reset_index()
    return PrbCounts(counts, joint, changes, psus)


def _by_category(
    codes: dict[str, np.ndarray],
    cq: PrbCountsRequest,
    w: np.ndarray,
    W: np.ndarray,
    ones: np.ndarray | None = None,
) -> dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """Per variable: the records (sum of ones), weight and replicate weights (R x L) by
    category (missing left out); one sparse product for every variable's categories."""
    ones = np.ones(len(w)) if ones is None else ones
    sizes = [len(cq.levels[v]) for v in cq.levels]
    offsets = np.cumsum([0, *sizes])
    rows, cols = [], []
    for v, off in zip(cq.levels, offsets[:-1], strict=False):
        ok = np.flatnonzero(codes[v] >= 0)
        rows.append(ok)
        cols.append(codes[v][ok] + off)
    r, c = np.concatenate(rows), np.concatenate(cols)
    Z = sp.csr_matrix((np.ones(len(r)), (r, c)), shape=(len(w), int(offsets[-1])))
    n, f, rep = Z.T @ ones, Z.T @ w, (Z.T @ W).T
    return {
        v: (n[a:b], f[a:b], rep[:, a:b])
        for v, a, b in zip(cq.levels, offsets[:-1], offsets[1:], strict=True)
    }


def _joint(
    codes: dict, combo: tuple[str, ...], cq: PrbCountsRequest, w: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """The distinct joint cells of combo (missing left out) with their weights."""
    cell = np.zeros(len(w), dtype=np.int64)
    ok = np.ones(len(w), dtype=bool)
    for c in combo:
        cell = cell * len(cq.levels[c]) + codes[c]
        ok &= codes[c] >= 0
    cell, w = cell[ok], w[ok]
    size = int(np.prod([len(cq.levels[c]) for c in combo]))
    if size <= 4 * len(cell) + 65_536:  # by counting, no sort
        sums, n = np.bincount(cell, w, size), np.bincount(cell, minlength=size)
        cells = np.flatnonzero(n)
        return cells, sums[cells]
    cells, inv = np.unique(cell, return_inverse=True)
    return cells, np.bincount(inv, w, len(cells))


def prb_count_tables(
    parts: Sequence[PrbCounts], cq: PrbCountsRequest, spec: ReleaseSpec, method: str
) -> tuple[pd.DataFrame, pd.DataFrame]:
    """On the driver: count_changes' weighted counts (with replicate SEs when the input has
    replicate weights) and tvd_table's TVD, from the partitions' parts."""
    rscales = _rscales(parts, cq, spec) if cq.replicates else None
    rows = []
    for v, levels in cq.levels.items():
        before = [np.sum([p.counts[v][k] for p in parts], axis=0) for k in range(3)]
        moved = [np.sum([p.changes[method][0][v][k] for p in parts], axis=0) for k in range(3)]
        after = [a + d for a, d in zip(before, moved, strict=True)]
        tab = {}
        for (n, f, rep), suffix in ((before, ""), (after, "_star")):
            tab["t" + suffix], tab["f" + suffix] = np.rint(n).astype(np.int64), f
            if rscales is not None:
                dev = rep - f[None, :]
                tab["se" + suffix] = np.sqrt(rscales @ (dev * dev))
        order = ["t", "t_star", "f", "f_star", "se", "se_star"]
        frame = pd.DataFrame({k: tab[k] for k in order if k in tab})
        frame.index = pd.MultiIndex.from_product([[v], levels.astype(str)])
        rows.append(frame[(frame["t"] > 0) | (frame["t_star"] > 0)])
    out = pd.concat(rows)
    out.index.names = ["variable", "category"]
    out["delta_t"] = (out["t_star"] - out["t"]).abs() / out["t"].where(out["t"] > 0)
    out["delta_f"] = (out["f_star"] - out["f"]).abs() / out["f"].where(out["f"] > 0)
    return out, _tvd_rows(parts, cq)


def _summed(pairs: Sequence[tuple[np.ndarray, np.ndarray]]) -> pd.Series:
    """(cells, weights) of several partitions as one series of weights by cell."""
    cells = np.concatenate([c for c, _ in pairs])
    u, inv = np.unique(cells, return_inverse=True)
    return pd.Series(np.bincount(inv, np.concatenate([s for _, s in pairs]), len(u)), index=u)


def _tvd_rows(parts: Sequence[PrbCounts], cq: PrbCountsRequest) -> pd.DataFrame:
    """Table 6: per combo, the input's cells and the TVD of each method's joint distribution
    (the input's with its moved records' changes) from the input's."""
    rows = []
    for j, combo in enumerate(cq.combos):
        dist = _summed([p.joint[j] for p in parts])
        row = {"variables": ", ".join(combo), "cells": len(dist)}
        p0 = dist / dist.sum()
        for name in cq.moved:
            after = dist.add(_summed([p.changes[name][1][j] for p in parts]), fill_value=0.0)
            row[name] = 0.5 * float(p0.sub(after / after.sum(), fill_value=0.0).abs().sum())
        rows.append(row)
    return pd.DataFrame(rows)


def _rscales(parts: Sequence[PrbCounts], cq: PrbCountsRequest, spec: ReleaseSpec) -> np.ndarray:
    """The input design's replicate scales, from one row per PSU (jkn's from the PSUs each
    replicate leaves without weight), as SurveyDesign sets them on the records."""
    psus = pd.concat([p.psus for p in parts], ignore_index=True)
    psus = psus.groupby(cq.labels, sort=False).max().reset_index().assign(__w=1.0)
    d = spec.design
    return SurveyDesign(
        psus, "__w", strata=d.strata, psu=d.psu or ROW, replicate_weights=cq.replicates,
        **replicate_options(d.replicate_weights),
    ).rscales  # fmt: skip
