"""Release folder: internal manifest and tables, the public files (flows.public_files); atomic publish."""

from __future__ import annotations

import hashlib
import json
import platform
import shutil
import uuid
from collections.abc import Callable
from datetime import UTC, datetime
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd

from flows.public_files import write_public_files
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


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def sha256_frame(df: pd.DataFrame) -> str:
    """Content hash of a frame (column names, dtypes and values)."""
    h = hashlib.sha256()
    h.update(json.dumps([[c, str(t)] for c, t in df.dtypes.items()]).encode())
    h.update(pd.util.hash_pandas_object(df, index=False).to_numpy().tobytes())
    return h.hexdigest()


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


def write_release(
    spec: ReleaseSpec,
    manifest: Manifest,
    tables: dict[str, pd.DataFrame],
    report_writer: Callable[[Manifest, Path], Any],
    puf: pd.DataFrame | None = None,
    notes: str | None = None,
) -> Path:
    """Write the release folder atomically: build it under a temporary name, then rename.

    With puf=None only internal/ is written (a rejected or failed release: nothing public).
    `tables` maps 'stage/table' -> frame; report_writer(manifest, path) writes internal/report.html.
    """
    final = release_dir(spec)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.parent / f".{final.name}.tmp-{uuid.uuid4().hex[:8]}"
    try:
        internal = tmp / "internal"
        internal.mkdir(parents=True)
        outputs: dict[str, str] = {}
        if puf is not None:
            outputs = write_public_files(puf, tmp / "public", notes or "")
        for key, frame in tables.items():
            path = internal / f"{key}.csv"
            path.parent.mkdir(parents=True, exist_ok=True)
            frame.to_csv(path, index=False, lineterminator="\n")
        manifest.hashes.outputs = outputs
        write_json(internal / "manifest.json", manifest.to_json())
        report_writer(manifest, internal / "report.html")
        # swap into place: the old folder (a re-run) is removed only after the new one is in
        backup = None
        if final.exists():
            backup = final.parent / f".{final.name}.old-{uuid.uuid4().hex[:8]}"
            final.rename(backup)
        tmp.rename(final)
        if backup is not None:
            shutil.rmtree(backup, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


def now() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")
