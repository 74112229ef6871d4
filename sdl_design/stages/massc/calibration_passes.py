"""MASSC Step IV by partition: the retained records' weights and replicate weights calibrated
to the original file's totals (calibrate_treated's, bit for bit), and the replications'
weight calibrations and study totals (massc_replications').

Every sum is a block sum (sdl_design.survey.blocksum) of one partition's records by a group it knows
locally (its own distinct categories, domain cells or calibration profiles); the driver maps
the local groups to the whole file's and adds the blocks in order, so the totals are the bits
the in-memory calibration adds. A partition codes its controls and domain cells once, as its
records are and with every record's donor values (_both_codes): a treatment's retained
records take one or the other, so every treatment (the release's, each replication's) is
integer work on the same codes, and one pass serves them all. The passes:
- pass 1: the categories of the controls, the cells of the declared domains, their original
  weight totals and replicate totals, and whether the replicate weights are the original's;
- pass 2 (again after a domain is dropped): the original's totals of the domains' labels
  and the retained records' weight and replicate weights summed by calibration profile;
- apply: each partition writes its retained records with w g and the replicates' w_r g_r;
- for the replications, their study totals at the calibrated weight instead.
Between them the driver runs the rules and solvers the in-memory calibration runs on the same
sums: cell_labels (domain pooling), calibrate_profiles, replicate_factors, drop_finest.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import pandas as pd

from sdl_design.blas import single_blas_thread
from sdl_design.codes import factorize
from sdl_design.edits import check_edits
from sdl_design.engine.cache import cached
from sdl_design.engine.partitions import (
    Partition,
    PartitionError,
    _selected,
    _write_partition,
    partition_identity,
    read_partition,
    written_identity,
)
from sdl_design.keys import key_frame, key_levels
from sdl_design.rng import release_seed
from sdl_design.spec import KeySpec, ReleaseSpec
from sdl_design.stages.massc.measures import epsilon_from_replications
from sdl_design.stages.massc.moments import ZParts
from sdl_design.stages.massc.passes import (
    BlockTotals,
    MasscInputs,
    _original_rows,
    _partial_sums,
    _tilde,
    _treated_records,
    massc_request,
    substituted,
)
from sdl_design.stages.massc.stage import EDIT_HINT, _domain_specs
from sdl_design.stages.massc.treatment import _coarsened as _treatment_coarsened
from sdl_design.stages.massc.treatment import (
    cell_labels,
    domain_metrics,
    drop_finest,
    label_totals,
    margin_name,
    replication_seed,
    weight_factors,
)
from sdl_design.survey import blocksum
from sdl_design.survey.blocksum import (
    BlockAccumulator,
    BlockPartial,
    combine_local,
    combine_partials,
)
from sdl_design.survey.calibration import (
    CalibrationInfeasible,
    _margin_codes,
    calibrate_profiles,
    profile_design,
    replicate_factors,
)
from sdl_design.survey.design import dense_codes, first_of

# replications made in the same passes: their selections' exchange carries an indicator per
# record and selection (the uniforms are drawn where the records are selected), and their
# study totals the values of the records that continue a block begun in an earlier partition
# (up to BLOCK per partition): both grow with this number. At most REPLICATIONS_AT_ONCE,
# fewer when their indicators (two selections of 1 byte a record each) would pass
# REPLICATION_BYTES
REPLICATIONS_AT_ONCE = 20
REPLICATION_BYTES = 400 * 2**20


# the study totals' partials of the replications in one map (each partition's block sums
# and the terms continuing a block begun in an earlier one): added to the totals as they
# arrive, so that about TOTALS_HELD partitions' partials are held at a time over the
# processes (a result on each worker, one being computed, those come early on the driver);
# at most TOTALS_BYTES of them. (Gathered whole, 10 replications at once took the ACS's 15M
# records in 15 partitions from 4.8 to 17.3 GiB summed over processes.)
TOTALS_BYTES = 2 * 2**30
TOTALS_HELD = 6


def totals_at_once(one: int, n_parts: int) -> int:
    """How many replications one map of study totals makes when one replication's partials
    over the n_parts partitions hold `one` bytes (at least 1)."""
    held = one * min(TOTALS_HELD, n_parts) / max(1, n_parts)
    return int(max(1, min(REPLICATIONS_AT_ONCE, TOTALS_BYTES // max(1, int(held)))))


def replications_at_once(n_records: int) -> int:
    """How many replications one batch of passes makes for a file of n_records (at least 1)."""
    fit = REPLICATION_BYTES // max(1, 2 * n_records)
    return int(max(1, min(REPLICATIONS_AT_ONCE, fit)))


@dataclass(frozen=True)
class CalibrationRequest:
    """Step IV as the release runs it (stages.massc.calibration): the categorical controls
    (KeySpecs, recodes applied), the declared domains (keys in their published coding), the
    method, bounds, infeasibility policy, domains' minimum records and the replicate weights."""

    weight: str
    controls: tuple[KeySpec, ...]
    domains: tuple[tuple[KeySpec, ...], ...]
    method: str
    bounds: tuple[float, float] | None
    policy: str
    min_records: int
    replicates: tuple[str, ...]

    def columns(self) -> list[str]:
        names = [k.name for k in self.controls] + [k.name for d in self.domains for k in d]
        return list(dict.fromkeys([self.weight, *names, *self.replicates]))


def calibration_request(spec: ReleaseSpec, columns: Sequence[str]) -> CalibrationRequest:
    """The spec's Step IV on an input with these columns (PartitionError naming the field when
    a column is missing)."""

    cal = spec.stages.massc.calibration
    controls = tuple(KeySpec(name=c) if isinstance(c, str) else c for c in cal.controls)
    domains = tuple(tuple(d) for d in _domain_specs(spec)) if cal.domain_margins else ()
    req = CalibrationRequest(
        weight=spec.design.weight,
        controls=controls,
        domains=domains,
        method=cal.method,
        bounds=None if cal.bounds is None else (float(cal.bounds[0]), float(cal.bounds[1])),
        policy=cal.infeasible_policy,
        min_records=cal.domain_min_records,
        replicates=tuple(spec.replicate_columns(list(columns))),
    )
    missing = [c for c in req.columns() if c not in columns]
    if missing:
        raise PartitionError(
            f"stages.massc.calibration / utility.domains: columns {missing} are not in the "
            "input; fix the names or set calibration.domain_margins: false"
        )
    return req


