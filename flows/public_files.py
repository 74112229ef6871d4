"""The public files: which columns may leave; writing puf.parquet, puf.csv, codebook.csv, README.md
and (with replicate weights) replicate_scales.csv."""

from __future__ import annotations

import hashlib
import os
import shutil
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd

from expectations.suites import output_verdicts, record_failures
from flows.public_docs import REPLICATE_SCALES, codebook, psu_key, variance_notes
from sdl_design.edits import combine_rule_failures, rule_failures
from sdl_design.engine.partitions import read_partition
from sdl_design.io import GrowingFileDigest, file_digest, parquet_options
from sdl_design.keys import coded_keys, publish_coding
from sdl_design.leaks import drop_unused_levels, publish_order
from sdl_design.public_summary import (
    BUCKET_VALUES,
    SMALL,
    PartSummary,
    PsuKey,
    PublicSummary,
    add_bucket_counts,
    bucket_bits,
    distinct_in_bucket,
    merge_parts,
    summarize_part,
)
from sdl_design.spec import ReleaseSpec

if TYPE_CHECKING:
    from sdl_design.stage import StageResult


def public_frame(
    df: pd.DataFrame,
    spec: ReleaseSpec,
    masked_design: bool,
    drop: Sequence[str] = (),
    design_columns: Sequence[str] = (),
    labels: Sequence[str] = (),
) -> pd.DataFrame:
    """The public file's frame (public_records without the records' input labels)."""
    return public_records(df, spec, masked_design, drop, design_columns, labels)[0]


def public_records(
    df: pd.DataFrame,
    spec: ReleaseSpec,
    masked_design: bool,
    drop: Sequence[str] = (),
    design_columns: Sequence[str] = (),
    labels: Sequence[str] = (),
) -> tuple[pd.DataFrame, pd.Index]:
    """The public file's frame: only the columns the spec classifies as publishable
    (ReleaseSpec.published_columns), every coded key in its published coding
    (keys.publish_coding), categorical levels no record has dropped, and the records sorted by
    their published values (the design labels `labels` first, then the columns in file order:
    leaks.publish_order), never in the confidential file's order; and each row's index label
    in df (the input's). design_columns: those a stage built for the public design (pseudo
    strata, PSUs, replicate weights)."""
    keep = spec.published_columns(list(df.columns), masked_design, drop, design_columns)
    out = drop_unused_levels(publish_coding(df[keep], spec.variables.keys))
    order = publish_order(
        [*[c for c in labels if c in keep], *[c for c in keep if c not in labels]],
        lambda c: out[c],
        len(out),
    )
    return out.iloc[order].reset_index(drop=True), df.index[order]


def record_map(original_index: pd.Index, published: pd.Index) -> pd.DataFrame:
    """The confidential record map (internal/record_map.parquet): input_row (0-based row of the
    input file), public_row (0-based row of puf.parquet, null when the record is not
    published). published: each public row's index label in the input (public_records)."""
    pos = original_index.get_indexer(published)
    if (pos < 0).any():
        raise ValueError("record map: a public record has no row in the input file")
    public_row = np.full(len(original_index), -1, dtype=np.int64)
    public_row[pos] = np.arange(len(published))
    row = pd.array(public_row, dtype="Int64")
    row[public_row < 0] = pd.NA
    return pd.DataFrame(
        {"input_row": np.arange(len(original_index), dtype=np.int64), "public_row": row}
    )


def detail_frame(
    puf: pd.DataFrame, df: pd.DataFrame, rows: pd.Index, spec: ReleaseSpec
) -> pd.DataFrame | None:
    """The public records (puf) with each coded key's values before its published coding, read
    from df at the records' index labels rows (None when no key is coded)."""

    coded = [k.name for k in coded_keys(spec.variables.keys) if k.name in puf.columns]
    if not coded:
        return None
    pos = df.index.get_indexer(rows)
    return puf.assign(**{c: df[c].to_numpy()[pos] for c in coded})


# text cells a spreadsheet would run as a formula (OWASP "CSV injection")
FORMULA_PREFIXES = ("=", "+", "-", "@", "\t", "\r")


