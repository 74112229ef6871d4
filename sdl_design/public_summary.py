"""What the public README and codebook say about the public file, without the file: its record
count, columns and dtypes, each column's missing values, exact distinct count, range and (for a
text column with few values) its values, and one row per PSU of its design (the replicate
weights' zero patterns give JKn's scale factors). Made from the whole frame in memory, or
from the parts of a file (row groups) merged: small value sets are merged on the driver, the
distinct values of a column with many are counted by hash bucket (each bucket's values from
every part, read from disk by one task), so that no process holds a whole column's values.
"""

from __future__ import annotations

import pickle
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd

from sdl_design.survey.design import DesignError, sorted_codes

# a part sends the distinct values of a column when it has at most this many
SMALL = 4096
# a text column's values are listed in the codebook when it has at most this many
VALUES_MAX = 60
# the distinct values one bucket task holds, about (with every column's)
BUCKET_VALUES = 1 << 23
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


@dataclass
class ColumnStats:
    """One column: dtype, numeric or not, missing values, exact distinct non-missing values,
    min and max (numeric; None without a value) and the distinct values as sorted text (a
    non-numeric column with at most VALUES_MAX of them, else None)."""

    dtype: str
    numeric: bool
    n_missing: int
    n_distinct: int
    lo: float | None = None
    hi: float | None = None
    values: list[str] | None = None


@dataclass(frozen=True)
class PsuKey:
    """How the PSU rows are made: the weight, strata, PSU and replicate weight columns, and
    whether each record is its own PSU (JKn without a PSU column: a row per stratum)."""

    weight: str
    strata: str | None
    psu: str | None
    reps: tuple[str, ...]
    per_record: bool = False


@dataclass
class PublicSummary:
    """The public file as the README and codebook read it (see the module)."""

    n: int
    columns: list[str]
    stats: dict[str, ColumnStats]  # every column (distinct counts: None when not asked for)
    psus: pd.DataFrame | None = None  # one row per PSU (psu_rows), when a PsuKey was given

    @property
    def shape(self) -> tuple[int, int]:
        return self.n, len(self.columns)

    def numeric(self, column: str) -> bool:
        return self.stats[column].numeric


# ---------------------------------------------------------------- one part


def _is_numeric(s: pd.Series) -> bool:
    return bool(pd.api.types.is_numeric_dtype(s))


def _numeric_stats(df: pd.DataFrame, num: list[str], batch: int = 16) -> dict[str, tuple]:
    """(missing, distinct non-missing, min, max) of the numeric columns, polars' passes over
    `batch` columns at a time (its threads, no GIL; NaN is missing)."""
    import polars as pl

    if not num or len(df) == 0:
        return {c: (int(df[c].isna().sum()), 0, float("nan"), float("nan")) for c in num}
    out: dict[str, tuple] = {}
    for a in range(0, len(num), batch):
        cols = num[a : a + batch]
        frame = pl.from_pandas(df[cols].reset_index(drop=True), nan_to_null=True)
        ex = [pl.col(c) for c in frame.columns]
        row = frame.select(
            *(c.null_count().alias(f"m{j}") for j, c in enumerate(ex)),
            *(c.drop_nulls().n_unique().alias(f"u{j}") for j, c in enumerate(ex)),
            *(c.min().cast(pl.Float64).alias(f"lo{j}") for j, c in enumerate(ex)),
            *(c.max().cast(pl.Float64).alias(f"hi{j}") for j, c in enumerate(ex)),
        ).row(0, named=True)
        for j, c in enumerate(cols):
            out[c] = (int(row[f"m{j}"]), int(row[f"u{j}"]), row[f"lo{j}"], row[f"hi{j}"])
    return out


def _numeric_values(s: pd.Series, distinct: bool = True) -> np.ndarray:
    """The column's distinct non-missing values as polars tells them apart (NaN missing, -0.0
    equal to 0.0): floats as float64, integers as int64 (uint64 as it is), booleans 0/1
    (distinct False: every record's non-missing value, in that form)."""
    miss = s.isna().to_numpy()
    if pd.api.types.is_bool_dtype(s):
        v = s.to_numpy(dtype=np.int64, na_value=0)[~miss]
    elif pd.api.types.is_float_dtype(s):
        v = s.to_numpy(dtype=np.float64, na_value=np.nan)[~miss]
        v = v[~np.isnan(v)] + 0.0  # -0.0 is 0.0
    elif s.dtype.kind == "u" or str(s.dtype) == "UInt64":
        v = s.to_numpy(dtype=np.uint64, na_value=0)[~miss]
    else:
        v = s.to_numpy(dtype=np.int64, na_value=0)[~miss]
    return pd.unique(v) if distinct else v