def check_massc(spec: ReleaseSpec, columns: Sequence[str]) -> None:
    """What MASSC by partition refuses, before anything runs (PartitionError naming the field):
    massc_request's and a missing calibration column."""

    massc_request(spec, columns)
    calibration_request(spec, columns)


# ---------------------------------------------------------------- values of several partitions


def _row_ids(frames: Sequence[pd.DataFrame]) -> list[np.ndarray]:
    """One id per distinct row over all frames (same columns; NaN equal to NaN), numbered by
    first appearance in the frames in order: each frame's rows' ids."""
    if not frames or not len(frames[0].columns):
        return [np.zeros(len(f), dtype=np.int64) for f in frames]
    ids = np.zeros(0, dtype=np.int64)
    for j, c in enumerate(frames[0].columns):  # the rows' ids over the columns so far
        both = pd.concat([f[c].astype(object) for f in frames], ignore_index=True)
        code, uniq = factorize(both, use_na_sentinel=False)
        code = code.astype(np.int64)  # ids * len(uniq) + code < rows**2: no overflow
        ids = code if j == 0 else factorize(ids * len(uniq) + code)[0].astype(np.int64)
    at = np.cumsum([0, *(len(f) for f in frames)])
    return [ids[at[i] : at[i + 1]] for i in range(len(frames))]


def _lookup(table: pd.DataFrame, rows: pd.DataFrame, what: str, missing_ok: bool = False):
    """The position in table of a row equal to each of rows (the first when repeated; -1
    for a row table lacks when missing_ok)."""
    a, b = _row_ids([table, rows])
    ids, first = np.unique(a, return_index=True)
    at = np.minimum(np.searchsorted(ids, b), max(len(ids) - 1, 0))
    found = (ids[at] == b) if len(ids) else np.zeros(len(b), dtype=bool)
    if not missing_ok and not found.all():
        raise PartitionError(f"calibration: a record's {what} is not in pass 1's")
    return np.where(found, first[at] if len(ids) else -1, -1)


def _sorted_values(uniques: Sequence[pd.Series]) -> tuple[list[np.ndarray], list[Any]]:
    """The categories of a column split over partitions (each partition's distinct values):
    each partition's values' codes into the sorted categories, and the categories, as
    calibration._margin_codes sorts the whole column (a missing value is MISSING)."""

    both = pd.concat([u.astype(object) for u in uniques], ignore_index=True)
    code, cats = _margin_codes(both)
    at = np.cumsum([0, *(len(u) for u in uniques)])
    return [code[at[i] : at[i + 1]] for i in range(len(uniques))], cats


def _local(s: pd.Series) -> tuple[np.ndarray, pd.Series]:
    """Each record's local code and the distinct values (first-appearance order)."""
    code, uniq = factorize(s, use_na_sentinel=False)
    return code.astype(np.int64), pd.Series(uniq, dtype=s.dtype if len(uniq) else object)


def _partials(
    codes: np.ndarray,
    X: np.ndarray,
    n_groups: int,
    start: int,
    n_rows_part: int,
    take: np.ndarray | None = None,
    scale: np.ndarray | None = None,
) -> list[BlockPartial]:
    """The BlockPartials of each column of X (records start..start+n-1 of their file; take:
    the rows of X that are those records, scale: a factor per record)."""
    rows = np.arange(start, start + n_rows_part, dtype=np.int64)
    bins = blocksum.block_bins(codes, n_groups, start, start + n_rows_part, rows)
    X = np.asarray(X, dtype=float)
    return bins.of_columns(X.reshape(len(X), -1), take, scale)


# ---------------------------------------------------------------- the partition's records


@dataclass(frozen=True)
class Treated:
    """Where the treatment by partition left its records: the substituted files (donors), the
    two selections' folders and the retention rates phi by MASSC stratum."""

    donors: str
    selected: tuple[str, str]
    phi: np.ndarray


def _retained(
    part: Partition, m: MasscInputs, tr: Treated
) -> tuple[pd.DataFrame, np.ndarray, pd.DataFrame]:
    """b2, the partition's retained records (B(1)'s, every column), their factors 1/phi_h,
    and b1 (every record)."""
    b1, _, d2 = _treated_records(part, m.spec, m.req, tr.donors, tr.selected, None)
    _, h, _ = _original_rows(part, m)
    factor = 1.0 / tr.phi[h]  # massc_treat's factor, then the retained records'
    return b1[d2], factor[d2], b1


def _coarsened(df: pd.DataFrame, creq: CalibrationRequest) -> pd.DataFrame:
    return _treatment_coarsened(df, list(creq.controls))[0]


def _numeric_control(values: pd.Series, k: KeySpec) -> bool:
    """Whether a control is a numeric total (control_totals' rule: numeric values, no bins or
    map; values: its distinct values as key_frame reads them), checked for missing values."""
    if k.bins is not None or k.map is not None or not pd.api.types.is_numeric_dtype(values):
        return False
    if values.isna().any():
        raise PartitionError(
            f"stages.massc.calibration.controls: '{k.name}' has missing values; a numeric "
            "total needs every value (give it bins, or impute)"
        )
    return True


@dataclass
class _Codes:
    """The calibration's columns of some records as local codes: per control each record's
    code into the distinct (coarsened) values; per declared domain each record's cell code
    into a table of the cells' recoded keys (values) and of a record's raw values (raw)."""

    controls: list[tuple[np.ndarray, pd.Series]]
    domains: list[tuple[np.ndarray, pd.DataFrame, pd.DataFrame]]

    def rows(self, idx: np.ndarray) -> _Codes:
        """The codes of the records idx (the same tables)."""
        return _Codes(
            [(c[idx], v) for c, v in self.controls],
            [(c[idx], v, r) for c, v, r in self.domains],
        )


