"""The release report (internal/report.html, self-contained) and the run's Prefect artifacts.

For the board first: a plain-language verdict (publish or not, and why), what leaves the
building (every published column and what was done to it, the dropped columns with why), the
risk of the published file, its analytic validity and every gate; then the detail.
The detail shows what it is given: each stage's result with the tables it declares
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

from flows.html import artifact_key, fold, img, png_b64, scroll, table, value
from flows.manifest import Manifest
from flows.public_docs import column_span, column_treatments, dropped_columns, dropped_groups
from sdl_design.describe import RISK_DELTA, SURVEY_UNIQUES, RiskRow, finite
from sdl_design.plots import se_ratio_boxplot
from sdl_design.stage import NEAR_ROOM, NEAR_RULE
from sdl_design.stages import RELEASE_STAGES, assessment_of, described
from sdl_design.tune import is_risk_gate
from sdl_design.utility import deff_class_summary

if TYPE_CHECKING:
    from sdl_design.stage import Gate, StageResult

__all__ = [
    "MAX_ROWS",
    "artifact_key",
    "near_gates",
    "post_artifacts",
    "render_html",
    "render_report",
]

MAX_ROWS = 60
RISK_SECTION = "disclosure-risk"  # the id of the section on the risk of the published file
NOTE_CHARS = 360  # a longer stage note folds under its beginning
CSS = (
    "*,*::before,*::after{box-sizing:border-box}"
    "body{font-family:sans-serif;margin:0 auto;padding:1.5em 2em;max-width:1200px;color:#222;"
    "overflow-wrap:break-word}"
    ".scroll{overflow-x:auto;max-width:100%}"
    "details{margin:.4em 0}summary{cursor:pointer;font-weight:bold;padding:2px 0}"
    "details[open]>summary{margin-bottom:.3em}"
    "table.t{border-collapse:collapse;font-size:13px;margin:.5em 0}"
    "table.t td,table.t th{border:1px solid #ccc;padding:3px 6px;text-align:right}"
    "table.t th{background:#f3f3f3}.pass{color:#070}.fail{color:#b00;font-weight:bold}"
    "img{max-width:100%;border:1px solid #eee}.note{color:#555;font-size:12px}"
    "h2{border-bottom:2px solid #ddd;padding-bottom:3px}"
    ".verdict{font-size:16px;padding:.4em .8em;border-left:6px solid}.verdict p{margin:.5em 0}"
    ".verdict.pass{border-color:#070;background:#f1f8f1;color:#222;font-weight:normal}"
    ".verdict.fail{border-color:#b00;background:#fbf1f1;color:#222;font-weight:normal}"
    "ul.why li{margin:.3em 0}.near{color:#a60;font-weight:bold}"
    "details.long{margin:0}details.long>summary{font-weight:normal}details.long p{margin:.2em 0}"
    "table.t td:first-child,table.t th:first-child{text-align:left}"
    "#leaves table.t td,#leaves table.t th{text-align:left}"
)


def _kv(d: dict, caption: str, folded: bool = False) -> str:
    """A dict as a two-column table in the scroll container; folded: under a <details>."""
    if not d:
        return ""
    rows = "".join(
        f"<tr><th style='text-align:left'>{escape(str(k))}</th><td style='text-align:left'>"
        f"{escape(value(v))}</td></tr>"
        for k, v in d.items()
    )
    html = scroll(f"<table class='t'>{rows}</table>")
    if folded:
        return fold(f"{caption} ({len(d)})", html)
    return f"<p><b>{escape(caption)}</b></p>{html}"


def _section(sid: str, title: str, body: list[str], absent: str) -> str:
    content = "\n".join(b for b in body if b) or f"<p class='note'>{escape(absent)}</p>"
    return f"<section id='{sid}'><h2>{escape(title)}</h2>\n{content}\n</section>"


def _summary(m: Manifest, results: Sequence[StageResult]) -> str:
    n = len(m.gates)
    counts = m.counts
    summary = {
        "release id": m.release.release_id,
        "status": m.status,
        **({"reason": m.reason} if m.reason else {}),
        "created": m.release.created,
        "records in / out": "{} / {}".format(
            "?" if counts.n_input is None else counts.n_input,
            "?" if counts.n_output is None else counts.n_output,
        ),
        "gates": f"{n - m.n_failed_gates} of {n} passed",
        "stages run": ", ".join(s.name for s in m.stages) or ", ".join(r.name for r in results),
    }
    return _section("summary", "Summary", [_kv(summary, "Release")], "")


def _assessed(results: Sequence[StageResult], name: str) -> float | None:
    """A metric of the assessment (sdl_design.stages.assessment_of), None if absent or not
    finite."""
    a = assessment_of(results)
    return None if a is None else finite(a.metrics, name)


def _measured(results: Sequence[StageResult], measure: str) -> float | None:
    """A measure the report names (e.g. RISK_DELTA), from the first stage that ran and took
    it (Describes.report_measures)."""
    for cls, r in described(results):
        v = finite(r.metrics, cls.report_measures.get(measure))
        if v is not None:
            return v
    return None


def _pct(v: float | None) -> str:
    return "n/a" if v is None else f"{100 * v:.1f}%"


def _num(v: float | None, fmt: str = ".3f") -> str:
    return "n/a" if v is None else format(v, fmt)


def _verdict(m: Manifest, results: Sequence[StageResult]) -> str:
    """The verdict in plain words: publish or not, and why; the worst single estimate and
    every gate near its limit (NEAR_RULE)."""
    gates = m.gates
    failed = [g for g in gates if not g.passed]
    ap = m.approval
    if m.status == "failed":
        head = "Do not publish: the release did not complete"
        why = f" ({m.reason})." if m.reason else "."
        text = head + why + " No file was produced for publication."
    elif failed:
        names = "; ".join(
            f"{g.name}: {value(g.value) if g.value is not None else '?'} against {g.threshold}"
            for g in failed[:5]
        )
        more = f" and {len(failed) - 5} more" if len(failed) > 5 else ""
        text = (
            f"Do not publish: {len(failed)} of {len(gates)} checks failed ({names}{more}). "
            "Nothing was released; the failed checks say what must change."
        )
    elif m.status == "rejected" and ap.decision == "rejected":
        text = f"Not published: rejected by {ap.approver or 'the board'}" + (
            f" ({ap.comment})." if ap.comment else "."
        )
    elif not gates:
        text = "No decision possible: no check was evaluated on this release."
    else:
        text = _publish_text(m, results)
    cls = "pass" if (gates and not failed and m.status not in ("failed", "rejected")) else "fail"
    paras = [escape(text)]
    if m.status != "failed":
        paras += [_worst_estimate(results), _near_text(m, results)]
    box = "".join(f"<p>{p}</p>" for p in paras if p)
    return _section("verdict", "Verdict", [f"<div class='verdict {cls}'>{box}</div>"], "")


def _publish_text(m: Manifest, results: Sequence[StageResult]) -> str:
    """The verdict of a release whose every gate passed."""
    n_in, n_out = m.counts.n_input, m.counts.n_output
    reid = _assessed(results, "reid_share_worst")
    if reid is None:
        reid = _assessed(results, "reid_share")
    uniq = _assessed(results, "unique_share_published")
    uniq0 = _survey_uniques(results)
    overlap = _assessed(results, "overlap_median")
    ser = _assessed(results, "se_ratio_median")
    xi = m.parameters.gates.xi if m.parameters.gates else None
    done = "published" if m.status == "published" else "ready to publish"
    parts = [
        f"Publish: the file is {done}, and all {len(m.gates)} checks pass.",
        (
            f"It holds {n_out:,} of the {n_in:,} survey records."
            if n_in is not None and n_out is not None
            else ""
        ),
    ]
    if reid is not None:
        parts.append(
            f"An intruder who knows the intruder's key ({_intruder(results)}) would "
            f"correctly re-identify {_pct(reid)} of the people who were unique in the survey"
            + (f" (the limit is {_pct(xi)})" if xi is not None else "")
            + "."
        )
    parts.append(_ungated(results))
    if uniq is not None:
        parts.append(
            f"{_pct(uniq)} of published records are unique on the intruder's key"
            + (f" (in the survey file: {_pct(uniq0)})" if uniq0 is not None else "")
            + "."
        )
    if overlap is not None:
        parts.append(
            f"Estimates from the public file agree with the confidential file within sampling "
            f"error: their confidence intervals overlap by {_pct(overlap)} at the median"
            + (
                f", and standard errors are {ser:.2f} times the original at the median"
                if ser
                else ""
            )
            + "."
        )
    if m.approval.decision == "approved" and m.approval.approver:
        parts.append(f"Approved by {m.approval.approver}.")
    return " ".join(p for p in parts if p)


def _table_of(results: Sequence[StageResult], name: str) -> tuple[str, pd.DataFrame] | None:
    """(stage, table) of the first result with a nonempty table of that name."""
    for r in results:
        t = r.tables.get(name)
        if t is not None and len(t):
            return r.name, t
    return None


def _fmt(v: Any) -> str:
    try:
        f = float(v)
    except (TypeError, ValueError):
        return str(v)
    return f"{f:,.4g}" if abs(f) < 1e4 else f"{f:,.0f}"


def _worst_estimate(results: Sequence[StageResult]) -> str:
    """The estimate furthest from the survey file's (the assessment's worst-estimates table,
    largest |standardized bias| first) and the model coefficient with the smallest CI overlap,
    as escaped HTML with a link to the figure of its variable."""
    found = _table_of(results, "worst_estimates")
    out = []
    if found is not None and {"variable", "domain"} <= set(found[1].columns):
        stage, t = found
        w = t.iloc[0]
        what = f"the {w['statistic']} of {w['variable']}" if "statistic" in t else w["variable"]
        where = f"{w['domain']}" + (f" = {w['level']}" if "level" in t else "")
        detail = []
        if {"estimate_released", "estimate_original"} <= set(t.columns):
            detail.append(
                f"{_fmt(w['estimate_released'])} published vs {_fmt(w['estimate_original'])} "
                "in the survey file"
            )
        if "std_bias" in t and np.isfinite(w["std_bias"]):
            detail.append(f"{w['std_bias']:+.1f} survey SEs apart")
        if "ci_overlap" in t and np.isfinite(w["ci_overlap"]):
            detail.append(f"95% intervals overlap {w['ci_overlap']:.2f}")
        text = escape(f"Worst single estimate: {what} in {where}: {', '.join(detail)}.")
        fig = _figure_of(results, str(w["variable"]))
        if fig:
            text += f" (<a href='#{escape(fig)}'>figure</a>)"
        out.append(text)
    coefs = _table_of(results, "model_coefficients")
    if coefs is not None and {"term", "model", "ci_overlap"} <= set(coefs[1].columns):
        c = coefs[1].sort_values("ci_overlap", kind="stable").iloc[0]
        sd = (
            f", {c['std_diff']:+.1f} SEs apart"
            if "std_diff" in c and np.isfinite(c["std_diff"])
            else ""
        )
        out.append(
            escape(
                f"Worst model coefficient: {c['term']} in {c['model']}: 95% intervals overlap "
                f"{c['ci_overlap']:.2f}{sd}."
            )
        )
    return " ".join(out)


def _figure_of(results: Sequence[StageResult], variable: str) -> str:
    """The id of the figure of a variable (a figure key ending in '_<variable>'), else ''."""
    for r in results:
        for k in r.figures:
            if k == variable or k.endswith(f"_{variable}"):
                return _fig_id(r.name, k)
    return ""


def _fig_id(stage: str, key: str) -> str:
    return artifact_key(f"fig-{stage}-{key}", "fig")


def _gate_objects(results: Sequence[StageResult]) -> dict[str, Gate]:
    """The gates the results made, by name (their why, ideal value and limits)."""
    return {g.name: g for r in results for g in r.gates}


def near_gates(m: Manifest, results: Sequence[StageResult]) -> list[tuple[str, float, float]]:
    """(name, value, limit) of every evaluated, passing gate near its limit (NEAR_RULE)."""
    objs = _gate_objects(results)
    out = []
    for g in m.gates:
        o = objs.get(g.name)
        if not g.passed or o is None:
            continue
        lim = o.near_limit()
        if lim is not None:
            out.append((g.name, o.value, lim))
    return out


def _near_text(m: Manifest, results: Sequence[StageResult]) -> str:
    """The gates near their limits, in one sentence with the rule (escaped HTML)."""
    if not _gate_objects(results) or not m.gates:
        return ""
    near = near_gates(m, results)
    rule = (
        f"passing with at most {NEAR_ROOM:.0%} of the room between the ideal value and the "
        "limit left; the rule is under the gate table"
    )
    if not near:
        return escape(f"No check is near its limit ({rule}).")
    items = "; ".join(f"{n}: {v:.4g} (limit {lim:.4g})" for n, v, lim in near)
    return escape(f"Near their limits ({rule}): {items}.")


def _leaves(m: Manifest, results: Sequence[StageResult]) -> str:
    """Every published column and what was done to it; the columns dropped, with why."""

    cols = column_treatments(None, results)
    body = []
    if len(cols):
        body.append(table(cols, "Published columns"))
    dropped = dropped_columns(results)
    if dropped:
        groups = dropped_groups(dropped)  # one row per reason, as the public README
        d = pd.DataFrame(
            {
                "column": [", ".join(c) if len(c) <= 4 else column_span(c) for c, _ in groups],
                "why not published": [why for _, why in groups],
            }
        )
        body.append(table(d, "Columns not published"))
    rows = []
    n_in, n_out = m.counts.n_input, m.counts.n_output
    if n_in is not None and n_out is not None:
        rows.append(f"Records: {n_out:,} published of {n_in:,} in the survey file.")
    rows += [t for cls, r in described(results) for t in cls.treated_sentences(r)]
    if rows:
        body.append("<ul>" + "".join(f"<li>{escape(r)}</li>" for r in rows) + "</ul>")
    return _section(
        "leaves",
        "What leaves the building",
        body,
        "No column record: the release stopped before the published file was assessed.",
    )


def _check_rows(m: Manifest, rows: list[tuple[str, float | None, str, str]]) -> str:
    """(what, value, limit text, pass/fail/'') rows as a table."""
    html = "".join(
        f"<tr><td style='text-align:left'>{escape(w)}</td><td>{escape(v)}</td>"
        f"<td>{escape(lim)}</td><td class='{ok}'>{escape(ok)}</td></tr>"
        for w, v, lim, ok in rows
    )
    return scroll(
        "<table class='t'><tr><th>measure</th><th>value</th><th>limit</th><th></th></tr>"
        f"{html}</table>"
    )


def _whys(m: Manifest, results: Sequence[StageResult], risk: bool) -> str:
    """Each evaluated risk gate (risk=True) or other gate with its why sentence: what it
    protects against and why its limit is what it is (from the gate that made it)."""

    objs = _gate_objects(results)
    near = {n for n, _, _ in near_gates(m, results)}
    items = []
    for g in m.gates:
        o = objs.get(g.name)
        if o is None or not o.why or is_risk_gate(g.name) != risk:
            continue
        flag = " <span class='near'>near its limit</span>" if g.name in near else ""
        items.append(
            f"<li><b>{escape(g.name)}</b>: {escape(value(g.value))} against "
            f"{escape(str(g.threshold))}{flag}. {escape(o.why)}</li>"
        )
    if not items:
        return ""
    what = "risk gate" if risk else "utility gate"
    return (
        f"<p><b>What each {what} protects against, and why its limit</b></p>"
        f"<ul class='why'>{''.join(items)}</ul>"
    )


def _ok(v: float | None, lo: float | None = None, hi: float | None = None) -> str:
    if v is None or (lo is None and hi is None):
        return ""
    good = (lo is None or v >= lo) and (hi is None or v <= hi)
    return "pass" if good else "fail"


def _survey_uniques(results: Sequence[StageResult]) -> float | None:
    """The share of the survey file's records unique on the intruder's key (the attack's
    sample uniques), else a stage's share on the declared keys (SURVEY_UNIQUES)."""
    n = _assessed(results, "reid_sample_uniques")
    n0 = _assessed(results, "n_original")
    if n is not None and n0:
        return n / n0
    return _measured(results, SURVEY_UNIQUES)


