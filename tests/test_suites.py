"""Great Expectations suites: counts agree with plain pandas, failures name the check and the size."""

import numpy as np
import pandas as pd
import pytest

from expectations.suites import (
    GateFailed,
    validate_edits,
    validate_metric_gates,
    validate_output,
)
from sdl_design.spec import parse_spec

SPEC = {
    "release": {"name": "mini", "year": 2026, "seed": 7},
    "design": {"weight": "w", "strata": "h", "psu": "p", "segment": "seg"},
    "variables": {"direct_identifiers": ["id"], "keys": ["age", "sex"], "study": ["inc"]},
    "edits": [
        {"rule": "between", "column": "age", "min": 0, "max": 90},
        {"rule": "in_set", "column": "marital", "values": ["never"], "when": "age < 15"},
        {"rule": "in_set", "column": "preg", "values": [0], "when": "sex == 'm' and age >= 12"},
        {"rule": "compare", "column_a": "inc", "op": ">=", "column_b": "wage"},
        {"rule": "not_null", "column": "sex"},
    ],
}


@pytest.fixture(scope="module")
def data():
    rng = np.random.default_rng(3)
    n = 400
    df = pd.DataFrame(
        {
            "id": [f"r{i}" for i in range(n)],
            "w": rng.uniform(1, 5, n),
            "h": rng.integers(1, 4, n),
            "p": rng.integers(1, 3, n),
            "seg": rng.integers(1, 50, n),
            "age": rng.integers(-3, 95, n),
            "sex": rng.choice(["f", "m", None], n, p=[0.49, 0.49, 0.02]),
            "marital": rng.choice(["never", "married"], n),
            "preg": rng.integers(0, 2, n),
            "inc": rng.uniform(0, 10, n),
            "wage": rng.uniform(0, 10, n),
        }
    )
    return df


def brute_force_counts(df):
    return [
        int((~df.age.between(0, 90)).sum()),
        int(((df.age < 15) & (df.marital != "never")).sum()),
        int(((df.sex == "m") & (df.age >= 12) & (df.preg != 0)).sum()),
        int((~(df.inc >= df.wage)).sum()),
        int(df.sex.isna().sum()),
    ]


def test_edit_counts_match_pandas(data):
    spec = parse_spec(SPEC)
    res = validate_edits(data, spec.edits, "id")
    assert res["value"].astype(int).tolist() == brute_force_counts(data)
    assert not res["passed"].any()
    first = res.iloc[0]
    bad_ids = set(data.loc[~data.age.between(0, 90), "id"])
    assert "records fail (e.g. id [" in first.detail
    shown = first.detail.split("[", 1)[1].rstrip("])").replace("'", "").split(", ")
    assert set(shown) <= bad_ids and len(shown) == min(5, len(bad_ids))


def test_edits_pass_on_clean_data(data):
    clean = data[data.age.between(0, 90) & data.sex.notna()].copy()
    clean.loc[clean.age < 15, "marital"] = "never"
    clean.loc[(clean.sex == "m") & (clean.age >= 12), "preg"] = 0
    clean["wage"] = clean["inc"] / 2
    res = validate_edits(clean, parse_spec(SPEC).edits, "id")
    assert res["passed"].all() and (res["value"] == 0).all()


def test_metric_gates_say_by_how_much():
    res = validate_metric_gates(
        [
            {"name": "massc.delta", "value": 0.31, "lower": None, "upper": 0.25},
            {"name": "swap.se_ratio_median", "value": 0.95, "lower": 0.8, "upper": 1.25},
            {"name": "swap.se_ratio_p10", "value": 0.7, "lower": 0.8, "upper": 1.25},
            {"name": "prb.max_risk", "value": float("nan"), "lower": None, "upper": 0.395},
        ]
    ).set_index("name")
    assert res["passed"].tolist() == [False, True, False, False]
    assert res.loc["massc.delta", "detail"] == "0.31 is above 0.25 by 0.06"
    assert res.loc["swap.se_ratio_p10", "detail"] == "0.7 is below 0.8 by 0.1"
    assert res.loc["swap.se_ratio_median", "threshold"] == "[0.8, 1.25]"
    # the suite's exception lists the failed checks, each with its detail
    assert str(GateFailed("gates", res.reset_index())).splitlines() == [
        "gates: 3 of 4 checks failed",
        "  - massc.delta: 0.31 is above 0.25 by 0.06",
        "  - swap.se_ratio_p10: 0.7 is below 0.8 by 0.1",
        "  - prb.max_risk: metric is missing",
    ]