def _original_codes(part: Partition, m: MasscInputs, creq: CalibrationRequest, b0) -> _Codes:
    """_codes_of the partition's original records b0 (kept in the partition cache)."""
    (original,) = [p for p in m.inputs if p.start == part.start]
    key = ("massc: original codes", partition_identity(original), repr(creq))
    return cached(key, lambda: _codes_of(b0, creq), _codes_bytes)


def _codes_bytes(codes: _Codes) -> int:
    arrays = [c for c, _ in codes.controls] + [c for c, _, _ in codes.domains]
    return sum(a.nbytes for a in arrays) + 4096 * len(arrays)


def _codes_of(df: pd.DataFrame, creq: CalibrationRequest) -> _Codes:
    """df's calibration columns coded (the recodes run on distinct values only)."""
    coarse = _coarsened(df, creq)
    controls = [_local(coarse[k.name]) for k in creq.controls]
    domains = []
    for dom in creq.domains:
        code = np.zeros(len(df), dtype=np.int64)
        per = []
        for k in dom:  # a compact code after each column: no overflow
            lv, lev = key_levels(df[k.name], k)
            code = factorize(code * len(lev) + lv)[0].astype(np.int64)
            per.append((lv, lev))
        first = first_of(code, int(code.max(initial=-1)) + 1)
        values = pd.DataFrame(
            {k.name: lev[lv[first]] for k, (lv, lev) in zip(dom, per, strict=True)}
        )
        raw = df[[k.name for k in dom]].iloc[first].reset_index(drop=True)
        domains.append((code, values, raw))
    return _Codes(controls, domains)


def _both_codes(
    part: Partition, m: MasscInputs, creq: CalibrationRequest, donors: str, extra: Sequence[str]
) -> tuple[_Codes, pd.DataFrame, np.ndarray]:
    """The partition's records coded twice, as they are (rows 0..n-1) and with every
    record's key-related columns from its donor (rows n..2n-1: B(1) takes these where
    substituted), with the calibration's and `extra` columns of the records (not the replicate
    weights: _replicates reads them), and whether each has a donor. Each
    pass of the calibrations and replications asks for them: computed once while the
    process's partition cache holds them."""
    key = (
        "massc: both codes",
        partition_identity(part),
        written_identity(donors, part),
        repr(replace(creq, replicates=())),  # (the replicate weights: not read)
        repr(m.req),
        tuple(extra),
    )
    return cached(key, lambda: _both_codes_now(part, m, creq, donors, extra), _both_bytes)


def _replicates(part: Partition, m: MasscInputs, creq: CalibrationRequest) -> np.ndarray:
    """The partition's replicate weights (records x replicates, column-major as read)."""
    reps = list(creq.replicates)
    return read_partition(part, reps, m.spec).to_numpy(dtype=float)


def _both_bytes(got: tuple[_Codes, pd.DataFrame, np.ndarray]) -> int:
    codes, df, has_donor = got
    arrays = [c for c, _ in codes.controls] + [c for c, _, _ in codes.domains]
    size = sum(a.nbytes for a in arrays) + has_donor.nbytes
    return size + int(df.memory_usage(index=False, deep=True).sum())


def _both_codes_now(
    part: Partition, m: MasscInputs, creq: CalibrationRequest, donors: str, extra: Sequence[str]
) -> tuple[_Codes, pd.DataFrame, np.ndarray]:
    """_both_codes computed (its arrays read-only: the cache may hand them to other passes)."""
    spec, req = m.spec, m.req
    cols = [c for c in creq.columns() if c not in set(creq.replicates)]
    df = read_partition(part, list(dict.fromkeys([*cols, *extra])), spec)
    tilde = _tilde(part, spec, req, donors, df.index)
    has_donor = tilde["__donor"].to_numpy() >= 0
    names = list(
        dict.fromkeys(k.name for k in (*creq.controls, *(k for d in creq.domains for k in d)))
    )
    own = df[names]
    sub = substituted(own, tilde, np.ones(len(df), dtype=bool), req)
    codes = _codes_of(pd.concat([own, sub], ignore_index=True), creq)
    for a in [c for c, _ in codes.controls] + [c for c, _, _ in codes.domains] + [has_donor]:
        a.setflags(write=False)
    return codes, df, has_donor


def _treated_rows(part: Partition, tr: Treated, has_donor: np.ndarray) -> tuple[np.ndarray, ...]:
    """d(2)'s records (positions) and where their codes are in _both_codes' rows."""

    d1 = _selected(part, tr.selected[0]) & has_donor
    keep = np.flatnonzero(_selected(part, tr.selected[1]))
    n = len(d1)
    return keep, np.where(d1[keep], n + keep, keep), d1


def _cells_of(code: np.ndarray, values: pd.DataFrame, raw: pd.DataFrame, rows: np.ndarray):
    """A declared domain's cells among records (code: each one's cell in the tables; rows:
    their global rows): the cells present, with their first records and counts, and each
    record's code among them."""
    count = np.bincount(code, minlength=len(values))
    present = np.flatnonzero(count)
    rank = np.full(len(values), -1, dtype=np.int64)
    rank[present] = np.arange(len(present))
    c = rank[code]
    first = first_of(c, len(present))
    return {
        "values": values.iloc[present].reset_index(drop=True),
        "raw": raw.iloc[present].reset_index(drop=True),
        "first": rows[first],
        "count": count[present],
        "code": c,
    }


# ---------------------------------------------------------------- pass 1


@dataclass
class CalibrationPass1:
    """One partition's categories, domain cells and their original totals (local codes)."""

    n2: int
    same_reps: bool
    w_o: BlockPartial  # the original weight's total (one group)
    controls: list[dict[str, Any]]
    domains: list[dict[str, Any]]


def retained_count(part: Partition, trs: Sequence[Treated]) -> list[int]:
    """The partition's retained records (d(2)) of each treatment."""

    return [int(_selected(part, tr.selected[1]).sum()) for tr in trs]


