"""Monitoring: statistics on hand-made registries, drift flags, the HTML report, and the flow."""

from __future__ import annotations

import base64
import json

import numpy as np
import pandas as pd
import pytest
from helpers import PNG, Parsed

from flows import monitor as mon
from flows import registry as reg


@pytest.fixture(scope="module", autouse=True)
def _figures(figures):
    """The report's figures are drawn in this module (tests look at them)."""


DEFF = np.repeat([0.6, 1.5, 3.0, 8.0], 10)  # ten characteristics in each design-effect class


def se_table(seed: int, distort: bool = False) -> pd.DataFrame:
    """SE ratios of a well-masked release (ratio ~ 1 +- 2%); with distort, the masking ignored
    the design (segments reassigned at random), so clustering is lost: SE_masked ~ SE_srs and the
    ratio ~ 1/sqrt(deff)."""
    rng = np.random.default_rng(seed)
    se0 = rng.uniform(0.5, 2.0, len(DEFF))
    ratio = 1.0 / np.sqrt(DEFF) if distort else 1.0 + rng.normal(0, 0.02, len(DEFF))
    return pd.DataFrame(
        {
            "characteristic": [f"x{i}" for i in range(len(DEFF))],
            "se_original": se0,
            "se_masked": se0 * ratio,
            "ratio": ratio,
            "deff": DEFF,
        }
    )


GATES = {  # the default survey's spec
    "delta_max": 0.25,
    "epsilon_max": 0.15,
    "xi": 0.395,
    "utility": {"overlap_median_min": 0.9, "share_beyond_2se_max": 0.05},
}


def manifest(
    year: int, seed: int, status="published", delta=0.10, name="default-survey", gates=GATES
):
    m = {
        "release": {
            "name": name,
            "year": year,
            "release_id": f"{name}-{year}-{seed:08x}",
            "created": f"{year}-02-01T06:00:00",
        },
        "status": status,
        "reason": None,
        "hashes": {"spec": "s", "input": str(seed), "outputs": {}},
        "parameters": {"release": {"seed": seed}},
        "metrics": {
            "massc.delta": delta,
            "massc.epsilon_formula": 0.04,  # the optimizer's own value: not the gated one
            "assess.epsilon_published": 0.05,
            "assess.reid_share": 0.38,
            "assess.overlap_median": 0.95,
            "assess.share_abs_std_bias_gt2": 0.02,
            "assess.unique_share_published": 0.2,
            "prb.max_risk": 0.37,
            "swap.share_swapped": 0.25,
            "massc.share_substituted": 0.04,
            "topcode.income.n_upper": 12.0,
            "topcode.income.share_upper": 0.005,
            "risk.unique_share": 0.3,  # a risk measure, not a treated share
        },
        "gates": [],
        "approval": {"approver": "dora", "decision": "approved"},
    }
    if gates is not None:
        m["parameters"]["gates"] = gates
    return m


@pytest.fixture
def url(tmp_path, monkeypatch):
    monkeypatch.delenv(reg.ENV_URL, raising=False)
    u = reg.registry_url(tmp_path)
    # two releases of the default survey: two years, different seeds, both well masked
    reg.record_release(manifest(2025, 11), {"swap": se_table(11)}, url=u)
    reg.record_release(manifest(2026, 22), {"swap": se_table(22), "final": se_table(23)}, url=u)
    return u


# ---------------------------------------------------------------- pure functions


def test_ratio_distribution_matches_numpy():
    se = se_table(1).assign(name="s", year=2025, release_id="r", source="swap")
    se["deff_class"] = np.where(se["deff"] > 5, "(5,25]", "low")
    d = mon.ratio_distribution(se).set_index(["deff_class"])
    r = se["ratio"].to_numpy()
    assert d.loc["all", "n"] == 40
    assert d.loc["all", "median"] == pytest.approx(np.median(r))
    assert d.loc["all", "p10"] == pytest.approx(np.quantile(r, 0.1))
    hi = r[se["deff"] > 5]
    assert d.loc["(5,25]", "p75"] == pytest.approx(np.quantile(hi, 0.75))
    assert d.loc["(5,25]", "max"] == pytest.approx(hi.max())


