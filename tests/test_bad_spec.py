"""Bad specs and inputs are refused before any work: one small case per class (issue 15, issue
13 items 4-5). Each case: `puf validate` and `puf run` exit 2 naming the field, no traceback,
the problem said once, nothing under public/."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys

import numpy as np
import pandas as pd
import pytest
import yaml
from helpers import ROOT

from flows.cli import main as puf
from flows.cli import write_demo_spec
from sdl_design.survey.design import SurveyDesign

N = 3000


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    """The 3,000-person demo: its spec (as data) and its input file, generated once."""
    root = tmp_path_factory.mktemp("demo")
    path = write_demo_spec(root, n_persons=N)
    return yaml.safe_load(path.read_text()), pd.read_parquet(
        root / "input" / "default_survey.parquet"
    )


def _case_dir(tmp_path, demo, edit_spec=None, edit_data=None, text=None):
    """A copy of the demo with the spec and/or data changed; the spec's path."""
    data, df = demo
    data = yaml.safe_load(yaml.safe_dump(data))  # deep copy
    df = df.copy()
    if edit_data:
        df = edit_data(df)
    if edit_spec:
        edit_spec(data, df)
    (tmp_path / "input").mkdir(parents=True, exist_ok=True)
    df.to_parquet(tmp_path / "input" / "default_survey.parquet", index=False)
    path = tmp_path / "spec.yaml"
    body = yaml.safe_dump(data, sort_keys=False)
    path.write_text(text(body) if text else body)
    return path


def _set(dotted, value):
    def edit(data, df):
        node = data
        *head, last = dotted.split(".")
        for h in head:
            node = node[h]
        if value is _DROP:
            del node[last]
        else:
            node[last] = value

    return edit


_DROP = object()


def _segments_across_psus(df):
    """Segment labels restarting at 1 in every PSU: segment 1 lies in every PSU."""
    df["segment"] = df.groupby(["stratum", "psu"])["segment"].rank(method="dense").astype(int)
    return df


def _lonely_psu(df):
    """A 2-PSU stratum whose second PSU keeps one record (its own segment); replicate weights
    rebuilt (jkn) for the changed design."""
    n_h = df.groupby("stratum")["psu"].nunique()
    h = n_h[n_h == 2].index[0]
    a, b = sorted(df.loc[df.stratum == h, "psu"].unique())
    in_b = df.index[(df.stratum == h) & (df.psu == b)]
    df.loc[in_b[1:], "psu"] = a
    df.loc[in_b[:1], "segment"] = df["segment"].max() + 1
    df = df.sort_values(["stratum", "psu", "segment"], kind="stable").reset_index(drop=True)
    rw = [c for c in df.columns if c.startswith("rw_")]
    reps = SurveyDesign(df, "wt", "stratum", "psu").with_replicates("jkn")
    assert reps.shape[1] == len(rw)  # still 70 PSUs
    df[rw] = reps.to_numpy()
    return df


def _dup_seed(text):
    return re.sub(r"(?m)^(  seed: .*)$", r"\1\n  seed: 7", text, count=1)


CASES = {
    # case: (edit_spec, edit_data, edit_text, fields the message must name)
    "duplicated YAML key": (None, None, _dup_seed, ["release.seed", "twice"]),
    "seed: true": (_set("release.seed", True), None, None, ["release.seed", "boolean"]),
    "release name ..": (_set("release.name", ".."), None, None, ["release.name", "dot"]),
    "release year 99999": (_set("release.year", 99999), None, None, ["release.year"]),
    "x < null": (
        lambda d, df: d["edits"].append(
            {"rule": "in_set", "column": "smoker", "values": [0], "when": "bmi < null"}
        ),
        None,
        None,
        ["edits.10", "no order"],
    ),
    "smoker == yes on a numeric column": (
        lambda d, df: d["edits"].append(
            {"rule": "in_set", "column": "insured", "values": [0, 1], "when": "smoker == yes"}
        ),
        None,
        None,
        ["edits[10].when", "holds numbers", "'yes' is text"],
    ),
    "gates.xi below stages.prb.xi": (
        _set("gates.xi", 0.36),
        None,
        None,
        ["gates.xi", "stages.prb.xi"],
    ),
    "swap rate above max_share": (
        _set("stages.swap.rate", 0.6),
        None,
        None,
        ["stages.swap", "max_share"],
    ),
    "sensitive: [] with MASSC": (
        _set("variables.sensitive", []),
        None,
        None,
        ["variables.sensitive", "MASSC"],
    ),
    "swap without a segment column": (
        _set("design.segment", _DROP),
        None,
        None,
        ["design.segment", "stages.swap"],
    ),
    "segments spanning PSUs": (
        None,
        _segments_across_psus,
        None,
        ["design.segment", "more than one PSU"],
    ),
    "JKn weights declared bootstrap": (
        _set("design.replicate_weights.method", "bootstrap"),
        None,
        None,
        ["design.replicate_weights.method", "set method: jkn"],
    ),
    "brr on 3-PSU strata": (
        _set("design.replicate_weights.method", "brr"),
        None,
        None,
        ["design.replicate_weights.method", "brr needs exactly 2 PSUs"],
    ),
    "one PSU left after MASSC subsampling": (
        None,
        _lonely_psu,
        None,
        ["design.psu", "single PSU", "MASSC"],
    ),
}


