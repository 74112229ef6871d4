"""The embedded default survey: determinism, schema, edits, nesting, weights, uniques, deffs."""

from __future__ import annotations

import operator
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import yaml

from sdl_design.keys import key_frame
from sdl_design.spec import parse_condition, parse_spec
from sdl_design.survey.design import SurveyDesign
from sdl_design.synth import make_survey

SPEC = parse_spec(
    yaml.safe_load((Path(__file__).parents[1] / "flows/default_spec.yaml").read_text())
)
COLUMNS = [
    "person_id", "name", "stratum", "psu", "segment", "household", "wt",
    "age", "sex", "race", "marital", "region", "county", "education", "hh_size",
    "income", "bmi", "diabetes", "hypertension", "smoker", "insured", "pregnant",
]  # fmt: skip
INTS = ["stratum", "psu", "segment", "household", "age", "hh_size"]
BINARY = ["diabetes", "hypertension", "smoker", "insured", "pregnant"]
STRINGS = ["person_id", "name", "sex", "race", "marital", "region", "county", "education"]
STUDY = ["income", "bmi", "diabetes", "hypertension", "smoker", "insured", "hh_size"]


@pytest.fixture(scope="module")
def survey() -> pd.DataFrame:
    return make_survey(20000, replicates=False)


def _taylor_deff(df: pd.DataFrame, y: str, domain: pd.Series | None = None) -> float:
    """Deff of a weighted (domain) mean: with-replacement PSU Taylor variance over w*s^2/n, by hand."""
    w, v = df["wt"].to_numpy(), df[y].to_numpy(float)
    d = np.ones(len(v), bool) if domain is None else domain.to_numpy()
    wd = w[d].sum()
    ybar = (w[d] * v[d]).sum() / wd
    z = np.where(d, w * (v - ybar) / wd, 0.0)
    t = pd.Series(z).groupby([df["stratum"].to_numpy(), df["psu"].to_numpy()]).sum()
    g = t.groupby(level=0)
    n_h = g.transform("size")
    var = (n_h / (n_h - 1) * (t - g.transform("mean")) ** 2).sum()
    n = d.sum()
    s2 = (w[d] * (v[d] - ybar) ** 2).sum() / wd * n / (n - 1)
    return float(var / (s2 / n))


def test_deterministic_by_seed():
    a = make_survey(5000, seed=11, replicates=False)
    b = make_survey(5000, seed=11, replicates=False)
    c = make_survey(5000, seed=12, replicates=False)
    ha, hb = pd.util.hash_pandas_object(a), pd.util.hash_pandas_object(b)
    assert (ha.to_numpy() == hb.to_numpy()).all()
    assert list(a.columns) == list(b.columns)
    assert not a.equals(c)


def test_columns_and_dtypes(survey):
    assert list(survey.columns) == COLUMNS
    assert len(survey) == 20000
    for c in INTS + BINARY:
        assert survey[c].dtype == np.int64, c
    for c in ["wt", "income", "bmi"]:
        assert survey[c].dtype == np.float64, c
    for c in STRINGS:
        assert pd.api.types.is_string_dtype(survey[c]) or survey[c].dtype == object, c
        assert survey[c].map(type).eq(str).all(), c
    for c in BINARY:
        assert set(survey[c].unique()) == {0, 1}, c
    assert survey["person_id"].is_unique
    assert survey["name"].str.fullmatch(r"[A-Z][a-z]+ [A-Z][a-z]+").all()
    assert set(survey["race"]) == {"white", "black", "hispanic", "asian", "other"}
    assert set(survey["sex"]) == {"female", "male"}
    assert survey.notna().all().all()


_OPS = {"<": operator.lt, "<=": operator.le, ">": operator.gt, ">=": operator.ge}
_OPS |= {"==": operator.eq, "!=": operator.ne}


def _when(df: pd.DataFrame, text: str | None) -> pd.Series:
    m = pd.Series(True, index=df.index)
    for col, op, value in parse_condition(text) if text else []:
        m &= df[col].isin(value) if op == "in" else _OPS[op](df[col], value)
    return m


@pytest.mark.parametrize("i", range(len(SPEC.edits)))
def test_edit_rules_hold(survey, i):
    rule = SPEC.edits[i]
    m = _when(survey, rule.when)
    assert m.any(), "the rule's condition selects no record: the test would be empty"
    s = survey.loc[m, rule.column]
    if rule.rule == "between":
        ok = pd.Series(True, index=s.index)
        if rule.min is not None:
            ok &= s >= rule.min
        if rule.max is not None:
            ok &= s <= rule.max
    elif rule.rule == "in_set":
        ok = s.isin(rule.values)
    else:
        ok = s.notna()
    assert ok.all(), f"{rule}: {int((~ok).sum())} records fail"


def test_consistency_beyond_the_edits(survey):
    child = survey["age"] < 18
    assert (survey.loc[~child, "education"] != "child").all()  # child iff age < 18
    preg = survey["pregnant"] == 1
    assert survey.loc[preg, "sex"].eq("female").all()
    assert survey.loc[preg, "age"].between(12, 49).all()
    women = (survey["sex"] == "female") & survey["age"].between(12, 49)
    assert 0.03 < survey.loc[women, "pregnant"].mean() < 0.08
    # every household has an adult, and children live with adults
    assert survey.groupby("household")["age"].max().ge(18).all()
    assert 0.15 < child.mean() < 0.4


