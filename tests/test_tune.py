"""puf tune: candidate generation, refinement, Pareto front, recommended YAML, the demo search."""

from __future__ import annotations

import json
import zlib
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import yaml

from sdl_design import tune
from sdl_design.spec import load_spec


@pytest.fixture(scope="module", autouse=True)
def _figures(figures):
    """The report's figures are drawn in this module (tests look at them)."""


DEFAULT = Path(__file__).resolve().parents[1] / "flows" / "default_spec.yaml"


@pytest.fixture(scope="module")
def spec():
    return load_spec(DEFAULT)


def _small_frame() -> pd.DataFrame:
    """Study columns of the default spec: income, bmi and hh_size numeric, the rest 0/1."""
    rng = np.random.default_rng(0)
    df = pd.DataFrame({v: rng.integers(0, 2, 50) for v in ("diabetes", "hypertension")})
    for v in ("smoker", "insured"):
        df[v] = rng.integers(0, 2, 50)
    df["income"], df["bmi"], df["hh_size"] = rng.gamma(2, 2e4, 50), rng.normal(27, 4, 50), 3
    df.loc[:10, "hh_size"] = 1
    return df


# ---------------------------------------------------------------- candidates


def test_one_factor_candidates_change_one_setting_each(spec):
    facs = tune.factors(spec, _small_frame())
    paths = [f.path for f in facs]
    assert paths == [
        "stages.swap.rate",
        "stages.swap.cumulative",
        "stages.prb.partition",
        "stages.prb.tuned",
        "stages.massc.epsilon",
        "stages.massc.psi_max",
        "stages.massc.phi_min",
        "stages.massc.substrata",
        "stages.topcode.income.upper.percentile",  # bmi is coded at a value, not a percentile
    ]
    own = spec.model_dump()
    cands = tune.one_factor_candidates(facs, toward="risk")
    assert len(cands) == sum(len(f.levels) for f in facs)
    assert len({c.key for c in cands}) == len(cands)
    for c in cands:
        assert len(c.changes) == 1 and len(c.reasons) == 1 and c.reasons[0]
        path, value = c.changes[0]
        assert value != tune.get_path(own, path)
        changed = tune.spec_with(spec, c.changes).model_dump()  # validates
        got = tune.get_path(changed, path)  # a mapping gets the model's defaults besides
        assert got == value or all(got[k] == v for k, v in value.items())
        # nothing else moved
        assert tune.apply_changes(changed, [(path, tune.get_path(own, path))]) == own
    # the first round takes one level of every factor, then the second round begins
    assert [c.changes[0][0] for c in cands[: len(facs)]] == paths
    first = {c.changes[0][0]: c.changes[0][1] for c in cands[: len(facs)]}
    # toward risk: the nearest level in the direction that lowers risk (more swapping, a larger
    # MASSC epsilon, more income top-coded); phi_min is at its floor, so its nearest level up
    assert first["stages.swap.rate"] == 0.3 and first["stages.massc.epsilon"] == 0.2
    assert first["stages.massc.phi_min"] == 0.7
    assert first["stages.topcode.income.upper.percentile"] == 99.0
    assert first["stages.massc.substrata"] == {"variables": ["income", "bmi", "hh_size"]}
    # toward utility the other way first
    toward_u = tune.one_factor_candidates(facs, toward="utility")[: len(facs)]
    first_u = {c.changes[0][0]: c.changes[0][1] for c in toward_u}
    assert first_u["stages.swap.rate"] == 0.2 and first_u["stages.massc.epsilon"] == 0.1
    assert first_u["stages.topcode.income.upper.percentile"] == 99.9


def test_partition_ladder_adds_one_variable_of_c_per_rung(spec):
    # the declared domains already refine the partition by every key in C: the rungs add
    # the cells that are not declared domains, in the cells' order (education, hh_size,
    # pregnant: the intruder's key beyond the declared keys)
    f = next(f for f in tune.factors(spec) if f.path == "stages.prb.partition")
    assert f.levels == [
        {"age": None, "sex": None, "education": None},
        {"age": None, "sex": None, "education": None, "hh_size": None},
        {"age": None, "sex": None, "education": None, "hh_size": None, "pregnant": None},
    ]


