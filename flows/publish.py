"""A release's files: the internal record (manifest, tables, report) and the public files
(flows.public_files), written into an attempt's staging folder (flows.txn publishes it)."""

from __future__ import annotations

import json
import platform
from collections.abc import Callable
from datetime import UTC, datetime
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd

from flows.public_files import write_csv, write_public_files
from sdl_design.io import file_digest as sha256_file  # noqa: F401 - one hash, used by flows
from sdl_design.io import frame_digest as sha256_frame  # noqa: F401
from sdl_design.spec import ReleaseSpec

if TYPE_CHECKING:
    from flows.manifest import Manifest

VERSIONED = [
    "puf-release",
    "pandas",
    "numpy",
    "scipy",
    "pyarrow",
    "prefect",
    "great-expectations",
    "svy",
]


def versions() -> dict[str, str]:
    out = {"python": platform.python_version()}
    for pkg in VERSIONED:
        try:
            out[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            out[pkg] = "not installed"
    return out


def release_dir(spec: ReleaseSpec) -> Path:
    return Path(spec.release.output_dir) / spec.release.name / str(spec.release.year)


def _json_default(o: Any) -> Any:
    if isinstance(o, np.integer):
        return int(o)
    if isinstance(o, np.floating):
        return None if np.isnan(o) else float(o)
    if isinstance(o, np.bool_):
        return bool(o)
    if isinstance(o, Path | datetime):
        return str(o)
    if isinstance(o, set | tuple):
        return list(o)
    return str(o)


def write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=False, default=_json_default) + "\n")


def write_record(
    internal: Path,
    manifest: Manifest,
    tables: dict[str, pd.DataFrame],
    report_writer: Callable[[Manifest, Path], Any],
    record_map: pd.DataFrame | None = None,
) -> None:
    """Write a release's internal record into `internal`: each 'stage/table' frame as CSV,
    manifest.json, report.html (report_writer(manifest, path)) and, when given, the
    confidential record map (record_map.parquet: input_row, public_row)."""
    internal.mkdir(parents=True, exist_ok=True)
    if record_map is not None:
        record_map.to_parquet(internal / "record_map.parquet", index=False)
    for key, frame in tables.items():
        path = internal / f"{key}.csv"
        path.parent.mkdir(parents=True, exist_ok=True)
        write_csv(frame, path)  # what frame.to_csv(path, index=False) writes, through polars
    write_json(internal / "manifest.json", manifest.to_json())
    report_writer(manifest, internal / "report.html")


def write_stage(
    staged: Path,
    manifest: Manifest,
    tables: dict[str, pd.DataFrame],
    report_writer: Callable[[Manifest, Path], Any],
    puf: pd.DataFrame | None = None,
    notes: str | None = None,
    fault: Callable[[str], None] | None = None,
    prepared: Callable[[Path], dict[str, str]] | None = None,
    record_map: pd.DataFrame | None = None,
) -> None:
    """Write a whole release into a staging folder: public/ (when puf is given, or moved there
    by prepared(public), which returns the digests of files written before; their hashes go
    into the manifest) and internal/ (write_record). The staged tree is what the release folder
    becomes when the attempt publishes (flows.txn)."""
    outputs: dict[str, str] = {}
    if prepared is not None:
        outputs = prepared(staged / "public")
    elif puf is not None:
        outputs = write_public_files(puf, staged / "public", notes or "")
    if fault is not None:
        fault("staging")
    manifest.hashes.outputs = outputs
    write_record(staged / "internal", manifest, tables, report_writer, record_map)


def now() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")