def test_design_nesting(survey):
    n_psu = survey.groupby("stratum")["psu"].nunique()
    assert len(n_psu) == 30 and n_psu.isin([2, 3]).all()
    assert (n_psu == 2).sum() > (n_psu == 3).sum() >= 2  # mostly 2, some 3
    labels = survey.groupby("stratum")["psu"].agg(lambda p: sorted(p.unique()))
    assert all(lab == list(range(1, len(lab) + 1)) for lab in labels)
    assert survey.groupby("segment")[["stratum", "psu"]].nunique().eq(1).all().all()
    assert survey.groupby("household")["segment"].nunique().eq(1).all()
    assert survey.groupby("county")["stratum"].nunique().eq(1).all()
    assert survey.groupby("stratum")["region"].nunique().eq(1).all()
    assert survey.groupby("stratum")["county"].nunique().between(2, 6).all()
    seg_per_psu = survey.groupby(["stratum", "psu"])["segment"].nunique()
    assert 8 <= seg_per_psu.median() <= 25
    # hh_size is the household's number of persons; sizes 1-8, realistic shares
    size = survey.groupby("household").size()
    assert (survey.groupby("household")["hh_size"].first() == size).all()
    assert size.max() <= 8 and 0.2 < (size == 1).mean() < 0.35 and 0.28 < (size == 2).mean() < 0.4


def test_weights(survey):
    w = survey["wt"]
    assert (w > 0).all() and np.isfinite(w).all()
    assert abs(w.sum() / 330e6 - 1) < 1e-9
    # oversampled domains carry lower weights
    by_race = survey.groupby("race")["wt"].median()
    assert by_race["white"] > 1.5 * by_race[["black", "hispanic", "asian"]].max()
    adults = survey[survey["race"] == "white"]
    assert (
        adults.loc[adults["age"] >= 60, "wt"].median()
        < 0.7 * adults.loc[adults["age"].between(18, 59), "wt"].median()
    )
    # unequal weights: a Kish weighting effect typical of an oversampled design
    kish = 1 + (w.std(ddof=0) / w.mean()) ** 2
    assert 1.15 < kish < 2.5
    # 60+ persons are oversampled: their share falls after weighting
    old = survey["age"] >= 60
    assert np.average(old, weights=w) < old.mean()


def test_income_distribution(survey):
    inc = survey["income"]
    assert (inc >= 0).all()
    assert inc[survey["age"] < 16].eq(0).all()  # no personal income for children
    adult_zero = inc[survey["age"] >= 18].eq(0).mean()
    assert 0.04 < adult_zero < 0.12
    assert inc.skew() > 5
    pos = np.log(inc[inc > 0])
    assert abs(pos.median() - np.log(30000)) < 0.6  # lognormal body near 30k
    # a Pareto tail: the top 1% holds far more than 1% of the total
    top = inc >= inc.quantile(0.99)
    assert inc[top].sum() / inc.sum() > 0.1


def test_many_sample_uniques_on_the_keys(survey):
    from helpers import county_key_spec

    keys = key_frame(survey, county_key_spec().variables.keys)
    counts = keys.value_counts()
    uniques = int((counts == 1).sum())
    assert uniques >= 300
    assert survey["county"].nunique() >= 60


def test_design_effects_spread(survey):
    """Taylor deffs (design.py) of the study-variable means overall and in race domains and of
    the race proportions run from below 1 to above 5 (the classes of paper 003, Table 1)."""
    sd = SurveyDesign(survey, weight="wt", strata="stratum", psu="psu")
    overall = sd.mean(STUDY)["deff"]
    domains = sd.mean(STUDY, by="race")["deff"]
    race = sd.proportion("race")["deff"].droplevel("variable")
    d = pd.concat([overall, domains, race])
    assert d.notna().all() and len(d) == 7 + 35 + 5
    assert d.min() < 1 and d.max() > 5
    assert (d < 1).sum() >= 2 and (d > 5).sum() >= 5
    assert race[["white", "black", "hispanic"]].min() > 5  # race clustered by segment
    assert overall["insured"] > 5  # strong PSU effect
    assert overall["diabetes"] < 2 and domains["diabetes"].min() < 1  # no area effect


def test_design_effects_agree_with_a_hand_computation(survey):
    sd = SurveyDesign(survey, weight="wt", strata="stratum", psu="psu")
    got = sd.mean(STUDY)["deff"].to_numpy()
    want = [_taylor_deff(survey, c) for c in STUDY]
    assert np.allclose(got, want, rtol=1e-9)
    got = sd.mean(STUDY, by="race")["deff"].xs("black", level="race").to_numpy()
    want = [_taylor_deff(survey, c, survey["race"] == "black") for c in STUDY]
    assert np.allclose(got, want, rtol=1e-9)


def test_replicate_weights_are_jkn():
    df = make_survey(5000, seed=5)
    rw = [c for c in df.columns if c.startswith("rw_")]
    assert rw == [f"rw_{i + 1:03d}" for i in range(len(rw))]
    assert list(df.columns[:7]) == COLUMNS[:7] and df.columns[7] == "rw_001"
    psus = df[["stratum", "psu"]].drop_duplicates()
    assert len(rw) == len(psus)
    n_h = df.groupby("stratum")["psu"].nunique()
    w = df["wt"].to_numpy()
    seen = set()
    for c in rw:
        r = df[c].to_numpy()
        dropped = df.loc[r == 0, ["stratum", "psu"]].drop_duplicates()
        assert len(dropped) == 1, c
        h, p = dropped.iloc[0]
        seen.add((h, p))
        in_h = (df["stratum"] == h).to_numpy()
        in_p = in_h & (df["psu"] == p).to_numpy()
        want = np.where(in_p, 0.0, np.where(in_h, w * n_h[h] / (n_h[h] - 1), w))
        assert np.allclose(r, want, rtol=1e-12), c
    assert len(seen) == len(psus)
    SPEC.check_data(df)  # the default spec accepts the survey (columns, design, sensitivities)