def retained_offsets(parts: Sequence[Partition], counts: Sequence[int]) -> dict[int, int]:
    """The retained records before each partition (by its first record)."""
    before = np.cumsum([0, *counts])[:-1].tolist()
    return {p.start: int(b) for p, b in zip(parts, before, strict=True)}


def calibration_pass1(
    part: Partition,
    m: MasscInputs,
    creq: CalibrationRequest,
    trs: Sequence[Treated],
    offsets: Sequence[dict[int, int]],
) -> list[CalibrationPass1]:
    """Pass 1 on one partition, per treatment (offsets: its retained records before each
    partition, by the partition's first record): per control its distinct categories on the
    retained records and on the original, with the original's weight and replicate totals by
    category; per declared domain its distinct cells (recoded keys) on both files with their
    first records, counts, the original's weight total and, for each replicate, the totals on
    both files. The original's side is the same for every treatment."""
    reps = list(creq.replicates)
    cols = creq.columns()
    b0, _, _ = _original_rows(part, m, cols, strata=False)
    n0 = len(b0)
    w_o = b0[creq.weight].to_numpy(dtype=float)
    R_o = b0[reps].to_numpy(dtype=float) if reps else np.zeros((n0, 0))
    codes_o = _original_codes(part, m, creq, b0)
    original = []  # per control: its categories on the original, their totals
    for k, (code, u0) in zip(creq.controls, codes_o.controls, strict=True):
        # control_totals' categories: key_frame's (a missing value is MISSING)
        u0 = key_frame(pd.DataFrame({"v": u0}), ["v"])["v"]
        if _numeric_control(u0, k):  # a single total: sum w x (one group)
            x, one = u0.to_numpy(dtype=float)[code], np.zeros(n0, dtype=np.int64)
            w = _partials(one, w_o * x, 1, part.start, n0)[0]
            w_reps = _partials(one, R_o * x[:, None], 1, part.start, n0) if reps else []
            original.append((None, w, w_reps))
            continue
        w = _partials(code, w_o, len(u0), part.start, n0)[0]
        original.append((u0, w, _partials(code, R_o, len(u0), part.start, n0) if reps else []))
    rows_o = b0.index.to_numpy()
    cells_o = []
    for code, values, raw in codes_o.domains:
        o = _cells_of(code, values, raw, rows_o)
        o["w"] = _partials(o["code"], w_o, len(o["first"]), part.start, n0)[0]
        cells_o.append(o)
    w_total = _partials(np.zeros(n0, dtype=np.int64), w_o, 1, part.start, n0)[0]
    codes, df, has_donor = _both_codes(part, m, creq, trs[0].donors, [])
    R = _replicates(part, m, creq) if reps else None
    out = []
    for tr, offs in zip(trs, offsets, strict=True):
        keep, at, _ = _treated_rows(part, tr, has_donor)
        c2 = codes.rows(at)
        n2, offset2 = len(keep), offs[part.start]
        same = bool(reps) and all(
            np.array_equal(R[keep, j], R_o[keep, j]) for j in range(len(reps))
        )
        controls = []
        for k, (code, u2), (u0, w, w_reps) in zip(
            creq.controls, c2.controls, original, strict=True
        ):
            b2_values = u2.iloc[dense_codes(code)[0]].reset_index(drop=True)
            if u0 is None:
                _numeric_control(key_frame(pd.DataFrame({"v": b2_values}), ["v"])["v"], k)
            controls.append({"b2": b2_values, "o": u0, "w": w, "reps": w_reps})
        domains = []
        rep_margins = bool(reps) and same
        for (code, values, raw), o in zip(c2.domains, cells_o, strict=True):
            t2 = _cells_of(code, values, raw, df.index.to_numpy()[keep])
            o = dict(o)
            if rep_margins:
                o["reps"] = _partials(o["code"], R_o, len(o["first"]), part.start, n0)
                t2["reps"] = _partials(t2["code"], R, len(t2["first"]), offset2, n2, keep)
            domains.append({"b2": t2, "o": o})
        out.append(CalibrationPass1(n2, same, w_total, controls, domains))
    for q in out:  # the local codes stay here
        for side in q.domains:
            for t in side.values():
                t.pop("code", None)
    return out


@dataclass
class DomainCells:
    """A declared domain's cells on the whole of both files (domain_margins' numbering: by
    first appearance in b2, then in the original) and its calibration labels."""

    values: pd.DataFrame  # the recoded keys of each cell
    lab: np.ndarray  # label code of each cell
    cats: pd.Index  # the labels
    b2_labels: np.ndarray  # the label codes the retained records have (sorted)


@dataclass
class CalibrationPlan:
    """What pass 1 found on the whole file: the controls' categories (on b2, sorted as the
    design codes them) and their original totals (per replicate too), the declared domains'
    cells and labels, their table, whether replicate calibration takes the margins, and the
    retained records before each partition."""

    control_values: list[pd.Series]  # b2's distinct values of each control (partition order)
    control_codes: list[np.ndarray]  # their codes into control_cats
    control_cats: list[list[Any]]
    numeric: list[bool]  # whether each control is a numeric total (its categories: values)
    ctrl: dict[str, Any]  # control_totals of the original
    ctrl_reps: list[dict[str, Any]]  # per replicate
    margins: dict[str, DomainCells]
    table: pd.DataFrame
    rep_margins: bool
    offsets: dict[int, int]  # retained records before each partition (by its first record)
    n2: int
    w_o_total: float


