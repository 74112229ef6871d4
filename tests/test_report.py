"""The release report: sections, embedded images, robustness to missing stages; Prefect artifacts."""

from __future__ import annotations

import base64
import json
import re
from html.parser import HTMLParser

import numpy as np
import pandas as pd
import pytest
from helpers import DEFAULT_SPEC, PNG, SECTIONS, Parsed

from flows.manifest import Manifest
from flows.report import MAX_ROWS, artifact_key, post_artifacts, render_report
from sdl_design.stage import StageResult
from sdl_design.stages.swap.method import se_ratio_boxplot


@pytest.fixture(scope="module", autouse=True)
def _figures(figures):
    """The report's figures are drawn in this module (tests look at them)."""


FLOW = ("risk", "swap", "prb", "massc", "topcode", "final")  # the flow's stages, in order


def se_table(seed: int) -> pd.DataFrame:
    rng = np.random.default_rng(seed)
    deff = rng.uniform(0.3, 8, 30)
    r = 1 + rng.normal(0, 0.03, 30)
    return pd.DataFrame(
        {
            "variable": [f"v{i}" for i in range(30)],
            "domain": "all",
            "se_original": 1.0,
            "se_masked": r,
            "ratio": r,
            "deff": deff,
        }
    )


def outputs(stages=("risk", "swap", "prb", "massc", "final")) -> list[StageResult]:
    df = pd.DataFrame({"x": [1, 2]})
    made = {
        "risk": StageResult(
            "risk",
            df,
            params={"keys": ["age", "sex"]},
            metrics={"unique_share": 0.31},
            tables={
                "by_stratum": pd.DataFrame({"stratum": list("UDTO"), "records": [31, 20, 15, 34]}),
                "profiles": pd.DataFrame({"profile": range(500), "risk": 0.5}),
            },
            notes=["1,234 key profiles"],
            report_tables=["by_stratum"],
        ),
        "swap": StageResult(
            "swap",
            df,
            params={"method": "2b", "rate": 0.25},
            metrics={"se_ratio_median": 1.01, "share_swapped": 0.25},
            tables={
                "ratios_by_characteristic": se_table(1),
                "se_ratio_summary": pd.DataFrame(
                    {"statistic": ["count", "50%"], "overall": [30, 1.0]}
                ),
                "pairs": pd.DataFrame({"segment_a": [1, 2], "segment_b": [3, 4]}),
            },
            figures={"se_ratio_boxplot": se_ratio_boxplot({"2b": se_table(1)})},
            notes=["Method 2b: 40 pairs"],
            report_tables=["se_ratio_summary", "ratios_by_characteristic"],
            se_ratio_table="ratios_by_characteristic",
        ),
        "prb": StageResult(
            "prb",
            df,
            params={"xi": 0.395, "theta0": 0.61, "m0": 3},
            metrics={"max_risk": 0.39},
            tables={
                "risk_table": pd.DataFrame({"block": [1, 2], "risk": [0.38, 0.39]}),
                "tvd": pd.DataFrame({"variables": ["age x sex"], "tvd": [0.012]}),
                "weighted_counts": pd.DataFrame(
                    {"cell": ["a", "b"], "orig": [10.0, 5.0], "masked": [9.5, 5.5]}
                ),
            },
            figures={"risk_hist": PNG + b"fake-but-valid-header"},
            report_tables=["weighted_counts", "tvd"],  # risk_table: CSV only
        ),
        "massc": StageResult(
            "massc",
            df,
            params={"psi_max": 0.25, "calibration": {"method": "logit", "bounds": [0.5, 2.0]}},
            metrics={"delta": 0.12, "epsilon": 0.05, "adj_min": 0.61, "adj_max": 1.83},
            tables={
                "delta_by_stratum": pd.DataFrame(
                    {"stratum": list("UDTO"), "delta": [0.2, 0.1, 0.05, 0.01]}
                ),
                "calibration": pd.DataFrame(
                    {"control": ["sex=female"], "target": [100.0], "achieved": [100.0]}
                ),
            },
            report_tables=["calibration", "delta_by_stratum", "epsilon_replications"],
        ),
        "final": StageResult(
            "final",
            df,
            metrics={"se_ratio_median": 1.0},
            tables={"se_ratios": se_table(2)},
            report_tables=["se_ratios"],
            se_ratio_table="se_ratios",
        ),
    }
    return [made[s] for s in stages]