def test_factors_skip_disabled_stages_and_missing_fields(spec):
    data = spec.model_dump()
    data["stages"]["swap"] = None
    data["stages"]["massc"]["enabled"] = False
    s2 = type(spec).model_validate(data)
    paths = [f.path for f in tune.factors(s2)]
    assert not any(p.startswith(("stages.swap", "stages.massc")) for p in paths)
    assert "stages.prb.partition" in paths


def test_prefix_cache_evicts_least_recently_used():
    from sdl_design.stage import StageResult

    orig = pd.DataFrame({"x": np.arange(1000.0)})  # 8,000 bytes of values, 132 of index

    def res(name):
        return (StageResult(name, orig), StageResult(name, orig + 1))  # one frame of its own

    c = tune.PrefixCache(orig, max_entries=2, max_bytes=20_000)
    c.put("a", res("a"))
    c.put("b", res("b"))
    assert c.get("a") is not None  # a is now the most recently used
    c.put("c", res("c"))  # beyond two entries: b goes
    assert c.get("b") is None and c.get("a") is not None and c.get("c") is not None
    c.max_entries = 10
    c.put("d", res("d"))  # 3 x 8,132 bytes > 20,000: the least recently used (a) goes
    assert c.get("a") is None and c.get("c") is not None and c.get("d") is not None
    c.put("big", (StageResult("big", pd.DataFrame({"x": np.zeros(3000)})),))  # alone too big
    assert c.get("big") is None and c.hits == 5


# ---------------------------------------------------------------- search on a synthetic landscape


def _value(spec, c: tune.Candidate, path: str):
    return tune.get_path(tune.apply_changes(spec.model_dump(), c.changes), path)


def _synthetic_rows(spec, cands: list[tune.Candidate], skip) -> list[dict]:
    """A known landscape: the delta gate's share of its limit falls with epsilon and rises with
    phi_min; utility falls with epsilon, rises with phi_min, peaks at swap rate 0.2."""
    rows = []
    for c in cands:
        eps = _value(spec, c, "stages.massc.epsilon")
        phi = _value(spec, c, "stages.massc.phi_min")
        rate = _value(spec, c, "stages.swap.rate")
        ratio = 1.04 - 1.2 * (eps - 0.15) + 0.05 * (phi - 0.5)
        u = 0.9 - 0.5 * (eps - 0.15) + 0.04 * (phi - 0.5) - 0.05 * abs(rate - 0.2)
        u += 1e-6 * (zlib.crc32(repr(c.key).encode()) % 997)  # no ties
        rows.append(
            {
                "changes": json.dumps([list(x) for x in c.changes]),
                "risk_index": ratio,
                "risk_ratios": json.dumps({"massc.delta": ratio}),
                "utility": u,
                "overlap_median": u,
                "overlap_p5": 0.5,
                "share_abs_std_bias_gt2": 0.0,
                "passes_risk": bool(ratio <= 1.0),
                "passes_all": False,
                "error": "",
            }
        )
    return rows


def _best_so_far(rows: list[dict]) -> dict:
    """Brute force: the highest utility among rows within the risk limit, else the lowest risk."""
    ok = [r for r in rows if r["risk_index"] <= 1.0]
    if ok:
        return max(ok, key=lambda r: r["utility"])
    return min(rows, key=lambda r: (r["risk_index"], -r["utility"]))