def _ungated(results: Sequence[StageResult]) -> str:
    """The attacks reported but not gated, for the verdict: the board sees what the spec
    declared out of the intruder's reach."""
    a = assessment_of(results)
    if a is None:
        return ""
    m, lines = a.metrics, a.params.get("intruder_key") or []
    out = []
    design = m.get("reid_share_design")
    if design is not None and not any(ln.startswith("published design labels") for ln in lines):
        out.append(
            f"With the design labels as well (declared unknown to an intruder) the same attack "
            f"would re-identify {_pct(design)}."
        )
    informed = m.get("nn_informed_share")
    if informed is not None:
        out.append(
            f"An insider holding the original continuous values and weights would link "
            f"{_pct(informed)} of the records by nearest neighbour (reported, not gated)."
        )
    return " ".join(out)


def _intruder(results: Sequence[StageResult]) -> str:
    """The intruder's key in a few words (the assessment's params), for the verdict."""
    a = assessment_of(results)
    if a is not None and a.params.get("intruder_key"):
        lines = a.params["intruder_key"]
        keys = [ln.split(": ", 1)[1] for ln in lines if ln.startswith(("declared", "other"))]
        labels = any(ln.startswith("published design labels") for ln in lines)
        return ", ".join(keys) + (", the design labels" if labels else "")
    return "the key variables"


