"""The release report: sections, embedded images, robustness to missing stages; Prefect artifacts."""

from __future__ import annotations

import base64
import json

import numpy as np
import pandas as pd
import pytest
from helpers import PNG, SECTIONS, STAGE_TABLES, Parsed

from flows.report import MAX_ROWS, artifact_key, post_artifacts, render_report
from sdl_design.stage import StageResult as StageOutput
from sdl_design.swap import se_ratio_boxplot


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


def _tables(stage: str, **given: pd.DataFrame) -> dict[str, pd.DataFrame]:
    """Every table the stage's task emits (helpers.STAGE_TABLES): the given ones, the others as
    a one-row frame naming themselves."""
    assert set(given) <= set(STAGE_TABLES[stage]), set(given) - set(STAGE_TABLES[stage])
    return {t: given.get(t, pd.DataFrame({"table": [f"{stage}/{t}"]})) for t in STAGE_TABLES[stage]}


def outputs(stages=("risk", "swap", "prb", "massc", "final")) -> list[StageOutput]:
    """Stage outputs with the table, metric and parameter names the tasks really emit."""
    df = pd.DataFrame({"x": [1, 2]})
    made = {
        "risk": StageOutput(
            "risk",
            df,
            params={"keys": ["age", "sex"]},
            metrics={"unique_share": 0.31, "max_score": 1.0},
            tables=_tables(
                "risk",
                by_stratum=pd.DataFrame({"stratum": list("UDTO"), "n_records": [31, 20, 15, 34]}),
                records=pd.DataFrame({"record": range(500), "risk_score": 0.5}),
            ),
            figures={"score_hist": PNG + b"fake-but-valid-header"},
            notes=["1,234 key profiles"],
        ),
        "swap": StageOutput(
            "swap",
            df,
            params={"method": "2b", "rate": 0.25},
            metrics={"se_ratio_median": 1.01, "share_swapped": 0.25},
            tables=_tables(
                "swap",
                se_ratios=se_table(1),
                se_ratio_summary=pd.DataFrame(
                    {"statistic": ["count", "50%"], "overall": [30, 1.0]}
                ),
                pairs=pd.DataFrame({"segment_a": [1, 2], "segment_b": [3, 4]}),
            ),
            figures={"se_ratio_boxplot": se_ratio_boxplot({"2b": se_table(1)})},
            notes=["Method 2b: 40 pairs"],
        ),
        "prb": StageOutput(
            "prb",
            df,
            params={"xi": 0.395, "theta": 0.799, "m0": 5, "method": "prb"},
            metrics={"max_risk": 0.39},
            tables=_tables(
                "prb",
                risk_by_block=pd.DataFrame(
                    {"m": [5, 6], "units": [7, 9], "max_risk": [0.38, 0.39]}
                ),
                tvd=pd.DataFrame({"variables": ["age x sex"], "prb": [0.012], "nzy": [0.02]}),
                weighted_counts=pd.DataFrame(
                    {"cell": ["a", "b"], "orig": [10.0, 5.0], "masked": [9.5, 5.5]}
                ),
            ),
            figures={"risk_hist": PNG + b"fake-but-valid-header"},
        ),
        "massc": StageOutput(
            "massc",
            df,
            params={
                "psi_max": 0.25,
                "calibration": {
                    "method": "logit",
                    "bounds": [0.5, 2.0],
                    "infeasible_policy": "widen",
                },
            },
            metrics={
                "delta": 0.12,
                "epsilon": 0.05,
                "calibration_factor_min": 0.61,
                "calibration_factor_max": 1.83,
            },
            tables=_tables(
                "massc",
                delta=pd.DataFrame(
                    {"appearance": list("udto"), "delta_bar": [0.2, 0.1, 0.05, 0.01]}
                ),
                weight_factors=pd.DataFrame(
                    {"percentile": [0, 50, 100], "calibration_factor": [0.61, 1.0, 1.83]}
                ),
            ),
            figures={"weight_factors": PNG + b"fake-but-valid-header"},
        ),
        "final": StageOutput(
            "final",
            df,
            metrics={"se_ratio_median": 1.0},
            tables=_tables("final", se_ratios=se_table(2)),
        ),
    }
    return [made[s] for s in stages]