def _formula_values(values: pd.Series) -> np.ndarray:
    """Whether each value is a text leading with a formula prefix, tested once per distinct
    value (a number in a mixed column stays a number, a missing value is no formula)."""
    try:
        codes, distinct = pd.factorize(values)  # missing values: code -1
    except TypeError:  # unhashable objects: each record's value
        codes, distinct = np.arange(len(values)), values.to_numpy(dtype=object)
    text = pd.Series(np.asarray(distinct, dtype=object)).astype("string")
    hit = text.str.startswith(FORMULA_PREFIXES).fillna(False).to_numpy(bool)
    if values.dtype == object and hit.any():
        hit &= np.array([isinstance(x, str) for x in distinct], dtype=bool)
    return np.append(hit, False)[codes]


def _neutralize(values: pd.Series) -> pd.Series:
    hit = _formula_values(values)
    return values.mask(hit, "'" + values.astype("string")) if hit.any() else values


def neutralize_formulas(df: pd.DataFrame) -> pd.DataFrame:
    """The frame with every formula-leading text cell and column name (FORMULA_PREFIXES)
    prefixed by a single quote, for the CSV files; numeric columns are left as they are (-3
    stays a number)."""
    names = {
        c: "'" + c for c in df.columns if isinstance(c, str) and c.startswith(FORMULA_PREFIXES)
    }
    if names:
        return _neutralize_cells(df).rename(columns=names)
    return _neutralize_cells(df)


def _neutralize_cells(df: pd.DataFrame) -> pd.DataFrame:
    """neutralize_formulas' cells."""
    out = None
    for c in df.columns:
        s = df[c]
        if isinstance(s.dtype, pd.CategoricalDtype):
            cats = pd.Series(s.cat.categories.astype(str))
            new = _neutralize(cats)
            if not new.equals(cats):
                out = df.copy() if out is None else out
                out[c] = s.cat.rename_categories(list(new))
        elif pd.api.types.is_string_dtype(s) or s.dtype == object:
            new = _neutralize(s)
            if new is not s:
                out = df.copy() if out is None else out
                out[c] = new
    return df if out is None else out


# every file a public folder may hold (replicate_scales.csv: with replicate weights)
PUBLIC_FILES = ("README.md", "codebook.csv", "puf.csv", "puf.parquet", REPLICATE_SCALES)


def public_names(folder: Path) -> list[str]:
    """The public files folder holds (PUBLIC_FILES that are there), sorted."""
    return sorted(name for name in PUBLIC_FILES if (Path(folder) / name).is_file())


def write_docs_files(notes: str, book: pd.DataFrame, folder: Path) -> None:
    """The README, the codebook (book) and, when notes carries them (PublicReadme), the
    replicate weights' multipliers (REPLICATE_SCALES) into folder; the CSVs with
    formula-leading text quoted."""
    neutralize_formulas(book).to_csv(folder / "codebook.csv", index=False, lineterminator="\n")
    scales = getattr(notes, "replicate_scales", None)
    if scales is not None:
        neutralize_formulas(scales).to_csv(
            folder / REPLICATE_SCALES, index=False, lineterminator="\n"
        )
    (folder / "README.md").write_text(notes)


def write_public_files(puf: pd.DataFrame, public: Path, notes: str) -> dict[str, str]:
    """Write the public folder (created here); returns {'public/<file>': sha256}."""
    from concurrent.futures import ThreadPoolExecutor

    import pyarrow as pa
    import pyarrow.parquet as pq

    public.mkdir()

    # the CSV (float formatting, one core for a minute at 1M records in pandas, seconds in
    # polars, which leaves the GIL) is written while the Parquet file and codebook are made
    def csv_file(path: Path) -> str:
        write_csv(neutralize_formulas(puf), path)
        return file_digest(path)

    with ThreadPoolExecutor(1) as pool:
        csv = pool.submit(csv_file, public / "puf.csv")
        table = pa.Table.from_pandas(puf, preserve_index=False)  # as pandas' to_parquet
        pq.write_table(table, public / "puf.parquet", **parquet_options(table.schema))
        del table
        write_docs_files(notes, codebook(puf, getattr(notes, "codebook_notes", None)), public)
        digests = {f.name: file_digest(f) for f in public.iterdir() if f.name != "puf.csv"}
        digests["puf.csv"] = csv.result()
    return {f"public/{name}": digests[name] for name in sorted(digests)}


