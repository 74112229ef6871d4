"""The public files: which columns may leave; writing puf.parquet, puf.csv, codebook.csv, README.md."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pandas as pd

from flows.public_docs import codebook
from sdl_design.spec import ReleaseSpec


def forbidden_columns(
    spec: ReleaseSpec, masked_design: bool, drop: Sequence[str] = ()
) -> list[str]:
    """The columns that may never be published (ReleaseSpec.unpublished_columns)."""
    return spec.unpublished_columns(masked_design, drop)


def public_frame(
    df: pd.DataFrame, spec: ReleaseSpec, masked_design: bool, drop: Sequence[str] = ()
) -> pd.DataFrame:
    """The columns that may be published: none of forbidden_columns, no internal '__' column."""
    gone = set(forbidden_columns(spec, masked_design, drop))
    keep = [c for c in df.columns if c not in gone and not str(c).startswith("__")]
    return df[keep].reset_index(drop=True)


def write_public_files(puf: pd.DataFrame, public: Path, notes: str) -> dict[str, str]:
    """Write the public folder (created here); returns {'public/<file>': sha256}."""
    from flows.publish import sha256_file

    public.mkdir()
    puf.to_parquet(public / "puf.parquet", index=False)
    puf.to_csv(public / "puf.csv", index=False, lineterminator="\n")
    codebook(puf, getattr(notes, "codebook_notes", None)).to_csv(
        public / "codebook.csv", index=False, lineterminator="\n"
    )
    (public / "README.md").write_text(notes)
    return {f"public/{f.name}": sha256_file(f) for f in sorted(public.iterdir())}
