"""SurveyDesign's fpc, two-stage variance and lonely-PSU options against R survey 4.1.1.

The numbers in tests/fixtures/r_design/expected.csv come from make_fixture.R there (svydesign
on R's api data, written with the data it used); R is not needed to run these tests.
"""

from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from pydantic import ValidationError

from sdl_design.spec import DesignSection
from sdl_design.survey.design import DesignError, SurveyDesign

FIX = Path(__file__).parent / "fixtures" / "r_design"
EST_RTOL, SE_RTOL = 1e-10, 1e-8
OPTIONS = ("remove", "certainty", "adjust", "average")

# case -> (data file, subset column or None, SurveyDesign keywords besides df and weight)
STRAT = {"strata": "stype"}
CLUS2 = {"psu": "dnum", "ssu": "snum"}
CASES: dict[str, tuple[str, str | None, dict]] = {
    "strat_fpc": ("apistrat", None, STRAT | {"fpc": "fpc"}),
    "strat_frac": ("apistrat", None, STRAT | {"fpc": "frac"}),
    "clus1_fpc": ("apiclus1", None, {"psu": "dnum", "fpc": "fpc"}),
    "clus1_frac": ("apiclus1", None, {"psu": "dnum", "fpc": "frac"}),
    "clus2_fpc": ("apiclus2", None, CLUS2 | {"fpc": "fpc1", "fpc2": "fpc2"}),
    "clus2_frac": ("apiclus2", None, CLUS2 | {"fpc": "frac1", "fpc2": "frac2"}),
    "clus2_nofpc": ("apiclus2", None, CLUS2),
    "lonely1_selfrep_fail": ("apistrat", "lonely1", STRAT | {"fpc": "fpc_sr"}),
}
for _opt in OPTIONS:
    _lp = {"lonely_psu": _opt}
    CASES |= {
        f"lonely1_{_opt}": ("apistrat", "lonely1", STRAT | _lp),
        f"lonely1_fpc_{_opt}": ("apistrat", "lonely1", STRAT | {"fpc": "fpc"} | _lp),
        f"lonely2_{_opt}": ("apistrat", "lonely2", STRAT | {"psu": "dnum"} | _lp),
        f"lonely2_fpc_{_opt}": ("apistrat", "lonely2", STRAT | {"psu": "dnum", "fpc": "fpc"} | _lp),
        f"clus2_fpc1_{_opt}": ("apiclus2", None, CLUS2 | {"fpc": "fpc1"} | _lp),
        f"clus2_strat_{_opt}": (
            "apiclus2",
            None,
            STRAT | CLUS2 | {"fpc": "fpc1", "fpc2": "fpc2"} | _lp,
        ),
    }


def _data(name: str, subset: str | None = None) -> pd.DataFrame:
    df = pd.read_csv(FIX / f"{name}.csv")
    return df if subset is None else df[df[subset]].reset_index(drop=True)


@pytest.fixture(scope="module")
def expected() -> pd.DataFrame:
    return pd.read_csv(FIX / "expected.csv")


def _design(case: str) -> SurveyDesign:
    name, subset, kw = CASES[case]
    return SurveyDesign(_data(name, subset), "pw", **kw)


def _replicate(d: SurveyDesign, method: str) -> SurveyDesign:
    """The design with replicate weights from with_replicates (R's as.svrepdesign)."""
    rw = d.with_replicates(method)
    df = pd.concat([d.df, rw], axis=1)
    return SurveyDesign(
        df, "pw", replicate_weights=list(rw.columns), method=method, rscales=rw.attrs["rscales"]
    )


def _ours(d: SurveyDesign, estimator: str, variables: list[str]) -> pd.DataFrame:
    """Our estimates and SEs indexed as the fixture's variable column."""
    kind, _, method = estimator.partition("_")
    if method:
        d = _replicate(d, method)
    if kind == "ratio":
        return d.ratio("api00", "api99")
    domains = [v for v in variables if "[" in v]
    plain = [v for v in variables if "[" not in v]
    out = [getattr(d, kind)(plain)] if plain else []
    if domains:  # "api00[stype=E]": the mean or total of api00 in the domain stype == "E"
        col = domains[0].split("[")[1].split("=")[0]
        by = getattr(d, kind)("api00", by=col)
        labels = [f"{v}[{col}={b}]" for v, b in by.index]
        out.append(by.set_axis(pd.Index(labels, name="variable")))
    return pd.concat(out)