def _risk(m: Manifest, results: Sequence[StageResult]) -> str:
    g = m.parameters.gates
    xi = g.xi if g else None
    dmax = g.delta_max if g else None
    umax = g.max_unique_share if g else None
    reid = _assessed(results, "reid_share_worst")
    if reid is None:
        reid = _assessed(results, "reid_share")
    delta = _assessed(results, "delta_published")  # on the published file, if measured
    if delta is None:
        delta = _measured(results, RISK_DELTA)
    uniq = _assessed(results, "unique_share_published")
    uniq0 = _survey_uniques(results)
    rows = [
        (
            "share of the survey's sample uniques an intruder re-identifies in the published "
            "file (worst exact-match or nearest-neighbour attack on the intruder's key)",
            _num(reid, ".4f"),
            f"<= xi = {xi}" if xi is not None else "none",
            _ok(reid, hi=xi),
        ),
        (
            "post-treatment risk delta (paper 000, eq. 3-6: risk left after substitution and "
            "subsampling)",
            _num(delta, ".4f") if delta is not None else "not measured",
            f"<= {dmax}" if dmax is not None else "none",
            _ok(delta, hi=dmax),
        ),
        (
            "records unique on the intruder's key, published file"
            + (f" (survey file: {_pct(uniq0)})" if uniq0 is not None else ""),
            _pct(uniq),
            f"<= {_pct(umax)}" if umax is not None else "none",
            _ok(uniq, hi=umax),
        ),
    ]
    ran = {cls.name: r for cls, r in described(results)}
    rows += [_risk_row(row, g) for c in RELEASE_STAGES for row in c.risk_rows(ran.get(c.name))]
    body = [_check_rows(m, rows), _whys(m, results, risk=True), _strata_counts(results)]
    return _section(RISK_SECTION, "Risk of the published file", body, "")