def _tiny(v: np.ndarray) -> np.ndarray:
    """Values polars writes otherwise than pandas: finite, non-zero, below 1e-4 in size."""
    return np.isfinite(v) & (v != 0) & (np.abs(v) < 1e-4)


def _kind(s: pd.Series) -> str | None:
    """How polars writes the column as pandas does: 'bool', 'float', 'int', 'text', or None
    (a type polars writes differently: dates, mixed objects)."""
    if pd.api.types.is_bool_dtype(s):
        return "bool"
    if pd.api.types.is_float_dtype(s):
        return "float"
    if pd.api.types.is_integer_dtype(s):
        return "int"
    if isinstance(s.dtype, pd.CategoricalDtype) or pd.api.types.is_string_dtype(s):
        if s.dtype == object and pd.api.types.infer_dtype(s, skipna=True) not in (
            "string",
            "empty",
        ):
            return None  # mixed objects: pandas decides how each is written
        return "text"
    return None


def _polars_ready(df: pd.DataFrame, repr_floats: frozenset[str]) -> pd.DataFrame:
    """The frame with every column as polars writes it exactly as pandas.to_csv does
    (booleans as True/False, empty strings as nothing, repr_floats' values in Python's repr:
    polars writes 1e-05 as 0.00001); every column of a kind (_kind)."""
    out = {}
    for c in df.columns:
        s = df[c]
        kind = _kind(s)
        if kind == "bool":
            out[c] = s.map({True: "True", False: "False"}).astype("string")
        elif kind == "float" and c in repr_floats:
            v = s.to_numpy(dtype=float, na_value=np.nan)
            out[c] = pd.Series(
                [repr(float(x)) if x == x else None for x in v], index=s.index, dtype="string"
            )
        elif kind == "text":
            out[c] = s.astype("string").replace("", pd.NA)
        else:
            out[c] = s
    return pd.DataFrame(out, index=df.index, copy=False)  # the columns as they are, no copy


@dataclass(frozen=True)
class CsvPlan:
    """How every chunk of one CSV file is written: through polars (else pandas) and which
    float columns by Python's repr (those with a value below 1e-4 anywhere in the file)."""

    polars: bool
    repr_floats: frozenset[str] = frozenset()

    def __or__(self, other: CsvPlan) -> CsvPlan:
        """The plan of two parts of one file (pandas if either needs it)."""
        return CsvPlan(self.polars and other.polars, self.repr_floats | other.repr_floats)


def csv_plan(df: pd.DataFrame) -> CsvPlan:
    """write_csv's choices for df (the same for any of its chunks written with this plan)."""
    names = [str(c) for c in df.columns]
    plain = names == list(df.columns) and len(set(names)) == len(names)  # polars needs these
    # (one column: pandas quotes an empty text as "" so that the line is not empty)
    kinds = {c: _kind(df[c]) for c in df.columns} if plain and len(df.columns) > 1 else {}
    if not kinds or None in kinds.values():
        return CsvPlan(False)
    tiny = [
        c
        for c, k in kinds.items()
        if k == "float" and _tiny(df[c].to_numpy(dtype=float, na_value=np.nan)).any()
    ]
    return CsvPlan(True, frozenset(tiny))


def write_csv(
    df: pd.DataFrame,
    path: Path,
    rows: int = 100_000,
    plan: CsvPlan | None = None,
    header: bool = True,
    append: bool = False,
) -> None:
    """Write df as CSV through polars (seconds at 1M records, where pandas.to_csv takes over a
    minute), byte for byte what `df.to_csv(index=False, lineterminator="\\n")` writes; `rows`
    records at a time (polars holds a copy of one chunk, not of the whole frame). plan: the
    whole file's CsvPlan when df is one chunk of it (header: whether this chunk starts it;
    append: written after what path holds)."""
    import polars as pl

    plan = csv_plan(df) if plan is None else plan
    if not plan.polars:
        mode = "a" if append else "w"
        df.to_csv(path, index=False, lineterminator="\n", header=header, mode=mode)
        return
    with open(path, "ab" if append else "wb") as f:
        for a in range(0, max(len(df), 1), rows):  # an empty frame: its header
            # converted a chunk at a time (text and booleans as strings: copies)
            chunk = _polars_ready(df.iloc[a : a + rows], plan.repr_floats).reset_index(drop=True)
            pl.from_pandas(chunk, nan_to_null=True).write_csv(
                f, line_terminator="\n", include_header=header and a == 0
            )