def _compare(got: pd.DataFrame, want: pd.DataFrame) -> tuple[float, float]:
    """Relative differences of estimates and SEs (NaN SEs must be NaN on both sides)."""
    got = got.loc[want["variable"]]
    e, s = got["estimate"].to_numpy(), got["se"].to_numpy()
    we, ws = want["estimate"].to_numpy(), want["se"].to_numpy()
    np.testing.assert_allclose(e, we, rtol=EST_RTOL, atol=0)
    np.testing.assert_array_equal(np.isnan(s), np.isnan(ws))
    ok = ~np.isnan(ws)
    np.testing.assert_allclose(s[ok], ws[ok], rtol=SE_RTOL, atol=0)
    rel = np.abs(s[ok] - ws[ok]) / np.abs(ws[ok])
    return float(np.max(np.abs(e - we) / np.abs(we))), float(rel.max(initial=0.0))


@pytest.mark.parametrize("case", sorted(CASES))
def test_matches_r(case: str, expected: pd.DataFrame):
    rows = expected[expected["case"] == case]
    assert len(rows), f"no R numbers for {case}"
    d = _design(case)
    for estimator, want in rows.groupby("estimator", sort=False):
        _compare(_ours(d, estimator, list(want["variable"])), want)


def test_every_fixture_case_is_tested(expected: pd.DataFrame):
    assert set(expected["case"]) == set(CASES)


def test_taylor_variance_and_covariance_agree_with_estimates():
    # the record-score kernels (GLM sandwich, domains) give the same two-stage variance
    d = _design("clus2_fpc")
    z = d.linearized_scores(["api00", "api99"], "mean")
    se = d.mean(["api00", "api99"])["se"].to_numpy()
    np.testing.assert_allclose(np.sqrt(d.taylor_variance(z)), se, rtol=1e-12)
    np.testing.assert_allclose(np.sqrt(np.diag(d.taylor_covariance(z))), se, rtol=1e-12)
    st = d._Q @ z  # SSU totals: psu_variance with them is the full variance, without stage 1
    zt = d._P @ z
    np.testing.assert_allclose(np.sqrt(d.psu_variance(zt, st)), se, rtol=1e-12)
    assert (d.psu_variance(zt) < d.psu_variance(zt, st)).all()


# ------------------------------------------------------------------ errors, as R's
@pytest.mark.parametrize(
    ("case", "match"),
    [
        ("lonely1_remove", r"strata \['H'\] .*single PSU"),
        ("lonely1_fpc_remove", r"strata \['H'\] .*single PSU"),
        ("lonely2_remove", r"strata \['H'\] .*single PSU"),
        ("clus2_fpc1_remove", r"single SSU"),  # one-school districts, infinite SSU population
        ("clus2_strat_remove", r"single SSU"),  # R: Stratum (E.E.152) has only one PSU at stage 2
    ],
)
def test_lonely_fail_raises(case: str, match: str):
    name, subset, kw = CASES[case]
    d = SurveyDesign(_data(name, subset), "pw", **(kw | {"lonely_psu": "fail"}))
    with pytest.raises(DesignError, match=match):
        d.mean("api00")