def _plan_controls(
    partials: Sequence[CalibrationPass1], creq: CalibrationRequest, n_rows: int
) -> tuple[list, list, list, list[bool], dict[str, Any], list[dict[str, Any]]]:
    """The controls' values and codes on b2, their sorted categories, whether each is a
    numeric total, and the original's totals (weight, each replicate) in block sums."""
    reps = list(creq.replicates)
    values, codes, cats_b2, ctrl, numeric = [], [], [], {}, []
    ctrl_reps: list[dict[str, Any]] = [{} for _ in reps]
    for j, k in enumerate(creq.controls):
        u2 = [q.controls[j]["b2"] for q in partials]
        code2, cats = _sorted_values(u2)
        values.append(pd.concat([u.astype(object) for u in u2], ignore_index=True))
        codes.append(np.concatenate(code2))
        cats_b2.append(cats)
        numeric.append(partials[0].controls[j]["o"] is None)
        if numeric[-1]:  # a single total: sum w x in block sums
            ctrl[k.name] = float(
                combine_partials([q.controls[j]["w"] for q in partials], 1, n_rows)[0]
            )
            for r in range(len(reps)):
                p_r = [q.controls[j]["reps"][r] for q in partials]
                ctrl_reps[r][k.name] = float(combine_partials(p_r, 1, n_rows)[0])
            continue
        code_o, cats_o = _sorted_values([q.controls[j]["o"] for q in partials])
        t = combine_local([q.controls[j]["w"] for q in partials], code_o, len(cats_o), n_rows)
        ctrl[k.name] = {c: float(v) for c, v in zip(cats_o, t, strict=True)}
        for r in range(len(reps)):
            p_r = [q.controls[j]["reps"][r] for q in partials]
            t = combine_local(p_r, code_o, len(cats_o), n_rows)
            ctrl_reps[r][k.name] = {c: float(v) for c, v in zip(cats_o, t, strict=True)}
    return values, codes, cats_b2, numeric, ctrl, ctrl_reps


def calibration_plan(
    partials: Sequence[CalibrationPass1],
    creq: CalibrationRequest,
    n_rows: int,
    offsets: dict[int, int],
) -> CalibrationPlan:
    """On the driver: the controls' categories and original totals, the domains' cells (their
    weight and replicate totals in block sums) and labels (cell_labels, domain_margins' rule)."""

    reps = list(creq.replicates)
    n2 = sum(q.n2 for q in partials)
    rep_margins = bool(reps) and all(q.same_reps for q in partials)
    values, codes, cats_b2, numeric, ctrl, ctrl_reps = _plan_controls(partials, creq, n_rows)
    margins, rows = {}, []
    for i, dom in enumerate(creq.domains):
        b2 = [q.domains[i]["b2"] for q in partials]
        o = [q.domains[i]["o"] for q in partials]
        ids = _row_ids([s["values"] for s in b2] + [s["values"] for s in o])
        ids2, ids_o = ids[: len(b2)], ids[len(b2) :]
        n_id = int(max((int(x.max(initial=-1)) for x in ids), default=-1)) + 1
        big = np.iinfo(np.int64).max
        first2, first_o = np.full(n_id, big), np.full(n_id, big)
        n_b, n_o = np.zeros(n_id, np.int64), np.zeros(n_id, np.int64)
        for s, x in zip(b2, ids2, strict=True):
            np.minimum.at(first2, x, s["first"])
            np.add.at(n_b, x, s["count"])
        for s, x in zip(o, ids_o, strict=True):
            np.minimum.at(first_o, x, s["first"])
            np.add.at(n_o, x, s["count"])
        # cells by first appearance in b2, then (cells b2 lacks) in the original
        in_b = n_b > 0
        order = np.lexsort((np.where(in_b, first2, first_o), ~in_b))
        cell = np.empty(n_id, dtype=np.int64)
        cell[order] = np.arange(n_id)
        raw = pd.concat(
            [s["raw"] for s in b2] + [s["raw"] for s in o], ignore_index=True
        )  # the first record of each cell: its raw values (its label's name)
        frm = pd.concat([s["values"] for s in b2] + [s["values"] for s in o], ignore_index=True)
        all_ids = np.concatenate(ids)
        firsts = np.concatenate([s["first"] for s in b2] + [s["first"] for s in o])
        is_b2 = np.repeat([True, False], [sum(len(x) for x in ids2), sum(len(x) for x in ids_o)])
        want = np.where(in_b[all_ids], first2[all_ids], first_o[all_ids])
        pick = np.flatnonzero((firsts == want) & (is_b2 == in_b[all_ids]))
        pick = pick[np.unique(all_ids[pick], return_index=True)[1]]  # one row per id
        at = np.empty(n_id, dtype=np.int64)
        at[all_ids[pick]] = pick
        at_first = raw.iloc[at[order]].reset_index(drop=True)
        t_o = combine_local([s["w"] for s in o], [cell[x] for x in ids_o], n_id, n_rows)
        reps_i = None
        if rep_margins:
            A = np.column_stack(
                [
                    combine_local([s["reps"][r] for s in b2], [cell[x] for x in ids2], n_id, n2)
                    for r in range(len(reps))
                ]
            )
            B = np.column_stack(
                [
                    combine_local([s["reps"][r] for s in o], [cell[x] for x in ids_o], n_id, n_rows)
                    for r in range(len(reps))
                ]
            )
            reps_i = (A, B)
        nb_cell = n_b[order]
        lab, cats, row = cell_labels(dom, at_first, nb_cell, t_o, reps_i, creq.min_records)
        rows.append(row)
        if lab is not None:
            margins[margin_name(dom)] = DomainCells(
                frm.iloc[at[order]].reset_index(drop=True),
                np.asarray(lab),
                cats,
                np.unique(np.asarray(lab)[nb_cell > 0]),
            )
    table = pd.DataFrame(rows, columns=["domain", "cells", "cells_kept", "pooled_share", "status"])
    w_o = BlockAccumulator(1, n_rows)
    for q in partials:
        w_o.add(q.w_o)
    return CalibrationPlan(
        values, codes, cats_b2, numeric, ctrl, ctrl_reps, margins, table, rep_margins, offsets, n2,
        float(w_o.total()[0]),
    )  # fmt: skip


# ---------------------------------------------------------------- pass 2


def _table_labels(values: pd.DataFrame, cells: DomainCells) -> np.ndarray:
    """The label code of each row of a table of cells (recoded keys; -1: not a cell)."""
    at = _lookup(cells.values, values, "domain cell", missing_ok=True)
    return np.where(at >= 0, cells.lab[np.maximum(at, 0)], -1)