def manifest(status="published", gates=None) -> Manifest:
    gates = (
        gates
        if gates is not None
        else [
            {"name": "massc: delta <= 0.25", "passed": True, "value": 0.12, "threshold": "<= 0.25"},
            {
                "name": "output: no direct identifiers",
                "passed": True,
                "value": 0.0,
                "threshold": "== 0",
            },
        ]
    )
    return Manifest.model_validate(
        {
            "release": {
                "name": "default-survey",
                "year": 2026,
                "release_id": "default-survey-2026-0a1b2c3d",
                "created": "2026-02-01T06:00:00",
            },
            "status": status,
            "reason": None if status == "published" else "gates failed",
            "hashes": {
                "spec": "a" * 64,
                "input": "b" * 64,
                "outputs": {"public/puf.parquet": "c" * 64},
            },
            "versions": {"python": "3.11.7", "prefect": "3.8.8"},
            "metrics": {"massc.delta": 0.12, "risk.n_unique": np.int64(5)},
            "gates": gates,
            "approval": {
                "required": True,
                "approver": "dora",
                "decision": "approved",
                "comment": "ok",
                "at": None,
            },
            "stages": [
                {"name": n, "notes": [], "params": {}}
                for n in ("risk", "swap", "prb", "massc", "final")
            ],
            "counts": {"n_input": 4000, "n_output": 3900},
        }
    )


def test_full_report(tmp_path):
    path = render_report(manifest(), outputs(), tmp_path / "internal" / "report.html", FLOW)
    html = path.read_text()
    p = Parsed(html)
    assert [i for i in p.ids if i in SECTIONS] == SECTIONS  # in this order
    assert [i for i in p.ids if i.startswith("stage-")] == [f"stage-{s}" for s in FLOW]
    alts = sorted(i["alt"] for i in p.imgs)
    # every figure of every result once, plus the report's SE-ratio box plot (swap vs final)
    assert alts == ["prb/risk_hist", "se-ratios/by-stage", "swap/se_ratio_boxplot"]
    for img in p.imgs:
        assert img["src"].startswith("data:image/png;base64,")
        assert base64.b64decode(img["src"].split(",", 1)[1]).startswith(PNG)
    assert all(s.startswith("data:") for s in p.srcs)  # self-contained: nothing fetched
    text = " ".join(p.text)
    for needle in (
        "risk: by_stratum",
        "massc: calibration",
        "massc: delta_by_stratum",
        "prb: weighted_counts",
        "prb: tvd",
        "swap: se_ratio_summary",
        "swap: SE ratios by design-effect class",
        "final: SE ratios by design-effect class",
        "internal/swap/ratios_by_characteristic.csv",
        "epsilon_replications: not produced by this run.",
        "Not run: switched off in the spec.",
        "dora",
        "approved",
        "adj_max",
        "2 passed, 0 failed",
        "Method 2b: 40 pairs",
        "theta0",
        "3.8.8",
    ):
        assert needle in text, needle
    # declared tables in the declared order, not in the order of the tables dict
    assert text.index("massc: calibration") < text.index("massc: delta_by_stratum")
    assert text.index("prb: weighted_counts") < text.index("prb: tvd")
    # undeclared tables stay in their CSVs, whatever their names (risk_table is not shown)
    for csv in (
        "internal/risk/profiles.csv",
        "internal/swap/pairs.csv",
        "internal/prb/risk_table.csv",
    ):
        assert csv in text
    assert "segment_a" not in html and "prb: risk_table" not in text
    # SE-ratio summary by class: the overall median of the 30 final ratios, as numpy has it
    assert f"{np.median(se_table(2)['ratio']):.4g}" in text
    # the swap ratios (30 rows) shown in full, not more than MAX_ROWS rows anywhere
    assert "v29" in text and p.rows < 20 * MAX_ROWS