@pytest.mark.parametrize("budget", [1, 5, 14, 30])
def test_search_respects_budget_and_refines_around_the_best(spec, budget):
    res = tune.search(
        spec, _small_frame(), budget, run_batch=lambda c, s: _synthetic_rows(spec, c, s)
    )
    t = res.table
    assert len(t) == budget
    assert t["changes"].iloc[0] == "[]" and t["origin"].iloc[0] == "spec"
    assert len(set(t["changes"])) == budget  # no candidate twice
    n_ofat = res.extra["n_one_factor"]
    assert (t["origin"].iloc[1 : 1 + n_ofat] == "one-factor").all()
    assert n_ofat == min(budget - 1, max(min(9, budget - 2), (2 * (budget - 1) + 2) // 3))
    rows = t.to_dict("records")
    n_refine = 0
    for k in range(1 + n_ofat, budget):
        best = _best_so_far(rows[:k])
        if rows[k]["origin"] != "refine":
            # refinement ran dry (nothing new around the best): the next one-factor level
            assert rows[k]["origin"] == "one-factor" and len(json.loads(rows[k]["changes"])) == 1
            continue
        n_refine += 1
        best = dict(json.loads(best["changes"]))
        this = {p: v for p, v in json.loads(rows[k]["changes"])}
        differ = {p for p in best.keys() | this.keys() if best.get(p, "own") != this.get(p, "own")}
        assert len(differ) == 1, (best, this)
    if budget >= 14:
        assert n_refine >= (budget - 1 - n_ofat) // 2
        # the own spec fails the risk limit; a larger epsilon fixes it, and the refinement adds
        # the utility gains of phi_min and a swap rate of 0.2 to it
        rec = t.loc[res.recommended]
        assert rec["passes_risk"] and res.extra["toward"] == "risk"
        got = dict(json.loads(rec["changes"]))
        assert got.get("stages.massc.epsilon", 0.15) > 0.15
        assert got.get("stages.massc.phi_min", 0.5) > 0.5


# ---------------------------------------------------------------- Pareto front


def _front_brute(r, u):
    out = []
    for i in range(len(r)):
        if not (np.isfinite(r[i]) and np.isfinite(u[i])):
            out.append(False)
            continue
        dom = any(
            np.isfinite(r[j])
            and np.isfinite(u[j])
            and r[j] <= r[i]
            and u[j] >= u[i]
            and (r[j] < r[i] or u[j] > u[i])
            for j in range(len(r))
        )
        out.append(not dom)
    return np.array(out)


def test_pareto_front_matches_brute_force():
    rng = np.random.default_rng(7)
    for trial in range(200):
        n = int(rng.integers(1, 25))
        r = rng.integers(0, 6, n).astype(float)  # many ties
        u = rng.integers(0, 6, n).astype(float)
        if trial % 3 == 0:
            r[rng.random(n) < 0.2] = np.nan
        np.testing.assert_array_equal(tune.pareto_front(r, u), _front_brute(r, u))
    # a worked case: (1, 5) and (0, 3) are on it; (1, 4), (2, 5) and (0, 2) are dominated
    r, u = [1, 1, 2, 0, 0], [5, 4, 5, 3, 2]
    assert tune.pareto_front(r, u).tolist() == [True, False, False, True, False]


def test_recommend_prefers_risk_pass_then_all_gates_then_beating_own():
    rows = [
        # own: fails a risk gate
        dict(changes="[]", passes_risk=False, passes_all=False, utility=0.95, risk_index=1.1),
        # best utility but fails a risk gate: never recommended
        dict(changes='[["a", 1]]', passes_risk=False, passes_all=False, utility=0.99),
        # passes risk, worse than own on the overlap median
        dict(changes='[["a", 2]]', passes_risk=True, passes_all=False, utility=0.94),
        # passes risk and beats own on both utility measures
        dict(changes='[["a", 3]]', passes_risk=True, passes_all=False, utility=0.93),
    ]
    for r, (om, sh) in zip(
        rows, [(0.95, 0.01), (0.99, 0.0), (0.94, 0.02), (0.96, 0.005)], strict=True
    ):
        r.update(overlap_median=om, share_abs_std_bias_gt2=sh, overlap_p5=0.7, error="")
    t = pd.DataFrame(rows)
    assert tune.recommend(t) == 3
    t.loc[2, "passes_all"] = True  # every gate holds: first
    assert tune.recommend(t) == 2
    t["passes_risk"] = False
    assert tune.recommend(t) is None


# ---------------------------------------------------------------- recommended YAML


def _subsequence(needles: list[str], hay: list[str]) -> bool:
    it = iter(hay)
    return all(any(n == h for h in it) for n in needles)


def test_recommended_yaml_keeps_lines_validates_and_comments_changes(tmp_path, spec):
    text = DEFAULT.read_text()
    changes = [
        ("stages.massc.epsilon", 0.2),  # a scalar on its own line
        ("stages.prb.partition", {"age": None, "sex": None, "education": None}),  # has a comment
        ("stages.topcode.income.upper.percentile", 99.9),  # inside a flow mapping
        ("stages.swap.cumulative", True),  # not written yet: added to its block section
        ("stages.massc.substrata", {"variables": ["income", "bmi"]}),  # added too
        ("stages.massc.phi_min", 0.9),
    ]
    reasons = [f"reason number {i}" for i in range(len(changes))]
    out = tune.recommended_yaml(text, changes, reasons, header="made by a test\nsecond line")
    lines, new = text.split("\n"), out.split("\n")
    touched = ("    epsilon: 0.15", "    partition: {age", "    income: {upper", "    phi_min: 0.5")
    kept = [ln for ln in lines if not ln.startswith(touched)]
    assert len(kept) == len(lines) - 4
    assert _subsequence(kept, new)  # every unchanged line, in order
    assert len(new) == len(lines) + 2 + 2  # header lines and two added settings
    assert new[:2] == ["# made by a test", "# second line"]
    expect = {
        "    epsilon: 0.2  # tuned (was 0.15): reason number 0",
        "    partition: {age: null, sex: null, education: null}  # tuned (was {age: null, "
        "sex: null}): reason number 1",
        "    income: {upper: {percentile: 99.9, replace: mean}}  # tuned (was 99.5): "
        "reason number 2",
        "    cumulative: true  # tuned (added): reason number 3",
        "    substrata: {variables: [income, bmi]}  # tuned (added): reason number 4",
        "    phi_min: 0.9  # tuned (was 0.5): reason number 5",
    }
    assert expect <= set(new)
    path = tmp_path / "recommended.yaml"
    path.write_text(out)
    got = load_spec(path)
    (tmp_path / "own.yaml").write_text(text)
    want = tune.spec_with(load_spec(tmp_path / "own.yaml"), changes)
    assert got == want


def test_recommended_yaml_block_values_and_shared_lines():
    text = (
        "a:\n"
        "  b:          # a block mapping\n"
        "    c: 1\n"
        "    # a comment inside\n"
        "    d: [1, 2]\n"
        "  e: {f: 1, g: 2}\n"
        "h: 3  # keep me\n"
    )
    changes = [("a.b", {"c": 2}), ("a.e.f", 5), ("a.e.g", 6)]
    out = tune.recommended_yaml(text, changes, ["x", "y", "z"])
    assert out.split("\n") == [
        "a:",
        "  b: {c: 2}  # tuned (was {c: 1, d: [1, 2]}): x",
        "  e: {f: 5, g: 6}  # tuned (was 1): y; tuned (was 2): z",
        "h: 3  # keep me",
        "",
    ]
    assert yaml.safe_load(out) == {"a": {"b": {"c": 2}, "e": {"f": 5, "g": 6}}, "h": 3}


def test_recommended_yaml_refuses_what_it_cannot_write():
    with pytest.raises((ValueError, KeyError)):
        tune.recommended_yaml("a: 1\n", [("b.c", 2)], ["no section b"])


# ---------------------------------------------------------------- the demo survey


@pytest.mark.flow  # many releases of the demo (the tuner's search)
def test_tune_demo_beats_the_spec_within_risk_and_reproduces(tmp_path, spec):
    """On the demo survey a budget of 13 finds a setting that meets every risk gate and beats
    the default spec's own on median overlap and on share beyond 2 SE (both strictly); the recommended YAML, run fresh
    (no shared stage results, every stage, figures drawn), gives the same assessment."""
    from sdl_design.synth import make_survey

    df = make_survey()  # the demo survey (its own data seed)
    res = tune.search(spec, df, budget=13)
    t = res.table
    assert len(t) == 13
    own = t.iloc[0]
    assert own["changes"] == "[]"  # the spec's own setting is the first candidate
    assert res.recommended is not None
    rec = t.loc[res.recommended]
    ratios = json.loads(rec["risk_ratios"])
    assert set(ratios) >= {"prb.max_identification_risk", "massc.delta"}
    assert all(v <= 1.0 for v in ratios.values()) and rec["risk_index"] == max(ratios.values())
    assert not any(tune.is_risk_gate(g) for g in filter(None, rec["failed_gates"].split("; ")))
    assert rec["overlap_median"] > own["overlap_median"]
    assert rec["share_abs_std_bias_gt2"] < own["share_abs_std_bias_gt2"]
    # no candidate within every risk limit is at least as good on both utility measures and
    # better on one
    ok = t[t["passes_risk"]]
    better = (ok["overlap_median"] >= rec["overlap_median"]) & (
        ok["share_abs_std_bias_gt2"] <= rec["share_abs_std_bias_gt2"]
    )
    strictly = (ok["overlap_median"] > rec["overlap_median"]) | (
        ok["share_abs_std_bias_gt2"] < rec["share_abs_std_bias_gt2"]
    )
    assert not (better & strictly).any()
    png = tune.risk_utility_map(t, res.recommended)
    assert png[:8] == b"\x89PNG\r\n\x1a\n"

    cand = res.candidates[res.recommended]
    text = tune.recommended_yaml(
        DEFAULT.read_text(), cand.changes, tune.change_reasons(res, res.recommended)
    )
    for path, value in cand.changes:
        key = path.rsplit(".", 1)[1]
        assert any(
            f"{key}: {tune._text(value)}" in ln.split("#")[0] and "# tuned" in ln
            for ln in text.split("\n")
        )
    path = tmp_path / "recommended_spec.yaml"
    path.write_text(text)
    spec2 = load_spec(path)
    assert spec2.stages.massc.replications == spec.stages.massc.replications  # unchanged
    results, _ = tune.run_pipeline(spec2, df)  # as `puf run`: every stage, figures on
    assess = next(r for r in results if r.name == "assess")
    assert assess.figures  # figures were drawn
    assert json.dumps(assess.metrics, sort_keys=True) == rec["assess_metrics"]
    gates = [g for r in results for g in r.gates]
    assert all(tune.gate_holds(g) for g in gates if tune.is_risk_gate(g.name))


# ---------------------------------------------------------------- the flow and the CLI


@pytest.mark.flow
@pytest.mark.usefixtures("prefect_server")
def test_puf_tune_flow_outputs_artifacts_and_a_spec_that_reproduces(tmp_path, capsys):
    """`puf tune` on a small demo survey: progress per candidate, the table, the map, the
    recommended spec in the scratch folder (not public/) and the artifacts; `puf run` of the
    recommended spec (the release flow) reproduces the candidate's assessment metrics."""
    from prefect.artifacts import Artifact

    from expectations.suites import GateFailed
    from flows.cli import main as puf
    from flows.cli import write_demo_spec
    from flows.release import release_flow

    path = write_demo_spec(tmp_path, n_persons=4000)
    # tune's run and reproduction under test, on a small survey: the intruder knows the
    # declared keys only (tests/test_release_flow.small_spec says why)
    data = yaml.safe_load(path.read_text())
    data["intruder"]["unknown"].update(dict.fromkeys(["education", "hh_size", "pregnant"], "test"))
    data["stages"]["prb"]["cells"] = None
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    code = puf(["tune", str(path), "--budget", "4"])
    out, err = capsys.readouterr()
    assert len([ln for ln in err.splitlines() if ln.startswith("[puf] tune (")]) == 4
    # what the numbers are: on stderr after the spec's own line, and in the summary
    assert "[puf] tune: risk index = the largest value / limit over the risk gates" in err
    assert "  risk index = the largest value / limit over the risk gates" in out
    assert "of its limit stages.prb.xi = " in out and "  utility = the median CI overlap" in out
    folder = tmp_path / "default-survey" / "tune" / "2026"
    t = pd.read_csv(folder / "candidates.csv", keep_default_na=False, na_values=[""])
    assert len(t) == 4 and t["candidate"].iloc[0] == "spec's own"
    assert (folder / "risk_utility_map.png").read_bytes()[:4] == b"\x89PNG"
    assert not (tmp_path / "default-survey" / "2026" / "public").exists()  # nothing published
    assert str(folder / "candidates.csv") in out and str(folder / "risk_utility_map.png") in out
    rows = json.loads(Artifact.get("puf-tune-default-survey-2026-candidates").data)
    assert [r["candidate"] for r in rows] == t["candidate"].tolist()
    md = Artifact.get("puf-tune-default-survey-2026-map").data
    assert "data:image/png;base64," in md

    assert t["passes_risk"].any()  # the small survey's own setting is within every risk limit
    assert code == 0
    rec_path = folder / "recommended_spec.yaml"
    assert str(rec_path) in out
    rec = t.loc[tune.recommend(t)]
    # the recommended spec is shared: the seed is not in it; the user sets theirs back
    seed = str(load_spec(path).release.seed)
    text = rec_path.read_text()
    assert seed not in text and "  seed: null  # set your release seed here" in text
    assert f"# {tune.RISK_AXIS}." in text and f"# {tune.UTILITY_AXIS}." in text
    rec_path.write_text(text.replace("  seed: null", f"  seed: {seed}", 1))
    spec2 = load_spec(rec_path)  # validates; its input and output folder made absolute
    assert spec2.release.input == (tmp_path / "input" / "default_survey.parquet").resolve()
    internal = tmp_path / "default-survey" / "2026" / "internal"
    try:
        release_flow(spec_path=str(rec_path), approve="tester")
    except GateFailed as e:  # a utility gate may still fail: the staged record and report
        internal = Path(e.report).parent  # are written all the same
    manifest = json.loads((internal / "manifest.json").read_text())
    want = json.loads(rec["assess_metrics"])
    got = {
        k.removeprefix("assess."): v
        for k, v in manifest["metrics"].items()
        if k.startswith("assess.")
    }
    assert set(got) == set(want)
    for k, v in want.items():
        assert got[k] == v or (_nan(v) and _nan(got[k])), k
    # the release report shows the tuning run's map in a section of its own
    from helpers import Parsed

    report = internal / "report.html"
    parsed = Parsed(report.read_text())
    assert "section-tune" in parsed.ids
    assert "tune/risk_utility_map" in {i["alt"] for i in parsed.imgs}


def _nan(x) -> bool:
    return x is None or (isinstance(x, float) and np.isnan(x))


def test_tune_adds_the_intruders_key_to_the_prb_cells():
    """A spec whose PRB treats the declared keys only fails the re-identification gate on the
    intruder's key (education, household size and pregnancy published as well); tune's PRB
    factor adds those columns to the cells one at a time, and the last level passes every
    risk gate."""
    from sdl_design.spec import parse_spec
    from sdl_design.synth import make_survey

    data = yaml.safe_load(DEFAULT.read_text())
    data["stages"]["prb"]["cells"] = None
    data["stages"]["prb"]["variables"].remove("hh_size")
    old = parse_spec(data, DEFAULT.parent)
    df = make_survey(8000)
    f = next(f for f in tune.factors(old, df) if f.path == "stages.prb")
    added = [[c for c in v["cells"] if c not in old.variables.key_names] for v in f.levels]
    assert added == [["education"], ["education", "hh_size"], ["education", "hh_size", "pregnant"]]
    assert "of the intruder's key" in f.reason(f.levels[0])
    own = tune.evaluate(old, df)
    assert not own["passes_risk"] and "re-identified" in own["failed_gates"]
    best = tune.evaluate(old, df, [("stages.prb", f.levels[-1])])
    assert best["passes_risk"], best["failed_gates"]


# ---------------------------------------------------------------- the map's labels


def _apart(a, b) -> bool:
    """Boxes (x0, y0, x1, y1) that share no area."""
    return min(a[2], b[2]) <= max(a[0], b[0]) or min(a[3], b[3]) <= max(a[1], b[1])


def _boxes_disjoint(boxes, others=None) -> bool:
    """No two of boxes overlap (others given: no box overlaps one of others)."""
    if others is not None:
        return all(_apart(a, b) for a in boxes for b in others)
    return all(_apart(a, b) for i, a in enumerate(boxes) for b in boxes[i + 1 :])


def test_number_ranges_collapse_runs_of_three_or_more():
    from sdl_design.plots import number_ranges

    assert number_ranges([9, 1, 5, 4, 6, 7, 2]) == ["1", "2", "4–7", "9"]
    assert number_ranges([3]) == ["3"] and number_ranges([]) == []


def test_labels_of_candidates_at_one_place_never_overprint():
    """Seven of eight candidates at the same (risk, utility), as a user measured on the demo:
    they get one label naming all seven, each number appears once over all labels, and no
    label box overlaps another label or a point."""
    from sdl_design.plots import place_labels

    xy = [(100.0, 300.0)] * 8
    xy[3] = (60.0, 100.0)
    labels = place_labels(xy, list(range(1, 9)), radius=4.0, fontsize=7.0)
    assert sorted(n for lab in labels for n in lab.members) == list(range(1, 9))
    shared = next(lab for lab in labels if 1 in lab.members)
    assert shared.members == (1, 2, 3, 5, 6, 7, 8) and shared.text == "1–3, 5–8"
    assert _boxes_disjoint([lab.box for lab in labels])
    points = [(x - 4, y - 4, x + 4, y + 4) for x, y in set(xy)]
    assert _boxes_disjoint([lab.box for lab in labels], points)


def test_labels_of_nearby_candidates_are_placed_apart():
    """Points a few points apart (each its own label) in a tight cluster: every label at a
    distinct place, no two boxes overlapping, none over a point, all inside the bounds;
    the same input gives the same layout."""
    from sdl_design.plots import place_labels

    xy = [(200.0 + 5 * (i % 4), 200.0 + 5 * (i // 4)) for i in range(12)]
    bounds = (0.0, 0.0, 400.0, 400.0)
    labels = place_labels(xy, list(range(1, 13)), radius=3.0, fontsize=7.0, bounds=bounds)
    assert [lab.members for lab in labels] == [(i,) for i in range(1, 13)]
    boxes = [lab.box for lab in labels]
    assert len({b[:2] for b in boxes}) == 12
    points = [(x - 3, y - 3, x + 3, y + 3) for x, y in xy]
    assert _boxes_disjoint(boxes) and _boxes_disjoint(boxes, points)
    assert all(b[0] >= 0 and b[1] >= 0 and b[2] <= 400 and b[3] <= 400 for b in boxes)
    assert any(lab.leader for lab in labels)  # the crowd pushes some away: a line to each
    assert place_labels(xy, list(range(1, 13)), 3.0, 7.0, bounds) == labels


def _map_table(n_same: int = 7) -> pd.DataFrame:
    """A tuning table: the spec's own and n_same - 1 others at its (risk, utility), one apart."""
    gates = json.dumps({"prb.max_identification_risk": [0.3903, 0.395], "massc.delta": [0.2, 0.25]})
    rows = [
        {
            "candidate": "spec's own" if i == 0 else f"massc.epsilon={0.05 * i:g}",
            "changes": "[]" if i == 0 else json.dumps([["stages.massc.epsilon", 0.05 * i]]),
            "risk_index": 0.988 if i < n_same else 0.9,
            "utility": 0.94 if i < n_same else 0.91,
            "passes_risk": True,
            "passes_all": True,
            "risk_gates": gates,
        }
        for i in range(n_same + 1)
    ]
    t = pd.DataFrame(rows)
    t["pareto"] = tune.pareto_front(t["risk_index"], t["utility"])
    return t


def test_the_map_numbers_each_candidate_once_and_lists_them_beside_it():
    """The drawn map: the annotations name every candidate number once (points at one place
    share one), no two annotation boxes overlap (placed by place_labels), and the table
    beside it lists each number with its changes."""
    from matplotlib.figure import Figure

    from sdl_design import plots

    t = _map_table()
    fig = Figure(figsize=(12.5, 5.8))
    ax = fig.add_axes((0.065, 0.16, 0.525, 0.76))
    plots._map_draw(ax, t, 0)
    plots._map_labels(ax, t, 0, 7.0)
    texts = [a.get_text() for a in ax.texts]
    numbers = [p for s in texts for p in s.replace("\n", " ").split(", ")]
    assert sorted(numbers) == ["1–7", "8"]
    labels = tune.short_labels(t)
    plots._map_table(fig, t, labels, 0, 0.7, 0.02)
    rows = [x.get_text() for x in fig.texts]
    for i in range(len(t)):
        assert any(r.split()[0] == str(i + 1) and labels[i] in r for r in rows[1:])
    assert rows[1].startswith(" 1 ★◆ 0.9880") and "spec's own" in rows[1]  # own, recommended
    assert all("★" not in r and "◆" not in r for r in rows[2:])
    png = tune.risk_utility_map(t, 0, "x")
    assert png[:8] == b"\x89PNG\r\n\x1a\n"


def test_short_labels_show_what_a_section_change_changes():
    t = pd.DataFrame(
        [
            {"changes": "[]", "stages.prb": "{cells: [age, sex], tuned: false}"},
            {
                "changes": json.dumps(
                    [["stages.prb", {"cells": ["age", "sex", "educ"], "tuned": False}]]
                ),
                "stages.prb": "",
            },
            {"changes": json.dumps([["stages.swap.rate", 0.2]]), "stages.prb": ""},
            {"changes": json.dumps([["stages.prb.partition", {"age": None, "sex": None}]])},
        ]
    )
    t.loc[0, "stages.prb.partition"] = "{age: null}"
    assert tune.short_labels(t) == [
        "spec's own",
        "prb.cells + [educ]",
        "swap.rate=0.2",
        "prb.partition.sex=null",
    ]
    assert all(len(s) <= 20 for s in tune.short_labels(t, 20))


# ---------------------------------------------------------------- what the numbers are


def test_axis_lines_name_the_risk_gate_its_metric_and_limit():
    """The console says what the risk index is: the largest value / limit over the risk
    gates, each gate of the spec's own named with its metric, value and limit (the one that
    sets the index first); and what utility is. A progress line names the gate that sets it."""
    from flows.tune import progress_line

    row = {
        "risk_index": 0.9881,
        "utility": 0.94,
        "overlap_median": 0.95,
        "share_abs_std_bias_gt2": 0.01,
        "passes_risk": True,
        "seconds": 1.0,
        "risk_gates": json.dumps(
            {
                "risk: share of original sample uniques re-identified (worst exact-match attack)": [
                    0.088,
                    0.395,
                ],
                "prb.max_identification_risk": [0.3903, 0.395],
            }
        ),
    }
    lines = tune.axis_lines(row)
    assert lines[0].startswith("risk index = the largest value / limit over the risk gates")
    assert "0.9881 = PRB's largest exact identification risk" in lines[1]
    assert "0.3903 of its limit stages.prb.xi = 0.395" in lines[1]
    assert "(reid_share_worst)" in lines[2] and "gates.xi = 0.395" in lines[2]
    assert lines[-1].startswith("utility = the median CI overlap")
    assert "2 original SEs" in lines[-1]
    line = progress_line(1, 8, tune.Candidate((), ()), row)
    assert "risk index 0.988 (PRB identification risk 0.3903 / stages.prb.xi 0.395)" in line
    assert tune.axis_lines({})[0].startswith("risk index = the share")
    assert "set by PRB identification risk / stages.prb.xi (8 of 8)" in tune.map_note(_map_table())


def test_every_risk_gate_of_a_run_has_words():
    """Each risk gate a run of the default spec sets is in RISK_TERMS (a renamed gate fails
    here, not silently in the console), and the row records its value and limit."""
    from sdl_design.synth import make_survey

    row = tune.evaluate(load_spec(DEFAULT), make_survey(3000))
    gates = tune.risk_gates(row)
    names = {g[0] for g in gates}
    assert names == set(json.loads(row["risk_ratios"]))
    assert "prb.max_identification_risk" in names and len(names) >= 4
    assert names <= set(tune.RISK_TERMS)
    assert gates[0][1] / gates[0][2] == pytest.approx(row["risk_index"])


# ---------------------------------------------------------------- what each stage does


def test_reasons_say_what_each_stage_does(spec):
    """Every reason names what its stage does: the swap exchanges segments (the design's
    segment column), never households; PRB post-randomizes keys; MASSC substitutes and
    subsamples; top-coding replaces values beyond a weighted percentile."""
    facs = tune.factors(spec, _small_frame())
    words = {
        "swap": "the swap exchanges whole segments (`segment`) between PSUs",
        "prb": "PRB post-randomizes the keys (",
        "massc": "MASSC substitutes key values from donors and subsamples records",
        "topcode": "top-coding replaces the values of income above a weighted percentile",
    }
    seen = set()
    for f in facs:
        stage = f.path.split(".")[1]
        for v in f.levels:
            reason = f.reason(v)
            assert reason.startswith(words[stage]), reason
            assert "household" not in reason.lower(), reason
            seen.add(stage)
    assert seen == set(words)
    rate = next(f for f in facs if f.path == "stages.swap.rate")
    lower = max(v for v in rate.levels if v < rate.own)
    assert "fewer of them change PSU" in rate.reason(lower)
    assert "more of them change PSU" in rate.reason(min(v for v in rate.levels if v > rate.own))
    top = next(f for f in facs if f.path.startswith("stages.topcode"))
    assert top.reason(99.9).endswith("the 99.9th instead of the 99.5th, fewer values coded")


def test_swap_reasons_name_the_spec_segment_column(spec):
    """A design whose segments are in another column: the reasons name that column."""
    design = spec.design.model_copy(update={"segment": "block"})
    other = spec.model_copy(update={"design": design})
    f = next(f for f in tune.factors(other) if f.path == "stages.swap.rate")
    assert "whole segments (`block`) between PSUs" in f.reason(f.levels[0])