def _table_controls(uniq: pd.Series, plan: CalibrationPlan, j: int) -> np.ndarray:
    """The code of each of a control's values among its sorted categories on b2 (-1: none)."""
    table = pd.DataFrame({"v": plan.control_values[j]})
    at = _lookup(table, pd.DataFrame({"v": uniq}), "control category", missing_ok=True)
    return np.where(at >= 0, plan.control_codes[j][np.maximum(at, 0)], -1)


@dataclass(frozen=True)
class ProfileColumns:
    """The columns of one calibration design (controls, then kept domain margins) and the
    number of categories of each on b2 (the mixed radix of the profile keys)."""

    controls: tuple[int, ...]  # indices of creq.controls
    margins: tuple[str, ...]
    sizes: tuple[int, ...]


def profile_columns(
    plan: CalibrationPlan, creq: CalibrationRequest, kept: Sequence[str]
) -> ProfileColumns:
    sizes = [len(c) for c in plan.control_cats]
    sizes += [len(plan.margins[m].b2_labels) for m in kept]
    if np.prod(np.array(sizes, dtype=float)) >= 2.0**62:
        raise PartitionError(
            "stages.massc.calibration: the controls and domain margins have too many profiles "
            "for the calibration by partition; coarsen them, or run the release in memory"
        )
    return ProfileColumns(tuple(range(len(creq.controls))), tuple(kept), tuple(sizes))


def _profile_keys(
    codes: _Codes, creq: CalibrationRequest, plan: CalibrationPlan, cols: ProfileColumns
) -> np.ndarray:
    """Each retained record's calibration profile as a mixed-radix key of its codes (the
    order _design's keys sort in)."""
    parts = []
    for j in cols.controls:
        code, uniq = codes.controls[j]
        parts.append(_table_controls(uniq, plan, j)[code])
    index = {margin_name_of(d): i for i, d in enumerate(creq.domains)}
    for mname in cols.margins:
        code, values, _ = codes.domains[index[mname]]
        lab = _table_labels(values, plan.margins[mname])  # (the table's rows, then records')
        parts.append(np.searchsorted(plan.margins[mname].b2_labels, lab)[code])
    key = np.zeros(len(parts[0]) if parts else 0, dtype=np.int64)
    for code, size in zip(parts, cols.sizes, strict=True):
        if (code < 0).any():
            raise PartitionError("calibration: a retained record's category is not in pass 1's")
        key = key * size + code
    return key


def margin_name_of(dom: Sequence[KeySpec]) -> str:

    return margin_name(dom)


@dataclass
class CalibrationPass2:
    """One partition's sums for the calibrations with the kept margins: the original's label
    totals (weight, replicates) and the retained records' weight and replicate weights by
    local calibration profile."""

    labels: dict[str, dict[str, Any]]
    keys: np.ndarray  # the weight's profiles (distinct keys, sorted)
    wp: BlockPartial
    keys_r: np.ndarray  # the replicates' profiles
    Wp: list[BlockPartial]


def calibration_pass2(
    part: Partition,
    m: MasscInputs,
    creq: CalibrationRequest,
    trs: Sequence[Treated],
    plans: Sequence[CalibrationPlan],
    kepts: Sequence[Sequence[str]],
) -> list[CalibrationPass2]:
    """Pass 2 on one partition, per treatment, for its plan's kept domain margins."""
    reps = list(creq.replicates)
    cols = creq.columns()
    b0, h, _ = _original_rows(part, m, cols)
    n0 = len(b0)
    w_o = b0[creq.weight].to_numpy(dtype=float)
    codes_o = _original_codes(part, m, creq, b0)
    index = {margin_name_of(d): i for i, d in enumerate(creq.domains)}
    codes, df, has_donor = _both_codes(part, m, creq, trs[0].donors, [])
    w = df[creq.weight].to_numpy(dtype=float)
    R_o = b0[reps].to_numpy(dtype=float) if reps else None
    R = _replicates(part, m, creq) if reps else None
    out = []
    for tr, plan, kept in zip(trs, plans, kepts, strict=True):
        keep, at, _ = _treated_rows(part, tr, has_donor)
        c2 = codes.rows(at)
        factor = (1.0 / tr.phi[h])[keep]  # massc_treat's factor of the retained records
        n2, start2 = len(keep), plan.offsets[part.start]
        labels = {}
        for mname in kept:
            cells = plan.margins[mname]
            code, values, _ = codes_o.domains[index[mname]]
            lab = _table_labels(values, cells)[code]
            k = len(cells.cats)
            labels[mname] = {
                "w": _partials(lab, w_o, k, part.start, n0)[0],
                "count": np.bincount(lab, minlength=k),
                "reps": _partials(lab, R_o, k, part.start, n0) if plan.rep_margins else [],
            }
        base = w[keep] * factor
        key = _profile_keys(c2, creq, plan, profile_columns(plan, creq, kept))
        keys, local = dense_codes(key)
        wp = _partials(local.ravel(), base, len(keys), start2, n2)[0]
        keys_r, Wp = np.zeros(0, np.int64), []
        if reps:
            r_kept = kept if plan.rep_margins else []
            key_r = _profile_keys(c2, creq, plan, profile_columns(plan, creq, r_kept))
            keys_r, local_r = dense_codes(key_r)
            Wp = _partials(local_r.ravel(), R, len(keys_r), start2, n2, keep, factor)
        out.append(CalibrationPass2(labels, keys, wp, keys_r, Wp))
    return out


# ---------------------------------------------------------------- the solve on the driver


@dataclass
class CalibrationFactors:
    """The solved calibration: the factors g of the weight's profiles (keys), of each
    replicate's (keys_r, one g per replicate), the kept margins and the report tables."""

    kept: list[str]
    keys: np.ndarray
    g: np.ndarray
    keys_r: np.ndarray
    g_r: list[np.ndarray]
    report: pd.DataFrame | None
    table: pd.DataFrame