def test_pick_releases_prefers_published():
    rel = pd.DataFrame(
        {
            "release_id": ["a", "b", "c", "d"],
            "name": ["s"] * 4,
            "year": [2025, 2025, 2026, 2026],
            "status": ["published", "rejected", "rejected", "failed"],
            "updated": ["2025-01", "2025-06", "2026-01", "2026-02"],
        }
    )
    assert mon.pick_releases(rel)["release_id"].tolist() == ["a", "d"]


def test_changes_and_flags():
    a, b = se_table(1), se_table(2)
    b.loc[3, "ratio"] = a.loc[3, "ratio"] + 0.25  # one characteristic jumps
    se = pd.concat([a.assign(year=2025), b.assign(year=2026)]).assign(name="s")
    ch = mon.ratio_changes(se)
    assert (ch["source"] == "swap").all()
    assert len(ch) == 40 and (ch["prev_year"] == 2025).all()
    expect = b["ratio"].to_numpy() - a["ratio"].to_numpy()
    assert np.allclose(
        ch.sort_values("characteristic", key=lambda c: c.str[1:].astype(int))["change"], expect
    )
    n_big = int((np.abs(expect) > 0.1).sum())
    table = pd.DataFrame(
        {
            "survey": ["s", "s"],
            "year": [2025, 2026],
            "release_id": ["r1", "r2"],
            "se_ratio_median": [1.0, 1.12],
            "delta": [0.2, 0.3],
            "delta_max": [0.25, 0.25],
            "epsilon": [0.1, np.nan],
            "epsilon_max": [0.15, 0.15],
            "id_risk": [0.39, 0.40],
            "id_risk_max": [0.395, 0.395],
        }
    )
    flags = mon.drift_flags(table, ch, band=(0.9, 1.1), max_change=0.1)
    kinds = {(f["year"], f["kind"]) for f in flags}
    assert kinds == {
        (2026, "se_ratio_median"),
        (2026, "delta"),
        (2026, "id_risk"),
        (2026, "se_ratio_change"),
    }
    change = next(f for f in flags if f["kind"] == "se_ratio_change")
    assert change["detail"].startswith(f"{n_big} of 40") and "x3" in change["detail"]
    assert change["value"] == pytest.approx(np.abs(expect).max())
    # a wider band and a larger allowed change: only the thresholds remain
    flags = mon.drift_flags(table, ch, band=(0.8, 1.25), max_change=0.5)
    assert {f["kind"] for f in flags} == {"delta", "id_risk"}


# ---------------------------------------------------------------- on a registry


