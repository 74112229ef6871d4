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
from itertools import count, groupby
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd

from sdl_design.blas import single_blas_thread
from sdl_design.codes import factorize
from sdl_design.edits import combine_rule_failures, rule_failures
from sdl_design.engine.cache import CACHE, cached, file_identity
from sdl_design.io import numeric_columns, parquet_options, type_input, unit_weight
from sdl_design.keys import key_levels
from sdl_design.risk import (
    MAX_CELLS,
    STRATA,
    RiskInputError,
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
from sdl_design.survey.design import (
    SurveyDesign,
    dense_codes,
    first_of,
    group_indicator,
    replicate_factor_groups,
    resolve_replicates,
    sparse_times,
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


_FRAME_TOKENS = count()


@dataclass(frozen=True, eq=False)
class FramePartition:
    """The records start..stop-1 held in this process's memory: the one partition of a release
    run in memory. Its passes read the frame (read_partition, positions start..stop-1 as its
    index) and what they write to a memory folder (MEMORY) is held, not written."""

    frame: pd.DataFrame
    start: int
    stop: int
    token: int = field(default_factory=lambda: next(_FRAME_TOKENS), compare=False)  # cache key

    @classmethod
    def of(cls, frame: pd.DataFrame) -> FramePartition:
        return cls(frame, 0, len(frame))


@dataclass(frozen=True, eq=False)
class Derived:
    """A partition's records as a stage would write them, derived when read
    (derive(records, *args, columns=the columns read or None)): records never written, e.g. a
    method's baseline measured beside the method."""

    base: Any  # a Partition, FramePartition or Derived
    derive: Callable[..., pd.DataFrame]
    args: tuple

    @property
    def start(self) -> int:
        return self.base.start

    @property
    def stop(self) -> int:
        return self.base.stop


def partition_columns(part: Any) -> list[str]:
    """The columns of a partition's records (a FramePartition's frame, a Parquet file's)."""
    if isinstance(part, Derived):
        return list(read_partition(part, None, None).columns)
    if isinstance(part, FramePartition):
        return list(part.frame.columns)
    return input_columns(part.pieces[0].path)


def held_frame(parts: Sequence[Any], spec: ReleaseSpec | None) -> pd.DataFrame | None:
    """The records of partitions that are one frame held in memory (a FramePartition, or
    derived from one), read whole; None for records in files."""
    if len(parts) != 1:
        return None
    base = parts[0]
    while isinstance(base, Derived):
        base = base.base
    return read_partition(parts[0], None, spec) if isinstance(base, FramePartition) else None


MEMORY = "memory:"  # a folder name's prefix: the frames written there are held in _HELD
_HELD: dict[str, dict[int, pd.DataFrame]] = {}
_FOLDERS = count()  # each memory folder's number (never reused in the process)


def memory_folder(name: str) -> str:
    """A new folder whose partitions are held in this process's memory (release_memory)."""
    folder = f"{MEMORY}{name}:{next(_FOLDERS)}"
    _HELD[folder] = {}
    return folder


def held(folder: str) -> list[pd.DataFrame]:
    """The frames written to a memory folder, in record order."""
    got = _HELD.get(folder, {})
    return [got[k] for k in sorted(got)]


def release_memory(folder: str) -> None:
    """A memory folder's frames let go."""
    _HELD.pop(folder, None)


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
    Parquet file when a spec is given (its declared missing codes read along). Columns read
    before come from this process's PartitionCache (sdl_design.engine.cache). A
    FramePartition's columns are the frame's, typed when it was read."""
    import pyarrow.parquet as pq

    if isinstance(part, FramePartition):
        frame = part.frame if columns is None else part.frame[list(dict.fromkeys(columns))]
        return frame.set_axis(pd.RangeIndex(part.start, part.stop))
    if isinstance(part, Derived):  # (derive is told the columns read: it may skip others)
        want = None if columns is None else list(dict.fromkeys(columns))
        frame = part.derive(read_partition(part.base, None, spec), *part.args, columns=want)
        return frame if want is None else frame[want]

    files = [pq.ParquetFile(piece.path) for piece in part.pieces]
    names = files[0].schema_arrow.names  # every file has the same columns
    cols = list(names) if columns is None else list(dict.fromkeys(columns))
    declared = [] if spec is None else [c for c in spec.variables.missing if c in set(names)]
    if spec is not None and columns is not None:
        cols += [c for c in declared if c not in cols]
    typing = _typing(spec, cols)
    where = partition_identity(part)
    cache = CACHE if CACHE.budget else None
    got: dict[str, pd.Series] = {}
    for c in cols if cache is not None else ():
        hit = cache.get((where, c, typing(c)))
        if hit is not None:
            got[c] = hit
    need = [c for c in cols if c not in got]
    if need:  # (type_input reads the declared missing codes' columns along)
        df = _read_columns(files, part, [*need, *(c for c in declared if c not in need)])
        if spec is not None:
            df = type_input(df, spec, text=False)
        for c in need:
            got[c] = df[c]
            if cache is not None:
                cache.put((where, c, typing(c)), df[c], df[c].memory_usage(index=False, deep=True))
    # copy=False: the columns as they are, not stacked into blocks (a copy of every one)
    out = pd.DataFrame(
        {c: got[c] for c in cols}, index=pd.RangeIndex(part.start, part.stop), copy=False
    )
    return out if spec is None else unit_weight(out, spec)


def partition_identity(part: Partition) -> tuple:
    """The partition's records as a cache key: its files' identities and the records read (a
    FramePartition's: its token, the frame's own for as long as the partition lives)."""
    if isinstance(part, FramePartition):
        return (("frame", part.token), part.start, part.stop)
    pieces = tuple((file_identity(p.path), p.row_groups, p.skip, p.rows) for p in part.pieces)
    return (pieces, part.start, part.stop)


def _typing(spec: ReleaseSpec | None, cols: list[str]) -> Callable[[str], tuple]:
    """What type_input does to a column of a Parquet file: its declared missing codes and
    whether it is read as a number (None: read as stored)."""
    if spec is None:
        return lambda c: ()
    numeric = numeric_columns(spec, cols)
    missing = spec.variables.missing
    return lambda c: (repr(missing.get(c)), c in numeric)


def _read_columns(files: list, part: Partition, cols: list[str]) -> pd.DataFrame:
    """The columns of the partition's records from its files, as stored (a block per
    column: a column kept by the cache holds its own memory only)."""
    import pyarrow as pa

    tables = []
    for pf, piece in zip(files, part.pieces, strict=True):
        table = pf.read_row_groups(list(piece.row_groups), columns=cols)
        if piece.skip or table.num_rows != piece.rows:  # row groups cut at a block
            table = table.slice(piece.skip, piece.rows)
        tables.append(table)
    table = tables[0] if len(tables) == 1 else pa.concat_tables(tables)
    df = table.to_pandas(split_blocks=True)
    df.index = pd.RangeIndex(part.start, part.stop)
    return df


def _write_partition(data: pd.DataFrame, part: Partition, folder: str) -> str:
    """data as folder/part-<first record>.parquet in one row group (plan_partitions then
    reads a stage's folder in the partitions that wrote it, where they end at block
    boundaries), written whole (a temporary name, renamed)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    if str(folder).startswith(MEMORY):  # held, not written (FramePartition)
        _HELD[folder][part.start] = data
        return f"{folder}/{part.start}"
    path = Path(folder) / f"part-{part.start:012d}.parquet"
    tmp = path.with_suffix(".parquet.tmp")
    table = pa.Table.from_pandas(data, preserve_index=False)
    pq.write_table(table, tmp, row_group_size=max(1, len(data)), **parquet_options(table.schema))
    tmp.replace(path)
    return str(path)


def _lookup(frame: pd.DataFrame, table: pd.DataFrame, what: str) -> np.ndarray:
    """The row of table holding each row of frame (same columns; missing values match)."""
    if frame.shape[1] == 0:
        return np.zeros(len(frame), dtype=np.int64)
    t = table.assign(__row=np.arange(len(table)))
    got = frame.reset_index(drop=True).merge(t, how="left", on=list(frame.columns))["__row"]
    if got.isna().any():
        raise PartitionError(f"a record's {what} is not in pass 1's table")
    return got.to_numpy(dtype=np.int64)


def written_partition(folder: str, part: Any) -> Partition | FramePartition:
    """The records a pass wrote for part to folder (_write_partition: a Parquet file of one
    row group, or a frame held in a memory folder), as a partition of the same records."""
    if str(folder).startswith(MEMORY):
        return FramePartition(_HELD[folder][part.start], part.start, part.stop)
    path = str(Path(folder) / f"part-{part.start:012d}.parquet")
    return Partition((Piece(path, (0,), 0, part.stop - part.start),), part.start, part.stop)


def written_identity(folder: str, part: Any) -> tuple:
    """What a pass wrote for part to folder as a cache key (its file's identity; a memory
    folder's name, never reused in the process)."""
    if str(folder).startswith(MEMORY):
        return (folder, part.start)
    return file_identity(str(Path(folder) / f"part-{part.start:012d}.parquet"))


def _selected(part: Partition, folder: str) -> np.ndarray:
    """The partition's indicators of a selection (its folder's column __sel; read-only:
    several passes read them from the process's partition cache)."""
    import pyarrow.parquet as pq

    if str(folder).startswith(MEMORY):
        return _HELD[folder][part.start]["__sel"].to_numpy()
    path = str(Path(folder) / f"part-{part.start:012d}.parquet")

    def read() -> np.ndarray:
        sel = pq.read_table(path, columns=["__sel"]).column(0).to_numpy(zero_copy_only=False)
        sel.setflags(write=False)
        return sel

    return cached(("selection", file_identity(path)), read, lambda sel: sel.nbytes)


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


@dataclass
class ProfileRisk:
    """The risk measures of a profile table (risk_profile's, without the records): the
    metrics, each profile's risk stratum, GenMASSC score r and, for a sample unique, its
    P(F=1|f=1) and E(1/F|f=1) (NaN otherwise), the log-linear fit's method and cells."""

    metrics: dict[str, float]
    by_profile: pd.DataFrame  # stratum, risk_score, p_unique, e_inv_f (the table's rows)
    method: str | None = None
    model_cells: float | None = None


def profile_measures(
    profiles: pd.DataFrame,
    keys: Sequence[KeySpec | str],
    sensitive: Sequence[SensitiveSpec] = (),
    loglinear: bool = True,
    interactions: bool | Sequence[tuple[str, str]] = False,
) -> ProfileRisk:
    """risk_profile's measures (uniques, doubles, triples; GenMASSC scores, paper 000 eq. 1-2;
    pseudo-ML log-linear tau1, tau2, paper 001 eq. 4 and 7) from the whole file's profile
    table (profile_counts of one partition, combine_profiles of many; wsum when loglinear)."""
    names = [k.name for k in _specs(keys)]
    m = profiles["count"].to_numpy()
    n = int(m.sum())
    out = cell_metrics(n, len(m), np.bincount(np.minimum(m, 4), weights=m, minlength=5))
    r = np.full(len(m), np.nan)
    if sensitive:
        r = profile_scores(profiles, sensitive)
        out.update(
            mean_score=float((m * r).sum() / n),
            max_score=float(r.max()),
            n_score_1=float(m[r >= 1.0 - 1e-12].sum()),
        )
    p1 = e_inv = np.full(len(m), np.nan)
    method = cells = None
    if loglinear:
        # each key's levels in first-appearance order (profiles are), as risk._key_codes has them
        per = [factorize(profiles[k], use_na_sentinel=False) for k in names]
        sizes = [len(u) for _, u in per]
        pairs = interaction_pairs(names, interactions)
        cell = table_cells([c.astype(np.int64) for c, _ in per], sizes)
        k_all = int(np.prod(np.array(sizes, dtype=float)))
        if k_all > MAX_CELLS:  # (loglinear_risk's bound, its message)
            raise RiskInputError(
                f"keys: the full table of key cells has {k_all:,} cells (levels "
                f"{dict(zip(names, sizes, strict=True))}), more than max_cells={MAX_CELLS:,}; "
                "coarsen keys (bins or map) or drop a key"
            )
        f = np.bincount(cell, weights=m, minlength=k_all).astype(np.int64)
        y = np.bincount(cell, weights=profiles["wsum"].to_numpy(), minlength=k_all)
        fit, lam_cell, method = fit_table(f, y, sizes, pairs, None)
        unique = m == 1
        w = np.where(unique, profiles["wsum"].to_numpy(), 1.0)  # a unique's sum is its weight
        p1, e_inv = unique_risk(lam_cell[cell], w, None, unique)
        out.update(tau1=float(np.nansum(p1)), tau2=float(np.nansum(e_inv)))
        out["tau1_share"] = out["tau1"] / n
        out["tau2_share"] = out["tau2"] / n
        cells = float(fit.n_cells)
    stratum = np.asarray(STRATA)[np.minimum(m, 4) - 1]
    table = pd.DataFrame({"stratum": stratum, "risk_score": r, "p_unique": p1, "e_inv_f": e_inv})
    return ProfileRisk(out, table, method, cells)


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


PROFILE_ROOM = 2**62  # profile_rows' codes stay below it


def profile_rows(
    df: pd.DataFrame,
    keys: Sequence[KeySpec | str],
    profiles: pd.DataFrame,
    missing_ok: bool = False,
) -> np.ndarray:
    """The row of each record's key profile in the whole input's table (combine_profiles);
    -1 for a profile not in it when missing_ok. A label matches an equal one (a missing
    value a missing value): each key's levels are looked up among the table's labels, the
    keys' codes combined into one integer per profile."""
    rec = np.zeros(len(df), dtype=np.int64)
    tab = np.zeros(len(profiles), dtype=np.int64)
    room = 1
    for k in _specs(keys):
        c, lv = key_levels(df[k.name], k)
        tcode, tlabels = factorize(profiles[k.name].astype(object), use_na_sentinel=False)
        level = pd.Index(tlabels, dtype=object).get_indexer(pd.Index(lv, dtype=object))
        size = len(tlabels) + 1  # 0: a label the table lacks
        if room * size >= PROFILE_ROOM:  # compact the codes so far (no overflow)
            tab, rec, room = _compacted(tab, rec)
        rec = rec * size + (level[c] + 1)
        tab = tab * size + (tcode.astype(np.int64) + 1)
        room *= size
    table = pd.Index(tab)
    if not table.is_unique:
        raise PartitionError("profiles: a key profile is in the table given more than once")
    at = table.get_indexer(rec).astype(np.int64)
    if not missing_ok and (at < 0).any():
        raise PartitionError("profiles: a record's key profile is not in the table given")
    return at


def _compacted(tab: np.ndarray, rec: np.ndarray) -> tuple[np.ndarray, np.ndarray, int]:
    """The table's codes renumbered 1..k (0 for a record's code the table lacks)."""
    ids, inv = np.unique(tab, return_inverse=True)
    at = np.minimum(np.searchsorted(ids, rec), max(len(ids) - 1, 0))
    found = ids[at] == rec if len(ids) else np.zeros(len(rec), dtype=bool)
    return inv.ravel().astype(np.int64) + 1, np.where(found, at + 1, 0), len(ids) + 1


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
            c, lv = factorize(df[column], use_na_sentinel=True)
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
    hc, hu = factorize(h)
    pc, pu = factorize(p)
    code, pair = factorize(hc.astype(np.int64) * len(pu) + pc)
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
    g, psus = _psu_keys(df, req)
    P = len(psus)
    per = req.domain_codes(df)
    # cells: the crossing of every domain's level (a domain's level is a union of cells)
    codes = [c + 1 for c, _ in per]  # 0: no level
    cell = _combine(codes, [len(u) + 1 for _, u in per]) if per else np.zeros(len(df), np.int64)
    C = int(cell.max()) + 1 if len(cell) else 0
    n_c, W_c, X_c, Y_c, XR_c, YR_c, psu_W = _cell_sums(df, req, w, cell, C, g, P)
    out = MeansPass1(psus, np.bincount(g, w, P), psu_W, [], [], [], [], [], [], [])
    first = first_of(cell, C)
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


def _cell_sums(
    df: pd.DataFrame, req: MeansRequest, w: np.ndarray, cell: np.ndarray, C: int, g: np.ndarray,
    P: int,
) -> tuple[np.ndarray, ...]:  # fmt: skip
    """Per cell: records n, sum w, sum w nn (X), sum w y0 (Y) and the replicate sums XR, YR
    (C x R x k); and the replicate weights' sums by PSU (g: each record's of P). A cell's sums
    are [F 1]' Z of its rows: with few replicate factor groups (W_i = w_i F_g, as a
    jackknife's within PSUs), Z the sums of w [y0 nn] by (cell, group) and F its groups'
    factors (W read once, no record gathered: 3 partitions of 1M records, 70 replicates, 50
    variables: 22.0-25.6 -> 17.9 CPU s); else Z the records' [y0 nn] and F their [W w], taken
    once in cell order (a column at a time)."""
    k, R, n = len(req.variables), len(req.replicate_weights), len(df)
    W = df[list(req.replicate_weights)].to_numpy(dtype=float) if R else None
    groups = replicate_factor_groups(W, w) if R and n else None
    if groups is not None:
        codes, G, F = groups
        pairs, of = dense_codes(cell * G + codes)  # (cell, group), sorted by cell
        Z = sparse_times(group_indicator(of, len(pairs)), _observed_block(df, req, w))
        rows = np.column_stack([F[pairs % G], np.ones(len(pairs))])
        cell_of = pairs // G
        pg, pof = dense_codes(g * G + codes)  # (PSU, group): sum w F_g
        psu_W = sparse_times(group_indicator(pg // G, P), F[pg % G] * np.bincount(pof, w)[:, None])
    else:
        order = np.argsort(cell, kind="stable")
        Z = _observed_block(df, req, None, order)
        rows = np.empty((n, R + 1), order="F")  # the replicate weights and w, in cell order
        for j in range(R):
            np.take(W[:, j], order, out=rows[:, j])
        np.take(w, order, out=rows[:, R])
        cell_of = cell[order]
        psu_W = sparse_times(group_indicator(g[order], P), rows[:, :R]) if R else np.zeros((P, 0))
    bounds = np.searchsorted(cell_of, np.arange(C + 1))
    S = np.empty((C, R + 1, 2 * k))
    for c in range(C):  # (sums of a cell of no row: 0)
        a, b = bounds[c], bounds[c + 1]
        np.matmul(rows[a:b].T, Z[a:b], out=S[c])
    n_c = np.bincount(cell, minlength=C).astype(float)
    W_c = np.bincount(cell, w, C)
    return n_c, W_c, S[:, R, k:], S[:, R, :k], S[:, :R, k:], S[:, :R, :k], psu_W


def _observed_block(
    df: pd.DataFrame, req: MeansRequest, w: np.ndarray | None, order: np.ndarray | None = None
) -> np.ndarray:
    """[y0 nn] (n x 2k: the variables, missing as 0, then 1{observed}), times w when given,
    taken in order when given; column-major, a column at a time."""
    k = len(req.variables)
    Ys = np.empty((len(df), 2 * k), order="F")
    for j, c in enumerate(req.variables):
        y = df[c].to_numpy(dtype=float, na_value=np.nan)
        if order is not None:
            y = y.take(order)
        seen = ~np.isnan(y)
        Ys[:, j] = np.where(seen, y, 0.0)
        Ys[:, k + j] = seen
        if w is not None:
            Ys[:, j] *= w
            Ys[:, k + j] *= w
    return Ys


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
        whole = bool(on.all())  # every record in a level: no gathers of the records
        rows = slice(None) if whole else np.flatnonzero(on)
        cd = code[rows]
        c = Rd[cd]  # each record's level's R, then in place: y - R n (the linearization)
        c *= nn[rows]
        np.subtract(y0[rows], c, out=c)
        wc = w[rows, None] * c
        pair, of = dense_codes(g[rows] * L + cd)
        out.psus.append(psus.iloc[pair // L].reset_index(drop=True))
        out.level.append(pair % L)
        out.zt.append(group_indicator(of, len(pair)) @ wc)
        out.ss.append(_sum_by(cd, np.multiply(wc, c, out=c), L))
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


def scan_pass1(
    part: Partition, spec: ReleaseSpec, req: MeansRequest, means: bool = True
) -> ScanPartial:
    """Pass 1 of a scan on one partition (read here: a worker reads its own partition). One
    BLAS thread: the sums are the same whichever process or thread count runs it. means
    False: the PSUs without the means' sums (a scan that measures no SE)."""
    df = read_partition(part, scan_columns(spec, req), spec)
    with single_blas_thread():
        return ScanPartial(
            records=len(df),
            profiles=profile_counts(
                df, spec.variables.keys, spec.design.weight, spec.variables.sensitive
            ),
            edits=rule_failures(df, spec.edits),
            means=means_pass1(df, req) if means else psus_of(df, req),
        )


def profile_pass(part: Any, spec: ReleaseSpec) -> pd.DataFrame:
    """Map: the profile table of one partition's keys (profile_counts; combine_profiles)."""
    v = spec.variables
    w = spec.design.weight
    cols = [k.name for k in v.keys] + [s.name for s in v.sensitive] + ([w] if w else [])
    df = read_partition(part, list(dict.fromkeys(cols)), spec)
    return profile_counts(df, v.keys, w, v.sensitive)


def psus_of(df: pd.DataFrame, req: MeansRequest) -> MeansPass1:
    """The partition's PSUs as a MeansPass1 without sums (means_pass1's checks of the weight
    and the design labels)."""
    w = df[req.weight].to_numpy(dtype=float)
    if not (w > 0).all():
        raise PartitionError(f"design.weight: column '{req.weight}' has weights <= 0 or missing")
    _, psus = _psu_keys(df, req)
    P = len(psus)
    return MeansPass1(psus, np.zeros(P), np.zeros((P, 0)), [], [], [], [], [], [], [])


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
    return profile_measures(
        profiles,
        v.keys,
        v.sensitive,
        loglinear=section.loglinear,
        interactions=section.interactions or False,
    ).metrics


def combine_scan(partials: Sequence[ScanPartial]) -> dict[str, Any]:
    """The whole input's records, profiles, edit failures and pass 1 sums."""
    return {
        "records": sum(p.records for p in partials),
        "profiles": combine_profiles([p.profiles for p in partials]),
        "edits": combine_rule_failures([p.edits for p in partials]),
        "means": combine_pass1([p.means for p in partials]),
    }


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


# ---------------------------------------------------------------- the published records' originals


@dataclass(frozen=True)
class Linked:
    """A partition of the published records (rows start..stop-1 of the published file) and
    the original records they are: the retained records lo..hi-1 (by rank among a partition's
    retained records) of each original partition they come from."""

    start: int
    stop: int
    released: Any
    originals: tuple[tuple[Any, int, int], ...]


def retained_in(part: Any, selected: str) -> int:
    """Map: the partition's records MASSC retained (its d(2) selection in `selected`)."""

    return int(_selected(part, selected).sum())


def link(original: Sequence[Any], released: Sequence[Any], retained: Sequence[int]) -> list[Linked]:
    """Each published partition with the original records it holds: the published file is
    the retained records in record order (retained: each original partition's count)."""
    n_r = released[-1].stop if released else 0
    if sum(retained) != n_r:
        raise PartitionError(
            f"assess: {n_r} published records, but {sum(retained)} original records retained; "
            "the records after the last stage are not the retained ones in order"
        )
    before = np.cumsum([0, *retained])
    out = []
    for r in released:
        spans = []
        for p, a, c in zip(original, before[:-1].tolist(), retained, strict=True):
            lo, hi = max(r.start, a), min(r.stop, a + c)
            if lo < hi:
                spans.append((p, lo - a, hi - a))
        out.append(Linked(r.start, r.stop, r, tuple(spans)))
    return out


def linked_originals(
    linked: Linked, columns: list[str], spec: ReleaseSpec, selected: str | None
) -> pd.DataFrame:
    """The original records a published partition holds (columns of them), in its order:
    the retained records lo..hi-1 of each original partition (MASSC's d(2) in `selected`)."""

    parts = []
    for p, lo, hi in linked.originals:
        o = read_partition(p, columns, spec)
        kept = np.flatnonzero(_selected(p, selected)) if selected else np.arange(len(o))
        parts.append(o.iloc[kept[lo:hi]])
    return pd.concat(parts) if parts else pd.DataFrame(columns=columns)


def input_rows(linked: Linked, selected: str | None) -> np.ndarray:
    """Map: each record of a published partition's original record, as its row in the input
    (the retained records lo..hi-1 of each original partition it comes from, MASSC's d(2) in
    `selected`)."""

    at = []
    for p, lo, hi in linked.originals:
        kept = np.flatnonzero(_selected(p, selected)) if selected else np.arange(p.stop - p.start)
        at.append(p.start + kept[lo:hi])
    return np.concatenate(at) if at else np.zeros(0, dtype=np.int64)