def manifest(status="published", gates=None) -> dict:
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
    return {
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
        "parameters": {},
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


def test_full_report(tmp_path):
    path = render_report(manifest(), outputs(), tmp_path / "internal" / "report.html")
    html = path.read_text()
    p = Parsed(html)
    assert set(SECTIONS) <= set(p.ids)
    assert {f"stage-{s}" for s in ("risk", "swap", "prb", "massc", "final")} <= set(p.ids)
    alts = sorted(i["alt"] for i in p.imgs)
    # every StageOutput figure once, plus the report's own SE-ratio box plot (swap vs final)
    assert alts == [
        "final/se_ratios_boxplot",
        "massc/weight_factors",
        "prb/risk_hist",
        "risk/score_hist",
        "swap/se_ratio_boxplot",
    ]
    for img in p.imgs:
        assert img["src"].startswith("data:image/png;base64,")
        assert base64.b64decode(img["src"].split(",", 1)[1]).startswith(PNG)
    assert all(s.startswith("data:") for s in p.srcs)  # self-contained: nothing fetched
    text = " ".join(p.text)
    # each table the tasks emit is shown once (a placeholder table holds its own name)
    for o in outputs():
        for t, v in o.tables.items():
            if list(v.columns) == ["table"]:
                assert text.count(f"{o.name}/{t}") == 1, (o.name, t)
    # in its section, under its caption
    for needle in (
        "before treatment (risk): by_stratum",
        "before treatment (risk): by_profile_size",
        "after treatment (MASSC): delta",
        "after treatment (MASSC): delta_profiles",
        "prb: risk_by_block",
        "prb: identification_risk",
        "prb: tvd",
        "prb: weighted_counts",
        "massc: replicate_calibration",
        "massc: weight_factors",
        "swap (Table 1 form): se_ratio_summary",
        "swap (Table 1 form): se_ratio_summary_baseline",
        "swap (Table 1 form): se_ratio_summary_replicate",
        "final: SE ratios by deff class",
        "final: se_ratio_summary",
        "swap: SE ratio by characteristic",
        "massc: rates",
        "massc: study_totals",
        "dora",
        "approved",
        "Weight adjustment factors",
        "calibration_factor_max",
        "infeasible_policy",
        "2 passed, 0 failed",
        "Method 2b: 40 pairs",
        "3.8.8",
    ):
        assert needle in text, needle
    # the record-level risk table and the swap map stay in their CSVs
    assert "records: internal/risk/records.csv" in text
    assert "pairs: internal/swap/pairs.csv" in text
    assert "segment_a" not in html and "risk_score" not in html
    # the swap se_ratios table (30 rows) shown in full, not more than MAX_ROWS rows anywhere
    assert "v29" in text and p.rows < 20 * MAX_ROWS


def test_failed_gates_and_missing_stages(tmp_path):
    gates = [
        {"name": "massc: delta <= 0.25", "passed": False, "value": 0.31, "threshold": "<= 0.25"},
        {"name": "swap: median SE ratio", "passed": True, "value": 1.0, "threshold": "[0.8, 1.25]"},
    ]
    m = manifest("rejected", gates)
    m["approval"] = {}
    m.pop("versions")
    path = render_report(m, outputs(("risk",)), tmp_path / "r.html")
    p = Parsed(path.read_text())
    assert set(SECTIONS) <= set(p.ids)
    assert [i["alt"] for i in p.imgs] == ["risk/score_hist"]  # the only stage run: its figure
    text = " ".join(p.text)
    assert "FAILED" in text and "1 passed, 1 failed" in text and "gates failed" in text
    for absent in ("PRB stage not run.", "MASSC stage not run.", "No SE ratios computed."):
        assert absent in text
    # nothing at all
    p = Parsed(render_report({"release": {}}, [], tmp_path / "e.html").read_text())
    assert set(SECTIONS) <= set(p.ids) and "No gate was evaluated." in " ".join(p.text)


def test_long_table_truncated(tmp_path):
    o = outputs(("risk",))
    o[0].tables["by_profile_size"] = pd.DataFrame({"size": range(500), "n": range(500)})
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
        return post_artifacts(manifest("rejected", gates), outputs(("risk",)))

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
