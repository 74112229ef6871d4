"""The release report (internal/report.html, self-contained) and the run's Prefect artifacts.

The report shows what it is given: each stage's result with the tables it declares
(`StageResult.report_tables`) and all its figures, the SE ratios of every result that declares an
`se_ratio_table`, and for a stage of the flow with no result a line saying it did not run.
"""

from __future__ import annotations

from collections.abc import Sequence
from html import escape
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd

from flows.html import artifact_key, img, png_b64, table, value
from flows.manifest import Manifest

if TYPE_CHECKING:
    from sdl_design.stage import StageResult

__all__ = ["MAX_ROWS", "artifact_key", "post_artifacts", "render_html", "render_report"]

MAX_ROWS = 60
CSS = (
    "body{font-family:sans-serif;margin:2em;max-width:1200px;color:#222}"
    "table.t{border-collapse:collapse;font-size:13px;margin:.5em 0}"
    "table.t td,table.t th{border:1px solid #ccc;padding:3px 6px;text-align:right}"
    "table.t th{background:#f3f3f3}.pass{color:#070}.fail{color:#b00;font-weight:bold}"
    "img{max-width:100%;border:1px solid #eee}.note{color:#555;font-size:12px}"
    "h2{border-bottom:2px solid #ddd;padding-bottom:3px}"
)


def _kv(d: dict, caption: str) -> str:
    if not d:
        return ""
    rows = "".join(
        f"<tr><th style='text-align:left'>{escape(str(k))}</th><td style='text-align:left'>"
        f"{escape(value(v))}</td></tr>"
        for k, v in d.items()
    )
    return f"<p><b>{escape(caption)}</b></p><table class='t'>{rows}</table>"


def _section(sid: str, title: str, body: list[str], absent: str) -> str:
    content = "\n".join(b for b in body if b) or f"<p class='note'>{escape(absent)}</p>"
    return f"<section id='{sid}'><h2>{escape(title)}</h2>\n{content}\n</section>"


def _summary(m: Manifest, results: Sequence[StageResult]) -> str:
    n = len(m.gates)
    counts = m.counts
    summary = {
        "release id": m.release.release_id,
        "status": m.status,
        "reason": m.reason,
        "created": m.release.created,
        "records in / out": "{} / {}".format(
            "?" if counts.n_input is None else counts.n_input,
            "?" if counts.n_output is None else counts.n_output,
        ),
        "gates": f"{n - m.n_failed_gates} of {n} passed",
        "stages run": ", ".join(s.name for s in m.stages) or ", ".join(r.name for r in results),
    }
    return _section("summary", "Summary", [_kv(summary, "Release")], "")


def _gates(m: Manifest) -> str:
    if not m.gates:
        return _section("gates", "Gates", [], "No gate was evaluated.")
    rows = "".join(
        f"<tr><td style='text-align:left'>{escape(g.name)}</td>"
        f"<td class='{'pass' if g.passed else 'fail'}'>{'passed' if g.passed else 'FAILED'}</td>"
        f"<td>{escape(value(g.value))}</td><td>{escape(str(g.threshold))}</td></tr>"
        for g in m.gates
    )
    n_fail = m.n_failed_gates
    html = (
        f"<p>{len(m.gates) - n_fail} passed, {n_fail} failed.</p><table class='t'><tr>"
        f"<th>gate</th><th>result</th><th>value</th><th>threshold</th></tr>{rows}</table>"
    )
    return _section("gates", "Gates", [html], "")


def _approval(m: Manifest) -> str:
    ap = m.approval
    decision = {
        "required": ap.required,
        "approver": ap.approver or "none",
        "decision": ap.decision or "none",
        "comment": ap.comment,
        "at": ap.at,
    }
    return _section("approval", "Approval", [_kv(decision, "Decision")], "")


def _se_summary(se: pd.DataFrame) -> pd.DataFrame | None:
    from sdl_design.utility import deff_class_summary

    if "ratio" not in se or "deff" not in se:
        return None
    t = deff_class_summary(se["ratio"], se["deff"])
    t.index.name = "statistic"
    return t.reset_index()