def test_failed_gates_and_missing_stages(tmp_path):
    gates = [
        {"name": "massc: delta <= 0.25", "passed": False, "value": 0.31, "threshold": "<= 0.25"},
        {"name": "swap: median SE ratio", "passed": True, "value": 1.0, "threshold": "[0.8, 1.25]"},
    ]
    m = manifest("rejected", gates)
    m.approval = m.approval.model_copy(update={"approver": None, "decision": None})
    m.versions = {}
    path = render_report(m, outputs(("risk",)), tmp_path / "r.html", FLOW)
    p = Parsed(path.read_text())
    assert set(SECTIONS) <= set(p.ids) and p.imgs == []
    assert [i for i in p.ids if i.startswith("stage-")] == [f"stage-{s}" for s in FLOW]
    text = " ".join(p.text)
    assert "FAILED" in text and "1 passed, 1 failed" in text and "gates failed" in text
    assert "No SE ratios computed." in text
    # five stages of the flow without a result, each said so
    assert text.count("Not run: switched off in the spec, or the release stopped before it.") == 5
    # nothing at all: a drafted release with no gate, no stage
    bare = Manifest.model_validate({"release": {"name": "s", "year": 2026, "release_id": "s-1"}})
    p = Parsed(render_report(bare, [], tmp_path / "e.html").read_text())
    text = " ".join(p.text)
    assert set(SECTIONS) <= set(p.ids)
    assert "No gate was evaluated." in text and "No stage ran." in text


def test_long_table_truncated(tmp_path):
    o = outputs(("risk",))
    o[0].tables["by_profile_size"] = pd.DataFrame({"size": range(500), "n": range(500)})
    o[0].report_tables.append("by_profile_size")
    text = " ".join(Parsed(render_report(manifest(), o, tmp_path / "r.html").read_text()).text)
    assert f"first {MAX_ROWS} of 500 rows; all rows in internal/risk/by_profile_size.csv" in text


def test_artifact_key():
    assert artifact_key("puf-Default_Survey-2026") == "puf-default-survey-2026"


@pytest.mark.flow
@pytest.mark.usefixtures("prefect_server")
def test_post_artifacts_in_a_flow():
    from prefect import flow
    from prefect.artifacts import Artifact

    gates = [
        {
            "name": "g1",
            "passed": np.bool_(False),
            "value": np.float64(0.31),
            "threshold": "<= 0.25",
        },
        {"name": "g2", "passed": True, "value": np.int64(3), "threshold": "<= 5"},
    ]

    @flow
    def f():
        m = manifest("rejected", gates)
        m.stages[0].notes = ["1,234 key profiles"]
        return post_artifacts(m)

    keys = f()
    assert keys == [
        "puf-default-survey-2026-summary",
        "puf-default-survey-2026-gates",
        "puf-default-survey-2026-metrics",
    ]
    rows = json.loads(Artifact.get(keys[1]).data)
    assert rows == [
        {"name": "g1", "passed": False, "value": 0.31, "threshold": "<= 0.25"},
        {"name": "g2", "passed": True, "value": 3, "threshold": "<= 5"},
    ]
    metrics = {r["metric"]: r["value"] for r in json.loads(Artifact.get(keys[2]).data)}
    assert metrics == {"massc.delta": 0.12, "risk.n_unique": 5}
    md = Artifact.get(keys[0]).data
    assert "## Failed gates" in md and "g1: 0.31" in md
    # stage notes from the manifest's stage records
    assert "## risk\n\n- 1,234 key profiles" in md and "## swap" not in md


def test_a_result_with_a_section_title_gets_its_own_section(tmp_path):
    """The assessment declares a section title: it is the first detail section (right after the
    summary), with its figures and tables, and not again among the stages."""
    df = pd.DataFrame({"x": [1.0]})
    worst = pd.DataFrame({"variable": ["bmi"], "std_bias": [2.5]})
    res = StageResult(
        "assess",
        df,
        notes=["median CI overlap 0.97"],
        tables={"worst_estimates": worst},
        report_tables=["worst_estimates"],
        figures={"estimates_bmi": PNG + b"x"},
        section="Analytic validity and risk of the published file",
    )
    path = render_report(manifest(), [*outputs(("risk",)), res], tmp_path / "r.html", FLOW)
    p = Parsed(path.read_text())
    assert p.ids.index("section-assess") == p.ids.index("summary") + 1
    assert p.ids.count("stage-assess") == 1  # once, inside its own section
    assert {i["alt"] for i in p.imgs} >= {"assess/estimates_bmi"}
    assert "assess: worst_estimates" in " ".join(p.text)