def _no_public(path):
    return not any(p.name == "public" for p in path.parent.rglob("*"))


@pytest.mark.parametrize("case", list(CASES))
def test_refused_before_any_work(case, demo, tmp_path, capsys):
    edit_spec, edit_data, text, fields = CASES[case]
    path = _case_dir(tmp_path, demo, edit_spec, edit_data, text)
    for argv in (["validate", str(path)], ["run", str(path), "--approve", "x"]):
        code = puf(argv)
        out, err = capsys.readouterr()
        said = out + err
        assert code == 2, (argv[0], said)
        for f in fields:
            assert f in said, (argv[0], f, said)
        assert "Traceback" not in said
        assert err.count("release spec is not valid") == 1
        assert _no_public(path)


def test_year_override_out_of_range(demo, tmp_path, capsys):
    path = _case_dir(tmp_path, demo)
    assert puf(["run", str(path), "--approve", "x", "--year", "99999"]) == 2
    err = capsys.readouterr().err
    assert "release.year (--year)" in err and "Traceback" not in err
    assert _no_public(path)


def test_demo_passes_validate(demo, tmp_path, capsys):
    path = _case_dir(tmp_path, demo)
    assert puf(["validate", str(path)]) == 0
    out = capsys.readouterr().out
    assert f"valid; {N} records" in out and "preconditions hold" in out


def test_sensitivity_labels_one_spelling(demo, tmp_path, capsys):
    """Labels written '1.0'/'0.0' (text) match the integer data in validate and in the risk
    stage alike, with the same scores as 1/0."""
    from conftest import run_stage

    from sdl_design.spec import load_spec
    from sdl_design.stages.risk import RiskStage

    def text_labels(data, df):
        data["variables"]["sensitive"][0]["sensitivity"] = {"1.0": 1.0, "0.0": 0.0}
        data["variables"]["sensitive"][1]["sensitivity"] = {"1": 0.3, "0": 0.0}

    path = _case_dir(tmp_path, demo, text_labels)
    assert puf(["validate", str(path)]) == 0
    capsys.readouterr()
    spec = load_spec(path)
    spec.stages.risk.loglinear = False
    df = demo[1]
    ref = load_spec(_case_dir(tmp_path / "ref", demo))
    ref.stages.risk.loglinear = False
    got = run_stage(RiskStage, df, spec).tables["profiles"]["risk_score"]
    want = run_stage(RiskStage, df, ref).tables["profiles"]["risk_score"]
    np.testing.assert_array_equal(got.to_numpy(), want.to_numpy())


