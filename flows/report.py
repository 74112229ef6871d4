"""The release report (internal/report.html, self-contained) and the run's Prefect artifacts.

Robust to any stage being switched off or any table missing: it shows what is there.
"""

from __future__ import annotations

import base64
import json
import re
from html import escape
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

MAX_ROWS = 60
HIDDEN_TABLES = {("risk", "records"), ("swap", "pairs")}  # record-level / swap map: CSV only
CSS = (
    "body{font-family:sans-serif;margin:2em;max-width:1200px;color:#222}"
    "table.t{border-collapse:collapse;font-size:13px;margin:.5em 0}"
    "table.t td,table.t th{border:1px solid #ccc;padding:3px 6px;text-align:right}"
    "table.t th{background:#f3f3f3}.pass{color:#070}.fail{color:#b00;font-weight:bold}"
    "img{max-width:100%;border:1px solid #eee}.note{color:#555;font-size:12px}"
    "h2{border-bottom:2px solid #ddd;padding-bottom:3px}"
)


def _img(png: bytes, alt: str) -> str:
    b64 = base64.b64encode(png).decode()
    return f"<figure><img alt='{escape(alt)}' src='data:image/png;base64,{b64}'></figure>"


def _value(v: Any) -> str:
    if isinstance(v, float | np.floating):
        return f"{float(v):.6g}"
    if isinstance(v, dict | list | tuple):
        return json.dumps(v, default=str)
    return str(v)


def _table(df: pd.DataFrame | None, caption: str = "", where: str = "") -> str:
    if df is None or len(df) == 0:
        return f"<p class='note'>{escape(caption or 'table')}: empty.</p>"
    head = df.head(MAX_ROWS)
    if isinstance(head.index, pd.MultiIndex) or head.index.name is not None:
        head = head.reset_index()
    html = head.to_html(
        index=False, border=0, classes="t", na_rep="", float_format=lambda x: f"{x:.4g}"
    )
    cap = f"<p><b>{escape(caption)}</b></p>" if caption else ""
    more = ""
    if len(df) > MAX_ROWS:
        more = (
            f"<p class='note'>first {MAX_ROWS} of {len(df)} rows; all rows in {escape(where)}</p>"
        )
    return cap + html + more


def _kv(d: dict, caption: str) -> str:
    if not d:
        return ""
    rows = "".join(
        f"<tr><th style='text-align:left'>{escape(str(k))}</th><td style='text-align:left'>"
        f"{escape(_value(v))}</td></tr>"
        for k, v in d.items()
    )
    return f"<p><b>{escape(caption)}</b></p><table class='t'>{rows}</table>"


class _Outputs:
    """Stage outputs by name, with a record of the tables and figures already shown."""

    def __init__(self, outputs: list):
        self.by_name = {o.name: o for o in outputs}
        self.shown: set[tuple[str, str]] = set()

    def get(self, stage: str):
        return self.by_name.get(stage)

    def tables(self, stage: str, pattern: str) -> dict[str, pd.DataFrame]:
        o = self.by_name.get(stage)
        if o is None:
            return {}
        rx = re.compile(pattern)
        return {
            k: v
            for k, v in o.tables.items()
            if rx.search(k) and (stage, k) not in HIDDEN_TABLES and isinstance(v, pd.DataFrame)
        }

    def show_tables(self, stage: str, pattern: str, label: str = "") -> list[str]:
        out = []
        for k, v in self.tables(stage, pattern).items():
            self.shown.add((stage, k))
            out.append(_table(v, f"{label or stage}: {k}", f"internal/{stage}/{k}.csv"))
        return out

    def show_figures(self, stage: str, pattern: str) -> list[str]:
        o = self.by_name.get(stage)
        if o is None:
            return []
        rx = re.compile(pattern)
        out = []
        for k, png in o.figures.items():
            if rx.search(k) and (stage, f"fig:{k}") not in self.shown:
                self.shown.add((stage, f"fig:{k}"))
                out.append(_img(png, f"{stage}/{k}"))
        return out


def _section(sid: str, title: str, body: list[str], absent: str) -> str:
    content = "\n".join(b for b in body if b) or f"<p class='note'>{escape(absent)}</p>"
    return f"<section id='{sid}'><h2>{escape(title)}</h2>\n{content}\n</section>"


def _se_summary(se: pd.DataFrame) -> pd.DataFrame | None:
    from sdl_design.utility import deff_class_summary

    if se is None or "ratio" not in se or "deff" not in se:
        return None
    t = deff_class_summary(se["ratio"], se["deff"])
    t.index.name = "statistic"
    return t.reset_index()


