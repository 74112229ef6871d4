"""Unweighted (equal-probability) files: SurveyDesign(df, weight=None), the spec's
`design: {weight: null}` (or `unweighted: true`) and the weight column of ones that reading
the input adds (issue 34 item 5).

Against a closed form (an SRS with replacement: the SE of a mean is s/sqrt(n)) and against R
survey 4.1.1's svydesign without weights ("No weights or probabilities supplied, assuming
equal probability"): tests/fixtures/r_replicates/expected.csv, cases unweighted_*, from
make_fixture.R there.
"""

import copy
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from helpers import MINI_SPEC
from pydantic import ValidationError

from sdl_design.io import read_input, type_input
from sdl_design.spec import DesignSection, SpecError, parse_spec
from sdl_design.survey.design import UNIT_WEIGHT, SurveyDesign

FIX = Path(__file__).parent / "fixtures" / "r_replicates"
RTOL = 1e-10

# R case -> SurveyDesign keywords besides df and weight=None
R_CASES = {
    "unweighted_srs": {},
    "unweighted_strat": {"strata": "stype"},
    "unweighted_clus": {"strata": "stype", "psu": "dnum"},
}


@pytest.fixture(scope="module")
def apistrat() -> pd.DataFrame:
    return pd.read_csv(FIX / "apistrat.csv")


@pytest.fixture(scope="module")
def expected() -> pd.DataFrame:
    return pd.read_csv(FIX / "expected.csv")


def test_srs_mean_se_is_s_over_root_n(apistrat):
    d = SurveyDesign(apistrat, None)
    assert d.weight is None and (d.w == 1.0).all()
    y = apistrat["api00"].to_numpy(dtype=float)
    n, s = len(y), y.std(ddof=1)
    m = d.mean("api00").iloc[0]
    assert m["estimate"] == pytest.approx(y.mean(), rel=1e-14)
    assert m["se"] == pytest.approx(s / np.sqrt(n), rel=1e-12)
    assert m["deff"] == pytest.approx(1.0, rel=1e-12)  # Kish's deff of an SRS
    t = d.total("api00").iloc[0]
    assert t["estimate"] == pytest.approx(y.sum(), rel=1e-14)
    assert t["se"] == pytest.approx(np.sqrt(n) * s, rel=1e-12)


@pytest.mark.parametrize("case", list(R_CASES))
def test_unweighted_designs_equal_r(case, apistrat, expected):
    d = SurveyDesign(apistrat, None, **R_CASES[case])
    rows = expected[expected["case"] == case]
    assert len(rows) == 6
    for estimator, want in rows.groupby("estimator"):
        if estimator == "mean_by":
            got = d.mean("api00", by="sch.wide")
            got.index = [f"api00[sch.wide={level}]" for _, level in got.index]
        else:
            got = getattr(d, estimator)(["api00", "enroll"])
        got = got.loc[want["variable"]]
        np.testing.assert_allclose(got["estimate"], want["estimate"], rtol=RTOL, atol=0)
        np.testing.assert_allclose(got["se"], want["se"], rtol=RTOL, atol=0)


def test_no_weight_equals_a_weight_of_ones(apistrat):
    ones = pd.concat([apistrat, pd.Series(1.0, apistrat.index, name="one")], axis=1)
    for kw in R_CASES.values():
        a = SurveyDesign(apistrat, None, **kw).mean(["api00", "enroll"], by="stype")
        b = SurveyDesign(ones, "one", **kw).mean(["api00", "enroll"], by="stype")
        pd.testing.assert_frame_equal(a, b)


# ---------------------------------------------------------------- the spec


def test_weight_null_and_unweighted_true_name_the_unit_weight():
    for section in (DesignSection(weight=None), DesignSection(unweighted=True)):
        assert section.weight == UNIT_WEIGHT and section.unweighted
        assert section.weights_normalised  # the weights sum to the sample size
        again = DesignSection(**section.model_dump())  # the spec as written out and read back
        assert again.weight == UNIT_WEIGHT and again.unweighted
    assert not DesignSection(weight="w").unweighted
    both = DesignSection(weight=None, unweighted=True, strata="h", psu="p")
    assert both.unweighted and both.strata == "h"


@pytest.mark.parametrize(
    "section, match",
    [
        ({"strata": "h"}, "weight: null"),
        ({"weight": "w", "unweighted": True}, "not both"),
        ({"weight": None, "unweighted": False}, "unweighted: false"),
        ({"weight": None, "weights_normalised": False}, "weights_normalised"),
        ({"unweighted": "yes"}, "true or false"),
    ],
)
def test_contradictory_weight_declarations_are_refused(section, match):
    with pytest.raises(ValidationError, match=match):
        DesignSection(**section)


def _frame(n: int = 12) -> pd.DataFrame:
    rng = np.random.default_rng(1)
    return pd.DataFrame(
        {
            "id": [f"r{i}" for i in range(n)],
            "age": rng.integers(0, 90, n),
            "sex": rng.choice(["f", "m"], n),
            "dia": rng.integers(0, 2, n),
            "inc": rng.uniform(0, 1e5, n),
        }
    )


def _spec(tmp_path: Path, design: dict, fmt: str = "parquet") -> object:
    df = _frame()
    path = tmp_path / f"in.{fmt}"
    df.to_parquet(path) if fmt == "parquet" else df.to_csv(path, index=False)
    data = copy.deepcopy(MINI_SPEC)
    data["design"] = design
    data["release"]["input"] = str(path)
    return parse_spec(data)


@pytest.mark.parametrize("fmt", ["parquet", "csv"])
@pytest.mark.parametrize("design", [{"weight": None}, {"unweighted": True}])
def test_reading_an_unweighted_input_adds_the_weight_of_ones(tmp_path, design, fmt):
    spec = _spec(tmp_path, design, fmt)
    df, _ = read_input(spec)
    assert spec.design.weight == UNIT_WEIGHT and (df[UNIT_WEIGHT] == 1.0).all()
    assert df[UNIT_WEIGHT].dtype == np.float64
    spec.check_data(df)  # the spec's checks accept the file with its weight
    assert spec.classification(list(df.columns))[UNIT_WEIGHT] == "weight"
    d = SurveyDesign.from_spec(df, spec.design)
    y = df["inc"].to_numpy()
    se = y.std(ddof=1) / np.sqrt(len(y))
    assert d.mean("inc")["se"].iloc[0] == pytest.approx(se, rel=1e-12)
    # typing the frame again (a partition, a stage's file) keeps the column as it is
    assert type_input(df, spec, text=False) is df


def test_a_weighted_input_gets_no_weight_column(tmp_path):
    df = _frame().assign(w=2.0)
    data = copy.deepcopy(MINI_SPEC)
    data["design"] = {"weight": "w"}
    spec = parse_spec(data)
    assert UNIT_WEIGHT not in type_input(df, spec, text=False).columns


def test_an_input_with_its_own_unit_weight_column_is_refused(tmp_path):
    spec = _spec(tmp_path, {"weight": None})
    df = _frame().assign(**{UNIT_WEIGHT: 2.0})
    with pytest.raises(SpecError, match="rename that column"):
        type_input(df, spec, text=False)