def test_two_releases_no_drift_then_injected_drift(url, tmp_path):
    s = mon.monitor(url=url, out_dir=tmp_path / "m")
    assert s.releases["year"].tolist() == [2025, 2026] and s.flags == [] and s.status == 0
    r26 = s.releases.set_index("year").loc[2026]
    assert r26["se_source"] == "final"  # the end-to-end ratios are preferred to the swap's
    assert r26["se_ratio_median"] == pytest.approx(np.median(se_table(23)["ratio"]))
    assert r26["treated:swap"] == 0.25 and r26["treated:massc"] == 0.04
    assert r26["treated:topcode income (upper)"] == 0.005
    assert not [c for c in s.releases.columns if c.startswith("treated:") and "risk" in c]
    assert r26["epsilon"] == 0.05  # epsilon of the published file, not the optimizer's
    assert r26["delta_max"] == 0.25  # the survey's own gate, recorded in its manifest
    # the default survey records no max_unique_share gate: said, never flagged
    assert s.notes == [
        "default-survey: no sample-unique share threshold recorded by the release(s) of "
        "2025, 2026: sample-unique share not flagged there"
    ]

    # 2027: masking that ignores the design (SEs shrink to SRS) and a delta above its gate
    reg.record_release(
        manifest(2027, 33, status="rejected", delta=0.31),
        {"swap": se_table(33, distort=True)},
        url=url,
    )
    s = mon.monitor(url=url, out_dir=tmp_path / "m")
    assert s.releases["year"].tolist() == [2025, 2026, 2027] and s.status == 1
    flags = {f["kind"]: f for f in s.flags}
    assert {f["year"] for f in s.flags} == {2027}
    assert set(flags) == {"se_ratio_median", "se_ratio_change", "delta"}
    assert flags["se_ratio_median"]["value"] == pytest.approx(np.median(1 / np.sqrt(DEFF)))
    assert flags["delta"]["value"] == pytest.approx(0.31)
    # report: every survey section, both plots, flags listed
    p = Parsed(s.report.read_text())
    assert {"flags", "releases", "survey-default-survey"} <= set(p.ids)
    assert len(p.imgs) == 2
    for img in p.imgs:
        assert base64.b64decode(img["src"].split(",", 1)[1]).startswith(PNG)
    assert "median SE ratio 0.6" in s.report.read_text()
    # each release is held to its own recorded thresholds
    reg.record_release(
        manifest(2028, 44, delta=0.31, gates={"delta_max": 0.4, "epsilon_max": 0.15, "xi": 0.395}),
        {"swap": se_table(33, distort=True)},
        url=url,
    )
    s = mon.monitor(url=url, out_dir=tmp_path / "m")
    assert not [f for f in s.flags if f["year"] == 2028 and f["kind"] == "delta"]
    assert s.releases.set_index("year").loc[2028, "delta_max"] == 0.4


def test_survey_filter_and_empty(tmp_path, monkeypatch, url):
    reg.record_release(manifest(2026, 5, name="other"), {"swap": se_table(5)}, url=url)
    s = mon.monitor(survey="other", url=url, out_dir=tmp_path)
    assert s.releases["survey"].unique().tolist() == ["other"]
    empty = reg.registry_url(tmp_path / "empty")
    s = mon.monitor(url=empty, out_dir=tmp_path)
    assert len(s.releases) == 0 and s.flags == [] and "0 release(s)" in str(s)
    with pytest.raises(ValueError, match="band"):
        mon.monitor(url=empty, band=(1.1, 0.9))


@pytest.mark.flow
@pytest.mark.usefixtures("prefect_server")
def test_monitor_flow_artifacts_and_gate(url, tmp_path):
    from prefect.artifacts import Artifact

    s = mon.monitor_flow(url=url, out_dir=str(tmp_path), gate_on_drift=True)
    assert s.flags == [] and s.report.is_file()
    art = Artifact.get("puf-monitor-all-releases")
    rows = json.loads(art.data)
    assert [r["year"] for r in rows] == [2025, 2026]
    reg.record_release(manifest(2027, 33), {"swap": se_table(33, distort=True)}, url=url)
    with pytest.raises(mon.DriftDetected, match="median SE ratio"):
        mon.monitor_flow(url=url, out_dir=str(tmp_path), gate_on_drift=True)
    assert "2027" in Artifact.get("puf-monitor-all").data