def _assessed() -> list[StageResult]:
    """The default outputs plus an assessment that recorded the published columns."""
    a = StageResult(
        "assess",
        None,
        params={
            "published_columns": {
                "weight": ["wt"],
                "replicate weight": ["rw_1", "rw_2"],
                "key": ["age", "sex"],
                "study": ["bmi"],
            },
            "dropped_columns": {"name": "direct identifier (variables.direct_identifiers)"},
            "design_released": "3900 records, 2 strata, 4 PSUs, 2 jk1 replicate weights",
        },
        metrics={
            "reid_share": 0.07,
            "unique_share_published": 0.05,
            "overlap_median": 0.95,
            "overlap_p5": 0.75,
            "se_ratio_median": 1.01,
        },
        section="Analytic validity and risk of the published file",
    )
    o = outputs()
    o[2].params["theta"] = 0.61
    o[0].tables["by_stratum"] = pd.DataFrame(
        {"stratum": list("UDTO"), "n_records": [311, 222, 133, 3334]}
    )
    o[3].tables["delta"] = pd.DataFrame(
        {"appearance": list("udto"), "n_records": [184, 177, 166, 3300]}
    )
    o[2].tables["changed_by_variable"] = pd.DataFrame(
        {"variable": ["age", "sex"], "share_changed": [0.097, 0.001]}
    )
    return [*o, a]


def test_verdict_and_what_leaves_the_building(tmp_path):
    m = manifest()
    m.parameters.gates = m.parameters.gates or None
    p = Parsed(render_report(m, _assessed(), tmp_path / "r.html", FLOW).read_text())
    assert p.ids[:4] == ["verdict", "leaves", "disclosure-risk", "validity"]
    text = " ".join(p.text)
    assert text.index("Publish: the file is published, and all 2 checks pass.") < text.index(
        "What leaves the building"
    )
    assert "It holds 3,900 of the 4,000 survey records." in text
    assert "re-identify 7.0% of the people who were unique" in text
    # every published column once, the replicate weights as one row; the dropped one with why
    for needle in (
        "rw_1 .. rw_2 (2 columns)",
        "post-randomized by PRB of Zhang and Nayak (2018), theta 0.6100: 9.7% of records changed",
        "name",
        "direct identifier (variables.direct_identifiers)",
    ):
        assert needle in text, needle
    assert "reason" not in text  # a published release has no reason: no 'reason: None'
    # the two U/D/T/O counts side by side, said in words
    assert "Records by key-combination frequency" in text and "U, D, T, O: unique" in text
    counts = text[text.index("Records by key-combination frequency") :]
    assert counts.index("311") < counts.index("184") < counts.index("222") < counts.index("177")


def test_verdict_says_do_not_publish_on_a_failed_gate(tmp_path):
    gates = [
        {"name": "massc: delta <= 0.25", "passed": False, "value": 0.31, "threshold": "<= 0.25"},
        {"name": "output: ids", "passed": True, "value": 0.0, "threshold": "0 columns"},
    ]
    m = manifest("rejected", gates)
    p = Parsed(render_report(m, _assessed(), tmp_path / "r.html", FLOW).read_text())
    text = " ".join(p.text)
    assert (
        "Do not publish: 1 of 2 checks failed (massc: delta <= 0.25: 0.31 against <= 0.25)" in text
    )
    assert "Publish:" not in text