def _se_ratios(results: Sequence[StageResult]) -> str:
    """One box plot of every declared SE-ratio table (one box per stage in each design-effect
    class) and each table's summary by class."""
    from sdl_design.plots import se_ratio_boxplot

    declared = [r for r in results if r.se_ratio_table and r.se_ratio_table in r.tables]
    if not declared:
        return _section("se-ratios", "Standard-error ratios", [], "No SE ratios computed.")
    groups = {r.name: r.tables[r.se_ratio_table] for r in declared}
    png = se_ratio_boxplot(groups, "SE ratios by design-effect class", legend="stage", dpi=90)
    body = [img(png, "se-ratios/by-stage")]
    for r in declared:
        caption = f"{r.name}: SE ratios by design-effect class"
        body.append(table(_se_summary(groups[r.name]), caption))
        body.append(
            f"<p class='note'>one row per characteristic in "
            f"internal/{escape(r.name)}/{escape(str(r.se_ratio_table))}.csv</p>"
        )
    return _section("se-ratios", "Standard-error ratios", body, "")


def _stage(r: StageResult) -> str:
    """What one stage did: notes, parameters, metrics, all its figures, its declared tables;
    the other tables are named with their CSV."""
    name = escape(r.name)
    body = [f"<h3 id='stage-{name}'>{name}</h3>"]
    if r.notes:
        body.append("<ul>" + "".join(f"<li>{escape(str(n))}</li>" for n in r.notes) + "</ul>")
    body.append(_kv(r.params, "Parameters"))
    body.append(_kv(r.metrics, "Metrics"))
    body += [img(png, f"{r.name}/{k}") for k, png in r.figures.items()]
    for k in r.report_tables:
        where = f"internal/{r.name}/{k}.csv"
        if k in r.tables:
            body.append(table(r.tables[k], f"{r.name}: {k}", where, MAX_ROWS))
        else:
            body.append(f"<p class='note'>{escape(k)}: not produced by this run.</p>")
    csv_only = [k for k in r.tables if k not in r.report_tables]
    if csv_only:
        files = ", ".join(f"internal/{r.name}/{k}.csv" for k in csv_only)
        body.append(f"<p class='note'>Tables in CSV only: {escape(files)}</p>")
    return "\n".join(b for b in body if b)


def _not_run(name: str, m: Manifest) -> str:
    why = (
        "switched off in the spec, or the release stopped before it"
        if m.status in ("rejected", "failed")
        else "switched off in the spec"
    )
    return f"<h3 id='stage-{escape(name)}'>{escape(name)}</h3><p class='note'>Not run: {why}.</p>"


def _stages(m: Manifest, results: Sequence[StageResult], stages: Sequence[str] | None) -> str:
    by_name = {r.name: r for r in results if not r.section}  # the others have their own
    own = {r.name for r in results if r.section}
    names = [n for n in (stages or []) if n not in own]
    names += [n for n in by_name if n not in names]
    body = [_stage(by_name[n]) if n in by_name else _not_run(n, m) for n in names]
    return _section("stages", "What each stage did", body, "No stage ran.")


def _provenance(m: Manifest) -> str:
    hashes = {"spec": m.hashes.spec, "input": m.hashes.input}
    body = [
        _kv({k: v for k, v in hashes.items() if v is not None}, "Hashes"),
        _kv(m.hashes.outputs, "Published files"),
        _kv(m.versions, "Versions"),
    ]
    return _section("provenance", "Provenance", body, "")


def render_html(
    manifest: Manifest, results: Sequence[StageResult], stages: Sequence[str] | None = None
) -> str:
    """The report's HTML text. stages: the names of every stage of the flow, in order (a stage
    with no result gets a line saying it did not run); default: the results' names."""
    rel = manifest.release
    title = f"{rel.name} {rel.year}: release report"
    head = [
        "<!DOCTYPE html><html><head><meta charset='utf-8'>",
        f"<title>{escape(title)}</title><style>{CSS}</style></head><body>",
        f"<h1>{escape(title)}</h1>",
    ]
    own = [_section(f"section-{r.name}", r.section, [_stage(r)], "") for r in results if r.section]
    sections = [
        _summary(manifest, results),
        _gates(manifest),
        *own,
        _approval(manifest),
        _se_ratios(results),
        _stages(manifest, results, stages),
        _provenance(manifest),
    ]
    return "\n".join(head + sections + ["</body></html>"])