# ---------------------------------------------------------------- by partition

# puf.parquet's row groups: pyarrow's (write_table's and DataFrame.to_parquet's default)
PARQUET_ROWS = 1024 * 1024
# the records a row group's task orders, converts and writes at a time (its memory)
PUBLIC_SLICE = 131_072


@dataclass(frozen=True)
class Rows:
    """The public file's records start..stop-1 (one row group of puf.parquet)."""

    start: int
    stop: int


@dataclass
class PublicPass1:
    """One partition's published records: their count, the categories its records use, and
    its CsvPlan."""

    n: int
    categories: dict[str, list]  # categorical column -> its categories
    used: dict[str, np.ndarray]  # categorical column -> whether a record has each category
    csv: CsvPlan


@dataclass
class PublicPlan:
    """The public file of all partitions: its record count, the categories no record has
    (drop_unused_levels), the CSV's plan and the records per row group."""

    n: int
    unused: dict[str, list]
    csv: CsvPlan
    rows: int = PARQUET_ROWS

    def row_groups(self) -> list[Rows]:
        return [Rows(a, min(a + self.rows, self.n)) for a in range(0, self.n, self.rows)]


# a coded key's values before its published coding, beside it in a row group's pieces
DETAIL = "__detail:"


def _detail(part: object, spec: ReleaseSpec, keep: list[str]) -> pd.DataFrame:
    """The partition's published columns (keep) as the records have them (keys not coded)."""

    return read_partition(part, keep, spec)[keep]


def _published(part: object, spec: ReleaseSpec, keep: list[str]) -> pd.DataFrame:
    """The partition's published columns (keep), every coded key in its published coding."""
    return publish_coding(_detail(part, spec, keep), spec.variables.keys)


def public_column(part: object, spec: ReleaseSpec, keep: list[str], column: str) -> pd.Series:
    """Map: one published column of the partition (the public order's sort key)."""

    df = read_partition(part, [column], spec)[[column]]
    return publish_coding(df, spec.variables.keys)[column]


def public_values_at(
    part: Any, spec: ReleaseSpec, columns: list[str], rows: str
) -> dict[str, tuple[pd.Series, bool]]:
    """Map: published columns of the partition at the records of the file in rows (the .npy
    file of their ascending positions): a numeric or categorical column's values at those
    records alone, a text column whole (the public order ranks text on the whole column)."""
    at = np.load(rows, mmap_mode="r")
    a, b = np.searchsorted(at, [part.start, part.stop])
    local = np.asarray(at[a:b]) - part.start
    df = publish_coding(read_partition(part, columns, spec)[columns], spec.variables.keys)
    out = {}
    for c in columns:
        s = df[c].reset_index(drop=True)
        alone = isinstance(s.dtype, pd.CategoricalDtype) or pd.api.types.is_numeric_dtype(s)
        out[c] = (s.iloc[local].reset_index(drop=True), True) if alone else (s, False)
    return out


