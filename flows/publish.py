"""Release folder: public file, codebook and notes; internal manifest and tables; atomic publish."""

from __future__ import annotations

import hashlib
import json
import platform
import shutil
import uuid
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd

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


def codebook(puf: pd.DataFrame) -> pd.DataFrame:
    rows = []
    for c in puf.columns:
        s = puf[c]
        num = pd.api.types.is_numeric_dtype(s)
        vals = pd.unique(s.dropna())
        rows.append(
            {
                "variable": c,
                "type": "numeric" if num else "categorical",
                "dtype": str(s.dtype),
                "n_missing": int(s.isna().sum()),
                "n_distinct": int(len(vals)),
                "min": float(s.min()) if num and len(vals) else None,
                "max": float(s.max()) if num and len(vals) else None,
                "categories": "" if num or len(vals) > 60 else "; ".join(sorted(map(str, vals))),
            }
        )
    return pd.DataFrame(rows)


def variance_notes(
    spec: ReleaseSpec, masked_design: bool, replicate_method: str | None, n_rep: int
) -> str:
    d = spec.design
    lines = [
        f"# {spec.release.name} {spec.release.year}: public-use file",
        "",
        "Files: `puf.parquet` and `puf.csv` (the same records), `codebook.csv` (one row per variable).",
        "",
        "## Estimating variances",
        "",
        f"- Weight: `{d.weight}`. Every estimate must use it.",
    ]
    if masked_design:
        lines += [
            f"- Design variables: `{d.strata}` (pseudo-stratum) and `{d.psu}` (pseudo-PSU). They are masked:",
            "  whole segments were swapped between PSUs to protect geography, chosen so that variance",
            "  estimates change as little as possible. Use them as ordinary strata and PSUs with",
            "  with-replacement (ultimate cluster) Taylor linearization:",
            f"  R survey: `svydesign(ids=~{d.psu}, strata=~{d.strata}, weights=~{d.weight}, nest=TRUE)`;",
            f"  Stata: `svyset {d.psu} [pw={d.weight}], strata({d.strata})`;",
            f"  SUDAAN: `design=wr; nest {d.strata} {d.psu}; weight {d.weight}`.",
        ]
    if n_rep:
        scale = {
            "jkn": "JKn (delete one pseudo-PSU; scale (n_h-1)/n_h per replicate)",
            "jk1": "JK1 (scale (R-1)/R)",
            "brr": "BRR (scale 1/R)",
            "fay": f"Fay BRR with rho = {d.replicate_weights.rho if d.replicate_weights else ''} (scale 1/(R(1-rho)^2))",
            "sdr": "successive difference replication (scale 4/R)",
            "bootstrap": "bootstrap (scale 1/R)",
        }.get(replicate_method or "", replicate_method or "")
        lines += [
            f"- Replicate weights: {n_rep} columns, method {scale}; centre the replicate estimates on",
            "  the full-sample estimate (R survey: `mse = TRUE`).",
        ]
    lines += [
        "",
        "## Disclosure limitation applied",
        "",
        "Key variables may have been perturbed (post-randomization, substitution) and some records",
        "subsampled, with weights calibrated so that totals of the calibration controls are preserved.",
        "Extreme values are top-coded as the codebook shows. Do not attempt to identify any person.",
    ]
    return "\n".join(lines) + "\n"


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
            public = tmp / "public"
            public.mkdir()
            puf.to_parquet(public / "puf.parquet", index=False)
            puf.to_csv(public / "puf.csv", index=False, lineterminator="\n")
            codebook(puf).to_csv(public / "codebook.csv", index=False, lineterminator="\n")
            (public / "README.md").write_text(notes or "")
            for f in sorted(public.iterdir()):
                outputs[f"public/{f.name}"] = sha256_file(f)
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
