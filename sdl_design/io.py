"""Reading the input file as the spec declares it: types, missing codes, duplicated columns.

A CSV is read as text (every cell a string, nothing guessed as missing), then typed by the spec:
- numeric columns (the weight, replicate weights, study variables, keys and sensitive variables
  with bins, top-coded columns, the swap's matching and MASSC's substrata variables) are
  converted; a value that is not a number is an error naming the column and its first rows;
- categorical columns (keys and sensitive variables without bins, identifiers) stay text: a
  category "NA" stays "NA";
- every other column (other.keep/drop among them) is numeric when all its values are numbers
  written without leading zeros, else text: a county "0001" stays "0001", a 0/1 flag is a number.
The declared missing codes (`variables.missing`) become missing values (NaN) first; an empty
cell of a numeric column is missing too. A Parquet file keeps its own types; its declared
missing codes become NaN and a declared-numeric column stored as text is converted as above.
Duplicated column names (a CSV header naming a column twice, which pandas would publish as
`income.1`; duplicated Parquet fields) are an error. An unweighted file (`design: {weight:
null}`) gets its weight column of ones, `unit_weight`, here (unit_weight). No statistics here.
"""

from __future__ import annotations

import csv
import hashlib
import json
import os
import re
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd

from sdl_design.messages import did_you_mean, rows_text
from sdl_design.spec import SpecError
from sdl_design.synth import make_survey

if TYPE_CHECKING:
    from sdl_design.spec import ReleaseSpec

_LEADING_ZERO = re.compile(r"^[+-]?0\d")


def file_digest(path: Path) -> str:
    """sha256 of a file's bytes."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


class GrowingFileDigest:
    """sha256 of a file that is being appended to, hashed in another thread as far as it has
    been written (written(size)): the bytes are read back while the page cache holds them and
    the hash is ready when the writing ends (a public CSV of 1.4 GB took 4.4 s to hash after
    it was written). Nothing before `size` may be written again."""

    def __init__(self, path: Path):
        self._path, self._h, self._at = path, hashlib.sha256(), 0
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="puf-digest")
        self._futures: list = []

    def written(self, size: int) -> None:
        """The file's first size bytes are written: hash them (in order, in the thread)."""
        self._futures.append(self._pool.submit(self._hash_to, size))

    def _hash_to(self, size: int) -> None:
        with open(self._path, "rb") as f:
            f.seek(self._at)
            while self._at < size:
                chunk = f.read(min(1 << 22, size - self._at))
                if not chunk:
                    raise OSError(f"{self._path} ends at {self._at} bytes, not {size}")
                self._h.update(chunk)
                self._at += len(chunk)

    def hexdigest(self) -> str:
        """The digest of the whole file (as file_digest gives it), once every byte written
        is hashed; the thread ends."""
        try:
            for f in self._futures:
                f.result()
            self._hash_to(os.path.getsize(self._path))
        finally:
            self._pool.shutdown()
        return self._h.hexdigest()

    def close(self) -> None:
        """The thread ended without a digest (the writing failed)."""
        self._pool.shutdown(cancel_futures=True)


def parquet_options(schema: Any) -> dict[str, Any]:
    """pyarrow.parquet write options of every Parquet file puf writes: dictionary pages for the
    columns that are not floats. Float columns (weights, replicate weights) rarely repeat and
    their dictionaries, built and dropped at 1 MB, took a third of the write (1M records:
    2.3-2.6 s -> 1.7-1.8 s, 598 -> 582 MB)."""
    import pyarrow as pa

    return {"use_dictionary": [f.name for f in schema if not pa.types.is_floating(f.type)]}


def frame_digest(df: pd.DataFrame) -> str:
    """Content hash of a frame (column names, dtypes and values)."""
    h = hashlib.sha256()
    h.update(json.dumps([[c, str(t)] for c, t in df.dtypes.items()]).encode())
    h.update(pd.util.hash_pandas_object(df, index=False).to_numpy().tobytes())
    return h.hexdigest()