def public_order(
    run_map: Callable[..., list], parts: Sequence, spec: ReleaseSpec, keep: list[str],
    labels: Sequence[str], n: int, work: Path,
) -> np.ndarray:  # fmt: skip
    """The public file's order over the partitions (public_records'): each column read from
    every partition only while records are still tied on the columns before it; once few
    are, several columns' values at the tied records alone in one map (their positions in
    work/tied.npy)."""
    cols = [*[c for c in labels if c in keep], *[c for c in keep if c not in labels]]

    def column(c: str) -> pd.Series:
        got = run_map(public_column, parts, spec, keep, c, what=f"public files: order by {c}")
        return pd.concat(got, ignore_index=True)

    def values_at(batch: Sequence[str], rows: np.ndarray) -> dict[str, tuple[pd.Series, bool]]:
        np.save(work / "tied.npy", rows)
        what = f"public files: order by {batch[0]}" + (f"..{batch[-1]}" if len(batch) > 1 else "")
        got = run_map(public_values_at, parts, spec, list(batch), str(work / "tied.npy"), what=what)
        out = {}
        for c in batch:
            pieces = [g[c] for g in got]
            if all(alone for _, alone in pieces):
                out[c] = (pd.concat([s for s, _ in pieces], ignore_index=True), True)
            elif not any(alone for _, alone in pieces):
                out[c] = (pd.concat([s for s, _ in pieces], ignore_index=True), False)
            else:  # numeric in some partitions, text in others: the whole column
                out[c] = (column(c), False)
        return out

    return publish_order(cols, column, n, values_at)


def public_pass1(part: object, spec: ReleaseSpec, keep: list[str]) -> PublicPass1:
    """Map: the partition's published columns (keep): records, used categories, CsvPlan."""
    df = _published(part, spec, keep)
    cats = [c for c in keep if isinstance(df[c].dtype, pd.CategoricalDtype)]
    used = {}
    for c in cats:
        codes = df[c].cat.codes.to_numpy()
        used[c] = np.bincount(codes[codes >= 0], minlength=len(df[c].cat.categories)) > 0
    return PublicPass1(
        n=len(df),
        categories={c: list(df[c].cat.categories) for c in cats},
        used=used,
        csv=csv_plan(neutralize_formulas(df)),
    )


def public_plan(first: Sequence[PublicPass1], rows: int = PARQUET_ROWS) -> PublicPlan:
    """Reduce: the public file's plan from every partition's pass 1 (in partition order)."""
    unused = {}
    for c, cats in first[0].categories.items():
        if any(p.categories.get(c) != cats for p in first):
            raise ValueError(
                f"column {c!r} has other categories in another partition; the partitions of "
                "one file must share each categorical column's categories"
            )
        used = np.logical_or.reduce([p.used[c] for p in first])
        unused[c] = [x for x, u in zip(cats, used, strict=True) if not u]
    csv = first[0].csv
    for p in first[1:]:
        csv = csv | p.csv
    return PublicPlan(sum(p.n for p in first), unused, csv, rows)


def public_pieces(
    part: object, spec: ReleaseSpec, keep: list[str], plan: PublicPlan, folder: str, order: str
) -> int:
    """Map: the partition's published records, without the unused categories, split by the
    row group each goes to in the public order (order: the .npy file of public_order's
    positions), written as <folder>/c<group>/p<first record>.arrow with '__row' (the row in
    its group) and each coded key's values before its coding (DETAIL, for the edit rules).
    Returns the records written."""
    detail = _detail(part, spec, keep)
    df = publish_coding(detail, spec.variables.keys)
    for c, gone in plan.unused.items():
        if gone:
            df[c] = df[c].cat.remove_categories(gone)
    for k in coded_keys(spec.variables.keys):
        if k.name in keep:
            df[DETAIL + k.name] = detail[k.name].to_numpy()
    a, b = part.start, part.stop
    perm = np.load(order, mmap_mode="r")
    mine = (perm >= a) & (perm < b)
    at = np.empty(b - a, dtype=np.int64)  # each record's row in the public file
    at[np.asarray(perm[mine]) - a] = np.flatnonzero(mine)
    del perm, mine
    group = at // plan.rows
    df = df.reset_index(drop=True)
    for g in np.unique(group):
        sel = np.flatnonzero(group == g)
        piece = df.iloc[sel].reset_index(drop=True)
        piece["__row"] = at[sel] - g * plan.rows
        where = Path(folder) / f"c{g:06d}"
        where.mkdir(parents=True, exist_ok=True)
        piece.to_feather(where / f"p{a:012d}.arrow", compression="uncompressed")
    return len(df)


