"""SurveyDesign's replicate variance against R survey 4.1.1: the bootstrap conventions (Rao-Wu,
Canty-Davison), a producer's scale, mse TRUE and FALSE, JK1 and JKn, and JKn without strata.

The numbers in tests/fixtures/r_replicates/expected.csv come from make_fixture.R there (R's
as.svrepdesign drew the replicate weights, written to the CSVs with the data; svrepdesign on
the data as read back gave the estimates and SEs); R is not needed to run these tests.
"""

from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from pydantic import ValidationError

from sdl_design.spec import DesignSection, ReplicateSpec
from sdl_design.survey.design import DesignError, SurveyDesign

FIX = Path(__file__).parent / "fixtures" / "r_replicates"
RTOL = 1e-10
R = 50

# R case (without its _mse/_mean suffix) -> (data file, SurveyDesign keywords besides df, pw)
BOOT = {"replicate_weights": "cd_*", "method": "bootstrap"}
CASES: dict[str, tuple[str, dict]] = {
    "boot_strat": ("apistrat", BOOT | {"bootstrap": "rao-wu"}),
    "boot_clus1": ("apiclus1", BOOT | {"bootstrap": "rao-wu"}),
    "subboot_strat": (
        "apistrat",
        {"replicate_weights": "rw_*", "method": "bootstrap", "bootstrap": "rao-wu"},
    ),
    "cd_strat": ("apistrat", BOOT | {"strata": "stype", "bootstrap": "canty-davison"}),
    "cd_clus1": ("apiclus1", BOOT | {"psu": "dnum", "bootstrap": "canty-davison"}),
    "boot_scale": ("apistrat", BOOT | {"scale": 0.03}),
    "jk1_clus1": ("apiclus1", {"replicate_weights": "jk1_*", "method": "jk1"}),
    "jkn_strat": (
        "apistrat",
        {"replicate_weights": "jkn_*", "method": "jkn", "strata": "stype", "psu": "grp"},
    ),
}


def _data(name: str) -> pd.DataFrame:
    return pd.read_csv(FIX / f"{name}.csv")


def _jkn_rscales() -> np.ndarray:
    return pd.read_csv(FIX / "jkn_rscales.csv")["rscales"].to_numpy(dtype=float)


@pytest.fixture(scope="module")
def expected() -> pd.DataFrame:
    return pd.read_csv(FIX / "expected.csv")


def _ours(d: SurveyDesign, estimator: str) -> pd.DataFrame:
    """Our estimates and SEs indexed as the fixture's variable column."""
    if estimator == "total":
        return d.total(["api00", "enroll"])
    if estimator == "mean":
        return d.mean(["api00", "enroll"])
    if estimator == "ratio":
        return d.ratio("api00", "enroll")
    if estimator == "proportion":
        out = d.proportion("sch.wide")
        out.index = [f"{v}{c}" for v, c in out.index]
        return out
    out = d.mean("api00", by="sch.wide")
    out.index = [f"api00[sch.wide={level}]" for _, level in out.index]
    return out


def _assert_equal_r(d: SurveyDesign, rows: pd.DataFrame) -> None:
    assert len(rows) > 0
    for estimator, want in rows.groupby("estimator"):
        got = _ours(d, estimator).loc[want["variable"]]
        np.testing.assert_allclose(got["estimate"], want["estimate"], rtol=RTOL, atol=0)
        np.testing.assert_allclose(got["se"], want["se"], rtol=RTOL, atol=0)


@pytest.mark.parametrize("mse", [True, False], ids=["mse", "mean"])
@pytest.mark.parametrize("case", list(CASES))
def test_replicate_designs_equal_r(case, mse, expected):
    name, kw = CASES[case]
    d = SurveyDesign(_data(name), "pw", mse=mse, **kw)
    _assert_equal_r(d, expected[expected["case"] == f"{case}_{'mse' if mse else 'mean'}"])