def test_risk_section_prefers_the_published_file_delta(tmp_path):
    """Where the assessment measured delta on the published file, the risk table shows it
    (not MASSC's own)."""
    o = _assessed()
    o[-1].metrics["delta_published"] = 0.1234
    text = " ".join(
        Parsed(render_report(manifest(), o, tmp_path / "r.html", FLOW).read_text()).text
    )
    risk = text[text.index("Risk of the published file") : text.index("Analytic validity")]
    assert "0.1234" in risk and "0.1200" not in risk
    o[-1].metrics.pop("delta_published")
    text = " ".join(
        Parsed(render_report(manifest(), o, tmp_path / "s.html", FLOW).read_text()).text
    )
    risk = text[text.index("Risk of the published file") : text.index("Analytic validity")]
    assert "0.1200" in risk


@pytest.mark.parametrize("longest", [8, 70])
def test_forest_plot_keeps_every_row_label_inside_the_figure(monkeypatch, longest):
    """The forest plot's left margin (measured from its widest row label, not by tight layout)
    holds every label: none cut at the figure's edge or running into the axes; a label too
    wide for 60% of the figure is shortened with '...'."""
    from sdl_design import plots

    figs = []
    monkeypatch.setattr(plots, "png", lambda fig, dpi=100: figs.append(fig) or b"")
    n = 25
    labels = [f"d{i} = " + "W" * (longest if i == 7 else 3) for i in range(n)]
    rng = np.random.default_rng(3)
    rows = pd.DataFrame(
        {
            "label": labels,
            **{f"estimate_{c}": rng.normal(size=n) for c in ("original", "released")},
            **{f"se_{c}": rng.random(n) for c in ("original", "released")},
        }
    )
    plots._interval_plot(rows, "mean of y: published vs original", "mean")
    fig = figs[0]
    fig.canvas.draw()
    r = fig.canvas.get_renderer()
    ax = fig.axes[0]
    boxes = [t.get_window_extent(r) for t in ax.get_yticklabels() if t.get_text()]
    assert len(boxes) == n
    assert min(b.x0 for b in boxes) >= 0  # nothing cut at the left edge
    assert max(b.x1 for b in boxes) <= ax.get_window_extent(r).x0  # left of the axes
    assert max(b.x1 - b.x0 for b in boxes) > (longest - 3) * 5  # the widest one is measured
    # a label wider than 60% of the figure is shortened, the others are as given
    shown = [t.get_text() for t in ax.get_yticklabels()]
    assert [s.endswith("...") for s in shown] == [longest == 70 and i == 7 for i in range(n)]
    assert all(s == v for s, v in zip(shown, labels, strict=True) if not s.endswith("..."))


# ---------------------------------------------------------------- layout, verdict, gate sentences

VOID = {"img", "meta", "br", "hr", "input", "link", "wbr", "source"}


class Tree(HTMLParser):
    """Each <table>, <details> and text run of a page with the open elements around it."""

    def __init__(self, text: str):
        super().__init__()
        self.stack: list[tuple[str, dict]] = []
        self.tables: list[list[tuple[str, dict]]] = []
        self.texts: list[tuple[str, list[tuple[str, dict]]]] = []
        self.feed(text)
        self.close()

    def handle_starttag(self, tag, attrs):
        if tag == "table":
            self.tables.append(list(self.stack))
        if tag not in VOID:
            self.stack.append((tag, dict(attrs)))

    def handle_endtag(self, tag):
        for i in range(len(self.stack) - 1, -1, -1):
            if self.stack[i][0] == tag:
                del self.stack[i:]
                return

    def handle_data(self, data):
        if data.strip():
            self.texts.append((data, list(self.stack)))

    def around(self, needle: str) -> list[tuple[str, dict]]:
        """The open elements around the first text run containing needle."""
        return next(stack for text, stack in self.texts if needle in text)

    def section_text(self, sid: str) -> str:
        return " ".join(t for t, st in self.texts if any(a.get("id") == sid for _, a in st))


def _scrolls(stack: list[tuple[str, dict]]) -> bool:
    return any(
        tag == "div" and "scroll" in a.get("class", "") and "overflow-x:auto" in a.get("style", "")
        for tag, a in stack
    )


def _folded(stack: list[tuple[str, dict]]) -> bool:
    return any(tag == "details" for tag, _ in stack)


def _gate(name, value, lower=None, upper=None, ideal=None, why="Protects X; limit Y."):
    from sdl_design.stage import gate

    return gate(name, value, lower, upper, why=why, ideal=ideal)