def _risk_row(row: RiskRow, gates: Any) -> tuple[str, str, str, str]:
    """A stage's row of the risk table (what, value, limit text, pass/fail/''); gates: the
    release's gate parameters (None: none)."""
    lim = getattr(gates, row.limit, None) if gates is not None and row.limit else None
    return (
        row.what,
        _num(row.value, row.fmt) if row.value is not None else row.missing,
        f"<= {row.limit} = {lim}" if lim is not None else "none",
        _ok(row.value, hi=lim),
    )


def _strata_counts(results: Sequence[StageResult]) -> str:
    """The two U/D/T/O counts side by side, each said in words."""
    counts = {k: v for c, r in described(results) for k, v in c.key_frequencies(r).items()}
    if not counts:
        return ""
    idx = ["U", "D", "T", "O"]
    t = pd.DataFrame(index=pd.Index(idx, name="stratum"))
    for what, n in counts.items():
        t[what] = n.reindex(idx)
    note = (
        "<p class='note'>U, D, T, O: unique, doubleton, tripleton, other (4 or more). The first "
        "count classifies the survey file before treatment (what the risk scores and MASSC's "
        "rates use); the second classifies the same survey records by how often their original "
        "key combination is still found in the published file (what the risk delta of paper 000 "
        "averages; a record whose combination no longer appears is in neither row).</p>"
    )
    return table(t.reset_index(), "Records by key-combination frequency") + note