@pytest.mark.flow
@pytest.mark.usefixtures("prefect_server")
def test_when_conditions_have_their_meaning(demo, tmp_path, capsys):
    """`consent == yes` applies to the records with the text "yes"; `x == null` to those with
    x missing; `age == [10, 11]` to ages 10 and 11. Counted independently with pandas; validate
    says exit 1 with each count, run is rejected at edit validation (exit 1), no public/."""

    def data(df):
        rng = np.random.default_rng(5)
        df["consent"] = np.where(rng.random(len(df)) < 0.3, "yes", "no")
        df["x"] = np.where(rng.random(len(df)) < 0.2, np.nan, 1.0)
        return df

    rules = [
        {"rule": "in_set", "column": "smoker", "values": [0], "when": "consent == yes"},
        {"rule": "in_set", "column": "insured", "values": [1], "when": "x == null"},
        {"rule": "in_set", "column": "marital", "values": ["married"], "when": "age == [10, 11]"},
    ]

    def spec(d, df):
        d["edits"] += rules
        d["variables"]["other"]["drop"] += ["consent", "x"]

    path = _case_dir(tmp_path, demo, spec, data)
    df = pd.read_parquet(tmp_path / "input" / "default_survey.parquet")
    want = [
        int(((df.consent == "yes") & (df.smoker != 0)).sum()),
        int((df.x.isna() & (df.insured != 1)).sum()),
        int((df.age.isin([10, 11]) & (df.marital != "married")).sum()),
    ]
    assert all(n > 0 for n in want)
    assert puf(["validate", str(path)]) == 1
    out = capsys.readouterr().out
    for r, n in zip(rules, want, strict=True):
        assert f"when {r['when']}: {n} records fail" in out
    assert puf(["run", str(path), "--approve", "x"]) == 1
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err
    assert err.count("edit validation failed") == 1
    for r, n in zip(rules, want, strict=True):
        assert f"when {r['when']}: {n} records fail" in err
    assert _no_public(path)
    shutil.rmtree(tmp_path / "default-survey", ignore_errors=True)


def test_single_psu_chance_matches_the_selection():
    """The closed form against 20,000 runs of MASSC's own nested selection (select): strata of
    PSUs with (1, 1, 3), (1, 1, 1) and (2, 1) records at phi 0.5."""
    from sdl_design.preflight import single_psu_chance
    from sdl_design.stages.massc.treatment import select

    n_p = np.array([1, 1, 3, 1, 1, 1, 2, 1])
    psu_h = np.array([0, 0, 0, 1, 1, 1, 2, 2])
    chance = single_psu_chance(n_p, psu_h, 3, 0.5)
    # by hand: 0.5^2; 0.5^3 (1 + 3); 0.5 (the 2-record PSU is sure)
    np.testing.assert_allclose(chance, [0.25, 0.5, 0.5])
    groups = np.repeat(np.arange(len(n_p)), n_p)
    stratum = psu_h[groups]
    rng = np.random.default_rng(1)
    R = 20000
    left = np.zeros(3)
    for _ in range(R):
        kept = select(groups, np.full(len(groups), 0.5), rng)
        for h in range(3):
            left[h] += len(np.unique(groups[kept & (stratum == h)])) < 2
    np.testing.assert_allclose(left / R, chance, atol=0.015)  # ~4 binomial SEs


@pytest.mark.parametrize("method", ["jkn", "jk1", "bootstrap", "brr", "fay"])
def test_replicate_weights_made_by_the_method_pass(method, demo):
    """Weights made by SurveyDesign.with_replicates(method) pass the check of that method (on
    the 2-PSU strata for brr and fay), and JKn weights declared as the method do not."""
    from sdl_design.preflight import preflight
    from sdl_design.spec import parse_spec

    data, df = demo
    if method in ("brr", "fay"):
        n_h = df.groupby("stratum")["psu"].nunique()
        df = df[df.stratum.isin(n_h[n_h == 2].index)].reset_index(drop=True)
    keep = [c for c in df.columns if not c.startswith("rw_")]
    jkn = SurveyDesign(df, "wt", "stratum", "psu").with_replicates("jkn")
    made = SurveyDesign(df, "wt", "stratum", "psu").with_replicates(
        method, rho=0.3 if method == "fay" else None, seed=3, n_replicates=30
    )
    data = yaml.safe_load(yaml.safe_dump(data))
    data["design"]["replicate_weights"] = {"columns": "rw_*", "method": method}
    if method == "fay":
        data["design"]["replicate_weights"]["rho"] = 0.3
    spec = parse_spec(data)
    assert preflight(spec, pd.concat([df[keep], made], axis=1)) == []
    if method != "jkn":
        problems = preflight(spec, pd.concat([df[keep], jkn], axis=1))
        assert any(p.startswith("design.replicate_weights.method") for p in problems), problems


def test_validate_refuses_a_missing_spec_without_loading_prefect(tmp_path):
    """`puf validate` reads and checks the input without the flow's machinery: a missing spec
    is refused (exit 2, one line) before Prefect is imported (it took 5.5 s, now about 2)."""
    code = (
        "import sys\n"
        "from flows.cli import main\n"
        f"rc = main(['validate', {str(tmp_path / 'none.yaml')!r}])\n"
        "print(rc, 'prefect' in sys.modules)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120
    )
    assert out.stdout.split() == ["2", "False"], out.stderr
    assert out.stderr.strip().splitlines()[-1].endswith("give the path of a release spec YAML")