def _text_values(s: pd.Series) -> np.ndarray:
    """The column's distinct non-missing values (pd.unique's), as objects."""
    return np.asarray(pd.unique(s.dropna()), dtype=object)


def _bucket_of(values: np.ndarray, numeric: bool, bits: int) -> np.ndarray:
    """The hash bucket (0..2^bits-1) of each distinct value: equal values, equal buckets."""
    if bits == 0:
        return np.zeros(len(values), dtype=np.int64)
    if numeric:
        v = np.asarray(values)
        u = v.view(np.uint64) if v.dtype.itemsize == 8 else v.astype(np.int64).view(np.uint64)
        h = u * _GOLDEN  # Fibonacci hashing (wraps modulo 2^64)
    else:
        h = pd.util.hash_array(np.asarray([str(x) for x in values], dtype=object))
    return (h >> np.uint64(64 - bits)).astype(np.int64)


@dataclass
class PartSummary:
    """One part's columns: stats as of the part (the distinct count of the part alone), the
    distinct values of the columns with at most `small` of them, and the columns whose values
    went to the bucket files; whole: the part is the whole file (its stats are the file's,
    no value kept)."""

    n: int
    stats: dict[str, ColumnStats]
    small: dict[str, np.ndarray] = field(default_factory=dict)
    bucketed: set[str] = field(default_factory=set)
    psus: pd.DataFrame | None = None
    whole: bool = False


def _column_stats(df: pd.DataFrame) -> tuple[dict[str, ColumnStats], dict[str, np.ndarray]]:
    """Every column's ColumnStats of df alone, and the distinct values of its text columns."""
    ns = _numeric_stats(df, [c for c in df.columns if _is_numeric(df[c])])
    stats: dict[str, ColumnStats] = {}
    text: dict[str, np.ndarray] = {}
    for c in df.columns:
        s = df[c]
        if c in ns:
            miss, n_u, lo, hi = ns[c]
            stats[c] = ColumnStats(str(s.dtype), True, miss, n_u, lo, hi)
        else:
            text[c] = values = _text_values(s)
            listed = sorted(map(str, values)) if len(values) <= VALUES_MAX else None
            stats[c] = ColumnStats(
                str(s.dtype), False, int(s.isna().sum()), len(values), values=listed
            )
    return stats, text


def summarize_part(
    df: pd.DataFrame,
    folder: str,
    name: str,
    bits: int = 0,
    small: int | None = SMALL,
    key: PsuKey | None = None,
) -> PartSummary:
    """The PartSummary of df, one part of a file: its columns' missing values, ranges and
    distinct values; the distinct values of a column with more than `small` of them are
    written to folder/b<bucket>/<name>.pkl (2^bits buckets by hash); small None: df is the
    whole file, its distinct counts are the file's (no value kept or written). key: its PSU
    rows too (psu_rows: df's records in the public order when they are the PSUs)."""
    stats, text = _column_stats(df)
    out = PartSummary(len(df), stats, whole=small is None)
    out.psus = psu_rows(df, key) if key is not None else None
    if small is None:  # the distinct values of one part: its counts, nothing to merge
        return out
    sinks: list = []
    try:
        for c in df.columns:  # one column's values at a time
            few = stats[c].n_distinct <= small  # (the part's own count)
            values = text.pop(c) if c in text else _numeric_values(df[c], distinct=few)
            if few:
                out.small[c] = values
                continue
            if not sinks:
                for b in range(1 << bits):
                    where = Path(folder) / f"b{b:05d}"
                    where.mkdir(parents=True, exist_ok=True)
                    sinks.append(open(where / f"{name}.pkl", "wb"))  # noqa: SIM115
            # the values by bucket (a stable radix sort of the bucket numbers)
            b_of = _bucket_of(values, stats[c].numeric, bits).astype(np.uint16)
            values = values[np.argsort(b_of, kind="stable")]
            ends = np.cumsum(np.bincount(b_of, minlength=len(sinks)))
            for b, sink in enumerate(sinks):
                piece = values[(ends[b - 1] if b else 0) : ends[b]]
                pickle.dump((c, piece), sink, protocol=pickle.HIGHEST_PROTOCOL)
            out.bucketed.add(c)
            del values, b_of
    finally:
        for sink in sinks:
            sink.close()
    return out


# ---------------------------------------------------------------- PSU rows