def render_html(manifest: dict, outputs: list) -> str:
    """The report's HTML text."""
    rel = manifest.get("release") or {}
    o = _Outputs(outputs or [])
    title = f"{rel.get('name', '?')} {rel.get('year', '')}: release report"
    status = manifest.get("status", "?")
    head = [
        "<!DOCTYPE html><html><head><meta charset='utf-8'>",
        f"<title>{escape(title)}</title><style>{CSS}</style></head><body>",
        f"<h1>{escape(title)}</h1>",
    ]
    gates = manifest.get("gates") or []
    n_fail = sum(not g.get("passed") for g in gates)
    summary = {
        "release id": rel.get("release_id"),
        "status": status,
        "reason": manifest.get("reason"),
        "created": rel.get("created"),
        "records in / out": "{} / {}".format(
            (manifest.get("counts") or {}).get("n_input", "?"),
            (manifest.get("counts") or {}).get("n_output", "?"),
        ),
        "gates": f"{len(gates) - n_fail} of {len(gates)} passed",
        "stages run": ", ".join(s.get("name", "?") for s in manifest.get("stages") or [])
        or ", ".join(o.by_name),
    }
    sections = [_section("summary", "Summary", [_kv(summary, "Release")], "")]

    # gates
    if gates:
        g = pd.DataFrame(gates)
        rows = "".join(
            f"<tr><td style='text-align:left'>{escape(str(r.get('name')))}</td>"
            f"<td class='{'pass' if r.get('passed') else 'fail'}'>"
            f"{'passed' if r.get('passed') else 'FAILED'}</td>"
            f"<td>{escape(_value(r.get('value')))}</td><td>{escape(str(r.get('threshold')))}</td></tr>"
            for r in g.to_dict(orient="records")
        )
        gate_html = (
            f"<p>{len(gates) - n_fail} passed, {n_fail} failed.</p><table class='t'><tr>"
            f"<th>gate</th><th>result</th><th>value</th><th>threshold</th></tr>{rows}</table>"
        )
    else:
        gate_html = ""
    sections.append(_section("gates", "Gates", [gate_html], "No gate was evaluated."))

    # approval
    ap = manifest.get("approval") or {}
    sections.append(
        _section(
            "approval",
            "Approval",
            [
                _kv(
                    {
                        "required": ap.get("required"),
                        "approver": ap.get("approver") or "none",
                        "decision": ap.get("decision") or "none",
                        "comment": ap.get("comment", ""),
                        "at": ap.get("at"),
                    },
                    "Decision",
                )
            ],
            "",
        )
    )

    # risk before / after by stratum
    risk_body = o.show_tables("risk", r"stratum|profile_size", "before treatment (risk)")
    risk_body += o.show_tables("massc", r"delta|stratum|risk", "after treatment (MASSC)")
    risk_body += o.show_tables("final", r"risk|stratum", "after treatment (final)")
    sections.append(
        _section(
            "risk", "Disclosure risk before and after, by stratum", risk_body, "Risk not measured."
        )
    )

    # identification risk (PRB)
    sections.append(
        _section(
            "identification-risk",
            "Identification risk (PRB)",
            o.show_tables("prb", r"risk"),
            "PRB stage not run.",
        )
    )

    # SE ratios
    se_body = o.show_figures("swap", r"se_ratio|box") + o.show_figures("final", r"se_ratio|box")
    se_body += o.show_tables("swap", r"^se_ratio_summary", "swap (Table 1 form)")
    fin = o.get("final")
    if fin is not None and "se_ratios" in fin.tables:
        from flows.monitor import ratio_boxplot

        groups = {k: v.tables["se_ratios"] for k, v in o.by_name.items() if "se_ratios" in v.tables}
        png = base64.b64decode(ratio_boxplot(groups, "SE ratios by design-effect class", "stage"))
        se_body.append(_img(png, "final/se_ratios_boxplot"))
        se_body.append(
            _table(_se_summary(fin.tables["se_ratios"]), "final: SE ratios by deff class")
        )
    for stage in ("swap", "final"):
        se_body += o.show_tables(stage, r"^se_ratios$", f"{stage}: SE ratio by characteristic")
    sections.append(
        _section("se-ratios", "Standard-error ratios", se_body, "No SE ratios computed.")
    )

    # utility: TVD and weighted counts
    util = []
    for stage in ("prb", "massc", "topcode", "final"):
        util += o.show_tables(stage, r"tvd|count|cramer|aad|utility")
    sections.append(_section("utility", "TVD and weighted counts", util, "No utility tables."))

    # calibration (MASSC)
    massc = o.get("massc")
    cal = []
    if massc is not None:
        cal_params = (massc.params or {}).get("calibration")
        if cal_params:
            cal.append(
                _kv(
                    cal_params if isinstance(cal_params, dict) else {"calibration": cal_params},
                    "Calibration settings",
                )
            )
        cal_metrics = {
            k: v for k, v in massc.metrics.items() if re.search(r"calib|adj|factor|weight", k)
        }
        cal.append(_kv(cal_metrics, "Weight adjustment factors"))
        cal += o.show_tables("massc", r"calib|adjust|factor|replicate")
    sections.append(
        _section("calibration", "Calibration summary (MASSC)", cal, "MASSC stage not run.")
    )

    # each stage: what it did
    stage_html = []
    for out in outputs or []:
        body = [f"<h3 id='stage-{escape(out.name)}'>{escape(out.name)}</h3>"]
        if out.notes:
            body.append("<ul>" + "".join(f"<li>{escape(str(n))}</li>" for n in out.notes) + "</ul>")
        body.append(_kv(out.params, "Parameters"))
        body.append(_kv(out.metrics, "Metrics"))
        body += o.show_figures(out.name, r".")
        for k, v in out.tables.items():
            if (out.name, k) in o.shown:
                continue
            if (out.name, k) in HIDDEN_TABLES:
                body.append(
                    f"<p class='note'>{escape(k)}: internal/{escape(out.name)}/{escape(k)}.csv</p>"
                )
                continue
            body.append(_table(v, f"{out.name}: {k}", f"internal/{out.name}/{k}.csv"))
        stage_html.append("\n".join(b for b in body if b))
    sections.append(_section("stages", "What each stage did", stage_html, "No stage ran."))

    # provenance
    prov = [
        _kv({k: v for k, v in (manifest.get("hashes") or {}).items() if k != "outputs"}, "Hashes"),
        _kv((manifest.get("hashes") or {}).get("outputs") or {}, "Published files"),
        _kv(manifest.get("versions") or {}, "Versions"),
    ]
    sections.append(_section("provenance", "Provenance", prov, ""))
    return "\n".join(head + sections + ["</body></html>"])