@pytest.mark.parametrize("mse", [True, False], ids=["mse", "mean"])
def test_jkn_without_strata_with_rscales_equals_r(mse, expected):
    """R's svrepdesign(type="JKn", rscales=): the producer's rscales, no strata needed."""
    d = SurveyDesign(
        _data("apistrat"), "pw", replicate_weights="jkn_*", method="jkn",
        rscales=_jkn_rscales(), mse=mse,
    )  # fmt: skip
    _assert_equal_r(d, expected[expected["case"] == f"jkn_strat_{'mse' if mse else 'mean'}"])
    # the rscales derived from the declared strata are R's
    derived = SurveyDesign(_data("apistrat"), "pw", **CASES["jkn_strat"][1]).rscales
    np.testing.assert_allclose(derived, _jkn_rscales(), rtol=1e-15)


def test_jkn_without_strata_is_refused_naming_the_fix():
    """Replicates made with strata (other strata's PSUs unchanged) and no strata declared:
    one stratum would be assumed ((G-1)/G instead of (n_h-1)/n_h); R asks for rscales."""
    with pytest.raises(DesignError) as e:
        SurveyDesign(_data("apistrat"), "pw", replicate_weights="jkn_*", method="jkn")
    msg = str(e.value)
    for fix in ("design.strata", "design.replicate_weights.rscales", "jk1"):
        assert fix in msg
    with pytest.raises(DesignError, match="design.strata"):  # declaring the PSU is not enough
        SurveyDesign(_data("apistrat"), "pw", psu="grp", replicate_weights="jkn_*", method="jkn")


def test_one_stratum_jkn_keeps_its_scale(expected):
    """JKn replicates of a single stratum (every other PSU times G/(G-1): R's JK1) need no
    strata: their scale (G-1)/G is R's JK1 scale."""
    df = _data("apiclus1")
    for mse, tag in ((True, "mse"), (False, "mean")):
        d = SurveyDesign(df, "pw", psu="dnum", replicate_weights="jk1_*", method="jkn", mse=mse)
        np.testing.assert_allclose(d.rscales, np.full(15, 14 / 15), rtol=1e-15)
        _assert_equal_r(d, expected[expected["case"] == f"jk1_clus1_{tag}"])


def test_bootstrap_scales_by_convention():
    df = _data("apiclus1")
    kw = {"psu": "dnum", "replicate_weights": "cd_*", "method": "bootstrap"}

    def scale(**more) -> float:
        c = SurveyDesign(df, "pw", **kw, **more).rscales
        assert np.all(c == c[0]) and len(c) == R
        return float(c[0])

    assert scale() == 1 / R  # not declared: 1/R, as before the conventions were named
    assert scale(bootstrap="rao-wu") == 1 / (R - 1)  # R's svrepdesign(type="bootstrap")
    assert scale(bootstrap="canty-davison") == pytest.approx(15 / (14 * (R - 1)), rel=1e-15)
    assert scale(scale=0.5, rscales=np.full(R, 0.1)) == pytest.approx(0.05, rel=1e-15)
    strat = _data("apistrat")  # Canty-Davison's nbar: the harmonic mean of n_h (100, 50, 50)
    c = SurveyDesign(strat, "pw", strata="stype", **BOOT, bootstrap="canty-davison").rscales
    nbar = 1 / np.mean([1 / 100, 1 / 50, 1 / 50])
    np.testing.assert_allclose(c, nbar / ((nbar - 1) * (R - 1)), rtol=1e-15)


@pytest.mark.parametrize(
    "kw, match",
    [
        ({"method": "jk1", "bootstrap": "rao-wu"}, "bootstrap replicates"),
        ({"method": "bootstrap", "bootstrap": "efron"}, "rao-wu"),
        ({"method": "bootstrap", "bootstrap": "rao-wu", "scale": 0.1}, "not both"),
        ({"method": "brr", "scale": 0.1}, "fixed by the method"),
        ({"method": "bootstrap", "scale": -1.0}, "> 0"),
        ({"method": "bootstrap", "rscales": [0.1] * 3}, "one per replicate"),
    ],
)
def test_bad_replicate_options_are_refused(kw, match):
    with pytest.raises(DesignError, match=match):
        SurveyDesign(_data("apiclus1"), "pw", psu="dnum", replicate_weights="cd_*", **kw)