RECORDS = "__records"  # the records of a stratum, in the PSU rows of a design without PSUs


def psu_rows(df: pd.DataFrame, key: PsuKey, batch: int = 8) -> pd.DataFrame:
    """One row per PSU of df's records: its strata and PSU labels, the weight 1.0 and, per
    replicate weight, the largest weight of its records (0: the replicate deletes the PSU; -1:
    a record's is missing or negative, which SurveyDesign refuses). SurveyDesign on these rows
    has the replicate scale factors of the whole file's design (JKn: the stratum of the first
    PSU, in label order, whose replicate weights are all 0). When the records are the PSUs
    (key.per_record: JKn without a PSU column) one row per stratum instead: its records
    (RECORDS) and per replicate weight the smallest of its records' (0: a record of the
    stratum is deleted; record_jkn_scales reads these). The rows of several parts merge with
    merge_psus; the replicate weights are read `batch` columns at a time."""
    return _by_psu(df, key, batch)


def _by_psu(frame: pd.DataFrame, key: PsuKey, batch: int = 8) -> pd.DataFrame:
    """psu_rows of frame: records, or the PSU rows of several parts."""
    by = [c for c in (key.strata, None if key.per_record else key.psu) if c]
    reps = list(key.reps)
    if by:
        g = frame.groupby(by, sort=False, dropna=False, observed=True)
        codes, first = g.ngroup().to_numpy(), g.head(1).index
        out = frame.loc[first, by].reset_index(drop=True)
    else:  # one row: no strata (and no PSUs, or records that are the PSUs)
        codes = np.zeros(len(frame), dtype=np.int64)
        out = pd.DataFrame(index=range(1 if len(frame) else 0))
    out[key.weight] = 1.0
    if key.per_record:
        n = frame[RECORDS].to_numpy() if RECORDS in frame.columns else np.ones(len(frame))
        out[RECORDS] = np.bincount(codes, weights=n, minlength=len(out)).astype(np.int64)
    cols = {}
    for a in range(0, len(reps), batch):
        names = reps[a : a + batch]
        W = pd.DataFrame(frame[names].to_numpy(dtype=float), columns=names)
        W[~(W >= 0)] = -1.0
        gw = W.groupby(codes, sort=True)
        hi, lo = gw.max(), gw.min()
        for c in names:
            low = lo[c].to_numpy()
            cols[c] = np.where(low >= 0, low if key.per_record else hi[c].to_numpy(), -1.0)
    return pd.concat([out, pd.DataFrame(cols, columns=reps)], axis=1)


def merge_psus(parts: Sequence[pd.DataFrame], key: PsuKey) -> pd.DataFrame:
    """The PSU rows of a file from its parts'."""
    return _by_psu(pd.concat(list(parts), ignore_index=True), key)


def record_jkn_scales(rows: pd.DataFrame, strata: str | None, reps: list[str]) -> np.ndarray:
    """JKn's scale factors of a design whose records are its PSUs, from psu_rows' rows per
    stratum: (n_h - 1)/n_h of the first stratum (in label order) with a record the replicate
    deletes, n_h its records (SurveyDesign's, whose PSUs are then ordered by stratum and
    record)."""

    if strata and rows[strata].isna().any():
        raise DesignError(f"design: column '{strata}' has missing values; every record needs one")
    h = sorted_codes(rows[strata]) if strata else np.zeros(len(rows), dtype=np.int64)
    W = rows[reps].to_numpy(dtype=float)
    bad = (W < 0).any(axis=0)
    if bad.any():
        cols = [c for c, b in zip(reps, bad, strict=True) if b][:5]
        raise DesignError(
            f"design.replicate_weights: columns {cols} have missing or negative weights; "
            "replicate weights must be >= 0"
        )
    order = np.argsort(h, kind="stable")
    zero = W[order] == 0
    ok = zero.any(axis=0)
    if not ok.all():
        raise DesignError(
            f"design.replicate_weights: jkn replicates {np.flatnonzero(~ok)[:5].tolist()} delete "
            "no PSU; give rscales or check the method"
        )
    n_h = rows[RECORDS].to_numpy(dtype=float)[order][zero.argmax(axis=0)]
    return (n_h - 1.0) / n_h


# ---------------------------------------------------------------- whole and merged