def _profile_sums(keyss: Sequence[np.ndarray], partials, n_rows: int):
    keys = np.unique(np.concatenate(keyss)) if keyss else np.zeros(0, np.int64)
    ids = [np.searchsorted(keys, k) for k in keyss]
    return keys, combine_local(partials, ids, len(keys), n_rows)


def _design_of(keys: np.ndarray, plan: CalibrationPlan, creq, cols: ProfileColumns):

    codes, rest = np.empty((len(keys), len(cols.sizes)), dtype=np.int64), keys.copy()
    for j in range(len(cols.sizes) - 1, -1, -1):
        codes[:, j] = rest % cols.sizes[j]
        rest //= cols.sizes[j]
    margins, numeric, categorical = {}, {}, []
    for i, j in enumerate(cols.controls):
        name, cats = creq.controls[j].name, plan.control_cats[j]
        if plan.numeric[j]:  # the profile's value of a numeric total
            numeric[name] = np.asarray(cats, dtype=float)[codes[:, i]]
        else:
            margins[name] = cats
            categorical.append(i)
    for i, mname in enumerate(cols.margins, len(cols.controls)):
        cells = plan.margins[mname]
        margins[mname] = [cells.cats[c] for c in cells.b2_labels]
        categorical.append(i)
    return profile_design(codes[:, categorical], margins, numeric)


@single_blas_thread()  # as the in-memory stage runs (sdl_design.blas)
def calibrate_by_partition(
    plan: CalibrationPlan,
    creq: CalibrationRequest,
    sums: Callable[[list[str]], list[CalibrationPass2]],
    n_rows: int,
    first: list[CalibrationPass2] | None = None,
) -> CalibrationFactors:
    """calibrate_treated's solve on profile sums: the weight to the controls and kept domain
    margins, then every replicate (to its own totals; the margins too when the replicates are
    the original's), a domain dropped (finest first) while either is infeasible. sums(kept):
    pass 2 on every partition for those margins (first: its result for every margin, when
    made already)."""

    reps = list(creq.replicates)
    table = plan.table.copy()
    kept = list(plan.margins)
    margin_totals: dict[str, Any] = {}
    while True:
        got = first if first is not None and len(kept) == len(plan.margins) else sums(kept)
        for mname in kept:
            cells = plan.margins[mname]
            k = len(cells.cats)
            t = combine_local(
                [q.labels[mname]["w"] for q in got], [np.arange(k)] * len(got), k, n_rows
            )
            has = np.sum([q.labels[mname]["count"] for q in got], axis=0) > 0
            margin_totals[mname] = label_totals(cells.cats, t, has)
        totals = {**plan.ctrl, **{mname: margin_totals[mname] for mname in kept}}
        step = "the weight"
        try:
            keys, wp = _profile_sums([q.keys for q in got], [q.wp for q in got], plan.n2)
            cols = profile_columns(plan, creq, kept)
            d = _design_of(keys, plan, creq, cols)
            g = calibrate_profiles(d, wp, totals, creq.method, creq.bounds, explain=not kept)
            g_r, rows, keys_r = [], [], np.zeros(0, np.int64)
            if reps:
                step = "a replicate weight"
                r_kept = kept if plan.rep_margins else []
                per = _replicate_totals(plan, got, r_kept, n_rows)
                keys_r = np.unique(np.concatenate([q.keys_r for q in got]))
                ids = [np.searchsorted(keys_r, q.keys_r) for q in got]
                d_r = _design_of(keys_r, plan, creq, profile_columns(plan, creq, r_kept))
                warm: dict = {}
                for r, c in enumerate(reps):
                    wp_r = combine_local([q.Wp[r] for q in got], ids, len(keys_r), plan.n2)
                    b = creq.bounds
                    g_c, row = replicate_factors(
                        d_r, wp_r, per[r], c, creq.method, b, creq.policy, warm
                    )
                    g_r.append(g_c)
                    rows.append(row)
            break
        except CalibrationInfeasible:
            if not kept:
                raise
            drop_finest(kept, totals, table, step)
    report = pd.DataFrame(rows) if reps else None
    return CalibrationFactors(kept, keys, g, keys_r, g_r, report, table)


def _replicate_totals(
    plan: CalibrationPlan, got: Sequence[CalibrationPass2], kept: Sequence[str], n_rows: int
) -> list[dict[str, Any]]:
    """control_totals of the original's replicate weights: the controls' (pass 1) and the kept
    margins' labels (pass 2)."""
    per = [dict(t) for t in plan.ctrl_reps]
    for mname in kept:
        cells = plan.margins[mname]
        k = len(cells.cats)
        has = np.sum([q.labels[mname]["count"] for q in got], axis=0) > 0
        for r in range(len(per)):
            t = combine_local(
                [q.labels[mname]["reps"][r] for q in got], [np.arange(k)] * len(got), k, n_rows
            )
            per[r][mname] = {cells.cats[j]: float(t[j]) for j in np.flatnonzero(has)}
    return per


# ---------------------------------------------------------------- apply


def calibration_apply(
    part: Partition,
    m: MasscInputs,
    creq: CalibrationRequest,
    tr: Treated,
    plan: CalibrationPlan,
    cal: CalibrationFactors | None,
    folder: str,
) -> dict[str, Any]:
    """The partition's retained records with the calibrated weight w g and replicate weights
    w_r g_r (every column of B(1), in its order), written to folder; the distinct calibration
    and total factors with their counts and the calibrated weight's block sums (the metrics).
    cal None: no control and no margin (weights divided by phi only)."""

    reps = list(creq.replicates)
    b2, factor, b1 = _retained(part, m, tr)
    check_edits(b1, m.spec.edits, "MASSC output", EDIT_HINT)  # B(1), as the frame kernel checks
    w = b2[creq.weight].to_numpy(dtype=float)
    base = w * factor
    out = b2.copy(deep=False)
    both, _, has_donor = _both_codes(part, m, creq, tr.donors, [])
    codes = both.rows(_treated_rows(part, tr, has_donor)[1])
    w_cal = _calibrated_weight(base, codes, creq, plan, cal)
    if cal is None:
        for c in reps:
            out[c] = b2[c].to_numpy(dtype=float) * factor
    else:
        if reps:
            r_kept = cal.kept if plan.rep_margins else []
            key_r = _profile_keys(codes, creq, plan, profile_columns(plan, creq, r_kept))
            at = np.searchsorted(cal.keys_r, key_r)
            for c, g in zip(reps, cal.g_r, strict=True):
                out[c] = (b2[c].to_numpy(dtype=float) * factor) * g[at]
    out[creq.weight] = w_cal
    _write_partition(out, part, folder)
    n2 = len(b2)
    return {
        "adj": np.unique(w_cal / base, return_counts=True),
        "final": np.unique(w_cal / w, return_counts=True),
        "w_cal": _partials(np.zeros(n2, np.int64), w_cal, 1, plan.offsets[part.start], n2)[0],
    }