def test_each_survey_held_to_its_own_thresholds(tmp_path, monkeypatch):
    """Three surveys with the same delta 0.30 (and risk 0.38): survey a's spec gates delta at
    0.25 and xi at 0.36, b's at 0.35 and 0.395, c records no gate: only a is flagged (twice),
    and c's quantities are named as not flagged."""
    monkeypatch.delenv(reg.ENV_URL, raising=False)
    url = reg.registry_url(tmp_path)
    own = {
        "a": {"delta_max": 0.25, "epsilon_max": 0.15, "xi": 0.36},
        "b": {"delta_max": 0.35, "epsilon_max": 0.15, "xi": 0.395},
        "c": None,
    }
    for i, (name, gates) in enumerate(own.items()):
        m = manifest(2026, i, delta=0.30, name=name, gates=gates)
        reg.record_release(m, {"swap": se_table(i)}, url=url)
    s = mon.monitor(url=url, out_dir=tmp_path / "m")
    t = s.releases.set_index("survey")
    assert t["delta"].tolist() == [0.30, 0.30, 0.30]
    assert t.loc["a", "delta_max"] == 0.25 and t.loc["b", "delta_max"] == 0.35
    assert t.loc["a", "id_risk_max"] == 0.36 and np.isnan(t.loc["c", "delta_max"])
    assert sorted((f["survey"], f["kind"]) for f in s.flags) == [("a", "delta"), ("a", "id_risk")]
    assert s.status == 1
    unflagged = [n for n in s.notes if n.startswith("c: ")]
    labels = ("delta", "epsilon", "identification risk", "sample-unique share")
    assert len(unflagged) == len(mon.METRICS) and all(
        any(f" {x} " in n for n in unflagged) for x in labels
    )
    assert "NOTE c: no delta threshold recorded by the release(s) of 2026" in str(s)
    assert "c: no delta threshold recorded" in s.report.read_text()


def test_utility_flags_below_their_lower_threshold(tmp_path, monkeypatch):
    """Analytic validity drifts: a year whose median CI overlap falls under the survey's own
    utility gate (0.9) is flagged, one above it is not; the share beyond 2 SE is an upper bound."""
    monkeypatch.delenv(reg.ENV_URL, raising=False)
    url = reg.registry_url(tmp_path)
    for year, ov, beyond in ((2025, 0.95, 0.02), (2026, 0.85, 0.08)):
        m = manifest(year, year)
        m["metrics"]["assess.overlap_median"] = ov
        m["metrics"]["assess.share_abs_std_bias_gt2"] = beyond
        reg.record_release(m, {"final": se_table(year)}, url=url)
    s = mon.monitor(url=url, out_dir=tmp_path / "m")
    kinds = sorted((f["year"], f["kind"]) for f in s.flags)
    assert kinds == [(2026, "beyond_2se"), (2026, "overlap_median")]
    low = next(f for f in s.flags if f["kind"] == "overlap_median")
    assert low["value"] == 0.85 and low["limit"] == ">= 0.9"


def test_flat_trend_axis_reads_as_plain_numbers():
    """A series equal up to rounding (epsilon 0.15 each year, 1e-11 apart) gets plain tick
    labels around its value, not '1e-11+1.499999999e-1'."""
    from flows.monitor import _plain_y
    from sdl_design.plots import pyplot

    plt = pyplot()
    fig, ax = plt.subplots()
    y = np.array([0.15, 0.15 + 1e-11, 0.15 - 1e-11])
    ax.plot([2024, 2025, 2026], y)
    _plain_y(ax, y)
    fig.canvas.draw()
    assert ax.yaxis.get_offset_text().get_text() == ""
    ticks = [float(t.get_text().replace("\u2212", "-")) for t in ax.get_yticklabels()]
    lo, hi = ax.get_ylim()
    assert lo == pytest.approx(0.15 - 0.0075) and hi == pytest.approx(0.15 + 0.0075)
    shown = [t for t in ticks if lo <= t <= hi]
    assert 3 <= len(shown) <= 6 and all(abs(t - 0.15) <= 0.0075 for t in shown)
    plt.close(fig)


# ---------------------------------------------------------------- display: two surveys, failures

LONG = "national-health-and-nutrition-examination-survey"  # long name: long release ids
SMALL = "small-survey"  # no MASSC: no massc metric, no delta, top-coded bmi only
FAILED_ID = f"{LONG}-2027-0000004d"
ATTEMPT = "20270201T060000000000Z-abc123"
EDIT_REASON = (
    "edit validation failed on the input file: 1 of 11 checks failed\n"
    "  - edit[10] age between 30 and 90: 8425 records fail (e.g. row [3, 4, 10, 11, 12]) "
    + "and a long explanation of the rule "
    * 8
)
GATE_REASON = (
    "release gates failed; nothing was published: 2 of 20 checks failed\n"
    "  - utility: median CI overlap of domain estimates: 0.82 is below 0.9 by 0.08; worst "
    "estimates: " + "; ".join(f"mean of income in region x age = west, {a}" for a in range(20))
)
TOPCODED_VARS = [f"variable_{i}" for i in range(8)]  # many top-coded columns: more than 120


