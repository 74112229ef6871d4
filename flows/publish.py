"""A release's files: the internal record (manifest, tables, report) and the public files
(flows.public_files), written into an attempt's staging folder (flows.txn publishes it)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pandas as pd

from flows.html import artifact_key
from flows.manifest import VERSIONED, Manifest, _json_default, now, versions  # noqa: F401
from flows.public_files import write_csv, write_public_files
from flows.report import _plain, _verdict
from sdl_design.io import file_digest as sha256_file  # noqa: F401 - one hash, used by flows
from sdl_design.io import frame_digest as sha256_frame  # noqa: F401
from sdl_design.spec import ReleaseSpec


def release_dir(spec: ReleaseSpec) -> Path:
    return Path(spec.release.output_dir) / spec.release.name / str(spec.release.year)


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


# ---------------------------------------------------------------- the board's artifacts

WORST_COLUMNS = [
    "variable",
    "domain",
    "level",
    "statistic",
    "estimate_original",
    "estimate_released",
    "std_bias",
    "ci_overlap",
    "se_ratio",
]
LINKED = {  # the files a board member opens, relative to the release (or staged) folder
    "report": "internal/report.html",
    "gate table": "internal/gates.csv",
    "manifest": "internal/manifest.json",
    "public file": "public/puf.parquet",
    "public CSV": "public/puf.csv",
    "codebook": "public/codebook.csv",
    "public README": "public/README.md",
}


def _cell(v: Any) -> str:
    """A markdown table cell."""
    v = _plain(v)
    if v is None:
        return ""
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v).replace("|", "\\|").replace("\n", " ")


def md_table(rows: list[dict[str, Any]]) -> list[str]:
    """Rows (dicts with the same keys) as a markdown table's lines."""
    if not rows:
        return []
    cols = list(rows[0])
    out = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    out += ["| " + " | ".join(_cell(r.get(c)) for c in cols) + " |" for r in rows]
    return out


def gate_rows(manifest: Manifest) -> list[dict[str, Any]]:
    """The gate table as the board reads it: passed, value, limits, then the gate's name (the
    long column last, so a narrow page cuts the name, not the verdict)."""
    return [
        {"passed": g.passed, "value": _plain(g.value), "limits": g.threshold or "", "gate": g.name}
        for g in manifest.gates
    ]


def worst_rows(results: Any, n: int = 10) -> list[dict[str, Any]]:
    """The assessment's worst estimates (largest |standardized bias| first), n at most."""
    for r in results:
        t = r.tables.get("worst_estimates") if r.tables else None
        if t is not None and len(t):
            cols = [c for c in WORST_COLUMNS if c in t.columns] or list(t.columns)
            return [
                {c: _plain(v) for c, v in rec.items()} for rec in t[cols].head(n).to_dict("records")
            ]
    return []


def verdict_text(manifest: Manifest, results: Any) -> str:
    """The report's verdict in plain words (publish or not, and why): its section's text."""
    import html
    import re

    try:
        section = re.sub(r"<h2>.*?</h2>", "", _verdict(manifest, results), flags=re.S)
        section = re.sub(r"\s*\(<a href='#[^']*'>[^<]*</a>\)", "", section)  # in-page links
        text = " ".join(html.unescape(re.sub(r"<[^>]+>", " ", section)).split())
    except Exception:  # noqa: BLE001 - the line below says the essentials
        text = ""
    n, bad = len(manifest.gates), manifest.n_failed_gates
    return text or f"{manifest.status}: {n - bad} of {n} checks pass."


def verdict_markdown(
    manifest: Manifest, results: Any, folder: Path | None, n_worst: int = 10
) -> str:
    """The board's page: status and verdict, the gate table, the worst estimates, the files."""
    rel, ap = manifest.release, manifest.approval
    state = {
        "gated": "awaiting the review board's decision",
        "published": f"published (approved by {ap.approver or 'nobody: not required'})",
        "rejected": "not published (rejected)",
        "failed": "not published (failed)",
    }.get(manifest.status, manifest.status)
    n, bad = len(manifest.gates), manifest.n_failed_gates
    md = [
        f"# {rel.name} {rel.year}: {state}",
        "",
        f"**Verdict.** {verdict_text(manifest, results)}",
    ]
    if manifest.reason:
        md += ["", f"**Reason:** {manifest.reason}"]
    md += ["", f"Release `{rel.release_id}`; gates: {n - bad} of {n} passed."]
    md += ["", "## Gates", "", *(md_table(gate_rows(manifest)) or ["(no gate evaluated)"])]
    worst = worst_rows(results, n_worst)
    if worst:
        md += ["", f"## Worst estimates (first {len(worst)}, largest |standardized bias|)", ""]
        md += md_table(worst)
    if folder is not None:
        links = [(k, Path(folder) / p) for k, p in LINKED.items() if (Path(folder) / p).is_file()]
        md += ["", f"## Files (`{folder}`)", ""]
        md += [f"- {k}: [{p.name}]({p.resolve().as_uri()}) (`{p}`)" for k, p in links]
    return "\n".join(md)


def post_verdict(manifest: Manifest, results: Any = (), folder: Path | None = None) -> list[str]:
    """The current run's board artifacts: `-verdict` (markdown: verdict, gate table, worst
    estimates, links to the files in folder) and `-worst-estimates` (table); their keys."""
    from prefect.artifacts import create_markdown_artifact, create_table_artifact

    base = artifact_key(f"puf-{manifest.release.name}-{manifest.release.year}")
    keys = [f"{base}-verdict"]
    create_markdown_artifact(
        key=keys[0],
        markdown=verdict_markdown(manifest, results, folder),
        description="verdict, gate table, worst estimates and the files",
    )
    worst = worst_rows(results, 50)
    if worst:
        keys.append(f"{base}-worst-estimates")
        create_table_artifact(
            key=keys[-1], table=worst, description="worst estimates of the published file"
        )
    return keys