def numeric_columns(spec: ReleaseSpec, columns: list[str]) -> dict[str, str]:
    """Columns the spec needs as numbers -> the field that says so."""
    d, v, s = spec.design, spec.variables, spec.stages
    out: dict[str, str] = {d.weight: "design.weight"}
    for c in spec.replicate_columns(columns):
        out.setdefault(c, "design.replicate_weights")
    for i, c in enumerate(v.study):
        out.setdefault(c, f"variables.study[{i}]")
    for i, k in enumerate(v.keys):
        if k.bins is not None:
            out.setdefault(k.name, f"variables.keys[{i}].bins")
    for i, k in enumerate(v.sensitive):
        if k.bins is not None:
            out.setdefault(k.name, f"variables.sensitive[{i}].bins")
    for c in s.topcode.columns:
        out.setdefault(c, f"stages.topcode.{c}")
    if s.swap:
        for i, c in enumerate(s.swap.matching):
            out.setdefault(c, f"stages.swap.matching[{i}]")
    if s.massc and s.massc.substrata:
        for i, c in enumerate(s.massc.substrata.variables):
            out.setdefault(c, f"stages.massc.substrata.variables[{i}]")
    if s.prb:
        for c, bins in s.prb.partition.items():
            if bins is not None:
                out.setdefault(c, f"stages.prb.partition.{c}")
    return {c: f for c, f in out.items() if c in columns}


def text_columns(spec: ReleaseSpec) -> set[str]:
    """Columns the spec declares categorical: read as text, never turned into numbers."""
    v = spec.variables
    out = {k.name for k in v.keys if k.bins is None}
    out |= {s.name for s in v.sensitive if s.bins is None}
    out |= set(v.direct_identifiers)
    return out


def _duplicates(names: list[str], path: Path) -> None:
    dup = sorted(c for c, k in Counter(names).items() if k > 1)
    if dup:
        raise SpecError(
            [
                f"release.input: {path.name} names the columns {dup} more than once; every "
                "column must have one name (rename or remove the duplicates: a second copy "
                "would bypass the treatment of the first)"
            ]
        )


def _codec(encoding: str) -> str:
    """The codec a CSV is read with: UTF-8 with or without a byte-order mark."""
    import codecs

    return "utf-8-sig" if codecs.lookup(encoding).name == "utf-8" else encoding


def _not_text(path: Path, encoding: str, where: str) -> SpecError:
    return SpecError(
        [
            f"release.input: {path.name} is not {encoding} text ({where} cannot be decoded); "
            "save it as UTF-8, or declare its encoding in release.encoding (e.g. latin-1)"
        ]
    )


def _csv_header(path: Path, encoding: str = "utf-8") -> list[str]:
    if path.stat().st_size == 0:
        raise SpecError(
            [f"release.input: {path.name} is empty (0 bytes); give the survey file itself"]
        )
    try:
        with open(path, newline="", encoding=_codec(encoding)) as f:
            return next(csv.reader(f), [])
    except UnicodeDecodeError as e:
        raise _not_text(path, encoding, f"byte {e.start} of its header") from None


def _ragged_row(path: Path, encoding: str, n: int) -> tuple[int, int] | None:
    """The first row (counted from 1 after the header) whose cell count is not n, and its
    count; read only after the CSV parser has refused the file."""
    with open(path, newline="", encoding=_codec(encoding), errors="replace") as f:
        rows = csv.reader(f)
        next(rows, None)
        for i, row in enumerate(rows, 1):
            if row and len(row) != n:
                return i, len(row)
    return None


def _read_csv(path: Path, header: list[str], encoding: str) -> pd.DataFrame:
    """The CSV as text columns (pyarrow); every parse error as a SpecError that names the file,
    the row or what to do, and never a value of the data."""
    import pyarrow as pa
    import pyarrow.csv as pcsv

    every_text = pcsv.ConvertOptions(
        column_types=dict.fromkeys(header, pa.string()),
        strings_can_be_null=False,
        quoted_strings_can_be_null=False,
        null_values=[],
    )
    read = pcsv.ReadOptions(encoding=_codec(encoding).replace("utf-8-sig", "utf8"))
    try:
        return pcsv.read_csv(path, read_options=read, convert_options=every_text).to_pandas()
    except UnicodeDecodeError as e:
        raise _not_text(path, encoding, f"byte {e.start}") from None
    except pa.ArrowInvalid as e:
        text = str(e)
        if "UTF8" in text or "utf8" in text.lower():
            raise _not_text(path, encoding, "a byte after the header") from None
        bad = _ragged_row(path, encoding, len(header))
        if bad is not None:
            raise SpecError(
                [
                    f"release.input: row {bad[0]} of {path.name} has {bad[1]} cells where the "
                    f"header names {len(header)} columns; fix that row (a delimiter inside a "
                    "value needs quotes)"
                ]
            ) from None
        raise SpecError(
            [f"release.input: {path.name} cannot be read as CSV: {text.split(':')[0]}"]
        ) from None