def _small_manifest(year: int, seed: int, status: str = "published") -> dict:
    m = manifest(year, seed, status=status, name=SMALL)
    m["metrics"] = {
        k: v for k, v in m["metrics"].items() if not k.startswith(("massc.", "topcode.income"))
    }
    m["metrics"]["topcode.bmi.share_upper"] = 0.001
    return m


@pytest.fixture
def two_surveys(tmp_path, monkeypatch) -> str:
    """LONG (MASSC, 9 top-coded columns) published 2024-2026 and a failed 2027 attempt (edit
    rules: no metric) recorded through the attempts table; SMALL (no MASSC) published 2025 and
    2026 and rejected in 2027 (SE ratios lost the design: drift flags) with a long reason."""
    from flows.manifest import Manifest

    monkeypatch.delenv(reg.ENV_URL, raising=False)
    u = reg.registry_url(tmp_path)
    for year in (2024, 2025, 2026):
        m = manifest(year, year, name=LONG)
        m["metrics"].update({f"topcode.{v}.share_upper": 0.01 for v in TOPCODED_VARS})
        reg.record_release(m, {"final": se_table(year)}, url=u)
    failed = manifest(2027, 77, status="failed", name=LONG)
    failed["metrics"], failed["reason"] = {}, EDIT_REASON
    m = Manifest.model_validate(failed)
    reg.open_attempt(ATTEMPT, m, tmp_path / "attempt", url=u)
    reg.set_attempt(ATTEMPT, "failed", EDIT_REASON, manifest=m, url=u)
    for year in (2025, 2026):
        reg.record_release(_small_manifest(year, year), {"final": se_table(year)}, url=u)
    rejected = _small_manifest(2027, 99, status="rejected")
    rejected["reason"] = GATE_REASON
    reg.record_release(rejected, {"final": se_table(99, distort=True)}, url=u)
    return u


def _section(lines: list[str], start: str, stops: tuple[str, ...]) -> list[str]:
    """The lines from the one starting with `start` to the next starting with one of stops."""
    i = next(k for k, x in enumerate(lines) if x.startswith(start))
    j = next((k for k in range(i + 1, len(lines)) if lines[k].startswith(stops)), len(lines))
    return lines[i:j]


def test_terminal_text_fits_and_keeps_surveys_apart(two_surveys, tmp_path):
    s = mon.monitor(url=two_surveys, out_dir=tmp_path / "m")
    text = s.render()
    lines = text.splitlines()
    assert max(len(x) for x in lines) <= 120
    assert "\\n" not in text and "n/a" not in text
    # drift flags first: every DRIFT line before the first survey's table
    first_table = next(k for k, x in enumerate(lines) if x.startswith((LONG, SMALL)))
    drift = [k for k, x in enumerate(lines) if x.startswith("  DRIFT ")]
    assert drift and max(drift) < first_table
    assert lines[1] == f"DRIFT FLAGS ({len(s.flags)})"
    assert {f["survey"] for f in s.flags} == {SMALL}
    assert all(f"{SMALL} 2027 (rejected)" in lines[k] for k in drift)
    stops = (LONG, SMALL, "not published")
    big, small = _section(lines, LONG, stops), _section(lines, SMALL, stops)
    # each survey's table has only its own columns
    assert "delta" in big[1].split() and "delta" not in small[1]
    assert "massc" in " ".join(big) and "massc" not in " ".join(small)
    assert "income" in " ".join(big) and "income" not in " ".join(small)
    assert "bmi" in " ".join(small) and "bmi" not in " ".join(big)
    assert "delta <=" in " ".join(big) and "delta" not in " ".join(small[-2:])
    # the trend: published releases only; the failed and rejected runs are listed apart
    assert [x.split()[0] for x in big[2:5]] == ["2024", "2025", "2026"]
    assert not any("2027" in x for x in big + small)
    runs = _section(lines, "not published", ("  NOTE", "report:"))
    assert runs[0].startswith("not published: 2 run(s)")
    assert any(FAILED_ID in x and ATTEMPT in x and "failed" in x for x in runs)
    assert any("edit validation failed on the input file" in x for x in runs)
    assert any(x.startswith(f"  {SMALL}-2027-") and "rejected" in x for x in runs)
    # the top-coded columns that do not fit are named, not cut off silently
    note = " ".join(x for x in big if "more column(s)" in x or x.startswith("      "))
    assert "--wide shows every column" in note and "topcode variable_7 (upper)" in note