def _validity(m: Manifest, results: Sequence[StageResult]) -> str:
    g = m.parameters.gates
    u = getattr(g, "utility", None) if g else None
    u = u if isinstance(u, dict) else (u.model_dump() if hasattr(u, "model_dump") else {})
    ser = g.se_ratio if g else None
    lo, hi = (ser[0], ser[1]) if ser else (None, None)
    get = lambda n: _assessed(results, n)  # noqa: E731
    eps_max = g.epsilon_max if g else None
    rows = [
        (
            "median overlap of 95% confidence intervals, published vs survey file, over all "
            "domain estimates (Karr et al. 2006; 1 = identical)",
            _num(get("overlap_median")),
            f">= {u.get('overlap_median_min')}" if u.get("overlap_median_min") is not None else "",
            _ok(get("overlap_median"), lo=u.get("overlap_median_min")),
        ),
        (
            "5th percentile of that overlap",
            _num(get("overlap_p5")),
            f">= {u.get('overlap_p5_min')}" if u.get("overlap_p5_min") is not None else "",
            _ok(get("overlap_p5"), lo=u.get("overlap_p5_min")),
        ),
        (
            "share of estimates more than 2 survey SEs away from the survey estimate",
            _pct(get("share_abs_std_bias_gt2")),
            f"<= {_pct(u.get('share_beyond_2se_max'))}"
            if u.get("share_beyond_2se_max") is not None
            else "",
            _ok(get("share_abs_std_bias_gt2"), hi=u.get("share_beyond_2se_max")),
        ),
        (
            "SE ratio (published / survey), 10th percentile",
            _num(get("se_ratio_p10")),
            f"in [{lo}, {hi}]" if ser else "",
            _ok(get("se_ratio_p10"), lo, hi),
        ),
        ("SE ratio, median", _num(get("se_ratio_median")), "", ""),
        (
            "SE ratio, 90th percentile",
            _num(get("se_ratio_p90")),
            f"in [{lo}, {hi}]" if ser else "",
            _ok(get("se_ratio_p90"), lo, hi),
        ),
        (
            "smallest confidence-interval overlap of a coefficient of the declared models",
            _num(get("model_overlap_min")),
            f">= {u.get('model_overlap_min')}" if u.get("model_overlap_min") is not None else "",
            _ok(get("model_overlap_min"), lo=u.get("model_overlap_min")),
        ),
        (
            "largest relative error of a study total (epsilon, paper 000 eq. 7)",
            _num(get("epsilon_published"), ".4f"),
            f"<= {eps_max}" if eps_max is not None else "",
            _ok(get("epsilon_published"), hi=eps_max),
        ),
        (
            "propensity-score pMSE ratio (Snoke et al. 2018): the files' distinguishability over "
            "its null expectation; at or below 1, the public file cannot be told apart",
            _num(get("pmse_ratio_snoke")),
            "",
            "",
        ),
    ]
    if get("overlap_median") is None:
        return _section("validity", "Analytic validity", [], "The published file was not assessed.")
    body = [_check_rows(m, rows), _whys(m, results, risk=False)]
    return _section("validity", "Analytic validity", body, "")