def render_report(manifest: dict, outputs: list, path: str | Path) -> Path:
    """Write the self-contained HTML release report (plots embedded as base64 PNG)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(render_html(manifest, outputs), encoding="utf-8")
    return path


# ---------------------------------------------------------------- Prefect artifacts


def _plain(v: Any) -> Any:
    if isinstance(v, np.generic):
        v = v.item()
    if isinstance(v, float) and not np.isfinite(v):
        return None
    return v


def artifact_key(text: str) -> str:
    """A valid artifact key (lowercase letters, digits, dashes)."""
    return re.sub(r"[^a-z0-9-]+", "-", str(text).lower()).strip("-")[:100] or "release"


def post_artifacts(manifest: dict, outputs: list) -> list[str]:
    """Markdown summary, gates table and metrics table artifacts for the current run; returns keys."""
    from prefect.artifacts import create_markdown_artifact, create_table_artifact

    rel = manifest.get("release") or {}
    base = artifact_key(f"puf-{rel.get('name', 'release')}-{rel.get('year', '')}")
    gates = manifest.get("gates") or []
    n_fail = sum(not g.get("passed") for g in gates)
    ap = manifest.get("approval") or {}
    md = [
        f"# {rel.get('name')} {rel.get('year')}: {manifest.get('status')}",
        "",
        f"Release `{rel.get('release_id')}`; gates: {len(gates) - n_fail} of {len(gates)} passed; "
        f"approver: {ap.get('approver') or 'none'} ({ap.get('decision') or 'no decision'}).",
    ]
    if manifest.get("reason"):
        md.append(f"\n**Reason:** {manifest['reason']}")
    if n_fail:
        md += ["", "## Failed gates", ""]
        md += [
            f"- {g['name']}: {g.get('value')} (threshold {g.get('threshold')})"
            for g in gates
            if not g.get("passed")
        ]
    for out in outputs or []:
        if out.notes:
            md += ["", f"## {out.name}", ""] + [f"- {n}" for n in out.notes]
    keys = [f"{base}-summary", f"{base}-gates", f"{base}-metrics"]
    create_markdown_artifact(key=keys[0], markdown="\n".join(md), description="release summary")
    create_table_artifact(
        key=keys[1],
        table=[{k: _plain(v) for k, v in g.items()} for g in gates],
        description="gate results",
    )
    create_table_artifact(
        key=keys[2],
        table=[
            {"metric": k, "value": _plain(v)} for k, v in (manifest.get("metrics") or {}).items()
        ],
        description="release metrics",
    )
    return keys