def test_terminal_wide_has_every_column(two_surveys, tmp_path):
    s = mon.monitor(url=two_surveys, out_dir=tmp_path / "m")
    text = s.render(wide=True)
    lines = text.splitlines()
    assert max(len(x) for x in lines) > 120 and "\\n" not in text
    stops = (LONG, SMALL, "not published")
    big, small = _section(lines, LONG, stops), _section(lines, SMALL, stops)
    head = big[1].split("  ")
    for col in (
        "delta",
        "delta_max",
        "se_source",
        "treated:massc",
        "treated:topcode income (upper)",
    ):
        assert col in [h.strip() for h in head if h.strip()], col
    assert all(f"treated:topcode {v} (upper)" in big[1] for v in TOPCODED_VARS)
    assert "delta" not in small[1] and "massc" not in small[1]  # a gate without its quantity
    runs = "\n".join(_section(lines, "not published", ("  NOTE", "report:")))
    assert reg.one_line(GATE_REASON) in runs and reg.one_line(EDIT_REASON) in runs


def _tables(html: str) -> dict[str, list[str]]:
    """The header cells of each table, by the classes of its scroll container; asserts that
    every table sits in a container with overflow-x:auto."""
    from html.parser import HTMLParser

    class P(HTMLParser):
        def __init__(self):
            super().__init__()
            self.stack, self.out, self.cur, self.in_th = [], {}, None, False

        def handle_starttag(self, tag, attrs):
            a = dict(attrs)
            if tag == "div":
                self.stack.append(a)
            elif tag == "table":
                assert any("overflow-x:auto" in (d.get("style") or "") for d in self.stack)
                names = " ".join(d.get("class") or "" for d in self.stack)
                self.cur = self.out.setdefault(names, [])
            elif tag == "th":
                self.in_th = True

        def handle_endtag(self, tag):
            if tag == "div":
                self.stack.pop()
            elif tag == "th":
                self.in_th = False

        def handle_data(self, data):
            if self.in_th and self.cur is not None:
                self.cur.append(data.strip())

    p = P()
    p.feed(html)
    return p.out


def test_report_one_table_per_survey_flags_first(two_surveys, tmp_path):
    s = mon.monitor(url=two_surveys, out_dir=tmp_path / "m")
    html = s.report.read_text()
    assert "\\n" not in html and ">n/a<" not in html
    # drift flags at the top, before the first plot and the first survey
    assert html.index("id='flags'") < html.index("<img") < html.index("id='unpublished'")
    assert html.index("id='flags'") < html.index(f"id='survey-{LONG}'")
    tables = _tables(html)
    key = {name: next(k for k in tables if f"releases-{name}" in k) for name in (LONG, SMALL)}
    assert "delta" in tables[key[LONG]] and "delta" not in tables[key[SMALL]]
    treated = {name: tables[next(k for k in tables if f"treated-{name}" in k)] for name in key}
    assert {"massc", "topcode income (upper)", "topcode variable_7 (upper)"} <= set(treated[LONG])
    assert treated[SMALL] == ["year", "swap", "topcode bmi (upper)"]
    runs = next(k for k in tables if "runs" in k.split())
    assert tables[runs][:3] == ["survey", "year", "release"]
    # the failed and rejected runs are apart, with their reasons (line breaks kept as <br>)
    trend, rest = html.split("id='unpublished'")
    assert (
        FAILED_ID not in trend
        and f"{SMALL}-2027" not in trend.split("id='flags'")[1].split("</div>")[-1]
    )
    assert FAILED_ID in rest and "edit validation failed on the input file: 1 of 11 checks " in rest
    assert "checks failed<br>- edit[10] age between 30 and 90" in rest
    # the page fits 1,280 px: body capped, tables in scroll containers, images scaled
    assert "max-width:1200px" in html and "img{max-width:100%}" in html