def render_report(
    manifest: Manifest,
    results: Sequence[StageResult],
    path: str | Path,
    stages: Sequence[str] | None = None,
) -> Path:
    """Write the self-contained HTML release report (plots embedded as base64 PNG)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(render_html(manifest, results, stages), encoding="utf-8")
    return path


# ---------------------------------------------------------------- Prefect artifacts


def _plain(v: Any) -> Any:
    if isinstance(v, np.generic):
        v = v.item()
    if isinstance(v, float) and not np.isfinite(v):
        return None
    return v


def post_artifacts(
    manifest: Manifest,
    staged: Path | None = None,
    results: Sequence[StageResult] = (),
    max_rows: int = 50,
    max_figures: int = 6,
) -> list[str]:
    """Markdown summary, gates table and metrics table artifacts for the current run; returns keys.

    With the staged release folder (before the approval) also: `-report`, the staged report's
    location with the assessment's figures (embedded PNG), and `-assessment`, the assessment
    tables (worst estimates first, at most max_rows rows each) of the result with a section."""
    from prefect.artifacts import create_markdown_artifact, create_table_artifact

    m = manifest
    rel = m.release
    base = artifact_key(f"puf-{rel.name}-{rel.year}")
    n, n_fail = len(m.gates), m.n_failed_gates
    ap = m.approval
    md = [
        f"# {rel.name} {rel.year}: {m.status}",
        "",
        f"Release `{rel.release_id}`; gates: {n - n_fail} of {n} passed; "
        f"approver: {ap.approver or 'none'} ({ap.decision or 'no decision'}).",
    ]
    if m.reason:
        md.append(f"\n**Reason:** {m.reason}")
    if n_fail:
        md += ["", "## Failed gates", ""]
        md += [f"- {g.name}: {g.value} (threshold {g.threshold})" for g in m.gates if not g.passed]
    for st in m.stages:
        if st.notes:
            md += ["", f"## {st.name}", ""] + [f"- {n}" for n in st.notes]
    keys = [f"{base}-summary", f"{base}-gates", f"{base}-metrics"]
    create_markdown_artifact(key=keys[0], markdown="\n".join(md), description="release summary")
    create_table_artifact(
        key=keys[1],
        table=[{k: _plain(v) for k, v in g.model_dump().items()} for g in m.gates],
        description="gate results",
    )
    create_table_artifact(
        key=keys[2],
        table=[{"metric": k, "value": _plain(v)} for k, v in m.metrics.items()],
        description="release metrics",
    )
    if staged is None:
        return keys
    staged = Path(staged)
    report = staged / "internal" / "report.html"
    public = staged / "public"
    files = sorted(p.name for p in public.iterdir()) if public.is_dir() else []
    rmd = [
        f"# {rel.name} {rel.year}: the staged release",
        "",
        f"- report: [{report.name}]({report.resolve().as_uri()}) (`{report}`)",
        f"- public files as they would be published: {', '.join(files) or 'none'} (`{public}`)",
        f"- gates: {n - n_fail} of {n} passed (artifact `{keys[1]}`)",
        f"- records in / out: {m.counts.n_input} / {m.counts.n_output}",
    ]
    shown = [r for r in results if r.section]
    for r in shown:
        rmd += ["", f"## {r.section}", ""] + [f"- {n}" for n in r.notes]
        for name, png in list(r.figures.items())[:max_figures]:
            rmd += ["", f"![{r.name}/{name}](data:image/png;base64,{png_b64(png)})"]
    keys.append(f"{base}-report")
    create_markdown_artifact(
        key=keys[-1], markdown="\n".join(rmd), description="staged report and assessment figures"
    )
    rows: list[dict] = []
    for r in shown:
        for tname in r.report_tables or list(r.tables):
            t = r.tables.get(tname)
            if t is None or not len(t):
                continue
            for rec in t.head(max_rows).to_dict(orient="records"):
                rows.append(
                    {"table": f"{r.name}/{tname}", **{k: _plain(v) for k, v in rec.items()}}
                )
    if rows:
        cols = list(dict.fromkeys(k for row in rows for k in row))
        keys.append(f"{base}-assessment")
        create_table_artifact(
            key=keys[-1],
            table=[{c: row.get(c) for c in cols} for row in rows],
            description="assessment of the staged public file against the original",
        )
    return keys