@dataclass(frozen=True)
class SummaryPlan:
    """How the row groups summarize their records for the README and codebook: the PSU rows'
    key (None: no replicate weights), the hash bits of the distinct values' buckets and the
    largest value set a row group sends (sdl_design.public_summary)."""

    key: PsuKey | None
    bits: int
    small: int | None = SMALL  # None: one row group, the whole file


def public_group(
    rows: Rows,
    plan: PublicPlan,
    folder: str,
    spec: ReleaseSpec,
    replicates: list[str],
    summary: SummaryPlan | None = None,
) -> tuple:
    """Map: one row group of the public file from its pieces: <folder>/rows/c<group>.arrow
    (the records in the public order, as puf.parquet stores them) and
    <folder>/csv/c<group>.csv (as puf.csv has them, the header in the first); the pieces are
    removed. Returns the Arrow file's path, the failures of the output gates' record checks
    and edit rules on its records (examples: public row numbers) and the CSV's sha256 when the
    row group is the whole file (else None); with a SummaryPlan, its
    records' PartSummary too (their distinct values beyond summary.small in
    <folder>/distinct)."""

    g = rows.start // plan.rows
    src = Path(folder) / "pieces" / f"c{g:06d}"
    files = sorted(src.glob("p*.arrow"))
    pieces = [pd.read_feather(f) for f in files]
    df = pd.concat(pieces, ignore_index=True)
    del pieces
    if len(df) != rows.stop - rows.start:
        raise ValueError(f"row group {g}: {len(df)} records, not {rows.stop - rows.start}")
    order = np.empty(len(df), dtype=np.int64)
    order[df.pop("__row").to_numpy()] = np.arange(len(df))
    detail = {c.removeprefix(DETAIL): df.pop(c) for c in list(df.columns) if c.startswith(DETAIL)}
    for d in ("rows", "csv"):
        (Path(folder) / d).mkdir(exist_ok=True)
    # the summary read from the records while they are written (another thread: the writers
    # and pandas' hashing release the GIL; at 300,000 records in one group 1.3 s of 4)
    with ThreadPoolExecutor(1, thread_name_prefix="puf-summary") as pool:
        summed = None
        if summary is not None:
            where = str(Path(folder) / "distinct")
            summed = pool.submit(
                summarize_part, df, where, f"c{g:06d}", summary.bits, summary.small, summary.key
            )
        records, edits, digest = _write_group(
            df, order, detail, rows, plan, folder, g, spec, replicates
        )
        shutil.rmtree(src)
        out = str(Path(folder) / "rows" / f"c{g:06d}.arrow")
        got = (out, combine_rule_failures(records), combine_rule_failures(edits), digest)
        return got if summed is None else (*got, summed.result())


def _write_group(
    df: pd.DataFrame,
    order: np.ndarray,
    detail: dict[str, pd.Series],
    rows: Rows,
    plan: PublicPlan,
    folder: str,
    g: int,
    spec: ReleaseSpec,
    replicates: list[str],
) -> tuple[list, list]:
    """public_group's files of row group g: its records in the public order (order: each
    public row's record in df) as Arrow and CSV, a slice at a time (no reordered copy of the
    row group); the failures of the record checks and edit rules of each slice."""
    import pyarrow as pa

    # the row group's Arrow schema from all its records (as the whole frame's)
    schema = pa.Schema.from_pandas(df, preserve_index=False)
    out = Path(folder) / "rows" / f"c{g:06d}.arrow"
    csv = Path(folder) / "csv" / f"c{g:06d}.csv"
    records, edits = [], []
    # the whole file's CSV (one row group): hashed as it is written
    digest = GrowingFileDigest(csv) if rows.start == 0 and rows.stop == plan.n else None
    try:
        with pa.OSFile(str(out), "wb") as sink, pa.ipc.new_file(sink, schema) as w:
            for a in range(0, len(df), PUBLIC_SLICE):
                part = df.take(order[a : a + PUBLIC_SLICE]).reset_index(drop=True)
                write_csv(
                    neutralize_formulas(part), csv, plan=plan.csv, header=g == 0 and a == 0,
                    append=a > 0,
                )  # fmt: skip
                if digest is not None:
                    digest.written(csv.stat().st_size)
                w.write_table(pa.Table.from_pandas(part, schema=schema, preserve_index=False))
                ids = np.arange(rows.start + a, rows.start + a + len(part)) + 1  # from 1
                records.append(record_failures(part, spec, replicates, ids))
                values = {
                    c: v.take(order[a : a + PUBLIC_SLICE]).to_numpy() for c, v in detail.items()
                }
                edits.append(rule_failures(part.assign(**values), spec.edits, ids))
    except BaseException:
        if digest is not None:
            digest.close()
        raise
    return records, edits, None if digest is None else digest.hexdigest()