def _gates(m: Manifest, results: Sequence[StageResult] = ()) -> str:
    """Every gate: result, value, threshold, and whether it is near its limit (NEAR_RULE)."""
    if not m.gates:
        return _section("gates", "Gates", [], "No gate was evaluated.")
    near = {n: lim for n, _, lim in near_gates(m, results)}
    rows = "".join(
        f"<tr><td style='text-align:left'>{escape(g.name)}</td>"
        f"<td class='{'pass' if g.passed else 'fail'}'>{'passed' if g.passed else 'FAILED'}</td>"
        f"<td>{escape(value(g.value))}</td><td>{escape(str(g.threshold))}</td>"
        f"<td class='near'>{'near ' + escape(value(near[g.name])) if g.name in near else ''}"
        "</td></tr>"
        for g in m.gates
    )
    n_fail = m.n_failed_gates
    html = (
        f"<p>{len(m.gates) - n_fail} passed, {n_fail} failed, {len(near)} near their limit.</p>"
        + scroll(
            "<table class='t'><tr><th>gate</th><th>result</th><th>value</th><th>threshold</th>"
            f"<th>near limit</th></tr>{rows}</table>"
        )
        + f"<p class='note'>Near the limit: {escape(NEAR_RULE)}.</p>"
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

    if "ratio" not in se or "deff" not in se:
        return None
    t = deff_class_summary(se["ratio"], se["deff"])
    t.index.name = "statistic"
    return t.reset_index()


def _se_ratios(results: Sequence[StageResult]) -> str:
    """One box plot of every declared SE-ratio table (one box per stage in each design-effect
    class) and each table's summary by class."""

    declared = [r for r in results if r.se_ratio_table and r.se_ratio_table in r.tables]
    if not declared:
        return _section("se-ratios", "Standard-error ratios", [], "No SE ratios computed.")
    groups = {r.name: r.tables[r.se_ratio_table] for r in declared}
    png = se_ratio_boxplot(groups, "SE ratios by design-effect class", legend="stage", dpi=90)
    body = [img(png, "se-ratios/by-stage")]
    for r in declared:
        caption = f"{r.name}: SE ratios by design-effect class"
        body.append(table(_se_summary(groups[r.name]), caption, folded=True))
        body.append(
            f"<p class='note'>one row per characteristic in "
            f"internal/{escape(r.name)}/{escape(str(r.se_ratio_table))}.csv</p>"
        )
    return _section("se-ratios", "Standard-error ratios", body, "")


def _stage(r: StageResult, open_figures: Sequence[str] = ()) -> str:
    """What one stage did: notes (open), then folded: parameters, metrics, its figures (those in
    open_figures stay open: the figure the verdict links to), its declared tables; the other
    tables are named with their CSV."""
    name = escape(r.name)
    body = [f"<h3 id='stage-{name}'>{name}</h3>"]
    if r.notes:
        body.append("<ul>" + "".join(f"<li>{_note(str(n))}</li>" for n in r.notes) + "</ul>")
    shown = [k for k in r.figures if k in open_figures]
    body += [img(r.figures[k], f"{r.name}/{k}", _fig_id(r.name, k)) for k in shown]
    rest = [k for k in r.figures if k not in shown]
    if rest:
        figs = "".join(img(r.figures[k], f"{r.name}/{k}", _fig_id(r.name, k)) for k in rest)
        what = "Figures" if not shown else "Other figures"
        body.append(fold(f"{what} ({len(rest)}): {', '.join(rest)}", figs))
    body.append(_kv(r.params, "Parameters", folded=True))
    body.append(_kv(r.metrics, "Metrics", folded=True))
    for k in r.report_tables:
        where = f"internal/{r.name}/{k}.csv"
        if k in r.tables:
            body.append(table(r.tables[k], f"{r.name}: {k}", where, MAX_ROWS, folded=True))
        else:
            body.append(f"<p class='note'>{escape(k)}: not produced by this run.</p>")
    csv_only = [k for k in r.tables if k not in r.report_tables]
    if csv_only:
        files = ", ".join(f"internal/{r.name}/{k}.csv" for k in csv_only)
        body.append(f"<p class='note'>Tables in CSV only: {escape(files)}</p>")
    return "\n".join(b for b in body if b)


def _note(text: str, limit: int = NOTE_CHARS) -> str:
    """A stage note as HTML: a note longer than limit characters folds under its beginning."""
    if len(text) <= limit:
        return escape(text)
    head = text[: limit // 2].rsplit(" ", 1)[0]
    return fold(f"{head} ... ({len(text):,} characters)", f"<p>{escape(text)}</p>", cls="long")


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
        _kv({k: v for k, v in hashes.items() if v is not None}, "Hashes", folded=True),
        _kv(m.hashes.outputs, "Published files", folded=True),
        _kv(m.versions, "Versions", folded=True),
    ]
    return _section("provenance", "Provenance", body, "")


def _verdict_figures(results: Sequence[StageResult]) -> list[str]:
    """The figure keys the verdict links to (the worst estimate's variable): kept open."""
    found = _table_of(results, "worst_estimates")
    if found is None or "variable" not in found[1]:
        return []
    var = str(found[1]["variable"].iloc[0])
    return [k for r in results for k in r.figures if k == var or k.endswith(f"_{var}")]


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
    linked = _verdict_figures(results)
    own = [
        _section(f"section-{r.name}", r.section, [_stage(r, linked)], "")
        for r in results
        if r.section
    ]
    sections = [
        _verdict(manifest, results),
        _leaves(manifest, results),
        _risk(manifest, results),
        _validity(manifest, results),
        _gates(manifest, results),
        _approval(manifest),
        "<h2 style='margin-top:2em'>Detail</h2>",
        _summary(manifest, results),
        *own,
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