def test_cli_monitor_narrow_and_wide(two_surveys, tmp_path, monkeypatch, capsys):
    """`puf monitor` prints the same text as the summary (the flow replaced by its
    computation: no Prefect server in a unit test)."""
    from flows.cli import main

    def fake_flow(survey=None, url=None, out_dir=None, gate_on_drift=False):
        return mon.monitor(survey, url, out_dir)

    monkeypatch.setattr(mon, "monitor_flow", fake_flow)
    out_dir = str(tmp_path / "m")
    assert main(["monitor", "--registry", two_surveys, "--out", out_dir]) == 0
    narrow = capsys.readouterr().out
    assert max(len(x) for x in narrow.splitlines()) <= 120 and "\\n" not in narrow
    assert narrow.index("DRIFT FLAGS") < narrow.index(f"\n{LONG}: 3 published release(s)")
    assert main(["monitor", "--registry", two_surveys, "--out", out_dir, "--wide"]) == 0
    wide = capsys.readouterr().out
    assert "delta_max" in wide and "delta_max" not in narrow
    assert max(len(x) for x in wide.splitlines()) > 120
    args = ["monitor", "--registry", two_surveys, "--out", out_dir, "--gate-on-drift"]
    assert main(args) == 1
    capsys.readouterr()


def test_cli_releases_narrow_and_wide(two_surveys, capsys):
    from flows.cli import main

    assert main(["releases", "--registry", two_surveys]) == 0
    text = capsys.readouterr().out
    lines = text.splitlines()
    assert max(len(x) for x in lines) <= 120 and "\\n" not in text
    # one table per survey with its published releases, the runs that published nothing apart
    heads = [x for x in lines if x and not x.startswith(" ")]
    assert heads == [
        f"{LONG}: 3 published release(s)",
        f"{SMALL}: 2 published release(s)",
        "not published: 2 run(s) (failed, rejected, rolled back or under way)",
    ]
    stops = (LONG, SMALL, "not published")
    big = _section(lines, LONG, stops)
    assert [x.split()[0] for x in big[2:5]] == ["2026", "2025", "2024"]  # newest first
    assert all(f"{LONG}-{y}-" in x for x, y in zip(big[2:5], (2026, 2025, 2024), strict=True))
    assert FAILED_ID not in "\n".join(big)
    runs = _section(lines, "not published", ("zzz",))
    assert any(FAILED_ID in x and "failed" in x for x in runs)
    reason = [x for x in runs if x.startswith("      ")]  # the reasons, under their runs
    assert reason[0].strip().startswith("edit validation failed on the input file: 1 of 11")
    assert any(x.endswith("...") for x in reason)  # cut: --wide has it whole
    assert main(["releases", "--registry", two_surveys, "--wide"]) == 0
    wide = capsys.readouterr().out
    assert reg.one_line(EDIT_REASON) in wide and "\\n" not in wide
    assert max(len(x) for x in wide.splitlines()) > 120
    assert main(["releases", "--registry", two_surveys, "--survey", SMALL]) == 0
    only = capsys.readouterr().out
    assert LONG not in only and f"{SMALL}: 2 published release(s)" in only