def _assessed_with_gates() -> tuple[Manifest, list[StageResult]]:
    """A published release whose assessment has wide worst-estimate and model tables, a figure
    per study variable and gates: two near their limits, two not."""
    results = _assessed()
    a = results[-1]
    worst = pd.DataFrame(
        {
            "variable": ["income", "bmi"],
            "statistic": ["mean", "mean"],
            "domain": ["race x marital", "age"],
            "level": ["asian, separated", "18-25"],
            "estimate_original": [48100.0, 26.1],
            "estimate_released": [52300.0, 26.4],
            "std_bias": [4.2, 1.1],
            "ci_overlap": [0.12, 0.72],
            **{f"wide_column_{i}": [1.23456789e6, 2.0] for i in range(25)},
        }
    )
    coefs = pd.DataFrame(
        {
            "model": ["y ~ age", "y ~ age"],
            "term": ["Intercept", "age[T.18-25]"],
            "ci_overlap": [0.97, 0.61],
            "std_diff": [0.05, -0.9],
            **{f"se_column_{i}": [0.1, 0.2] for i in range(25)},
        }
    )
    a.tables = {"worst_estimates": worst, "model_coefficients": coefs}
    a.report_tables = ["worst_estimates", "model_coefficients"]
    a.figures = {"estimates_bmi": PNG + b"b", "estimates_income": PNG + b"i", "model_1": PNG}
    a.gates = [
        _gate("risk: re-identified share", 0.36, upper=0.395, ideal=0.0),  # 0.035 <= 0.0395
        _gate("risk: PSUs given away", 0.23, upper=0.5, ideal=0.0),  # far
        _gate("utility: median CI overlap", 0.905, lower=0.9, ideal=1.0),  # 0.005 <= 0.01
        _gate("utility: 90th percentile SE ratio", 1.2, 0.8, 1.25, ideal=1.0),  # 0.05 > 0.025
    ]
    gates = [
        {"name": g.name, "passed": True, "value": g.value, "threshold": "t"} for g in a.gates
    ] + [{"name": "output: no direct identifiers", "passed": True, "value": 0.0, "threshold": "0"}]
    return manifest(gates=gates), results


def test_every_table_scrolls_inside_its_container_and_long_sections_fold(tmp_path):
    from flows.report import CSS

    m, results = _assessed_with_gates()
    long_note = "partition sets merged: " + ", ".join(f"age=0-18, race=r{i}" for i in range(40))
    results[2].notes = [long_note, "PRB changed 4491 records"]
    html = render_report(m, results, tmp_path / "r.html", FLOW).read_text()
    t = Tree(html)
    assert len(t.tables) > 15
    assert all(_scrolls(stack) for stack in t.tables)  # every table scrolls inside its box
    assert "max-width:1200px" in CSS and ".scroll{overflow-x:auto;max-width:100%}" in CSS
    assert "box-sizing:border-box" in CSS  # padding inside the max-width
    # the verdict, the gate table and the board's sections stay open ...
    for needle in ("Publish: the file is published", "output: no direct identifiers"):
        assert not _folded(t.around(needle)), needle
    assert not _folded(t.around("Published columns"))
    # ... the long tables, parameters, metrics and stage figures are folded
    for needle in ("wide_column_0", "se_column_0", "adj_max", "v29", "theta0", "3.8.8"):
        assert _folded(t.around(needle)), needle
    # a long stage note folds under its beginning, a short one stays open
    assert _folded(t.around("race=r39")) and not _folded(t.around("PRB changed 4491 records"))
    summaries = [s for s, st in t.texts if st and st[-1][0] == "summary"]
    assert "partition sets merged: age=0-18, race=r0, age=0-18, race=r1, age=0-18," in (
        " ".join(summaries)
    )
    assert "assess: worst_estimates (2 rows)" in summaries
    assert "massc: calibration (1 row)" in summaries
    # the figure of the worst estimate's variable stays open, the others are folded
    imgs = {a["alt"]: stack for a, stack in _img_stacks(html)}
    assert not _folded(imgs["assess/estimates_income"])
    assert _folded(imgs["assess/estimates_bmi"]) and _folded(imgs["assess/model_1"])
    assert _folded(imgs["swap/se_ratio_boxplot"])