def test_bad_fpc_refused():
    df = _data("apistrat")
    with pytest.raises(DesignError, match="population smaller than their sample"):
        SurveyDesign(df.assign(fpc=50.0), "pw", strata="stype", fpc="fpc")
    with pytest.raises(DesignError, match="mix values below and above 1"):
        SurveyDesign(df.assign(mix=np.where(df.stype == "E", 0.5, 2000.0)), "pw", fpc="mix")
    with pytest.raises(DesignError, match="constant within the group"):
        SurveyDesign(df.assign(v=np.arange(len(df)) + 1000.0), "pw", strata="stype", fpc="v")
    with pytest.raises(DesignError, match="missing"):
        SurveyDesign(df.assign(fpc=np.nan), "pw", strata="stype", fpc="fpc")
    with pytest.raises(DesignError, match="lonely_psu"):
        SurveyDesign(df, "pw", strata="stype", lonely_psu="collapse")
    c2 = _data("apiclus2")
    with pytest.raises(DesignError, match="ssu"):
        SurveyDesign(c2, "pw", ssu="snum")
    with pytest.raises(DesignError, match="fpc2"):
        SurveyDesign(c2, "pw", psu="dnum", fpc="fpc1", fpc2="fpc2")
    with pytest.raises(DesignError, match="fpc2"):
        SurveyDesign(c2, "pw", psu="dnum", ssu="snum", fpc2="fpc2")


def test_replicates_with_fpc():
    d = _design("strat_fpc")
    with pytest.raises(DesignError, match="bootstrap"):
        d.with_replicates("bootstrap")
    with pytest.raises(DesignError, match="jk1"):
        d.with_replicates("jk1")
    two = _data("apistrat").groupby("stype").head(2)
    with pytest.warns(UserWarning, match="ignores the fpc"):  # R: "fpc dropped in conversion"
        SurveyDesign(two, "pw", strata="stype", fpc="fpc").with_replicates("brr")
    # given replicate weights do not take the fpc (R's svrepdesign): same SEs with or without
    rw = _design("clus1_fpc").with_replicates("jk1")
    df = pd.concat([_data("apiclus1"), rw], axis=1)
    kw = {"replicate_weights": list(rw.columns), "method": "jk1"}
    a = SurveyDesign(df, "pw", psu="dnum", fpc="fpc", **kw).mean("api00")
    b = SurveyDesign(df, "pw", psu="dnum", **kw).mean("api00")
    pd.testing.assert_frame_equal(a, b)


def test_without_new_options_unchanged():
    # the defaults give the with-replacement kernel bit for bit
    df = _data("apistrat")
    d = SurveyDesign(df, "pw", strata="stype", psu="dnum")
    z = d.linearized_scores(["api00", "enroll"], "total")
    zt = d._P @ z
    nh = d.n_h[:, None]
    s1, s2 = d._S @ zt, d._S @ (zt * zt)
    v = np.maximum((nh / (nh - 1.0) * (s2 - s1 * s1 / nh)).sum(axis=0), 0.0)
    np.testing.assert_array_equal(d.taylor_variance(z), v)
    np.testing.assert_allclose(d.total(["api00", "enroll"])["se"].to_numpy() ** 2, v, rtol=1e-13)
    # an ssu without fpc: the PSUs are ultimate clusters (R), the same numbers as without it
    c2 = _data("apiclus2")
    a = SurveyDesign(c2, "pw", psu="dnum", ssu="snum").mean(["api00", "api99"])
    b = SurveyDesign(c2, "pw", psu="dnum").mean(["api00", "api99"])
    pd.testing.assert_frame_equal(a, b)


def test_spec_design_section():
    base = {"weight": "pw", "strata": "stype", "psu": "dnum"}
    s = DesignSection(**base, fpc="fpc1", ssu="snum", fpc2="fpc2", lonely_psu="certainty")
    d = SurveyDesign.from_spec(_data("apiclus2"), s)
    assert (d.fpc, d.ssu, d.fpc2, d.lonely_psu) == ("fpc1", "snum", "fpc2", "certainty")
    assert DesignSection(**base).lonely_psu == "fail"
    with pytest.raises(ValidationError, match="fpc2 needs ssu"):
        DesignSection(**base, fpc="fpc1", fpc2="fpc2")
    with pytest.raises(ValidationError, match="ssu needs psu"):
        DesignSection(weight="pw", ssu="snum")
    with pytest.raises(ValidationError, match="fpc2 needs fpc"):
        DesignSection(**base, ssu="snum", fpc2="fpc2")
    with pytest.raises(ValidationError, match="lonely_psu"):
        DesignSection(**base, lonely_psu="collapse")
    with pytest.raises(ValidationError, match="extra|fpc3"):
        DesignSection(**base, fpc3="x")