def public_summary(
    puf: pd.DataFrame, key: PsuKey | None = None, stats: bool = True
) -> PublicSummary:
    """The PublicSummary of a whole frame (stats False: columns and dtypes only)."""
    if stats:
        st, _ = _column_stats(puf)
    else:
        st = {c: ColumnStats(str(puf[c].dtype), _is_numeric(puf[c]), 0, 0) for c in puf.columns}
    psus = psu_rows(puf, key) if key is not None else None
    return PublicSummary(len(puf), list(puf.columns), st, psus)


@dataclass
class Bucket:
    """One hash bucket of the distinct values (start, stop: for the runners' progress), with
    the small value sets of the parts that did not write it, for the bucketed columns."""

    start: int
    stop: int
    extra: dict[str, np.ndarray]


def distinct_in_bucket(bucket: Bucket, folder: str) -> dict[str, int]:
    """Map: the distinct values of each bucketed column in this bucket (every part's file)."""
    got: dict[str, list[np.ndarray]] = {c: [v] for c, v in bucket.extra.items()}
    for f in sorted((Path(folder) / f"b{bucket.start:05d}").glob("*.pkl")):
        with open(f, "rb") as src:
            while True:
                try:
                    c, v = pickle.load(src)
                except EOFError:
                    break
                got.setdefault(c, []).append(v)
    return {c: n_distinct(np.concatenate(v)) for c, v in got.items()}


def n_distinct(values: np.ndarray) -> int:
    """The number of distinct values (NaN one value, -0.0 equal to 0.0, as pd.unique): numbers
    by a sort (numpy's SIMD sort: 2M floats in 57 ms, hashing them 218 ms), others by hash."""
    if values.dtype.kind in "biuf":
        return len(np.unique(values))
    return len(pd.unique(values))


def bucket_bits(n: int, columns: int, per_bucket: int = BUCKET_VALUES) -> int:
    """Hash bits: 2^bits buckets of at most about per_bucket values (n records x columns)."""
    need = -(-max(n, 1) * max(columns, 1) // per_bucket)
    return int(max(0, need - 1).bit_length())


def merge_parts(
    parts: Sequence[PartSummary], columns: Sequence[str], bits: int, key: PsuKey | None = None
) -> tuple[PublicSummary, list[Bucket]]:
    """The file's summary from its parts' (in the file's order; the distinct counts of the
    bucketed columns left at 0) and the buckets whose distinct_in_bucket counts add up to
    them (none when every column's values were small: add_bucket_counts). Raises when the
    parts type a column otherwise. One part that is the whole file (PartSummary.whole): its
    stats, as they are."""
    if len(parts) == 1 and parts[0].whole:
        (part,) = parts
        stats = {c: part.stats[c] for c in columns}
        return PublicSummary(part.n, list(columns), stats, part.psus), []
    stats: dict[str, ColumnStats] = {}
    bucketed = set().union(*(p.bucketed for p in parts))
    extra: list[dict[str, list]] = [{} for _ in range(1 << bits)]
    for c in columns:
        each = [p.stats[c] for p in parts]
        kinds = {(s.dtype, s.numeric) for s in each}
        if len(kinds) > 1:
            raise ValueError(f"column {c!r} has dtypes {sorted(kinds)} in different parts")
        dtype, numeric = each[0].dtype, each[0].numeric
        los = [s.lo for s in each if s.lo is not None]
        his = [s.hi for s in each if s.hi is not None]
        st = ColumnStats(
            dtype,
            numeric,
            sum(s.n_missing for s in each),
            0,
            min(los) if los else None,
            max(his) if his else None,
        )
        small = [p.small[c] for p in parts if c in p.small]
        if c in bucketed:
            for v in small:
                b = _bucket_of(v, numeric, bits)
                for k in np.unique(b):
                    extra[k].setdefault(c, []).append(v[b == k])
        else:
            values = pd.unique(np.concatenate(small)) if small else np.empty(0)
            st.n_distinct = len(values)
            if not numeric and st.n_distinct <= VALUES_MAX:
                st.values = sorted(map(str, values))
        stats[c] = st
    buckets = [
        Bucket(b, b + 1, {c: np.concatenate(v) for c, v in extra[b].items()})
        for b in range(1 << bits)
    ]
    psus = None
    if key is not None:
        psus = merge_psus([p.psus for p in parts if p.psus is not None], key)
    out = PublicSummary(sum(p.n for p in parts), list(columns), stats, psus)
    return out, buckets if bucketed else []


def add_bucket_counts(summary: PublicSummary, counts: Sequence[dict[str, int]]) -> None:
    """The bucketed columns' distinct counts: the sums of their buckets' (in place)."""
    for got in counts:
        for c, k in got.items():
            summary.stats[c].n_distinct += int(k)