def test_replicate_options_need_replicate_weights():
    with pytest.raises(DesignError, match="replicate weight columns"):
        SurveyDesign(_data("apiclus1"), "pw", bootstrap="rao-wu")


def test_canty_davison_needs_several_psus_per_stratum():
    df = _data("apiclus1")
    with pytest.raises(DesignError, match="harmonic mean"):
        SurveyDesign(
            df, "pw", strata="dnum", psu="dnum", replicate_weights="cd_*", method="bootstrap",
            bootstrap="canty-davison",
        )  # fmt: skip


def test_mse_false_centres_on_the_replicates_with_positive_rscales():
    """R's svrVar: the centre is the mean of the replicates whose rscales are > 0."""
    df = _data("apiclus1")
    rs = np.full(R, 0.02)
    rs[:5] = 0.0
    d = SurveyDesign(df, "pw", replicate_weights="cd_*", method="bootstrap", rscales=rs, mse=False)
    W = df.filter(like="cd_").to_numpy()
    y = df["api00"].to_numpy()
    theta_r = (W.T @ y) / W.sum(axis=0)
    centre = theta_r[5:].mean()
    se = np.sqrt(np.sum(rs * (theta_r - centre) ** 2))
    assert d.mean("api00")["se"].iloc[0] == pytest.approx(se, rel=1e-12)
    assert d.replicate_se(np.array([0.0]), theta_r[:, None])[0] == pytest.approx(se, rel=1e-12)


def test_quantile_refuses_mse_false_replicates():
    d = SurveyDesign(
        _data("apiclus1"), "pw", replicate_weights="cd_*", method="bootstrap", mse=False
    )
    with pytest.raises(DesignError, match="mse"):
        d.quantile("api00", 0.5)
    assert np.isfinite(d.quantile("api00", 0.5, variance="taylor")["se"]).all()


@pytest.mark.parametrize("mse", [True, False], ids=["mse", "mean"])
def test_spec_replicate_section_equals_r(mse, expected):
    """design.replicate_weights: {bootstrap: canty-davison, mse: ...} through from_spec."""
    section = DesignSection(
        weight="pw",
        strata="stype",
        replicate_weights={
            "columns": "cd_*", "method": "bootstrap", "bootstrap": "canty-davison", "mse": mse,
        },
    )  # fmt: skip
    d = SurveyDesign.from_spec(_data("apistrat"), section)
    _assert_equal_r(d, expected[expected["case"] == f"cd_strat_{'mse' if mse else 'mean'}"])
    jkn = DesignSection(
        weight="pw",
        replicate_weights={"columns": "jkn_*", "method": "jkn", "rscales": _jkn_rscales().tolist()},
    )
    d = SurveyDesign.from_spec(_data("apistrat"), jkn)
    _assert_equal_r(d, expected[expected["case"] == "jkn_strat_mse"])
    scaled = DesignSection(
        weight="pw",
        replicate_weights={"columns": "cd_*", "method": "bootstrap", "scale": 0.03, "mse": mse},
    )
    d = SurveyDesign.from_spec(_data("apistrat"), scaled)
    _assert_equal_r(d, expected[expected["case"] == f"boot_scale_{'mse' if mse else 'mean'}"])


def test_spec_replicate_section_defaults_and_checks():
    rs = ReplicateSpec(columns="rw_*", method="bootstrap")
    assert rs.bootstrap is None and rs.scale is None and rs.rscales is None and rs.mse is True
    bad = [
        {"method": "jkn", "bootstrap": "rao-wu"},
        {"method": "bootstrap", "bootstrap": "canty-davison", "scale": 0.1},
        {"method": "brr", "scale": 0.1},
        {"method": "bootstrap", "scale": 0.0},
        {"method": "bootstrap", "bootstrap": "efron"},
        {"method": "jkn", "rscales": [0.5, -1.0]},
    ]
    for kw in bad:
        with pytest.raises(ValidationError):
            ReplicateSpec(columns="rw_*", **kw)
