"""The public files: which columns may leave; writing puf.parquet, puf.csv, codebook.csv, README.md."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pandas as pd

from flows.public_docs import codebook
from sdl_design.leaks import drop_unused_levels, shuffle_rows
from sdl_design.rng import release_seed, stage_rng
from sdl_design.spec import ReleaseSpec


def forbidden_columns(
    spec: ReleaseSpec, masked_design: bool, drop: Sequence[str] = ()
) -> list[str]:
    """The columns that may never be published (ReleaseSpec.unpublished_columns)."""
    return spec.unpublished_columns(masked_design, drop)


def public_frame(
    df: pd.DataFrame,
    spec: ReleaseSpec,
    masked_design: bool,
    drop: Sequence[str] = (),
    design_columns: Sequence[str] = (),
) -> pd.DataFrame:
    """The public file's frame: only the columns the spec classifies as publishable
    (ReleaseSpec.published_columns), categorical levels no record has dropped, and the records
    in an order drawn from the release's Generator (stream "publish-order" of release.seed and
    release.year), never the confidential file's order. design_columns: those a stage built for
    the public design (pseudo strata, PSUs, replicate weights)."""
    keep = spec.published_columns(list(df.columns), masked_design, drop, design_columns)
    rng = stage_rng(release_seed(spec.release.seed, spec.release.year), "publish-order")
    return shuffle_rows(drop_unused_levels(df[keep]), rng)


# text cells a spreadsheet would run as a formula (OWASP "CSV injection")
FORMULA_PREFIXES = ("=", "+", "-", "@", "\t", "\r")


def _neutralize(values: pd.Series) -> pd.Series:
    text = values.astype("string")
    hit = text.str.startswith(FORMULA_PREFIXES).fillna(False).to_numpy(bool)
    if values.dtype == object and hit.any():  # a number in a mixed column stays a number
        hit &= values.map(lambda x: isinstance(x, str)).to_numpy(bool)
    return values.mask(hit, "'" + text) if hit.any() else values


def neutralize_formulas(df: pd.DataFrame) -> pd.DataFrame:
    """The frame with every formula-leading text cell (FORMULA_PREFIXES) prefixed by a single
    quote, for the CSV files; numeric columns are left as they are (-3 stays a number)."""
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


def write_public_files(puf: pd.DataFrame, public: Path, notes: str) -> dict[str, str]:
    """Write the public folder (created here); returns {'public/<file>': sha256}."""
    from concurrent.futures import ThreadPoolExecutor

    from flows.publish import sha256_file

    public.mkdir()

    # the CSV (float formatting, one core for a minute at 1M records in pandas, seconds in
    # polars, which leaves the GIL) is written while the Parquet file and codebook are made
    def csv_file(path: Path) -> str:
        write_csv(neutralize_formulas(puf), path)
        return sha256_file(path)

    with ThreadPoolExecutor(1) as pool:
        csv = pool.submit(csv_file, public / "puf.csv")
        puf.to_parquet(public / "puf.parquet", index=False)
        neutralize_formulas(codebook(puf, getattr(notes, "codebook_notes", None))).to_csv(
            public / "codebook.csv", index=False, lineterminator="\n"
        )
        (public / "README.md").write_text(notes)
        digests = {f.name: sha256_file(f) for f in public.iterdir() if f.name != "puf.csv"}
        digests["puf.csv"] = csv.result()
    return {f"public/{name}": digests[name] for name in sorted(digests)}


def _polars_ready(df: pd.DataFrame) -> pd.DataFrame | None:
    """The frame with every column polars writes exactly as pandas.to_csv does (booleans as
    True/False, empty strings as nothing, floats below 1e-4 in Python's repr), or None when a
    column has a type polars would write differently (dates, mixed objects): pandas then."""
    out = {}
    for c in df.columns:
        s = df[c]
        if pd.api.types.is_bool_dtype(s):
            out[c] = s.map({True: "True", False: "False"}).astype("string")
        elif pd.api.types.is_float_dtype(s):
            v = s.to_numpy(dtype=float, na_value=np.nan)
            tiny = np.isfinite(v) & (v != 0) & (np.abs(v) < 1e-4)
            if tiny.any():  # polars writes 1e-05 as 0.00001; pandas uses repr
                out[c] = pd.Series(
                    [repr(float(x)) if x == x else None for x in v], index=s.index, dtype="string"
                )
            else:
                out[c] = s
        elif pd.api.types.is_integer_dtype(s):
            out[c] = s
        elif isinstance(s.dtype, pd.CategoricalDtype) or pd.api.types.is_string_dtype(s):
            if isinstance(s.dtype, pd.CategoricalDtype):
                s = s.astype("string")
            if s.dtype == object and pd.api.types.infer_dtype(s, skipna=True) not in (
                "string",
                "empty",
            ):
                return None  # mixed objects: pandas decides how each is written
            out[c] = s.astype("string").replace("", pd.NA)
        else:
            return None
    return pd.DataFrame(out, index=df.index, copy=False)  # the columns as they are, no copy


def write_csv(df: pd.DataFrame, path: Path, rows: int = 100_000) -> None:
    """Write df as CSV through polars (seconds at 1M records, where pandas.to_csv takes over a
    minute), byte for byte what `df.to_csv(index=False, lineterminator="\\n")` writes; `rows`
    records at a time (polars holds a copy of one chunk, not of the whole frame)."""
    import polars as pl

    names = [str(c) for c in df.columns]
    plain = names == list(df.columns) and len(set(names)) == len(names)  # polars needs these
    # (one column: pandas quotes an empty text as "" so that the line is not empty)
    ready = _polars_ready(df) if plain and len(df.columns) > 1 else None
    if ready is None:
        df.to_csv(path, index=False, lineterminator="\n")
        return
    with open(path, "wb") as f:
        for a in range(0, max(len(ready), 1), rows):  # an empty frame: its header
            chunk = ready.iloc[a : a + rows].reset_index(drop=True)
            pl.from_pandas(chunk, nan_to_null=True).write_csv(
                f, line_terminator="\n", include_header=a == 0
            )