def _missing_mask(s: pd.Series, codes: list[Any]) -> pd.Series:
    """Where s holds one of the declared missing codes (as text, or as the same number)."""
    text = {str(c) for c in codes}
    hit = s.isin(codes) if not _is_text(s) else s.isin(text)
    nums = [float(c) for c in codes if _number(c) is not None]
    if nums:
        x = pd.to_numeric(s, errors="coerce") if _is_text(s) else s
        if pd.api.types.is_numeric_dtype(x) and not pd.api.types.is_bool_dtype(x):
            hit |= x.isin(nums)
    return hit.fillna(False).astype(bool)


def _is_text(s: pd.Series) -> bool:
    return pd.api.types.is_string_dtype(s) or s.dtype == object


def _number(v: Any) -> float | None:
    try:
        return float(v)
    except (TypeError, ValueError):
        return None


def _parse_numbers(s: pd.Series) -> pd.Series | None:
    """Fast path (Arrow's parser): the text column as int64 (no blank) or float64 (blank cells
    NaN); None when a value is anything but a plain number (then the pandas path says which)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    try:
        t = pc.utf8_trim_whitespace(pa.array(s.array, type=pa.string()))
        t = pc.if_else(pc.equal(t, ""), pa.scalar(None, pa.string()), t)
        if t.null_count == 0:
            try:
                return pd.Series(pc.cast(t, pa.int64()).to_numpy(), index=s.index, name=s.name)
            except pa.ArrowInvalid:
                pass
        x = pc.cast(t, pa.float64())
        if pc.any(pc.is_nan(x)).as_py():  # a written 'nan' is not a declared missing code
            return None
        return pd.Series(x.to_numpy(zero_copy_only=False), index=s.index, name=s.name)
    except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError):
        return None


def _to_numeric(s: pd.Series, name: str, field: str, problems: list[str]) -> pd.Series:
    """A text (or object) column as numbers; blank cells are missing; anything else that is not
    a number is a problem naming the column and its first rows."""
    if not _is_text(s):
        return s
    fast = _parse_numbers(s)
    if fast is not None:
        return fast
    t = s.str.strip() if pd.api.types.is_string_dtype(s) else s
    blank = t.isna() | (t == "")
    x = pd.to_numeric(t.where(~blank), errors="coerce")
    bad = x.isna() & ~blank
    if bad.any():
        problems.append(
            f"{field}: column '{name}' has values that are not numeric: {rows_text(bad, s)}; "
            "correct them, or declare them as missing codes under variables.missing"
        )
    return x


def _infer(s: pd.Series) -> pd.Series:
    """A text column of an undeclared role: numbers when every non-blank value is a number
    written without leading zeros ('0001' keeps the column text), else the text as read."""
    t = s.str.strip()
    blank = t.isna() | (t == "")
    if blank.all() or t[~blank].str.match(_LEADING_ZERO).any():
        return s
    x = _parse_numbers(s)
    if x is None:
        x = pd.to_numeric(t.where(~blank), errors="coerce")
        if (x.isna() & ~blank).any():
            return s
    return x


def unit_weight(df: pd.DataFrame, spec: ReleaseSpec) -> pd.DataFrame:
    """An unweighted file (`design: {weight: null}`): the frame with the spec's weight column
    (UNIT_WEIGHT) of ones added, so that every stage reads a weight; the frame itself else,
    or when it has the column already with every value 1 (a frame typed again). The column
    with other values is an error (SpecError: rename it)."""
    d = spec.design
    if not getattr(d, "unweighted", False):
        return df
    if d.weight in df.columns:  # added before (a frame typed again), or the input's own
        w = pd.to_numeric(df[d.weight], errors="coerce")
        if (w == 1.0).all():
            return df
        raise SpecError(
            [
                f"design.weight: the file is declared unweighted, and the input has a column "
                f"'{d.weight}', the name the release gives its weights of 1; rename that column"
            ]
        )
    ones = pd.DataFrame({d.weight: np.ones(len(df))}, index=df.index)
    return pd.concat([df, ones], axis=1)  # (no insert into a frame of many blocks)


def type_input(df: pd.DataFrame, spec: ReleaseSpec, text: bool) -> pd.DataFrame:
    """The frame typed by the spec (see the module docstring); text: df was read as text (CSV).
    An unweighted file gets its weight column of ones (unit_weight). Raises SpecError listing
    every column that does not fit."""
    df = unit_weight(df, spec)
    problems: list[str] = []
    cols = [str(c) for c in df.columns]
    missing = spec.variables.missing
    for c in missing:
        if c not in df.columns:
            problems.append(
                f"variables.missing.{c}: column '{c}' is not in the input file"
                f"{did_you_mean(c, df.columns)}; fix the name"
            )
    out = {}
    numeric = numeric_columns(spec, cols)
    categorical = text_columns(spec)
    dtypes = df.dtypes
    for c in df.columns:
        codes = missing.get(c)
        as_text = pd.api.types.is_string_dtype(dtypes[c]) or pd.api.types.is_object_dtype(dtypes[c])
        if not codes and not (as_text and (c in numeric or (text and c not in categorical))):
            continue  # kept as read (a Series per column and partition cost 1 ms)
        s = s0 = df[c]  # (df[c] is a new Series at every access: compare with this one)
        if codes:
            s = s.where(~_missing_mask(s, codes))
        if c in numeric:
            s = _to_numeric(s, c, numeric[c], problems)
        elif text and c not in categorical:
            s = _infer(s)
        if s is not s0:
            out[c] = s
    if problems:
        raise SpecError(problems)
    # an unchanged frame is returned as it is (rebuilding it copied every column: 2 s at 1M)
    if not out:
        return df
    return pd.DataFrame({c: out[c] if c in out else df[c] for c in df.columns}, index=df.index)


def _not_parquet(path: Path, e: Exception) -> SpecError:
    reason = str(e).split(".")[0][:200]
    return SpecError(
        [
            f"release.input: {path.name} is not a readable Parquet file ({reason}); it may be "
            "truncated: copy or write it again, or give the CSV"
        ]
    )


def _parquet_schema(path: Path) -> Any:
    import pyarrow.parquet as pq

    if path.stat().st_size == 0:
        raise SpecError(
            [f"release.input: {path.name} is empty (0 bytes); give the survey file itself"]
        )
    try:
        return pq.read_schema(path)
    except (OSError, ValueError) as e:
        raise _not_parquet(path, e) from None


def _nested(schema: Any, spec: ReleaseSpec, path: Path) -> None:
    """Columns of lists, structs or maps are refused unless never published (other.drop or a
    direct identifier): a public file carries one value per cell."""
    import pyarrow as pa

    gone = set(spec.variables.other.drop) | set(spec.variables.direct_identifiers)
    nested = [
        f"{f.name} ({f.type})" for f in schema if pa.types.is_nested(f.type) and f.name not in gone
    ]
    if nested:
        raise SpecError(
            [
                f"release.input: {path.name} has columns of lists or records ({', '.join(nested)});"
                " a public file holds one value per cell: flatten them, or list them in "
                "variables.other.drop"
            ]
        )


def read_input(spec: ReleaseSpec) -> tuple[pd.DataFrame, str]:
    """The input file as the spec declares it, and its digest (sha256 of the file; of the frame
    for the embedded default survey when release.input is null). Raises SpecError."""
    path = spec.release.input
    if path is None:
        df = make_survey()  # its own data seed: the release seed stays with the release
        return type_input(df, spec, text=False), frame_digest(df)
    path = Path(path)
    if not path.is_file():
        raise SpecError(
            [f"release.input: no file at {path}; give the path of a .parquet or .csv file"]
        )
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        schema = _parquet_schema(path)
        _duplicates(list(schema.names), path)
        _nested(schema, spec, path)
        # the digest in a second thread while the file is parsed (hashlib and pyarrow leave
        # the interpreter free): 0.4 s of a 600 MB file no longer after the read
        with ThreadPoolExecutor(1, thread_name_prefix="puf-digest") as pool:
            digest = pool.submit(file_digest, path)
            try:
                df = pd.read_parquet(path)
            except (OSError, ValueError) as e:  # pyarrow's ArrowInvalid is a ValueError
                raise _not_parquet(path, e) from None
        return type_input(df, spec, False), digest.result()
    elif suffix == ".csv":
        enc = spec.release.encoding
        header = _csv_header(path, enc)
        _duplicates(header, path)
        df = _read_csv(path, header, enc)
        return type_input(df, spec, True), file_digest(path)
    raise SpecError([f"release.input: {path.name} is neither .parquet nor .csv; convert it"])
