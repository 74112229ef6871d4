"""Partitioned statistics: the pieces of a release that decompose over records, as map and
reduce functions on the partitions of a Parquet input (its row groups), so a file larger than
one process's memory is read a partition at a time, in one process or on Dask workers
(flows/scan.py runs them; only small aggregates come back to the driver).

- plan_partitions / read_partition: row groups in file order (a folder's files one after
  the other), a partition of an input longer than a block of sdl_design.survey.blocksum ending at a
  block boundary (none then begins inside a block); every record keeps its global row
  number; columns are typed as read_input types them.
- Key-profile counts (risk strata U/D/T/O, paper 000 section 2.3): the distinct recoded key
  profiles with their counts and first record, numbered in first-appearance order as
  risk.profile_codes numbers them; profile_sizes gives each record its cell count.
- Edit-rule failures: each rule's failing count and first failing rows (sdl_design.edits).
- Domain means with Taylor SE, deff and replicate SE: pass 1 sums w y, w and the replicate
  totals by cell (one sort of a partition's records by cell, one product per cell); pass 2
  the PSU totals of the linearized scores w (y - R n) / X centred on pass 1's estimates; the
  variances come from SurveyDesign's own kernel on a one-row-per-PSU design.
Every variable is a ratio of sum w y 1{y observed} to sum w 1{y observed} (a missing value
takes its record out of that variable's mean, as utility.domain_mean_se does).
Reductions add partials in partition order: a plan's results do not depend on where or in
which order its partitions ran.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from itertools import groupby
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd

from sdl_design.blas import single_blas_thread
from sdl_design.edits import check_edits, combine_rule_failures, rule_failures
from sdl_design.io import parquet_options, type_input
from sdl_design.keys import key_levels
from sdl_design.massc.common import _codes
from sdl_design.massc.common import _combine as _combine_codes
from sdl_design.massc.donors import donor_ranks, donor_search, search_profiles, search_values
from sdl_design.massc.measures import appearance_table, information_loss
from sdl_design.massc.moments import (
    StudyVariables,
    ZMoments,
    ZParts,
    _Bins,
    moment_terms,
    moments_of,
)
from sdl_design.massc.rates import optimal_phi, optimal_psi
from sdl_design.massc.stage import massc_config
from sdl_design.massc.treatment import cost_from, systematic_hits
from sdl_design.prb import (
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
from sdl_design.risk import (
    STRATA,
    _combine,
    _distance_matrix,
    _label,
    _sensitive_codes,
    cell_metrics,
    fit_table,
    interaction_pairs,
    profile_eta_zeta,
    table_cells,
    unique_risk,
)
from sdl_design.spec import KeySpec, SensitiveSpec
from sdl_design.survey import blocksum
from sdl_design.survey.blocksum import BlockAccumulator, BlockPartial
from sdl_design.survey.design import (
    SurveyDesign,
    block_view,
    dense_codes,
    first_of,
    group_indicator,
    resolve_replicates,
    sparse_times,
    take_rows,
)
from sdl_design.survey.exactsum import add_limbs_at
from sdl_design.swap import (
    Masking,
    SegmentDesign,
    SegmentPass1,
    aggregates_from_sums,
    apply_masking,
    combine_segment_pass1,
    matching_variance,
    plan_counts,
    plan_masking,
    segment_design,
    segment_pass1,
    segment_pass2,
    swap_pairs,
)

if TYPE_CHECKING:
    from sdl_design.spec import ReleaseSpec


class PartitionError(ValueError):
    """A partitioned input or request that cannot be read; the message names the fix."""


# ---------------------------------------------------------------- partitions


@dataclass(frozen=True)
class Piece:
    """The records of one Parquet file in a partition: its row groups, read from the skip-th
    record of the first of them (a row group cut at a block boundary), `rows` records."""

    path: str
    row_groups: tuple[int, ...]
    skip: int
    rows: int


@dataclass(frozen=True)
class Partition:
    """The records start..stop-1 of the input: pieces of one or more consecutive files."""

    pieces: tuple[Piece, ...]
    start: int
    stop: int


def _files(path: Path) -> list[Path]:
    if path.is_dir():
        files = sorted(path.glob("*.parquet"))
        if not files:
            raise PartitionError(f"release.input: no .parquet file in the folder {path}")
        return files
    if not path.is_file() or path.suffix.lower() != ".parquet":
        raise PartitionError(
            f"release.input: {path} is not a Parquet file or a folder of them; the partitioned "
            "path reads Parquet row groups (convert a CSV with pyarrow or pandas first)"
        )
    return [path]


def input_columns(path: str | Path) -> list[str]:
    """The input's column names (every file of a folder must have the same ones, of the same
    types: a partition may read two files as one)."""
    import pyarrow.parquet as pq

    files = _files(Path(path))
    first = pq.read_schema(files[0])
    names = list(first.names)
    for f in files[1:]:
        schema = pq.read_schema(f)
        other = list(schema.names)
        if other != names:
            raise PartitionError(
                f"release.input: {f.name} has columns {other[:6]}..., {files[0].name} has "
                f"{names[:6]}...; every file of the folder needs the same columns"
            )
        for a, b in zip(first, schema, strict=True):
            if a.type != b.type:
                raise PartitionError(
                    f"release.input: column {a.name} is {a.type} in {files[0].name} and "
                    f"{b.type} in {f.name}; write every file of the folder with the same "
                    "schema (e.g. pyarrow.parquet.write_table(table.cast(schema), path))"
                )
    return names


def plan_partitions(path: str | Path, n: int | None = None) -> list[Partition]:
    """The input (a Parquet file, or a folder of them read in name order as one file) as
    about n partitions of consecutive records with about equal counts (n None: one per row
    group). A partition ends where a row group ends; in an input longer than a block of
    blocksum.BLOCK records that end moves to the nearest multiple of the block (partitions
    whose ends meet are one), so no partition begins inside a block and the driver receives
    block sums only, not a block's terms. A partition may span files."""
    import pyarrow.parquet as pq

    files = _files(Path(path))
    input_columns(path)
    units = []  # (file, row group, rows, its first record in the input)
    at = 0
    for f in files:
        md = pq.ParquetFile(f).metadata
        for i in range(md.num_row_groups):
            r = md.row_group(i).num_rows
            if r > 0:
                units.append((str(f), i, r, at))
                at += r
    if not units:
        raise PartitionError(f"release.input: {path} holds no records")
    total = at
    every = n is None  # one per row group (a stage's folder: the partitions it was written in)
    n = len(units) if n is None else max(1, min(int(n), len(units)))
    ends, rows = [], 0
    for j, (_, _, r, _) in enumerate(units):
        rows += r
        # close at every row group, at the next multiple of total / n records, or at the end
        if every or j + 1 == len(units) or rows * n >= total * (len(ends) + 1):
            ends.append(rows)
    ends = _block_aligned(ends)
    firsts = [u[3] for u in units]
    parts, start = [], 0
    for stop in ends:  # the row groups holding records start..stop-1, by file
        mine = units[bisect_right(firsts, start) - 1 : bisect_left(firsts, stop)]
        pieces = []
        for f, group in groupby(mine, key=lambda u: u[0]):
            group = list(group)
            a, b = max(start, group[0][3]), min(stop, group[-1][3] + group[-1][2])
            pieces.append(Piece(f, tuple(u[1] for u in group), a - group[0][3], b - a))
        parts.append(Partition(tuple(pieces), start, stop))
        start = stop
    return parts