def _calibrated_weight(
    base: np.ndarray,
    codes: _Codes,
    creq: CalibrationRequest,
    plan: CalibrationPlan,
    cal: CalibrationFactors | None,
) -> np.ndarray:
    """w/phi g of the retained records (base: w/phi; codes: theirs; cal None: w/phi)."""
    if cal is None:
        return base
    key = _profile_keys(codes, creq, plan, profile_columns(plan, creq, cal.kept))
    return base * cal.g[np.searchsorted(cal.keys, key)]


def _replication_terms(data: dict[str, Any], zvars: Any, n_h: int, n_psu: int):
    """The sums of the study totals of B(2) at the calibrated weight (treated_totals)."""
    t = data["t"]  # TreatedParts: one study variable's values at a time
    yield from zvars.total_terms(t.y, t.d, data["w"])


def replication_totals(
    part: Partition,
    m: MasscInputs,
    creq: CalibrationRequest,
    trs: Sequence[Treated],
    plans: Sequence[CalibrationPlan],
    cals: Sequence[CalibrationFactors | None],
    zvars: Any,
) -> list[Any]:
    """Each replication's study totals on the partition (massc_replications' treated_totals):
    B(2)'s study values and domains (the substituted records' from tilde) at the calibrated
    weight, in block sums over the retained records."""

    spec, req = m.spec, m.req
    keys = [k.name for k in req.keys]
    extra = list(dict.fromkeys([req.weight, *req.study, *keys]))
    codes, _, has_donor = _both_codes(part, m, creq, trs[0].donors, [])
    df = read_partition(part, extra, spec)
    tilde = _tilde(part, spec, req, trs[0].donors, df.index)
    parts = ZParts.of(df, tilde, zvars)
    _, h, _ = _original_rows(part, m)
    w = df[creq.weight].to_numpy(dtype=float)
    out = []
    for tr, plan, cal in zip(trs, plans, cals, strict=True):
        rows, at, d1 = _treated_rows(part, tr, has_donor)
        base = w[rows] * (1.0 / tr.phi[h])[rows]
        w_cal = _calibrated_weight(base, codes.rows(at), creq, plan, cal)
        bundle = {"t": parts.treated(d1, rows), "w": w_cal}
        start2 = plan.offsets[part.start]
        out.append(
            _partial_sums(
                start2, len(rows), [bundle], [_replication_terms], zvars, 0, 0, np.zeros(0)
            )
        )
    return out


def replication_totals_of(zvars: Any, n2: int) -> BlockTotals:
    """The study totals of one replication as its partitions' partials arrive (totals_from
    of its totals(): the order of zvars.labels)."""
    return BlockTotals([_replication_terms], zvars, 0, 0, n2)


def weight_only(creq: CalibrationRequest) -> CalibrationRequest:
    """The calibration of the weight alone (the replications')."""
    return replace(creq, replicates=())


def replication_request(creq: CalibrationRequest, table: pd.DataFrame) -> CalibrationRequest:
    """The replications' Step IV (replication_plan's): the weight only, to the controls and
    the declared domains that the release treatment's weight-only calibration keeps (table:
    its calibration_domains)."""
    status = table.set_index("domain")["status"]
    kept = tuple(
        d for d in creq.domains if not status[" x ".join(k.name for k in d)].startswith("dropped")
    )
    return replace(creq, replicates=(), domains=kept)


def replication_generator(spec: ReleaseSpec, r: int) -> np.random.Generator:
    """Replication r's Generator (massc_replications': replication_seed of the release seed)."""

    return np.random.default_rng(
        replication_seed(release_seed(spec.release.seed, spec.release.year), r)
    )


def replication_epsilon(
    estimates: Sequence[np.ndarray], truth: np.ndarray, zvars: Any
) -> tuple[float, pd.DataFrame]:
    """The empirical epsilon over the replications and its table (massc_epsilon's)."""

    labels = [tuple(x) for x in zvars.labels]
    return epsilon_from_replications(np.vstack(estimates), truth, labels)


def calibration_summary(
    plan: CalibrationPlan,
    creq: CalibrationRequest,
    cal: CalibrationFactors | None,
    applied: Sequence[dict[str, Any]],
) -> tuple[dict[str, pd.DataFrame], dict[str, float]]:
    """calibrate_treated's tables and metrics from the solve and the partitions' factors."""

    tables: dict[str, pd.DataFrame] = {}
    metrics: dict[str, float] = {}
    table = plan.table if cal is None else cal.table
    if creq.domains:
        tables["calibration_domains"] = table
    if cal is not None:
        if cal.report is not None:
            tables["replicate_calibration"] = cal.report
        metrics["calibration_domains_kept"] = float(len(cal.kept))
        reps = creq.replicates and plan.rep_margins
        metrics["calibration_replicate_domains"] = float(len(cal.kept) if reps else 0)
    if creq.domains:
        metrics.update(domain_metrics(table))
    acc = BlockAccumulator(1, plan.n2)
    for a in applied:
        acc.add(a["w_cal"])
    summary = weight_factors(
        [a["adj"] for a in applied],
        [a["final"] for a in applied],
        float(acc.total()[0]),
        plan.w_o_total,
    )
    tables["weight_factors"] = summary.pop("table")
    metrics.update(summary)
    return tables, metrics