def _join(parts: Sequence[Path], dest: Path, digest: str | None = None) -> str:
    """The row groups' CSV chunks joined into dest, in order, hashed as they are copied, each
    deleted once copied (the disk holds the CSV once, not twice: 15M records' is 20 GB) (one
    chunk: renamed, not copied; 300,000 records' CSV took 1.2 s to copy); dest's sha256
    (digest: the one chunk's, hashed as it was written)."""
    if len(parts) == 1:
        os.replace(parts[0], dest)
        return file_digest(dest) if digest is None else digest
    h = hashlib.sha256()
    with open(dest, "wb") as out:
        for p in parts:
            with open(p, "rb") as part_csv:
                while chunk := part_csv.read(1 << 24):
                    h.update(chunk)
                    out.write(chunk)
            p.unlink()
    return h.hexdigest()


def _write_parquet(made: Sequence[tuple], path: Path) -> None:
    """puf.parquet from the row groups' Arrow pieces (made[g][0]), a row group each; a piece
    is deleted once written (the disk holds the records once more, not twice)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    writer = None
    try:
        for g, (piece, *_) in enumerate(made):
            with pa.memory_map(piece) as src:
                # one contiguous table, as pandas hands the whole frame to pyarrow (a
                # row group from several batches is encoded otherwise at 5M records)
                table = pa.ipc.open_file(src).read_all().combine_chunks()
            if writer is None:
                writer = pq.ParquetWriter(path, table.schema, **parquet_options(table.schema))
            elif not table.schema.equals(writer.schema, check_metadata=True):
                diff = [f.name for f in table.schema if f.type != writer.schema.field(f.name).type]
                raise ValueError(
                    f"row group {g} of the public file types columns {diff or 'alike'} "
                    "otherwise than the first (a column all missing in one row group?)"
                )
            writer.write_table(table)
            del table
            Path(piece).unlink()
    finally:
        if writer is not None:
            writer.close()


def write_docs(
    run_map: Callable[..., list],
    parts: Sequence[PartSummary],
    columns: Sequence[str],
    docs: SummaryPlan,
    spec: ReleaseSpec,
    results: Sequence[StageResult],
    folder: Path,
    work: Path,
) -> PublicSummary:
    """README.md, codebook.csv and replicate_scales.csv into folder from the row groups'
    PartSummaries (in public order): merged here, the bucketed columns' distinct values counted by a task per bucket
    (reading work/distinct), then the README and codebook as write_public_files writes them."""

    summary, buckets = merge_parts(parts, list(columns), docs.bits, docs.key)
    if buckets:
        where = str(work / "distinct")
        counts = run_map(distinct_in_bucket, buckets, where, what="public files: distinct values")
        add_bucket_counts(summary, counts)
    notes = variance_notes(spec, results, summary)
    write_docs_files(notes, codebook(summary, notes.codebook_notes), folder)
    return summary


def _order_file(
    run_map: Callable[..., list],
    parts: Sequence,
    spec: ReleaseSpec,
    keep: list[str],
    labels: Sequence[str],
    n: int,
    work: Path,
    input_rows: tuple[np.ndarray, int] | None,
) -> str:
    """public_order saved as work/order.npy (its path returned) and, with input_rows, the
    confidential record map in work/../internal/record_map.parquet."""
    work.mkdir()
    order = str(work / "order.npy")
    perm = public_order(run_map, parts, spec, keep, labels, n, work)
    np.save(order, perm)
    if input_rows is not None:
        rows, n_input = input_rows
        internal = work.parent.parent / "internal"
        internal.mkdir(exist_ok=True)
        record_map(pd.RangeIndex(n_input), pd.Index(rows[perm])).to_parquet(
            internal / "record_map.parquet", index=False
        )
    return order


def write_public_by_partition(
    run_map: Callable[..., list],
    parts: Sequence,
    spec: ReleaseSpec,
    columns: Sequence[str],
    masked_design: bool,
    drop: Sequence[str],
    design_columns: Sequence[str],
    folder: Path,
    rows: int = PARQUET_ROWS,
    results: Sequence[StageResult] | None = None,
    design: Any = None,
    labels: Sequence[str] = (),
    input_rows: tuple[np.ndarray, int] | None = None,
) -> dict[str, object]:
    """puf.parquet and puf.csv into folder (created here) from the partitions of the last
    stage's records, byte for byte what public_frame and write_public_files write from the
    whole frame (rows: the records per row group). Workers write the pieces and row groups
    into folder/.work (removed at the end: the pieces hold each record's public row); this
    process writes puf.parquet a row group at a time and joins the CSV's chunks. With the
    stage results (data None) the README describes, README.md and codebook.csv too, as
    write_public_files writes them: variance_notes and codebook on the PublicSummary merged
    from the row groups' (the distinct values of a column with many counted by hash bucket,
    a task per bucket). Returns {records, columns, files: {name: sha256}, gates:
    validate_output's table}. design: the DesignSection the file is read with (its replicate
    weights; default the spec's); labels: its strata/PSU columns (the public order's first);
    input_rows: (each record's row in the input, the input's records): the confidential record
    map is written to folder/../internal/record_map.parquet."""

    keep = spec.published_columns(list(columns), masked_design, drop, design_columns)
    first = run_map(public_pass1, parts, spec, keep, what="public files: columns")
    plan = public_plan(first, rows)
    if plan.n == 0:
        raise ValueError("no record is left to publish")
    folder.mkdir()
    work = folder / ".work"
    order = _order_file(run_map, parts, spec, keep, labels, plan.n, work, input_rows)
    run_map(
        public_pieces, parts, spec, keep, plan, str(work / "pieces"), order,
        what="public files: order",
    )  # fmt: skip
    groups = plan.row_groups()
    rw = (design if design is not None else spec.design).replicate_weights
    reps = rw.resolve(keep) if rw else []
    docs = None
    if results is not None:
        bits = bucket_bits(plan.n, len(keep), BUCKET_VALUES)
        # one row group: its distinct counts are the file's (no values sent, no buckets)
        docs = SummaryPlan(psu_key(spec, results, keep), bits, SMALL if len(groups) > 1 else None)
    made = run_map(
        public_group, groups, plan, str(work), spec, reps, docs, what="public files: row groups"
    )
    try:
        # the CSV joined and hashed on the other core while puf.parquet is written, and
        # puf.parquet hashed while the documentation is made, beside the CSV's hash if that
        # is still running (1M records: 1.9 GB to hash at 0.3 GB/s; in turn, the documents
        # waited 5 s for them)
        with ThreadPoolExecutor(2, thread_name_prefix="puf-digest") as pool:
            csv = pool.submit(
                _join,
                [work / "csv" / f"c{g:06d}.csv" for g in range(len(made))],
                folder / "puf.csv",
                made[0][3] if len(made) == 1 else None,
            )
            _write_parquet(made, folder / "puf.parquet")
            parquet = pool.submit(file_digest, folder / "puf.parquet")
            if docs is not None:
                write_docs(run_map, [m[4] for m in made], keep, docs, spec, results, folder, work)
            files = {"puf.csv": csv.result(), "puf.parquet": parquet.result()}
    finally:
        shutil.rmtree(work, ignore_errors=True)
    for name in public_names(folder):
        if name not in files:
            files[name] = file_digest(folder / name)
    files = {name: files[name] for name in sorted(files)}
    # the output gates (validate_output's): the columns, and the row groups' failures

    gates = output_verdicts(
        keep,
        spec,
        reps,
        masked_design,
        combine_rule_failures([m[1] for m in made]),
        combine_rule_failures([m[2] for m in made]),
    )
    return {"records": plan.n, "columns": len(keep), "files": files, "gates": gates}