def _img_stacks(html: str) -> list[tuple[dict, list]]:
    out = []

    class P(Tree):
        def handle_starttag(self, tag, attrs):
            if tag == "img":
                out.append((dict(attrs), list(self.stack)))
            super().handle_starttag(tag, attrs)

    P(html)
    return out


def test_verdict_names_the_worst_estimate_and_the_gates_near_their_limits(tmp_path):
    from sdl_design.stage import NEAR_RULE

    m, results = _assessed_with_gates()
    t = Tree(render_report(m, results, tmp_path / "r.html", FLOW).read_text())
    verdict = t.section_text("verdict")
    assert (
        "Worst single estimate: the mean of income in race x marital = asian, separated: "
        "52,300 published vs 48,100 in the survey file, +4.2 survey SEs apart, 95% intervals "
        "overlap 0.12." in verdict
    )
    assert "Worst model coefficient: age[T.18-25] in y ~ age: 95% intervals overlap 0.61" in verdict
    near = verdict[verdict.index("Near their limits") :]
    assert "at most 10% of the room between the ideal value and the limit left" in near
    assert "risk: re-identified share: 0.36 (limit 0.395)" in near
    assert "utility: median CI overlap: 0.905 (limit 0.9)" in near
    assert "PSUs given away" not in near and "SE ratio" not in near
    gates = t.section_text("gates")
    assert "5 passed, 0 failed, 2 near their limit." in gates and "near 0.395" in gates
    assert f"Near the limit: {NEAR_RULE}." in gates  # the rule, stated in full
    # the verdict's figure link points at the open figure of income
    assert (
        "href='#fig-assess-estimates-income'"
        in render_report(m, results, tmp_path / "s.html", FLOW).read_text()
    )
    # the worst estimate is named on a failed release too; nothing when nothing was assessed
    m.gates[0] = m.gates[0].model_copy(update={"passed": False})
    t = Tree(render_report(m, results, tmp_path / "f.html", FLOW).read_text())
    assert "Do not publish: 1 of 5 checks failed" in t.section_text("verdict")
    assert "mean of income in race x marital" in t.section_text("verdict")
    t = Tree(render_report(manifest(), outputs(), tmp_path / "n.html", FLOW).read_text())
    assert "Worst single estimate" not in t.section_text("verdict")


@pytest.mark.parametrize(
    ("value", "lower", "upper", "ideal", "near"),
    [
        (0.36, None, 0.395, 0.0, 0.395),  # 0.035 left of 0.395: within 10%
        (0.35, None, 0.395, 0.0, None),  # 0.045 left
        (0.395, None, 0.395, 0.0, 0.395),  # at the limit, passing
        (0.40, None, 0.395, 0.0, None),  # failing: not "near", failed
        (float("nan"), None, 0.395, 0.0, None),
        (0.905, 0.9, None, 1.0, 0.9),  # overlap: room 0.1, 0.005 left
        (0.92, 0.9, None, 1.0, None),
        (0.81, 0.8, 1.25, 1.0, 0.8),  # SE ratio: 0.01 of 0.2 left below
        (0.83, 0.8, 1.25, 1.0, None),
        (1.23, 0.8, 1.25, 1.0, 1.25),  # 0.02 of 0.25 left above
        (1.22, 0.8, 1.25, 1.0, None),
        (0.24, None, 0.25, None, 0.25),  # no ideal: within 5% of the limit
        (0.23, None, 0.25, None, None),
    ],
)
def test_near_limit_rule(value, lower, upper, ideal, near):
    assert _gate("g", value, lower, upper, ideal).near_limit() == near


def test_near_gates_picks_the_passing_gates_near_their_limits():
    from flows.report import near_gates

    m, results = _assessed_with_gates()
    assert [n for n, _, _ in near_gates(m, results)] == [
        "risk: re-identified share",
        "utility: median CI overlap",
    ]
    m.gates[2] = m.gates[2].model_copy(update={"passed": False})  # the manifest's verdict rules
    assert [n for n, _, _ in near_gates(m, results)] == ["risk: re-identified share"]


