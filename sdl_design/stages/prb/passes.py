"""The PRB stage by partition (paper 002): the cells, the transition matrices and the
post-randomization, a partition at a time (sdl_design.engine.partitions reads the partitions)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd

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
    """A partition's distinct cells of X_C (published coding) with their counts, and its
    distinct partition-set values."""

    cells: pd.DataFrame
    sets: pd.DataFrame


def prb_pass1(part: Partition, spec: ReleaseSpec, req: PrbRequest) -> PrbPass1:
    """Pass 1 of PRB on one partition: its cells with their counts and its partition sets."""
    df = read_partition(part, _prb_columns(req), spec)
    coded, pf = prb_frames(df, req)
    g = coded.groupby(req.names, sort=True, dropna=False, observed=True)
    return PrbPass1(g.size().reset_index(name="__t"), pf.drop_duplicates())


@dataclass
class PrbTables:
    """The whole input's cells in cell-code order with their counts t, and its partition sets
    in set order (their values and labels), as post_randomize numbers them on the whole file."""

    cells: pd.DataFrame
    sets: pd.DataFrame
    labels: list[str]


def combine_prb_pass1(partials: Sequence[PrbPass1], req: PrbRequest) -> PrbTables:
    """The whole input's cells (counts added) and partition sets, in post_randomize's order."""
    cells = pd.concat([p.cells for p in partials], ignore_index=True)
    cells = (
        cells.groupby(req.names, sort=True, dropna=False, observed=True)["__t"].sum().reset_index()
    )
    sets = pd.concat([p.sets for p in partials], ignore_index=True).drop_duplicates()
    _, values, labels = _partition_codes(sets.reset_index(drop=True))
    return PrbTables(cells, values, labels)


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
    out = {"metrics": metrics, "merges": draws.merges, "notes": draws.notes}
    return new, out | {"units": u, "block": draws.block}


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