def _block_aligned(ends: list[int]) -> list[int]:
    """The partitions' ends (the last the input's) moved to the nearest multiple of
    blocksum.BLOCK, ends that meet merged; kept as they are in an input of at most one block
    (its partitions send that block's terms, at most BLOCK records')."""
    B, total = blocksum.BLOCK, ends[-1]
    if total <= B:
        return ends
    moved = sorted({(e + B // 2) // B * B for e in ends[:-1]} - {0})
    return [e for e in moved if e < total] + [total]


def read_partition(
    part: Partition, columns: Sequence[str] | None, spec: ReleaseSpec | None = None
) -> pd.DataFrame:
    """The partition's records (index: global row numbers), typed as read_input types a
    Parquet file when a spec is given (its declared missing codes read along)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    files = [pq.ParquetFile(piece.path) for piece in part.pieces]
    cols = None if columns is None else list(dict.fromkeys(columns))
    if spec is not None and cols is not None:  # every file has the same columns
        have = set(files[0].schema_arrow.names)
        cols += [c for c in spec.variables.missing if c in have and c not in cols]
    tables = []
    for pf, piece in zip(files, part.pieces, strict=True):
        table = pf.read_row_groups(list(piece.row_groups), columns=cols)
        if piece.skip or table.num_rows != piece.rows:  # row groups cut at a block
            table = table.slice(piece.skip, piece.rows)
        tables.append(table)
    table = tables[0] if len(tables) == 1 else pa.concat_tables(tables)
    df = table.to_pandas()
    df.index = pd.RangeIndex(part.start, part.stop)
    if spec is None:
        return df

    return type_input(df, spec, text=False)


# ---------------------------------------------------------------- key profiles


def _specs(keys: Sequence[KeySpec | str]) -> list[KeySpec]:
    return [KeySpec(name=k) if isinstance(k, str) else k for k in keys]


SENS = "__s:"  # prefix of a profile table's columns of sensitive-category counts


def profile_counts(
    df: pd.DataFrame,
    keys: Sequence[KeySpec | str],
    weight: str | None = None,
    sensitive: Sequence[SensitiveSpec] = (),
) -> pd.DataFrame:
    """The distinct recoded key profiles of df (one row each, in first-appearance order): the
    keys' labels, `count` (records), `first` (index label of the first record), with a weight
    `wsum` (sum of weights) and, per sensitive variable and category, the records'
    count (columns '__s:<name>=<category>')."""
    specs = _specs(keys)
    per = [key_levels(df[k.name], k) for k in specs]
    g = _combine([c for c, _ in per], [len(lv) for _, lv in per])  # first-appearance codes
    G = int(g.max()) + 1 if len(g) else 0
    first = first_of(g, G)
    out = {k.name: lv[c[first]] for k, (c, lv) in zip(specs, per, strict=True)}
    out["count"] = np.bincount(g, minlength=G).astype(np.int64)
    out["first"] = df.index.to_numpy()[first].astype(np.int64)
    if weight is not None:
        out["wsum"] = np.bincount(g, df[weight].to_numpy(dtype=float), G)
    for s in sensitive:
        c, cats = _sensitive_codes(df, s)  # every category must have a score (RiskInputError)
        q = len(cats)
        counts = np.bincount(g * q + c, minlength=G * q).reshape(G, q)
        for j, cat in enumerate(cats):
            out[f"{SENS}{s.name}={cat}"] = counts[:, j].astype(np.int64)
    return pd.DataFrame(out)


def _profile_keys(t: pd.DataFrame) -> list[str]:
    return [c for c in t.columns if c not in ("count", "first", "wsum") and not c.startswith(SENS)]


def combine_profiles(partials: Sequence[pd.DataFrame]) -> pd.DataFrame:
    """profile_counts of the whole input from those of its partitions: counts and sums added
    (in partition order), profiles in first-appearance order (by their first record)."""
    t = pd.concat(list(partials), ignore_index=True)
    keys = _profile_keys(t)
    sums = [c for c in t.columns if c not in keys and c != "first"]
    for c in sums:
        if c.startswith(SENS):
            t[c] = t[c].fillna(0).astype(np.int64)  # a category absent from a partition
    agg = {c: (c, "sum") for c in sums} | {"first": ("first", "min")}
    out = t.groupby(keys, sort=False, dropna=False).agg(**agg)
    out = out.reset_index().sort_values("first", kind="stable").reset_index(drop=True)
    return out[keys + ["count", "first"] + [c for c in sums if c != "count"]]


def profile_risk(
    profiles: pd.DataFrame,
    keys: Sequence[KeySpec | str],
    sensitive: Sequence[SensitiveSpec] = (),
    loglinear: bool = True,
    interactions: bool | Sequence[tuple[str, str]] = False,
) -> dict[str, float]:
    """risk_profile's metrics (uniques, doubles, triples; GenMASSC scores, paper 000 eq. 1-2;
    pseudo-ML log-linear tau1, tau2, paper 001 eq. 4 and 7) from the whole input's profile
    table (combine_profiles, with wsum when loglinear), without the records."""
    names = [k.name for k in _specs(keys)]
    m = profiles["count"].to_numpy()
    n = int(m.sum())
    out = cell_metrics(n, len(m), np.bincount(np.minimum(m, 4), weights=m, minlength=5))
    if sensitive:
        r = profile_scores(profiles, sensitive)
        out.update(
            mean_score=float((m * r).sum() / n),
            max_score=float(r.max()),
            n_score_1=float(m[r >= 1.0 - 1e-12].sum()),
        )
    if loglinear:
        # each key's levels in first-appearance order (profiles are), as risk._key_codes has them
        per = [pd.factorize(profiles[k], use_na_sentinel=False) for k in names]
        sizes = [len(u) for _, u in per]
        pairs = interaction_pairs(names, interactions)
        cell = table_cells([c.astype(np.int64) for c, _ in per], sizes)
        k_all = int(np.prod(np.array(sizes, dtype=float)))
        f = np.bincount(cell, weights=m, minlength=k_all).astype(np.int64)
        y = np.bincount(cell, weights=profiles["wsum"].to_numpy(), minlength=k_all)
        _, lam_cell, _ = fit_table(f, y, sizes, pairs, None)
        unique = m == 1
        w = np.where(unique, profiles["wsum"].to_numpy(), 1.0)  # a unique's sum is its weight
        p1, e_inv = unique_risk(lam_cell[cell], w, None, unique)
        out.update(tau1=float(np.nansum(p1)), tau2=float(np.nansum(e_inv)))
        out["tau1_share"] = out["tau1"] / n
        out["tau2_share"] = out["tau2"] / n
    return out


def profile_scores(profiles: pd.DataFrame, sensitive: Sequence[SensitiveSpec]) -> np.ndarray:
    """The GenMASSC score r (paper 000, eq. 1-2) of each profile of the whole input's profile
    table (combine_profiles with the sensitive counts): the bits genmassc_scores gives its
    records (the categories in their order of appearance, as there)."""
    m = profiles["count"].to_numpy()
    r = np.zeros(len(m))
    pair_norm = np.where(m >= 2, 2.0 * m * (m - 1.0), np.inf)
    for s in sensitive:
        cols = [c for c in profiles.columns if c.startswith(f"{SENS}{s.name}=")]
        cats = [c.removeprefix(f"{SENS}{s.name}=") for c in cols]
        nc = profiles[cols].to_numpy(dtype=float)
        table = {_label(k): float(v) for k, v in s.sensitivity.items()}
        lam = _distance_matrix(s.name, cats, None)
        scores = np.array([table[c] for c in cats])
        eta, zeta = profile_eta_zeta(nc, m.astype(float), scores, lam, pair_norm)  # eq. 1
        r = np.maximum(r, (1.0 - eta) * zeta)  # eq. 2
    return r


def strata_counts(profiles: pd.DataFrame) -> pd.Series:
    """Records in each risk stratum U/D/T/O (cells of 1, 2, 3, 4+ records)."""
    n = profiles["count"].to_numpy()
    s = np.minimum(n, 4) - 1
    return pd.Series(np.bincount(s, weights=n, minlength=4).astype(np.int64), index=list(STRATA))


def profile_sizes(
    df: pd.DataFrame, keys: Sequence[KeySpec | str], profiles: pd.DataFrame
) -> np.ndarray:
    """Each record's cell count in the whole input (profiles: combine_profiles)."""
    return profiles["count"].to_numpy(dtype=np.int64)[profile_rows(df, keys, profiles)]


def profile_rows(
    df: pd.DataFrame,
    keys: Sequence[KeySpec | str],
    profiles: pd.DataFrame,
    missing_ok: bool = False,
) -> np.ndarray:
    """The row of each record's key profile in the whole input's table (combine_profiles);
    -1 for a profile not in it when missing_ok."""
    specs = _specs(keys)
    names = [k.name for k in specs]
    labels = {}
    for k in specs:
        c, lv = key_levels(df[k.name], k)
        labels[k.name] = pd.Series(lv[c], dtype=object)
    table = profiles[names].assign(__row=np.arange(len(profiles)))
    m = pd.DataFrame(labels).merge(table, on=names, how="left", sort=False)
    if len(m) != len(df):  # (validate="many_to_one" took half the time)
        raise PartitionError("profiles: a key profile is in the table given more than once")
    if missing_ok:
        return m["__row"].fillna(-1).to_numpy(dtype=np.int64)
    if m["__row"].isna().any():
        raise PartitionError("profiles: a record's key profile is not in the table given")
    return m["__row"].to_numpy(dtype=np.int64)


# ---------------------------------------------------------------- domain means and their SEs


@dataclass(frozen=True)
class MeansRequest:
    """Means of `variables` overall and in each domain (a tuple of columns whose labels are
    crossed: 'a:b'), under the design columns; keys: recodes of domain columns that are keys
    (their published labels, as broad_characteristics labels them)."""

    variables: tuple[str, ...]
    domains: tuple[tuple[str, ...], ...]
    weight: str
    strata: str | None
    psu: str
    replicate_weights: tuple[str, ...] = ()
    method: str | None = None
    rho: float | None = None
    keys: tuple[KeySpec, ...] = field(default=())

    @property
    def columns(self) -> list[str]:
        """The columns pass 1 reads (pass 2: all but the replicate weights)."""
        dom = [c for d in self.domains for c in d]
        design = [c for c in (self.weight, self.strata, self.psu) if c]
        return list(dict.fromkeys([*design, *self.variables, *dom, *self.replicate_weights]))

    def codes(self, df: pd.DataFrame, column: str) -> tuple[np.ndarray, np.ndarray]:
        """(codes, labels) of a domain column: each record's label as labels[codes] (text;
        code -1 where missing), a key's as its published coding (key_levels)."""
        key = next((k for k in self.keys if k.name == column), None)
        if key is not None:
            c, lv = key_levels(df[column], key)
        else:
            c, lv = pd.factorize(df[column], use_na_sentinel=True)
        return c.astype(np.int64), np.array([str(v) for v in lv], dtype=object)

    def domain_codes(self, df: pd.DataFrame) -> list[tuple[np.ndarray, np.ndarray]]:
        """Per domain: (codes, labels) of the records' levels, crossings' labels joined by
        ':' (code -1: the record is in no level); only the labels present are listed."""
        cache = {c: self.codes(df, c) for d in self.domains for c in d}
        out = []
        for d in self.domains:
            code, lab = cache[d[0]]
            for c in d[1:]:
                oc, ol = cache[c]
                pair = np.where((code < 0) | (oc < 0), -1, code * len(ol) + oc)
                lab = (lab[:, None] + ":" + ol[None, :]).ravel()
                code = pair
            present, dense = dense_codes(np.where(code < 0, len(lab), code))
            keep = present < len(lab)  # the last code is "no level" when some record has it
            code = np.where(code < 0, -1, dense)
            out.append((code, lab[present[keep]]))
        return out


def _observed(df: pd.DataFrame, req: MeansRequest) -> tuple[np.ndarray, np.ndarray]:
    """(y0, nn): the variables with missing values as 0, and the 1{observed} indicators."""
    Y = np.column_stack(
        [df[c].to_numpy(dtype=float, na_value=np.nan) for c in req.variables]
    ).reshape(len(df), -1)
    seen = ~np.isnan(Y)
    return np.where(seen, Y, 0.0), seen.astype(float)


def _psu_keys(df: pd.DataFrame, req: MeansRequest) -> tuple[np.ndarray, pd.DataFrame]:
    """Each record's PSU code within the partition and the PSUs' (stratum, psu) labels."""
    p = df[req.psu].to_numpy()
    h = df[req.strata].to_numpy() if req.strata else np.zeros(len(df), dtype=np.int64)
    if pd.isna(p).any() or pd.isna(h).any():
        raise PartitionError("design: a record has no stratum or PSU; every record needs both")
    hc, hu = pd.factorize(h)
    pc, pu = pd.factorize(p)
    code, pair = pd.factorize(hc.astype(np.int64) * len(pu) + pc)
    keys = pd.DataFrame({"stratum": hu[pair // len(pu)], "psu": pu[pair % len(pu)]})
    return code.astype(np.int64), keys


@dataclass
class MeansPass1:
    """Sums of one partition (or of several, combined): PSUs, and per domain its levels with
    records n, sum w, sum w nn (X), sum w y0 (Y) and the replicate totals XR, YR (R x L x k)."""

    psus: pd.DataFrame  # stratum, psu: one row per PSU
    psu_w: np.ndarray  # P: sum of w
    psu_W: np.ndarray  # P x R: sums of the replicate weights
    levels: list[np.ndarray]
    n: list[np.ndarray]
    Wd: list[np.ndarray]
    X: list[np.ndarray]
    Y: list[np.ndarray]
    XR: list[np.ndarray]
    YR: list[np.ndarray]


def means_pass1(df: pd.DataFrame, req: MeansRequest) -> MeansPass1:
    """Pass 1 of domain means on one partition: the sums above, by the levels it holds."""
    w = df[req.weight].to_numpy(dtype=float)
    if not (w > 0).all():
        raise PartitionError(f"design.weight: column '{req.weight}' has weights <= 0 or missing")
    y0, nn = _observed(df, req)
    k = y0.shape[1]
    R = len(req.replicate_weights)
    W = block_view(df, req.replicate_weights) if R else np.zeros((len(df), 0))
    if W is None:  # records x replicates, column-major, filled a column at a time
        W = np.empty((len(df), R), order="F")
        for j, c in enumerate(req.replicate_weights):
            W[:, j] = df[c].to_numpy(dtype=float)
    g, psus = _psu_keys(df, req)
    P = len(psus)
    psu_w = np.bincount(g, w, P)
    psu_W = sparse_times(group_indicator(g, P), W) if R else np.zeros((P, 0))
    per = req.domain_codes(df)
    # cells: the crossing of every domain's level (a domain's level is a union of cells)
    codes = [c + 1 for c, _ in per]  # 0: no level
    cell = _combine(codes, [len(u) + 1 for _, u in per]) if per else np.zeros(len(df), np.int64)
    C = int(cell.max()) + 1 if len(cell) else 0
    first = first_of(cell, C)
    wy, wn = w[:, None] * y0, w[:, None] * nn
    n_c = np.bincount(cell, minlength=C).astype(float)
    W_c = np.bincount(cell, w, C)
    X_c = group_indicator(cell, C) @ wn
    Y_c = group_indicator(cell, C) @ wy
    XR_c, YR_c = np.zeros((C, R, k)), np.zeros((C, R, k))
    if R:  # one sort by cell, then one product per cell: W_c' [y0 nn]
        order = np.argsort(cell, kind="stable")
        bounds = np.searchsorted(cell[order], np.arange(C + 1))
        Ws, Ys = take_rows(W, order), np.hstack([y0, nn])[order]
        for c in range(C):
            a, b = bounds[c], bounds[c + 1]
            t = Ws[a:b].T @ Ys[a:b]  # R x 2k
            YR_c[c], XR_c[c] = t[:, :k], t[:, k:]
    out = MeansPass1(psus, psu_w, psu_W, [], [], [], [], [], [], [])
    every = [(np.array(["all"], dtype=object), None)] + [
        (u, cd) for (_, u), cd in zip(per, codes, strict=True)
    ]
    for u, cd in every:
        lv = np.zeros(C, np.int64) if cd is None else cd[first] - 1  # each cell's level
        L = len(u)
        on = lv >= 0
        lvs = lv[on]
        out.levels.append(np.asarray(u, dtype=object))
        out.n.append(np.bincount(lvs, n_c[on], L))
        out.Wd.append(np.bincount(lvs, W_c[on], L))
        out.X.append(_sum_by(lvs, X_c[on], L))
        out.Y.append(_sum_by(lvs, Y_c[on], L))
        out.XR.append(_sum_by(lvs, XR_c[on], L).transpose(1, 0, 2))
        out.YR.append(_sum_by(lvs, YR_c[on], L).transpose(1, 0, 2))
    return out


def _sum_by(codes: np.ndarray, a: np.ndarray, L: int) -> np.ndarray:
    """Sums of the rows of a (m x ...) by codes 0..L-1, added in row order."""
    if not len(codes):
        return np.zeros((L, *a.shape[1:]))
    flat = sparse_times(group_indicator(codes, L), a.reshape(len(codes), -1))  # as np.add.at
    return flat.reshape(L, *a.shape[1:])


def combine_pass1(partials: Sequence[MeansPass1]) -> MeansPass1:
    """MeansPass1 of the whole input: PSUs sorted by (stratum, psu), levels sorted, partials
    added in partition order."""
    psus = (
        pd.concat([p.psus for p in partials], ignore_index=True)
        .drop_duplicates()
        .sort_values(["stratum", "psu"], kind="stable")
        .reset_index(drop=True)
    )
    index = pd.MultiIndex.from_frame(psus)
    R = partials[0].psu_W.shape[1]
    psu_w, psu_W = np.zeros(len(psus)), np.zeros((len(psus), R))
    for p in partials:
        at = index.get_indexer(pd.MultiIndex.from_frame(p.psus))
        psu_w[at] += p.psu_w
        psu_W[at] += p.psu_W
    out = MeansPass1(psus, psu_w, psu_W, [], [], [], [], [], [], [])
    for d in range(len(partials[0].levels)):
        lv = np.array(sorted({str(v) for p in partials for v in p.levels[d]}), dtype=object)
        L = len(lv)
        sums = {a: None for a in ("n", "Wd", "X", "Y", "XR", "YR")}
        for p in partials:
            at = np.searchsorted(lv, np.asarray([str(v) for v in p.levels[d]], dtype=object))
            for a in sums:
                v = getattr(p, a)[d]
                axis = 1 if a in ("XR", "YR") else 0
                if sums[a] is None:
                    shape = list(v.shape)
                    shape[axis] = L
                    sums[a] = np.zeros(shape)
                if axis:
                    sums[a][:, at] += v
                else:
                    sums[a][at] += v
        out.levels.append(lv)
        for a, v in sums.items():
            getattr(out, a).append(v)
    return out


def ratios(pass1: MeansPass1) -> list[np.ndarray]:
    """Per domain: the estimates R = Y / X (L x k) that pass 2 centres on."""
    with np.errstate(divide="ignore", invalid="ignore"):
        return [Y / X for Y, X in zip(pass1.Y, pass1.X, strict=True)]


@dataclass
class MeansPass2:
    """PSU x level totals of w (y0 - R nn) by domain (PSU labels, level, k sums) and the sums
    of w (y0 - R nn)^2 by level (L x k)."""

    psus: list[pd.DataFrame]
    level: list[np.ndarray]
    zt: list[np.ndarray]
    ss: list[np.ndarray]


def means_pass2(
    df: pd.DataFrame, req: MeansRequest, levels: list[np.ndarray], R: list[np.ndarray]
) -> MeansPass2:
    """Pass 2 on one partition: the centred PSU totals (levels, R: of the whole input)."""
    w = df[req.weight].to_numpy(dtype=float)
    y0, nn = _observed(df, req)
    g, psus = _psu_keys(df, req)
    out = MeansPass2([], [], [], [])
    every = [(np.zeros(len(df), np.int64), np.array(["all"], dtype=object))]
    for (local, lab), lv, Rd in zip(every + req.domain_codes(df), levels, R, strict=True):
        L = len(lv)
        at = np.searchsorted(lv, lab)  # the partition's levels among the whole input's
        if len(lab) and (at.max() >= L or (lv[at] != lab).any()):
            raise PartitionError("levels: a partition has a domain level pass 1 did not see")
        on = local >= 0
        code = np.where(on, at[local], -1) if len(lab) else local
        rows = np.flatnonzero(on)
        cd = code[rows]
        c = y0[rows] - Rd[cd] * nn[rows]  # y - R n (eq. of the ratio's linearization)
        wc = w[rows, None] * c
        pair, of = dense_codes(g[rows] * L + cd)
        out.psus.append(psus.iloc[pair // L].reset_index(drop=True))
        out.level.append(pair % L)
        out.zt.append(group_indicator(of, len(pair)) @ wc)
        out.ss.append(_sum_by(cd, wc * c, L))
    return out


def domain_means(req: MeansRequest, pass1: MeansPass1, pass2: Sequence[MeansPass2]) -> pd.DataFrame:
    """The table of estimates, Taylor SE, deff (Kish's with-replacement deff, as
    SurveyDesign.mean) and replicate SE of every variable overall and in every domain level,
    from the combined pass 1 and the partitions' pass 2 (in partition order)."""
    R = len(req.replicate_weights)
    rep = {f"__r{j}": pass1.psu_W[:, j] for j in range(R)}
    frame = pd.DataFrame(
        {"__w": pass1.psu_w, **rep, "__h": pass1.psus["stratum"], "__p": pass1.psus["psu"]}
    )
    design = SurveyDesign(
        frame,
        weight="__w",
        strata="__h",
        psu="__p",
        replicate_weights=list(rep) or None,
        method=req.method if R else None,
        rho=req.rho if R else None,
    )
    index = pd.MultiIndex.from_frame(pass1.psus)
    est_all = ratios(pass1)
    rows = []
    names = ["all"] + [":".join(d) for d in req.domains]
    k = len(req.variables)
    for d, name in enumerate(names):
        lv, L = pass1.levels[d], len(pass1.levels[d])
        zt, ss = np.zeros((len(index), L, k)), np.zeros((L, k))
        for p in pass2:
            at = index.get_indexer(pd.MultiIndex.from_frame(p.psus[d]))
            np.add.at(zt, (at, p.level[d]), p.zt[d])
            ss += p.ss[d]
        X, est = pass1.X[d], est_all[d]
        z = np.empty_like(zt)
        with np.errstate(divide="ignore", invalid="ignore"):
            z[design.g] = zt / X[None]
            var = design.psu_variance(z.reshape(len(index), L * k)).reshape(L, k)
            nd, Wd = pass1.n[d][:, None], pass1.Wd[d][:, None]
            srs = Wd * ss / ((nd - 1.0) * np.square(X))
            deff = np.where(nd > 1, var / srs, np.nan)
            theta_r = pass1.YR[d] / pass1.XR[d]  # R x L x k
        out = {
            "domain": name,
            "level": np.repeat(lv, k),
            "variable": np.tile(np.asarray(req.variables, dtype=object), L),
            "n": np.repeat(pass1.n[d], k).astype(np.int64),
            "estimate": est.ravel(),
            "se": np.sqrt(var).ravel(),
            "deff": deff.ravel(),
        }
        if R:
            dev = theta_r - est[None]
            out["se_rep"] = np.sqrt(np.einsum("r,rlk->lk", design.rscales, dev * dev)).ravel()
        rows.append(pd.DataFrame(out))
    return pd.concat(rows, ignore_index=True)


def means_request(spec: ReleaseSpec, columns: Sequence[str], design: Any = None) -> MeansRequest:
    """The SE request of a spec: its study variables, overall and in its utility domains (keys
    in their published coding), under its design (replicate weights when it has them) or
    `design` (a DesignSection: e.g. the pseudo design a stage built)."""
    d, v = design if design is not None else spec.design, spec.variables
    if not d.psu:
        raise PartitionError(
            "design.psu: the partitioned SEs sum by PSU; give the PSU column (a file without "
            "clusters: a record id column as the PSU)"
        )
    rw = d.replicate_weights
    reps = []
    if rw is not None:
        reps = resolve_replicates(list(columns), rw.columns)
    return MeansRequest(
        variables=tuple(v.study),
        domains=tuple(tuple(x) for x in spec.utility.domain_list(v.key_names)),
        weight=d.weight,
        strata=d.strata,
        psu=d.psu,
        replicate_weights=tuple(reps),
        method=rw.method if reps else None,
        rho=rw.rho if reps else None,
        keys=tuple(v.keys),
    )


def scan_columns(spec: ReleaseSpec, req: MeansRequest) -> list[str]:
    """The columns pass 1 of a scan reads: keys, sensitive variables, the edit rules' columns,
    the request's."""
    keys = spec.variables.key_names
    sensitive = [x.name for x in spec.variables.sensitive]
    edits = [c for r in spec.edits for c in r.columns()]
    return list(dict.fromkeys([*keys, *sensitive, *edits, *req.columns]))


@dataclass
class ScanPartial:
    """What pass 1 of a scan returns for one partition: small aggregates only."""

    records: int
    profiles: pd.DataFrame
    edits: list
    means: MeansPass1


def scan_pass1(part: Partition, spec: ReleaseSpec, req: MeansRequest) -> ScanPartial:
    """Pass 1 of a scan on one partition (read here: a worker reads its own partition). One
    BLAS thread: the sums are the same whichever process or thread count runs it."""
    df = read_partition(part, scan_columns(spec, req), spec)
    with single_blas_thread():
        return ScanPartial(
            records=len(df),
            profiles=profile_counts(
                df, spec.variables.keys, spec.design.weight, spec.variables.sensitive
            ),
            edits=rule_failures(df, spec.edits),
            means=means_pass1(df, req),
        )


def scan_pass2(
    part: Partition, spec: ReleaseSpec, req: MeansRequest, levels: list, R: list
) -> MeansPass2:
    """Pass 2 of a scan on one partition (reads the design and study columns again)."""
    cols = [c for c in req.columns if c not in set(req.replicate_weights)]
    df = read_partition(part, cols, spec)
    with single_blas_thread():
        return means_pass2(df, req, levels, R)


def scan_risk(spec: ReleaseSpec, profiles: pd.DataFrame) -> dict[str, float]:
    """The risk stage's metrics of the whole input from its profile table (the spec's risk
    section: log-linear model and interactions; GenMASSC scores over its sensitive variables)."""
    section = spec.stages.risk
    v = spec.variables
    return profile_risk(
        profiles,
        v.keys,
        v.sensitive,
        loglinear=section.loglinear,
        interactions=section.interactions or False,
    )


def combine_scan(partials: Sequence[ScanPartial]) -> dict[str, Any]:
    """The whole input's records, profiles, edit failures and pass 1 sums."""
    return {
        "records": sum(p.records for p in partials),
        "profiles": combine_profiles([p.profiles for p in partials]),
        "edits": combine_rule_failures([p.edits for p in partials]),
        "means": combine_pass1([p.means for p in partials]),
    }


# ---------------------------------------------------------------- segment swap (paper 003)


@dataclass(frozen=True)
class SwapRequest:
    """The swap of a spec on a partitioned input: its design columns (dc, as
    swap.design_columns gives them) and its stages.swap section."""

    dc: dict
    matching: tuple[str, ...]
    section: Any

    @property
    def columns(self) -> list[str]:
        """The columns passes 1 and 2 read."""
        d = self.dc
        design = [d["weight"], d["strata"], d["psu"], d["segment"]]
        return list(dict.fromkeys([*design, *self.matching]))


def swap_request(spec: ReleaseSpec, columns: Sequence[str]) -> SwapRequest:
    """The spec's swap (its design's replicate weights resolved on the input's columns)."""

    section = spec.stages.active("swap")
    if section is None:
        raise PartitionError("stages.swap: the spec has no active swap stage; enable it")
    d = spec.design
    if not (d.strata and d.psu and d.segment):
        raise PartitionError(
            "design.strata, design.psu, design.segment: the swap moves segments between PSUs "
            "within strata; give all three columns"
        )
    rs = d.replicate_weights
    reps = resolve_replicates(list(columns), rs.columns) if rs else []
    dc = {
        "weight": d.weight,
        "strata": d.strata,
        "psu": d.psu,
        "segment": d.segment,
        "replicate_weights": reps,
        "method": rs.method if reps else None,
        "rho": rs.rho if reps else None,
    }
    return SwapRequest(dc, tuple(section.matching), section)


def swap_pass1(part: Partition, spec: ReleaseSpec, req: SwapRequest) -> SegmentPass1:
    """Pass 1 of the swap on one partition: its segments with their stratum and PSU, and the
    bounds of the sums' terms (swap.segment_pass1)."""
    d = req.dc
    df = read_partition(part, req.columns, spec)
    return segment_pass1(df, d["weight"], d["strata"], d["psu"], d["segment"], req.matching)


def swap_pass2(
    part: Partition, spec: ReleaseSpec, req: SwapRequest, design: SegmentDesign
) -> tuple[np.ndarray, np.ndarray]:
    """Pass 2 on one partition: exact limb sums of w and w x by segment (swap.segment_pass2)
    for the segments it has (their indices, and the limbs: small beside all segments')."""
    d = req.dc
    df = read_partition(part, req.columns, spec)
    codes = pd.Index(design.segment_labels).get_indexer(df[d["segment"]])
    if (codes < 0).any():
        raise PartitionError(f"design.segment: a '{d['segment']}' label is not in pass 1's table")
    present, local = np.unique(codes, return_inverse=True)
    limbs = segment_pass2(df, d["weight"], d["segment"], req.matching, design, local, len(present))
    return present, limbs


def swap_design(partials: Sequence[SegmentPass1], req: SwapRequest) -> SegmentDesign:
    """The whole input's segments, PSUs and strata and the grids of pass 2's exact sums."""
    return segment_design(combine_segment_pass1(partials), req.matching)


@single_blas_thread()  # as the in-memory stage runs (sdl_design.blas)
def swap_masking(
    req: SwapRequest,
    design: SegmentDesign,
    partials: Sequence[tuple[np.ndarray, np.ndarray]],
    rng: np.random.Generator,
) -> tuple[Masking, dict[str, Any], dict[str, pd.DataFrame]]:
    """On the driver, from pass 2's segment sums alone: the swaps, the pseudo labels and the
    replicate factors (swap.plan_masking; rng: the swap stage's Generator), with the plan's
    counts and its tables (the confidential pairs; the matching variances before and after)."""
    limbs = np.zeros((3, len(design.segment_labels), 2 * len(req.matching)))
    for present, part_limbs in partials:
        limbs = add_limbs_at(limbs, present, part_limbs)
    agg = aggregates_from_sums(design, limbs, req.matching)
    st, d = req.section, req.dc
    plan, masking = plan_masking(
        agg,
        d,
        rng,
        st.replicate_method or d["method"],
        st.rho if st.rho is not None else d["rho"],
        rate=st.rate,
        method=st.method,
        max_share=st.max_share,
        cumulative=st.cumulative,
        scope=st.scope,
    )
    tables = {
        "pairs": swap_pairs(agg, plan, st.method, st.cumulative),
        "matching_variance": matching_variance(plan, req.matching).reset_index(),
    }
    return masking, plan_counts(agg, plan), tables


def swap_apply(
    part: Partition,
    spec: ReleaseSpec,
    req: SwapRequest,
    segment_labels: np.ndarray,
    masking: Masking,
    folder: str,
) -> str:
    """The masked partition (every column; pseudo strata and PSUs, rebuilt replicate weights)
    written to folder as part-<first record>.parquet (whole or not at all); returns the path."""
    d = req.dc
    df = read_partition(part, None, spec)
    codes = pd.Index(segment_labels).get_indexer(df[d["segment"]])
    if (codes < 0).any():
        raise PartitionError(f"design.segment: a '{d['segment']}' label is not in pass 1's table")
    data, _, _ = apply_masking(df, d, codes, masking)
    return _write_partition(data, part, folder)


# ---------------------------------------------------------------- a stage's damage by partition


def means_only_pass1(part: Partition, spec: ReleaseSpec, req: MeansRequest) -> MeansPass1:
    """Pass 1 of the domain means alone on one partition (scan_pass2 is its pass 2)."""
    df = read_partition(part, req.columns, spec)
    with single_blas_thread():
        return means_pass1(df, req)


def se_ratio_rows(original: pd.DataFrame, masked: pd.DataFrame) -> pd.DataFrame:
    """SE of the masked file over SE of the original, per variable and domain level (Taylor,
    and replicate when both tables have it), from two domain_means tables; the estimate's
    relative change beside it."""
    on = ["domain", "level", "variable"]
    t = original.merge(masked, on=on, how="inner", suffixes=("_original", "_masked"))
    with np.errstate(divide="ignore", invalid="ignore"):
        t["ratio"] = t["se_masked"] / t["se_original"]
        if "se_rep_original" in t.columns and "se_rep_masked" in t.columns:
            t["ratio_rep"] = t["se_rep_masked"] / t["se_rep_original"]
        t["estimate_change"] = (t["estimate_masked"] - t["estimate_original"]) / t[
            "estimate_original"
        ].abs()
    return t


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


def _lookup(frame: pd.DataFrame, table: pd.DataFrame, what: str) -> np.ndarray:
    """The row of table holding each row of frame (same columns; missing values match)."""
    if frame.shape[1] == 0:
        return np.zeros(len(frame), dtype=np.int64)
    t = table.assign(__row=np.arange(len(table)))
    got = frame.reset_index(drop=True).merge(t, how="left", on=list(frame.columns))["__row"]
    if got.isna().any():
        raise PartitionError(f"a record's {what} is not in pass 1's table")
    return got.to_numpy(dtype=np.int64)


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


def _write_partition(data: pd.DataFrame, part: Partition, folder: str) -> str:
    """data as folder/part-<first record>.parquet in one row group (plan_partitions then
    reads a stage's folder in the partitions that wrote it, where they end at block
    boundaries), written whole (a temporary name, renamed)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = Path(folder) / f"part-{part.start:012d}.parquet"
    tmp = path.with_suffix(".parquet.tmp")
    table = pa.Table.from_pandas(data, preserve_index=False)
    pq.write_table(table, tmp, row_group_size=max(1, len(data)), **parquet_options(table.schema))
    tmp.replace(path)
    return str(path)


# ---------------------------------------------------------------- MASSC Step II: donors


@dataclass(frozen=True)
class MasscRequest:
    """MASSC as the release runs it (massc_config): keys, sensitive variables, importance,
    restriction columns, declared-domain cell columns, the columns of the substituted file
    (substitute: taken from the donor; need: substitute plus study), the weight, the risk
    strata's merge and the study variables' domain rule."""

    keys: tuple[KeySpec, ...]
    sensitive: tuple[SensitiveSpec, ...]
    importance: tuple[tuple[str, float], ...]
    restrictions: tuple[str, ...]
    cells: tuple[KeySpec, ...]
    substitute: tuple[str, ...]
    need: tuple[str, ...]
    study: tuple[str, ...]
    weight: str
    merge: tuple[tuple[str, str], ...]
    max_levels: int
    min_records: int
    strata: str | None
    psu: str | None

    def columns(self) -> list[str]:
        names = [k.name for k in (*self.keys, *self.cells)] + [s.name for s in self.sensitive]
        return list(dict.fromkeys([*self.restrictions, *names, *self.need]))


def massc_request(spec: ReleaseSpec, columns: Sequence[str]) -> MasscRequest:
    """The spec's MASSC (stages.massc) on an input with these columns; k-means substrata have
    no partitioned path (PartitionError naming the field)."""

    if spec.stages.massc is None:
        raise PartitionError("stages.massc: the spec has no MASSC stage; enable it")
    cfg = massc_config(spec, pd.DataFrame(columns=list(columns)))
    if not cfg.psu_col:
        raise PartitionError(
            "design.psu: MASSC by partition needs the design's PSUs (its loss budgets are in "
            "Taylor sampling variances); name the PSU column"
        )
    if cfg.substrata:
        raise PartitionError(
            "stages.massc.substrata: k-means substrata need every record of a stratum in one "
            "process; remove them to run MASSC by partition, or run the release in memory"
        )
    return MasscRequest(
        keys=tuple(cfg.keys),
        sensitive=tuple(cfg.sensitive),
        importance=tuple(cfg.importance.items()),
        restrictions=tuple(cfg.restrictions),
        cells=tuple(cfg.domain_columns),
        substitute=tuple(cfg.substitute_columns),
        need=tuple(dict.fromkeys([*cfg.substitute_columns, *cfg.study])),
        study=tuple(cfg.study),
        weight=cfg.weight,
        merge=tuple((cfg.strata_merge or {}).items()),
        max_levels=cfg.max_levels,
        min_records=cfg.min_records,
        strata=cfg.strata_col,
        psu=cfg.psu_col,
    )


def _search_units(df: pd.DataFrame, req: MasscRequest) -> tuple[list[pd.Series], np.ndarray]:
    """The search-profile values of df's records (restriction and cell columns, keys,
    sensitive categories, in that order) and each record's local search profile."""

    r, k, s = search_values(df, req.keys, req.sensitive, req.restrictions, req.cells)
    codes = [_codes(v) for v in (*r, *k, *s)]
    a, b = len(r), len(r) + len(k)
    _, pid = search_profiles(codes[:a], codes[a:b], codes[b:])
    return [*r, *k, *s], pid


def donor_pass1(part: Partition, spec: ReleaseSpec, req: MasscRequest) -> pd.DataFrame:
    """Pass 1 of the donor search on one partition: its distinct search profiles (values in
    columns v0, v1, ...), in local first-appearance order, with their records (`count`) and
    first record (`first`, global row)."""
    df = read_partition(part, req.columns(), spec)
    values, pid = _search_units(df, req)
    first = first_of(pid, int(pid.max()) + 1 if len(pid) else 0)
    out = {f"v{j}": v.to_numpy()[first] for j, v in enumerate(values)}
    out["count"] = np.bincount(pid).astype(np.int64)
    out["first"] = part.start + first.astype(np.int64)
    return pd.DataFrame(out)


def advanced(state: dict, k: int) -> np.random.Generator:
    """A Generator at PCG64 state `state` advanced past k doubles: its draws are those the
    stage's Generator makes from its k-th on (random() takes one 64-bit step per double)."""
    bg = np.random.PCG64()
    bg.state = state
    bg.advance(k)
    return np.random.Generator(bg)


@dataclass
class DonorPlan:
    """The donor search of the whole input, from the partitions' profile tables: each
    search profile's donor profile (the driver's search, find_donors' draws) and, per
    partition, what its records need to draw and fetch their donor records."""

    starts: np.ndarray  # first record of each partition (its index here)
    local: list[np.ndarray]  # per partition: global profile of each of its local profiles
    donor_p: np.ndarray  # donor profile of each profile (-1: none)
    n_changed: np.ndarray  # keys changed between a profile and its donor profile
    size: np.ndarray  # records of each profile
    has_start: np.ndarray  # records with a donor in the partitions before each partition
    state: dict  # the Generator's state at the records' draws (find_donors' donor_records)
    route_key: np.ndarray  # profile * (N + 1) + records of the profile in earlier partitions
    route_part: np.ndarray  # the partition holding those records
    route_before: np.ndarray  # records of the profile in earlier partitions
    n_profiles: int
    by_level: dict[int, int]
    n_no_donor_domain: int = 0  # records without a partner only because of the domain cells

    def index(self, part: Partition) -> int:
        return int(np.searchsorted(self.starts, part.start))


def donor_plan(
    tables: Sequence[pd.DataFrame],
    req: MasscRequest,
    rng: np.random.Generator,
    chunk: int = 200_000,
) -> DonorPlan:
    """On the driver: the whole input's search profiles (codes in first-appearance order, as
    find_donors numbers them on the whole file), the donor search with rng, and the routes
    from a (donor profile, rank) draw to the partition holding that record. rng is left as
    find_donors leaves it (advanced past the records' draws, which the partitions make)."""

    if not isinstance(rng.bit_generator, np.random.PCG64):
        raise PartitionError("the donor draws by partition need a PCG64 Generator (stage_rng)")
    t = pd.concat(list(tables), keys=range(len(tables)), names=["__part", None])
    vcols = [c for c in t.columns if c.startswith("v")]
    gid = t.groupby(vcols, sort=False, dropna=False).ngroup().to_numpy()
    n_g = int(gid.max()) + 1
    first_g = np.full(n_g, np.iinfo(np.int64).max)
    np.minimum.at(first_g, gid, t["first"].to_numpy())
    order = np.argsort(first_g, kind="stable")  # profiles in first-appearance order
    pid_of_g = np.empty(n_g, dtype=np.int64)
    pid_of_g[order] = np.arange(n_g)
    pid = pid_of_g[gid]
    count = t["count"].to_numpy()
    size = np.bincount(pid, weights=count, minlength=n_g).astype(np.int64)
    at = np.flatnonzero(t["first"].to_numpy() == first_g[gid])  # each profile's first row
    units = t.iloc[at[np.argsort(pid[at])]]
    codes = [_codes(units[c]) for c in vcols]
    a = len(req.restrictions) + len(req.cells)
    b = a + len(req.keys)
    prof, _ = search_profiles(codes[:a], codes[a:b], codes[b:], size)
    search = donor_search(
        prof, list(req.keys), list(req.sensitive), dict(req.importance), rng, chunk
    )
    part_of = t.index.get_level_values("__part").to_numpy()
    n_parts = len(tables)
    has_rows = np.where(search.donor_p[pid] >= 0, count, 0)
    has = np.bincount(part_of, weights=has_rows, minlength=n_parts).astype(np.int64)
    state = rng.bit_generator.state
    rng.bit_generator.advance(int(has.sum()))  # the records' draws, made by the partitions
    # routes: rows by (profile, partition) with the profile's records in earlier partitions
    by = np.lexsort((part_of, pid))
    p_s, c_s = pid[by], count[by]
    cum = np.cumsum(c_s)
    head = np.r_[True, p_s[1:] != p_s[:-1]]
    before = cum - c_s - np.maximum.accumulate(np.where(head, cum - c_s, 0))
    N = int(size.sum())
    lev = np.bincount(search.n_changed, weights=size, minlength=len(req.keys) + 1)
    bounds = np.r_[0, np.cumsum([len(x) for x in tables])]
    n_no_donor_domain = 0
    if req.cells:  # records whose donor set has other key profiles but their cell none
        r = len(req.restrictions)
        base = _combine_codes(codes[:r], len(units))
        keys = _combine_codes(codes[a:b], len(units))

        def single(group: np.ndarray) -> np.ndarray:  # the group holds one key profile
            return pd.Series(keys).groupby(group).transform("nunique").to_numpy() == 1

        cell = _combine_codes([base, _combine_codes(codes[r:a], len(units))], len(units))
        n_no_donor_domain = int(size[single(cell) & ~single(base)].sum())
    return DonorPlan(
        starts=np.array([int(x["first"].min()) if len(x) else -1 for x in tables]),
        local=[pid[bounds[i] : bounds[i + 1]] for i in range(n_parts)],
        donor_p=search.donor_p,
        n_changed=search.n_changed,
        size=size,
        has_start=np.r_[0, np.cumsum(has)[:-1]],
        state=state,
        route_key=p_s * (N + 1) + before,
        route_part=part_of[by],
        route_before=before,
        n_profiles=prof.n_p,
        by_level={i: int(lev[i]) for i in range(len(req.keys) + 1)},
        n_no_donor_domain=n_no_donor_domain,
    )


def donor_send(
    part: Partition, spec: ReleaseSpec, req: MasscRequest, plan: DonorPlan
) -> list[dict[str, np.ndarray]]:
    """Pass 2 on one partition: each record with a donor draws its donor record (the rank
    within the donor profile, from the uniforms find_donors draws for it: the Generator
    advanced to the partition's first such record); the requests, per partition holding
    the donors: requester rows (local), donor profiles and their local ranks there."""

    df = read_partition(part, req.columns(), spec)
    _, pid = _search_units(df, req)
    i = plan.index(part)
    dp = plan.donor_p[plan.local[i][pid]]
    rows = np.flatnonzero(dp >= 0)
    off = donor_ranks(dp[rows], plan.size, advanced(plan.state, int(plan.has_start[i])))
    N = int(plan.size.sum())
    r = np.searchsorted(plan.route_key, dp[rows] * (N + 1) + off, side="right") - 1
    target = plan.route_part[r]
    rank = off - plan.route_before[r]
    return [
        {"rows": rows[target == j], "dp": dp[rows][target == j], "rank": rank[target == j]}
        for j in range(len(plan.local))
    ]


def donor_serve(
    part: Partition,
    requests: Sequence[dict[str, np.ndarray]],
    spec: ReleaseSpec,
    req: MasscRequest,
    plan: DonorPlan,
) -> list[dict[str, Any]]:
    """Pass 3 on the partition holding donors: for each requesting partition, the donor
    records (the rank-th record of the profile in record order here) as global rows and
    their values of the substituted columns."""
    df = read_partition(part, req.columns(), spec)
    _, pid = _search_units(df, req)
    glob = plan.local[plan.index(part)]  # global profile of each local profile
    inv = np.argsort(glob)
    by_pid = np.argsort(pid, kind="stable")
    start = np.r_[0, np.cumsum(np.bincount(pid, minlength=len(glob)))[:-1]]
    out = []
    for q in requests:
        lp = inv[np.searchsorted(glob, q["dp"], sorter=inv)]
        at = by_pid[start[lp] + q["rank"]]
        out.append(
            {
                "rows": q["rows"],
                "donor": part.start + at,
                "values": df[list(req.substitute)].iloc[at].reset_index(drop=True),
            }
        )
    return out


def donor_receive(
    part: Partition,
    replies: Sequence[dict[str, Any]],
    spec: ReleaseSpec,
    req: MasscRequest,
    plan: DonorPlan,
    folder: str | None = None,
) -> pd.DataFrame | str:
    """Pass 4 on one partition: its records' substituted file tilde (find_donors then
    substitute: every record with a donor takes the donor's substituted columns) with the
    donor's global row in `__donor` (-1: none); written to folder when given (its path
    returned), else returned."""
    df = read_partition(part, list(req.need), spec)
    donor = np.full(len(df), -1, dtype=np.int64)
    tilde = df[list(req.need)].copy(deep=False)
    got = [q for q in replies if len(q["rows"])]
    if got:
        rows = np.concatenate([q["rows"] for q in got])
        donor[rows] = np.concatenate([q["donor"] for q in got])
        take = np.arange(len(df))
        take[rows] = len(df) + np.arange(len(rows))
        for c in req.substitute:
            new = pd.concat([q["values"][c] for q in got], ignore_index=True)
            both = pd.concat([df[c], new.astype(df[c].dtype)], ignore_index=True)
            tilde[c] = pd.Series(both.array.take(take), index=df.index, name=c)
    tilde["__donor"] = donor
    return tilde if folder is None else _write_partition(tilde, part, folder)


# ---------------------------------------------------------------- MASSC Steps I-II: strata, moments


def massc_strata_labels(profiles: pd.DataFrame, req: MasscRequest) -> list[str]:
    """The risk strata (merged by stages.massc.strata_merge) that hold records of the whole
    input, sorted: massc_plan's strata labels (profiles: the scan's combine_profiles)."""
    merge = dict(req.merge)
    present = {STRATA[min(int(c), 4) - 1] for c in profiles["count"]}
    return sorted({merge.get(s, s) for s in present})


def massc_study_variables(profiles: pd.DataFrame, req: MasscRequest) -> StudyVariables:
    """study_variables of the whole input from its key-profile counts (the keys' labels are
    key_frame's): every study variable and the count, over the categories of each key with at
    most max_levels categories that hold min_records records."""
    domains: dict[str, list[str]] = {"": [""]}
    count = profiles["count"].to_numpy()
    for k in req.keys:
        labels = profiles[k.name].astype(str).to_numpy()
        vc = pd.Series(count).groupby(labels).sum()
        if len(vc) <= req.max_levels:
            domains[k.name] = sorted(vc.index[vc >= req.min_records].tolist())
    return StudyVariables(["_count", *req.study], domains, list(req.keys))


@dataclass
class MomentsPartial:
    """One partition's part of MASSC's plan sums: records per stratum, the BlockPartials of the
    blocks that start in it, and the values of its first records when they continue a block
    begun in an earlier partition (the driver makes their terms: one bundle per kind of
    terms, _TERMS)."""

    N: np.ndarray
    sums: dict[tuple[str, str, str], BlockPartial]
    head: list[dict[str, Any]] | None
    head_block: int


def _take(obj: Any, rows: slice) -> Any:
    if isinstance(obj, dict):
        return {k: _take(v, rows) for k, v in obj.items()}
    return obj.take(rows) if isinstance(obj, ZParts) else obj[rows]


def _plan_terms(data: dict[str, Any], zvars: StudyVariables, n_h: int, n_psu: int):
    """The sums of the plan's moments (z_moments: theta, V, S2_nu of eq. 8a)."""
    return moment_terms(data["p"], zvars, data["h"], n_h, data["w"], None)


def _original_terms(data: dict[str, Any], zvars: StudyVariables, n_h: int, n_psu: int):
    """The sums of the original's totals theta_z and PSU totals (V_z)."""
    ys, ds, w = data["ys"], data["ds"], data["w"]
    yield from zvars.total_terms(ys.__getitem__, ds.__getitem__, w)
    yield from zvars.psu_terms(ys, ds, w, data["g"], n_psu)


def _cost_terms(data: dict[str, Any], zvars: StudyVariables, n_h: int, n_psu: int):
    """The sums of the disclosure costs: r_k / F_k by stratum (disclosure_cost)."""

    yield ("", "", "cost"), _Bins(data["h"], None, n_h, len(data["h"])), data["rF"]


_TERMS = (_plan_terms, _original_terms, _cost_terms)


@dataclass(frozen=True)
class MasscInputs:
    """What MASSC's passes read besides their partition: the spec, its MASSC request, the
    release input's partitions (the original records), the scan's key-profile table and the
    MASSC strata labels (massc_strata_labels)."""

    spec: ReleaseSpec
    req: MasscRequest
    inputs: Sequence[Partition]
    profiles: pd.DataFrame
    labels: list[str]


def _original_rows(
    part: Partition,
    m: MasscInputs,
    columns: Sequence[str] = (),
    strata: bool = True,
) -> tuple[pd.DataFrame, np.ndarray, np.ndarray]:
    """B(0): the input's records of the partition (its keys and `columns`), each record's
    MASSC stratum (0..len(labels)-1: the risk stratum of its original key profile, merged) and
    the row of that profile in the scan's table (strata False: the records only, the other
    two empty)."""
    spec, req, inputs, profiles, labels = m.spec, m.req, m.inputs, m.profiles, m.labels
    (original,) = [p for p in inputs if p.start == part.start]
    keys = [k.name for k in req.keys]
    b0 = read_partition(original, list(dict.fromkeys([*keys, *columns])), spec)
    if not strata:
        return b0, np.zeros(0, np.int64), np.zeros(0, np.int64)
    merge = dict(req.merge)
    h_of = pd.Index(labels).get_indexer([merge.get(s, s) for s in STRATA]).astype(np.int64)
    at = profile_rows(b0, req.keys, profiles)
    h = h_of[np.minimum(profiles["count"].to_numpy()[at], 4) - 1]  # U, D, T, O merged
    return b0, h, at


def _tilde(
    part: Partition, spec: ReleaseSpec, req: MasscRequest, donors: str, index
) -> pd.DataFrame:
    """The partition's substituted file tilde (donor_receive's), typed as the records."""
    import pyarrow.parquet as pq

    path = Path(donors) / f"part-{part.start:012d}.parquet"
    t = pq.read_table(path, columns=[*req.need, "__donor"]).to_pandas()
    return type_input(t, spec, text=False).set_axis(index)


def _partial_sums(
    start: int,
    n: int,
    bundles: Sequence[dict[str, Any]],
    families: Sequence[Callable],
    zvars: StudyVariables,
    n_h: int,
    n_psu: int,
    N: np.ndarray,
) -> MomentsPartial:
    """A MomentsPartial of the records start..start+n-1: each family of terms (a function of
    its bundle of record values) summed by block from the partition's first block start on,
    and the bundles of the records before it (they continue an earlier partition's block)."""
    B = blocksum.BLOCK
    hs = min(n, -(-start // B) * B - start)  # records continuing a block
    rest = slice(hs, n)
    sums = {}
    for terms, data in zip(families, bundles, strict=True):
        for key, bins, x in terms(_take(data, rest), zvars, n_h, n_psu):
            sums[key] = bins.partial(x, start + hs)
    return MomentsPartial(
        N=N,
        sums=sums,
        head=[_take(data, slice(0, hs)) for data in bundles] if hs else None,
        head_block=start // B if hs else -1,
    )


def moments_pass(
    part: Partition,
    m: MasscInputs,
    psus: pd.DataFrame,
    zvars: StudyVariables,
    scores: np.ndarray,
    donors: str,
) -> MomentsPartial:
    """MASSC's plan sums on one partition of its input (part: the records after the earlier
    stages): the moments of eq. 8a from the records and the substituted file tilde (donors:
    the folder of donor_receive) by strata of the original keys; the original's totals and PSU
    totals from the input's partition holding the same records (psus: the original design's
    PSUs, (stratum, psu) sorted, as SurveyDesign codes them); the stratum sums of r_k / F_k
    (scores: the profiles' GenMASSC scores, profile_scores)."""
    spec, req, profiles, labels = m.spec, m.req, m.profiles, m.labels
    keys = [k.name for k in req.keys]
    df = read_partition(part, list(dict.fromkeys([req.weight, *req.study, *keys])), spec)
    tilde = _tilde(part, spec, req, donors, df.index)
    design = [c for c in (req.strata, req.psu) if c]
    b0, h, at = _original_rows(part, m, [req.weight, *req.study, *design])
    F = profiles["count"].to_numpy()[at]
    r = scores[at] if req.sensitive else 1.0  # GenMASSC scores of the original records
    pairs = pd.MultiIndex.from_arrays(
        [b0[req.strata] if req.strata else np.zeros(len(b0), np.int64), b0[req.psu]]
    )
    code, uniq = pd.factorize(pairs)
    g = pd.MultiIndex.from_frame(psus).get_indexer(uniq)[code].astype(np.int64)
    if (g < 0).any():
        raise PartitionError("design: a record's (stratum, psu) is not in the scan's PSUs")
    ys, ds = zvars.frame_parts(b0)
    bundles = [
        {"p": ZParts.of(df, tilde, zvars), "h": h, "w": df[req.weight].to_numpy(dtype=float)},
        {"ys": ys, "ds": ds, "w": b0[req.weight].to_numpy(dtype=float), "g": g},
        {"h": h, "rF": r / F.astype(float)},
    ]
    N = np.bincount(h, minlength=len(labels))
    return _partial_sums(part.start, len(df), bundles, _TERMS, zvars, len(labels), len(psus), N)


def _block_totals(
    partials: Sequence[MomentsPartial],
    families: Sequence[Callable],
    zvars: StudyVariables,
    n_h: int,
    n_psu: int,
    n_rows: int,
) -> dict[tuple[str, str, str], np.ndarray]:
    """The group sums of the whole input from the partitions' parts, in partition order."""
    acc: dict[tuple[str, str, str], BlockAccumulator] = {}
    for q in partials:
        if q.head is not None:  # the terms of a block begun in an earlier partition
            for terms, data in zip(families, q.head, strict=True):
                for key, bins, x in terms(data, zvars, n_h, n_psu):
                    acc[key].extend(q.head_block, bins.codes, x)
        for key, part_sums in q.sums.items():
            if key not in acc:
                acc[key] = BlockAccumulator(part_sums.sums.shape[1], n_rows)
            acc[key].add(part_sums)
    return {key: a.total() for key, a in acc.items()}


@dataclass
class PlanSums:
    """massc_plan's sums of the whole input: the moments of eq. 8a (denom not set), the
    original's totals theta_z and their Taylor variances V_z, and the stratum sums of the
    disclosure costs' r_k / F_k."""

    moments: ZMoments
    truth: np.ndarray
    sampling_var: np.ndarray
    cost_sums: np.ndarray


def psu_design(psus: pd.DataFrame) -> SurveyDesign:
    """A design of one record per PSU (psus: stratum, psu) whose PSU kernel is the whole
    input's (the same PSU codes, strata and PSU counts)."""
    frame = psus.assign(__w=1.0)
    return SurveyDesign(frame, "__w", "stratum", "psu")


def combine_moments(
    partials: Sequence[MomentsPartial],
    zvars: StudyVariables,
    labels: list[str],
    psus: pd.DataFrame,
    n_rows: int,
) -> PlanSums:
    """massc_plan's sums from the partitions' parts, in partition order: the same bits as in
    memory (sdl_design.survey.blocksum)."""
    sums = _block_totals(partials, _TERMS, zvars, len(labels), len(psus), n_rows)
    N = np.sum([q.N for q in partials], axis=0)
    return PlanSums(
        moments_of(sums, zvars, N, labels, treated=False),
        zvars.totals_from(sums),
        zvars.variance_from(sums, psu_design(psus)),
        sums[("", "", "cost")],
    )


def massc_psi(spec: ReleaseSpec, columns: Sequence[str], sums: PlanSums) -> tuple[Any, np.ndarray]:
    """On the driver: the disclosure costs a_h and the substitution rates psi (eq. 9) from the
    plan's sums, as massc_plan computes them (loss budgets in the original's Taylor variances,
    or theta_z^2, by stages.massc.loss_scale). Sets the moments' denom D_z."""

    cfg = massc_config(spec, pd.DataFrame(columns=list(columns)))
    mom = sums.moments
    mom.denom = sums.sampling_var if cfg.loss_scale == "sampling" else sums.truth**2
    cost, _ = cost_from(sums.cost_sums, mom.N, cfg)
    return optimal_psi(mom, cfg.alpha, cfg.psi_max, cfg.psi_min, cost), cost


# ---------------------------------------------------------------- MASSC Steps II-III: selection


def _group_values(df: pd.DataFrame, h: np.ndarray, req: MasscRequest) -> pd.DataFrame:
    """The selection groups' values of the records (massc_treat's groups): the design's
    (stratum, PSU) of the records when the design has both (nested selection), else their
    MASSC stratum."""
    if req.strata and req.psu:
        return pd.DataFrame({"s": df[req.strata].to_numpy(), "p": df[req.psu].to_numpy()})
    return pd.DataFrame({"h": h})


def _selection_records(part: Partition, m: MasscInputs) -> tuple[pd.DataFrame, np.ndarray]:
    """The partition's selection group values and MASSC strata."""
    spec, req = m.spec, m.req
    nest = [c for c in (req.strata, req.psu) if c] if req.strata and req.psu else []
    df = read_partition(part, nest or [req.weight], spec)
    _, h, _ = _original_rows(part, m)
    return _group_values(df, h, req), h


def select_pass1(part: Partition, m: MasscInputs) -> pd.DataFrame:
    """The partition's distinct selection groups with their first record (global row)."""
    values, _ = _selection_records(part, m)
    code = values.groupby(list(values.columns), sort=False, dropna=False).ngroup().to_numpy()
    first = first_of(code, int(code.max()) + 1 if len(code) else 0)
    return values.iloc[first].reset_index(drop=True).assign(first=part.start + first)


def select_groups(tables: Sequence[pd.DataFrame]) -> pd.DataFrame:
    """The whole input's selection groups in first-appearance order (select's codes)."""
    t = pd.concat(list(tables), ignore_index=True)
    cols = [c for c in t.columns if c != "first"]
    t = t.groupby(cols, sort=False, dropna=False)["first"].min().reset_index()
    return t.sort_values("first", kind="stable").reset_index(drop=True)[cols]


@dataclass
class SelectPlan:
    """One selection (select) of the whole input: its groups, the rate of each MASSC stratum,
    the Generator's state at the records' uniforms (drawn in record order: each partition
    advances to its first record) and the groups' starts (drawn after them, on the driver)."""

    groups: pd.DataFrame
    rates: np.ndarray
    state: dict
    start_u: np.ndarray
    n_parts: int

    def owner(self, g: np.ndarray) -> np.ndarray:
        """The partition that selects within group g (groups in ranges of about equal count)."""
        return g * self.n_parts // max(len(self.groups), 1)


def select_plan(
    groups: pd.DataFrame, rates: np.ndarray, rng: np.random.Generator, n_rows: int, n_parts: int
) -> SelectPlan:
    """The plan of select(groups, rates[h], rng) on n_rows records; rng is left as select
    leaves it (past the records' uniforms and the groups' starts)."""
    if not isinstance(rng.bit_generator, np.random.PCG64):
        raise PartitionError("the selection by partition needs a PCG64 Generator (stage_rng)")
    state = rng.bit_generator.state
    rng.bit_generator.advance(int(n_rows))  # the records' uniforms, drawn by the partitions
    start_u = rng.random(len(groups) if n_rows else 0)
    return SelectPlan(groups, np.asarray(rates, dtype=float), state, start_u, n_parts)


@dataclass
class Selections:
    """Several selections of the whole input made in one exchange (select_send, serve,
    receive): their plans and the folders their indicators go to."""

    plans: list[SelectPlan]
    folders: list[str]

    @property
    def n_parts(self) -> int:
        return self.plans[0].n_parts

    def owner(self, g: np.ndarray) -> np.ndarray:
        return self.plans[0].owner(g)  # the groups and partitions are the same in every plan


def select_send(part: Partition, m: MasscInputs, sels: Selections) -> list[dict[str, np.ndarray]]:
    """Each record's group, and per selection its uniform (select's, in record order) and
    rate, sent to the partition that selects within its group."""
    values, h = _selection_records(part, m)
    g = _lookup(values, sels.plans[0].groups, "selection group")
    u = np.stack([advanced(p.state, part.start).random(len(h)) for p in sels.plans])
    pi = np.stack([p.rates[h] for p in sels.plans])
    if np.any((pi < 0) | (pi > 1)):
        raise PartitionError("stages.massc: rates must lie in [0, 1]")
    rows = part.start + np.arange(len(h))
    to = sels.owner(g)
    return [
        {"rows": rows[to == j], "g": g[to == j], "u": u[:, to == j], "pi": pi[:, to == j]}
        for j in range(sels.n_parts)
    ]


def select_serve(
    part: Partition, requests: Sequence[dict[str, np.ndarray]], m: MasscInputs, sels: Selections
) -> list[dict[str, np.ndarray]]:
    """The systematic selections within the groups this partition owns: per selection, its
    records sorted by group, uniform and record (select's order), the hits sent back to each
    partition."""

    rows, g = (np.concatenate([q[k] for q in requests]) for k in ("rows", "g"))
    u, pi = (np.concatenate([q[k] for q in requests], axis=1) for k in ("u", "pi"))
    sender = np.repeat(np.arange(len(requests)), [len(q["rows"]) for q in requests])
    hit = np.zeros((len(sels.plans), len(rows)), dtype=bool)
    for r, plan in enumerate(sels.plans):
        order = np.lexsort((rows, u[r], g))
        hit[r, order] = systematic_hits(g[order], pi[r, order], plan.start_u)
    return [{"rows": rows[sender == i], "hit": hit[:, sender == i]} for i in range(len(requests))]


def select_receive(
    part: Partition,
    replies: Sequence[dict[str, np.ndarray]],
    m: MasscInputs,
    sels: Selections,
) -> list[int]:
    """The partition's indicators of each selection, written to its folder (column __sel);
    the counts."""
    out = []
    for r, folder in enumerate(sels.folders):
        sel = np.zeros(part.stop - part.start, dtype=bool)
        for q in replies:
            sel[q["rows"] - part.start] = q["hit"][r]
        _write_partition(pd.DataFrame({"__sel": sel}), part, folder)
        out.append(int(sel.sum()))
    return out


def _selected(part: Partition, folder: str) -> np.ndarray:
    import pyarrow.parquet as pq

    path = Path(folder) / f"part-{part.start:012d}.parquet"
    return pq.read_table(path, columns=["__sel"]).column(0).to_numpy(zero_copy_only=False)


def _treated_terms(data: dict[str, Any], zvars: StudyVariables, n_h: int, n_psu: int):
    """The sums of S2 of w z* (eq. 8b) on B(1) (the records substituted: d1)."""
    return moment_terms(data["p"], zvars, data["h"], n_h, data["w"], data["d1"], plan=False)


def treated_pass(
    part: Partition,
    m: MasscInputs,
    zvars: StudyVariables,
    donors: str,
    selected: str,
) -> MomentsPartial:
    """The moments of z* on one partition (massc_treat's): d(1) = selected and with a donor
    (selected: select_receive's folder)."""
    spec, req, labels = m.spec, m.req, m.labels
    keys = [k.name for k in req.keys]
    df = read_partition(part, list(dict.fromkeys([req.weight, *req.study, *keys])), spec)
    tilde = _tilde(part, spec, req, donors, df.index)
    _, h, _ = _original_rows(part, m)
    d1 = _selected(part, selected) & (tilde["__donor"].to_numpy() >= 0)
    bundle = {"p": ZParts.of(df, tilde, zvars), "h": h, "w": df[req.weight].to_numpy(float)}
    bundle["d1"] = d1
    N = np.array([int(d1.sum())])  # records substituted
    return _partial_sums(part.start, len(df), [bundle], [_treated_terms], zvars, len(labels), 0, N)


@dataclass
class RatesPlan:
    """What meet_delta's revisions read and replace of a MASSC plan made by partition."""

    moments: ZMoments
    psi: Any
    cost: np.ndarray


@dataclass
class PartitionedTreatment:
    """A MASSC treatment by partition (its d(1) and d(2) are in the selections' folders)."""

    phi: Any
    n_substituted: int
    n_retained: int
    moments: ZMoments  # with S2 of z* (eq. 8b)


def massc_phi(
    cfg: Any,
    partials: Sequence[MomentsPartial],
    zvars: StudyVariables,
    base: ZMoments,
    cost: np.ndarray,
    n_rows: int,
) -> tuple[Any, ZMoments, int]:
    """On the driver: the moments of z* from the partitions' parts and the retention rates phi
    (eq. 10), as massc_treat computes them (cfg: its MasscConfig; base: the plan's moments);
    and the records substituted."""

    labels = base.strata
    totals = _block_totals(partials, [_treated_terms], zvars, len(labels), 0, n_rows)
    mom = moments_of(totals, zvars, base.N, labels, treated=True, base=base)
    phi = optimal_phi(mom, cfg.beta, cfg.phi_min, cfg.phi_max, cost)
    return phi, mom, int(sum(int(q.N[0]) for q in partials))


# ---------------------------------------------------------------- MASSC: delta (eq. 3-6)


def _treated_records(
    part: Partition,
    spec: ReleaseSpec,
    req: MasscRequest,
    donors: str,
    selected: tuple[str, str],
    columns: Sequence[str] | None = (),
) -> tuple[pd.DataFrame, np.ndarray, np.ndarray]:
    """B(1)'s keys, sensitive variables and `columns` (None: every column) of the partition's
    records (the substituted ones with their donor's key-related columns), d(1) and d(2)
    (selected: select_receive's folders of the two selections)."""
    names = list(dict.fromkeys([*(k.name for k in req.keys), *(s.name for s in req.sensitive)]))
    df = read_partition(part, None if columns is None else [*names, *columns], spec)
    tilde = _tilde(part, spec, req, donors, df.index)
    d1 = _selected(part, selected[0]) & (tilde["__donor"].to_numpy() >= 0)
    d2 = _selected(part, selected[1])
    return substituted(df, tilde, d1, req), d1, d2


def substituted(
    df: pd.DataFrame, tilde: pd.DataFrame, d1: np.ndarray, req: MasscRequest
) -> pd.DataFrame:
    """B(1) of the partition's records: the substituted ones (d1) take their donor's
    key-related columns from tilde."""
    b1 = df.copy(deep=False)
    for c in df.columns:
        if c in req.substitute:
            b1[c] = df[c].where(~d1, tilde[c])
    return b1


def delta_pass1(
    part: Partition,
    spec: ReleaseSpec,
    req: MasscRequest,
    donors: str,
    selected: tuple[str, str],
) -> pd.DataFrame:
    """The key profiles of the partition's records in B(2) (retained, after substitution) with
    their sensitive categories' counts (profile_counts)."""
    b1, _, d2 = _treated_records(part, spec, req, donors, selected)
    return profile_counts(b1[d2], req.keys, None, req.sensitive)


def _delta_terms(data: dict[str, Any], zvars: StudyVariables, n_h: int, n_psu: int):
    """The sums of delta_k by how the record's original profile appears in B(2)."""

    yield ("", "", "delta"), _Bins(data["cls"], None, 5, len(data["cls"])), data["delta_k"]


def delta_pass2(
    part: Partition,
    m: MasscInputs,
    scores: np.ndarray,
    treated: pd.DataFrame,
    treated_scores: np.ndarray,
    risk_basis: str,
    donors: str,
    selected: tuple[str, str],
) -> MomentsPartial:
    """delta_k = (1 - d_k(1)) d_k(2) r_k(2) (eq. 3) of the partition's records in block sums by
    appearance class (0: the original profile is absent from B(2); 1-4: u, d, t, o), and the
    records of each class (treated: combine_profiles of delta_pass1's tables; scores, and
    treated_scores: the GenMASSC scores of the original's and of B(2)'s profiles)."""
    spec, req, inputs, profiles = m.spec, m.req, m.inputs, m.profiles
    b1, d1, d2 = _treated_records(part, spec, req, donors, selected)
    (original,) = [p for p in inputs if p.start == part.start]
    b0 = read_partition(original, [k.name for k in req.keys], spec)
    n = len(b0)
    at0 = profile_rows(b0, req.keys, profiles)
    in2 = profile_rows(b0, req.keys, treated, missing_ok=True)
    app = np.where(in2 >= 0, treated["count"].to_numpy()[np.maximum(in2, 0)], 0)
    r0 = scores[at0] if req.sensitive else np.ones(n)
    r2 = np.zeros(n)
    if d2.any():
        at2 = profile_rows(b1[d2], req.keys, treated)
        r2[d2] = treated_scores[at2] if req.sensitive else 1.0
    r = {"original": r0, "treated": r2, "max": np.maximum(r0, r2)}[risk_basis]
    delta_k = (~d1) * d2 * r  # eq. 3
    cls = np.minimum(app, 4)
    data = {"cls": cls, "delta_k": delta_k}
    N = np.bincount(cls, minlength=5)
    return _partial_sums(part.start, n, [data], [_delta_terms], None, 5, 0, N)


def combine_delta(partials: Sequence[MomentsPartial], n_rows: int) -> Any:
    """delta (eq. 5-6: the largest of delta_u, delta_d, delta_t, delta_o) and its table by
    appearance, from the partitions' parts: delta_measures' bits."""

    totals = _block_totals(partials, [_delta_terms], None, 5, 0, n_rows)[("", "", "delta")]
    table = appearance_table(totals, np.sum([q.N for q in partials], axis=0), n_rows)
    return PartitionedDelta(float(table["delta_bar"].max()), table)


@dataclass
class PartitionedDelta:
    """delta_measures' delta and table by appearance, of a treatment by partition."""

    delta: float
    by_appearance: pd.DataFrame


def massc_loss(
    tr: PartitionedTreatment, plan: RatesPlan, sums: PlanSums
) -> tuple[pd.DataFrame, float]:
    """The information loss of the treatment against the original totals (eq. 7, 8a + 8b) and
    epsilon, its largest RRMSE, as the MASSC stage reports them."""

    il = information_loss(tr.moments, plan.psi.rates, tr.phi.rates, sums.truth, sums.sampling_var)
    eps = float(np.nanmax(il["rrmse"])) if il["rrmse"].notna().any() else float("nan")
    return il, eps


def massc_tables(
    donors: DonorPlan,
    sums: PlanSums,
    plan: RatesPlan,
    tr: PartitionedTreatment,
    dm: PartitionedDelta,
    loss: pd.DataFrame,
) -> dict[str, pd.DataFrame]:
    """The tables of MASSC by partition: donors by keys changed, the moments of eq. 8a by
    stratum, the study totals (theta_z after the earlier stages, the original's with its
    Taylor SE), the rates by stratum, delta by appearance, the information loss."""
    mom = sums.moments
    levels = pd.DataFrame(
        {"keys_changed": list(donors.by_level), "records": list(donors.by_level.values())}
    )
    z = pd.DataFrame(mom.labels, columns=["variable", "domain", "category"])
    moments = pd.concat(
        [
            z.assign(stratum=h, N=mom.N[i], sum_nu=mom.V[i], S2_nu=mom.S2_nu[i])
            for i, h in enumerate(mom.strata)
        ],
        ignore_index=True,
    )
    z["theta"] = mom.theta
    z["original_total"] = sums.truth
    z["original_se"] = np.sqrt(sums.sampling_var)
    rates = pd.DataFrame(
        {
            "stratum": mom.strata,
            "N": mom.N,
            "cost_a": plan.cost,
            "psi": plan.psi.rates,
            "phi": tr.phi.rates,
        }
    )
    return {
        "donor_levels": levels,
        "moments": moments,
        "totals": z,
        "rates": rates,
        "delta": dm.by_appearance,
        "epsilon_formula": loss,
    }