def _all_gates_spec():
    import yaml

    from sdl_design.spec import parse_spec

    data = yaml.safe_load(DEFAULT_SPEC.read_text())
    data["gates"].update(max_unique_share=0.2, max_psu_recoverable=0.5)
    return parse_spec(data, DEFAULT_SPEC.parent)


def test_every_risk_gate_says_what_it_protects_against_and_why_its_limit(tmp_path):
    from sdl_design.stages.assess.method import assessment_gates
    from sdl_design.stages.massc.stage import delta_gates
    from sdl_design.stages.prb.method import identification_risk_gate
    from sdl_design.tune import is_risk_gate

    spec = _all_gates_spec()
    metrics = {
        "overlap_median": 0.95,
        "overlap_p5": 0.7,
        "share_abs_std_bias_gt2": 0.01,
        "model_overlap_min": 0.9,
        "se_ratio_p10": 0.9,
        "se_ratio_p90": 1.1,
        "epsilon_published": 0.01,
        "reid_share_worst": 0.088,
        "delta_published": 0.22,
        "psu_recoverable": 0.23,
        "unique_share_published": 0.1,
    }
    gates = [
        *assessment_gates(metrics, spec),
        identification_risk_gate(0.391, spec.gates.xi),
        *delta_gates(spec, 0.23),
    ]
    risk = [g for g in gates if is_risk_gate(g.name)]
    assert len(risk) == 6  # xi, delta, PSUs, uniques on the published file; PRB; MASSC
    for g in gates:
        assert g.why.startswith("Protects") and g.why.endswith("."), g.name
        assert not re.search(r"\. [A-Z]", g.why), g.name  # one sentence
        assert g.ideal is not None, g.name
        assert g.as_dict()["why"] == g.why
    limits = {g.name: g.why for g in risk}
    assert "xi = 0.395" in limits["prb.max_identification_risk"]
    assert "gates.delta_max = 0.25" in limits["massc.delta"]
    psu = next(w for n, w in limits.items() if "PSUs" in n)
    assert "50% (gates.max_psu_recoverable) is acceptable because" in psu
    assert "at least 50% of the original PSUs stay hidden" in psu
    # the report shows each risk gate's sentence in the risk section, the others in validity
    m = manifest(
        gates=[{"name": g.name, "passed": True, "value": g.value, "threshold": "t"} for g in gates]
    )
    res = [*outputs(), StageResult("assess", None, metrics=metrics, gates=gates)]
    t = Tree(render_report(m, res, tmp_path / "r.html", FLOW).read_text())
    risk_text, validity = t.section_text("disclosure-risk"), t.section_text("validity")
    for g in gates:
        where, other = (risk_text, validity) if is_risk_gate(g.name) else (validity, risk_text)
        assert g.why in where and g.why not in other, g.name


def test_figures_drawn_in_another_thread_as_in_the_callers():
    """carried: a figure function run in a worker thread draws when its caller would and
    gives its empty value inside the caller's figures_off (tuning keeps numbers only)."""
    from concurrent.futures import ThreadPoolExecutor

    from sdl_design.plots import estimate_plots, figures_off, with_figure_mode

    est = pd.DataFrame(
        {
            "statistic": ["mean"] * 2,
            "domain": ["(all)", "sex"],
            "level": ["", "1"],
            "variable": ["bmi"] * 2,
            "estimate_original": [26.0, 25.5],
            "estimate_released": [26.1, 25.4],
            "se_original": [0.1, 0.2],
            "se_released": [0.1, 0.2],
            "std_bias": [0.5, -0.3],
        }
    )
    coefs = pd.DataFrame(columns=["model", "term", "coef_original", "coef_released"])
    with ThreadPoolExecutor(1) as pool:
        drawn = pool.submit(with_figure_mode(estimate_plots), est, coefs).result()
        with figures_off():
            off = pool.submit(with_figure_mode(estimate_plots), est, coefs).result()
    assert list(drawn) == ["estimates_bmi"] and drawn["estimates_bmi"].startswith(PNG)
    assert off == {}