def test_output_gates(data):
    spec = parse_spec(SPEC)
    clean = data[data.age.between(0, 90) & data.sex.notna()].copy()
    clean.loc[clean.age < 15, "marital"] = "never"
    clean.loc[(clean.sex == "m") & (clean.age >= 12), "preg"] = 0
    clean["wage"] = 0.0
    puf = clean.drop(columns=["id", "seg", "h", "p"])
    ok = validate_output(puf, spec, [], masked_design=False)
    assert ok["passed"].all(), ok[~ok.passed]
    # identifiers, original design labels, an internal column and a zero weight are all caught
    bad = clean.drop(columns=["seg"]).assign(__block=1)
    bad.iloc[0, bad.columns.get_loc("w")] = 0.0
    res = validate_output(bad, spec, [], masked_design=False).set_index("name")
    cols = res.loc["output: no direct identifiers, original design labels or internal columns"]
    assert not cols.passed and cols.value == 4  # id, h, p, __block
    assert "['__block', 'h', 'id', 'p']" in cols.detail
    assert res.loc["output: weight w positive", "value"] == 1
    # the same verdicts from counts (a public file written by partition): output_verdicts of
    # record_failures and rule_failures on two halves, combined
    from expectations.suites import output_verdicts, record_failures
    from sdl_design.edits import combine_rule_failures, rule_failures

    bad.iloc[1, bad.columns.get_loc("w")] = np.nan
    bad.iloc[2, bad.columns.get_loc("age")] = 120  # an edit rule broken
    want = validate_output(bad, spec, [], masked_design=False)
    halves = [(bad.iloc[:50], np.arange(50)), (bad.iloc[50:], np.arange(50, len(bad)))]
    got = output_verdicts(
        list(bad.columns), spec, [], False,
        combine_rule_failures([record_failures(h, spec, [], i) for h, i in halves]),
        combine_rule_failures([rule_failures(h, spec.edits, i) for h, i in halves]),
    )  # fmt: skip
    assert got["name"].tolist() == want["name"].tolist()
    assert got["passed"].tolist() == want["passed"].tolist()
    assert got["value"].tolist() == want["value"].tolist()
    assert (~got["passed"]).sum() == 4  # columns, weight positive, weight missing, the edit
    # with a masked design the pseudo labels must be there
    res = validate_output(puf, spec, [], masked_design=True).set_index("name")
    req = res.loc[res.index.str.contains("columns present")].iloc[0]
    assert not req.passed and req.value == 2 and "['h', 'p']" in req.detail  # strata, PSU


def test_replicate_min_check_counts_records_with_a_negative_replicate_weight(data):
    """The output's replicate-weight check: a record fails when its smallest replicate weight,
    missing ones skipped, is below 0 (pandas' min(axis=1), brute force); a record whose
    replicate weights are all missing or -0.0 passes. Whole file (GX) and by halves
    (record_failures) count the same records."""
    from expectations.suites import _row_min, output_verdicts, record_failures
    from sdl_design.edits import combine_rule_failures, rule_failures

    spec = parse_spec(SPEC)
    clean = data[data.age.between(0, 90) & data.sex.notna()].copy()
    clean.loc[clean.age < 15, "marital"] = "never"
    clean.loc[(clean.sex == "m") & (clean.age >= 12), "preg"] = 0
    puf = clean.drop(columns=["id", "seg", "h", "p"]).reset_index(drop=True)
    rng = np.random.default_rng(3)
    reps = [f"rw{i}" for i in range(6)]
    R = rng.uniform(0.0, 3.0, (len(puf), len(reps)))
    R[rng.random(R.shape) < 0.1] = np.nan
    R[3] = np.nan  # every replicate missing: no smallest value
    R[4, 0] = -0.0
    R[[5, 9, 11], rng.integers(0, len(reps), 3)] = [-1.0, -0.5, -2.0]
    puf = pd.concat([puf, pd.DataFrame(R, columns=reps)], axis=1)
    want_min = puf[reps].min(axis=1).to_numpy()
    np.testing.assert_array_equal(_row_min(puf, reps), want_min)
    want = validate_output(puf, spec, reps, masked_design=False)
    label = [n for n in want["name"] if n.startswith("output: replicate weights")][0]
    assert want.set_index("name").loc[label, "value"] == 3 == (want_min < 0).sum()
    halves = [(puf.iloc[:50], np.arange(50)), (puf.iloc[50:], np.arange(50, len(puf)))]
    got = output_verdicts(
        list(puf.columns), spec, reps, False,
        combine_rule_failures([record_failures(h, spec, reps, i) for h, i in halves]),
        combine_rule_failures([rule_failures(h, spec.edits, i) for h, i in halves]),
    )  # fmt: skip
    assert got.set_index("name").loc[label, "value"] == 3
    assert got["passed"].tolist() == want["passed"].tolist()
