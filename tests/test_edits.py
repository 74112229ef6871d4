"""Edit rules: each rule's violations on hand-counted records, the GX suite agrees with them,
EditFailure names rule and count, and the CLI turns a broken edit into exit code 1."""

import pickle
import subprocess
import sys

import numpy as np
import pandas as pd
import pytest
import yaml
from pydantic import TypeAdapter

from expectations.suites import validate_edits
from flows.cli import main as puf
from sdl_design.edits import (
    DEFAULT_HINT,
    EditFailure,
    EditRule,
    check_edits,
    edit_failures,
    failing_rows,
    failure_counts,
)
from sdl_design.spec import CalibrationSpec, KeySpec, parse_spec


def rules(*specs):
    return TypeAdapter(list[EditRule]).validate_python(list(specs))


@pytest.fixture
def hand():
    """Eight records with missing values in every column; labels r0..r7."""
    return pd.DataFrame(
        {
            "age": [-1, 0, 14, 15, 90, 91, np.nan, 12],
            "sex": ["m", "f", "m", None, "f", "m", "f", np.nan],
            "marital": [
                "never",
                "married",
                "married",
                "never",
                None,
                "married",
                "never",
                "married",
            ],
            "inc": [1.0, 2.0, np.nan, 4.0, 5.0, 0.0, 7.0, 8.0],
            "wage": [0.5, 3.0, 1.0, np.nan, 5.0, 1.0, 6.0, 2.0],
        },
        index=[f"r{i}" for i in range(8)],
    )


# (rule, label, failing records counted by hand)
HAND = [
    # a missing age passes (missing-value policy) unless the rule says missing: fail
    ({"rule": "between", "column": "age", "min": 0, "max": 90}, "age between 0 and 90", "r0 r5"),
    ({"rule": "between", "column": "age", "min": 15}, "age >= 15", "r0 r1 r2 r7"),
    ({"rule": "between", "column": "age", "max": 14}, "age <= 14", "r3 r4 r5"),
    # a missing age never satisfies 'age < 15'
    (
        {"rule": "in_set", "column": "marital", "values": ["never"], "when": "age < 15"},
        "marital in ['never'] when age < 15",
        "r1 r2 r7",
    ),
    # a missing value passes; with missing: fail it is not in the set
    (
        {"rule": "in_set", "column": "marital", "values": ["never", "married"]},
        "marital in ['never', 'married']",
        "",
    ),
    # and + in: sex == 'm' holds for r0 r2 r5, age in [14, 91, 12] for r2 r5 r7
    (
        {
            "rule": "in_set",
            "column": "marital",
            "values": ["never"],
            "when": "sex == 'm' and age in [14, 91, 12]",
        },
        "marital in ['never'] when sex == 'm' and age in [14, 91, 12]",
        "r2 r5",
    ),
    # a missing sex satisfies "sex != 'f'" (r3, r7)
    (
        {"rule": "in_set", "column": "marital", "values": ["never"], "when": "sex != 'f'"},
        "marital in ['never'] when sex != 'f'",
        "r2 r5 r7",
    ),
    ({"rule": "not_null", "column": "marital"}, "marital not null", "r4"),
    (
        {"rule": "not_null", "column": "marital", "when": "age > 90"},
        "marital not null when age > 90",
        "",
    ),
    # a missing value on either side passes (r2 r3)
    (
        {"rule": "compare", "column_a": "inc", "op": ">=", "column_b": "wage"},
        "inc >= wage",
        "r1 r5",
    ),
    (
        {"rule": "compare", "column_a": "inc", "op": ">", "column_b": "wage", "when": "age <= 14"},
        "inc > wage when age <= 14",
        "r1",
    ),
    ({"rule": "compare", "column_a": "inc", "op": "!=", "column_b": "wage"}, "inc != wage", "r4"),
    # missing: fail (the rule says so): the missing records break it too
    (
        {"rule": "between", "column": "age", "min": 0, "max": 90, "missing": "fail"},
        "age between 0 and 90",
        "r0 r5 r6",
    ),
    (
        {"rule": "in_set", "column": "marital", "values": ["never", "married"], "missing": "fail"},
        "marital in ['never', 'married']",
        "r4",
    ),
    (
        {"rule": "compare", "column_a": "inc", "op": ">=", "column_b": "wage", "missing": "fail"},
        "inc >= wage",
        "r1 r2 r3 r5",
    ),
    (
        {"rule": "compare", "column_a": "inc", "op": "!=", "column_b": "wage", "missing": "fail"},
        "inc != wage",
        "r2 r3 r4",
    ),
]


@pytest.mark.parametrize("i", range(len(HAND)))
def test_violations_hand_counted(hand, i):
    spec, text, expected = HAND[i]
    (rule,) = rules(spec)
    bad = rule.violations(hand)
    assert bad.dtype == bool and bad.index.equals(hand.index)
    assert list(bad.index[bad]) == expected.split()
    assert rule.label(i) == f"edit[{i}] {text}"


def test_columns_checked_first(hand):
    between, compare = rules(HAND[0][0], HAND[10][0])
    assert between.columns() == ["age"]
    assert compare.columns() == ["inc", "wage", "age"]
    (both,) = rules(HAND[5][0])
    assert both.columns() == ["marital", "sex", "age"]


def test_compare_nullable_integers():
    df = pd.DataFrame(
        {
            "a": pd.array([1, pd.NA, 3, 4], dtype="Int64"),
            "b": pd.array([1, 1, pd.NA, 5], dtype="Int64"),
        }
    )
    (rule,) = rules({"rule": "compare", "column_a": "a", "op": "==", "column_b": "b"})
    assert rule.violations(df).tolist() == [False, False, False, True]
    (strict,) = rules(
        {"rule": "compare", "column_a": "a", "op": "==", "column_b": "b", "missing": "fail"}
    )
    assert strict.violations(df).tolist() == [False, True, True, True]


def test_expectation_descriptions():
    exps = [r.expectation() for r in rules(*(h[0] for h in HAND))]
    assert [e.kind for e in exps] == ["between"] * 3 + ["in_set"] * 4 + ["not_null"] * 2 + [
        "true"
    ] * 3 + ["between", "in_set", "true", "true"]
    assert exps[0].kwargs == {"min_value": 0, "max_value": 90} and not exps[0].missing_breaks
    assert exps[5].when == [("sex", "==", "m"), ("age", "in", [14, 91, 12])]
    assert exps[3].kwargs == {"value_set": ["never"]} and not exps[3].missing_breaks
    assert not exps[7].missing_breaks and exps[7].derived is None  # GX not_null counts them
    assert exps[12].missing_breaks and exps[13].missing_breaks  # missing: fail
    assert exps[9].column is None and exps[9].derived is not None


def test_sdl_design_does_not_import_gx():
    code = (
        "import sys, sdl_design.spec, sdl_design.edits; "
        "assert 'great_expectations' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


# ---------------------------------------------------------------- GX suite agrees


MANY = [
    {"rule": "between", "column": "age", "min": 0, "max": 90},
    {"rule": "between", "column": "inc", "min": 0},
    {"rule": "between", "column": "wage", "max": 8, "when": "sex == 'f'"},
    {
        "rule": "between",
        "column": "age",
        "min": 18,
        "max": 65,
        "when": "emp in [1, 2] and age >= 10",
    },
    {"rule": "in_set", "column": "marital", "values": ["never"], "when": "age < 15"},
    {"rule": "in_set", "column": "marital", "values": ["never", "married", "widowed"]},
    {"rule": "in_set", "column": "emp", "values": [0], "when": "age <= 14"},
    {"rule": "in_set", "column": "sex", "values": ["f", "m"]},
    {"rule": "in_set", "column": "preg", "values": [0], "when": "sex != 'f' and age > 11"},
    {"rule": "not_null", "column": "sex"},
    {"rule": "not_null", "column": "inc", "when": "age > 17"},
    {"rule": "compare", "column_a": "inc", "op": ">=", "column_b": "wage"},
    {
        "rule": "compare",
        "column_a": "wage",
        "op": "<",
        "column_b": "inc",
        "when": "marital == 'married'",
    },
    {"rule": "compare", "column_a": "age", "op": ">", "column_b": "hh", "when": "emp == 1"},
    {"rule": "compare", "column_a": "inc", "op": "!=", "column_b": "wage"},
    {"rule": "between", "column": "inc", "min": 0, "missing": "fail"},
    {"rule": "in_set", "column": "sex", "values": ["f", "m"], "missing": "fail"},
    {"rule": "compare", "column_a": "inc", "op": ">=", "column_b": "wage", "missing": "fail"},
    {"rule": "in_set", "column": "emp", "values": [0, 1, 2, 3]},  # holds
]


def random_frame(n=3000, seed=11):
    rng = np.random.default_rng(seed)

    def holes(x, p):
        x = pd.Series(x, dtype=object if isinstance(x[0], str) else float)
        x[rng.random(n) < p] = np.nan if x.dtype == float else None
        return x

    df = pd.DataFrame(
        {
            "id": [f"p{i}" for i in range(n)],
            "age": holes(rng.integers(-2, 95, n), 0.03),
            "sex": holes(rng.choice(["f", "m", "x"], n, p=[0.49, 0.49, 0.02]), 0.02),
            "marital": holes(rng.choice(["never", "married", "widowed", "other"], n), 0.02),
            "emp": rng.integers(0, 4, n),
            "preg": rng.integers(0, 2, n),
            "hh": rng.integers(1, 8, n),
            "inc": holes(rng.normal(5, 3, n), 0.04),
            "wage": holes(rng.uniform(0, 10, n), 0.04),
        }
    )
    same = rng.random(n) < 0.02  # ties for '!=' (and '>=' holds there)
    df.loc[same, "wage"] = df.loc[same, "inc"]
    return df


def test_gx_suite_agrees_with_violations():
    df = random_frame()
    rs = rules(*MANY)
    res = validate_edits(df, rs, "id")  # raises when GX and violations() disagree
    counts = [int(r.violations(df).sum()) for r in rs]
    assert res["value"].astype(int).tolist() == counts
    assert all(c > 0 for c in counts[:-1]) and counts[-1] == 0  # the test has teeth
    assert res["passed"].tolist() == [c == 0 for c in counts]
    assert res["name"].tolist() == [r.label(i) for i, r in enumerate(rs)]
    for r, rule, row in zip(res.itertuples(), rs, range(len(rs)), strict=True):
        bad = rule.violations(df)
        if bad.any():
            first = df.loc[bad, "id"].head(5).tolist()
            assert r.detail == f"{int(bad.sum())} records fail (e.g. id {first})", row
        else:
            assert r.detail == "holds"
    # without an id column the examples are row numbers, counted from 1
    res = validate_edits(df.drop(columns="id"), rs[:1])
    bad = np.flatnonzero(rs[0].violations(df)) + 1
    assert res.detail[0] == f"{len(bad)} records fail (e.g. row {bad[:5].tolist()})"


def test_rule_that_cannot_be_evaluated_fails_with_the_reason():
    df = random_frame(n=300)
    res = validate_edits(df.drop(columns="sex"), rules(MANY[7], MANY[0]), "id")
    assert res["passed"].tolist() == [False, not rules(MANY[0])[0].violations(df).any()]
    assert res.detail[0].startswith("could not be evaluated: KeyError") and "sex" in res.detail[0]
    assert res["value"][0] == 0.0


# ---------------------------------------------------------------- EditFailure


def test_check_edits_names_rules_and_counts(hand):
    rs = rules(HAND[0][0], HAND[1][0], HAND[3][0], {"rule": "not_null", "column": "sex"})
    with pytest.raises(EditFailure) as ei:
        check_edits(hand, rs, "PRB output")
    err = ei.value
    assert isinstance(err, RuntimeError)
    assert str(err) == (
        "PRB output breaks edit rules: edits[0] age between 0 and 90 (2 records); "
        "edits[1] age >= 15 (4 records); edits[2] marital in ['never'] when age < 15 (3 records); "
        f"edits[3] sex not null (2 records): {DEFAULT_HINT}"
    )
    t = err.table
    assert t["rule"].tolist() == [0, 1, 2, 3]
    assert t["column"].tolist() == ["age", "age", "marital", "sex"]
    assert t["count"].tolist() == [2, 4, 3, 2]
    assert t["label"][2] == "edit[2] marital in ['never'] when age < 15"
    # up to five example row labels, in file order
    assert t["examples"].tolist() == [
        ["r0", "r5"],
        ["r0", "r1", "r2", "r7"],
        ["r1", "r2", "r7"],
        ["r3", "r7"],
    ]
    back = pickle.loads(pickle.dumps(err))  # crosses Dask workers intact
    assert str(back) == str(err) and back.table.equals(t)
    # the same failures, one row per record, through the older helpers
    rows = failing_rows(hand, rs)
    assert (
        rows.groupby("rule").size().to_dict()
        == failure_counts(hand, rs)
        == {0: 2, 1: 4, 2: 3, 3: 2}
    )
    assert rows.loc[rows.rule == 3, "row"].tolist() == ["r3", "r7"]


def test_check_edits_caps_examples_and_passes_clean_data(hand):
    df = pd.DataFrame({"age": np.arange(100, 120)}, index=np.arange(20) * 10)
    (rule,) = rules(HAND[0][0])
    table = edit_failures(df, [rule])
    assert table["count"].tolist() == [20] and table["examples"][0] == [0, 10, 20, 30, 40]
    with pytest.raises(
        EditFailure, match=r"^MASSC output breaks edit rules: edits\[0\] .* \(20 records\): fix"
    ):
        check_edits(df, [rule], "MASSC output", hint="fix")
    check_edits(hand.loc[["r1", "r2", "r3", "r4"]], [rule], "PRB output")  # no failure: no raise
    assert failing_rows(hand.iloc[:0], [rule]).empty and failure_counts(hand.iloc[:0], [rule]) == {}


# ---------------------------------------------------------------- spec


def test_key_lists_take_names_or_mappings():
    keys = [{"name": "age", "bins": [0, 18, 65]}, "sex"]
    expected = [KeySpec(name="age", bins=[0, 18, 65]), KeySpec(name="sex")]
    cal = CalibrationSpec(method="raking", controls=keys)
    spec = parse_spec(
        {
            "release": {"name": "m", "year": 2026, "seed": 1},
            "design": {"weight": "w", "strata": "h", "psu": "p"},
            "variables": {"keys": keys},
            "edits": [HAND[5][0]],
        }
    )
    assert cal.controls == expected and spec.variables.keys == expected
    assert spec.edits[0].violations  # the spec's edits are the rule models of sdl_design.edits


# ---------------------------------------------------------------- CLI


def tiny_spec(tmp_path, n=40, broken=3):
    """A small survey whose first `broken` children are married, and a spec with edits on it."""
    rng = np.random.default_rng(5)
    df = pd.DataFrame(
        {
            "id": [f"q{i}" for i in range(n)],
            "w": rng.uniform(1, 3, n),
            "h": np.repeat([1, 2], n // 2),
            "p": np.tile([1, 2], n // 2),
            "age": rng.integers(0, 90, n),
            "sex": rng.choice(["f", "m"], n),
        }
    )
    df["marital"] = np.where(df.age < 15, "never", "married")
    kids = df.index[df.age < 15][:broken]
    df.loc[kids, "marital"] = "married"
    df.to_parquet(tmp_path / "tiny.parquet", index=False)
    spec = {
        "release": {
            "name": "tiny",
            "year": 2026,
            "seed": 3,
            "input": "tiny.parquet",
            "output_dir": ".",
        },
        "design": {"weight": "w", "strata": "h", "psu": "p"},
        "variables": {
            "direct_identifiers": ["id"],
            "keys": ["age", "sex"],
            "other": {"keep": ["marital"]},
        },
        "edits": [
            {"rule": "between", "column": "age", "min": 0, "max": 90},
            {"rule": "in_set", "column": "marital", "values": ["never"], "when": "age < 15"},
        ],
        "approval": {"required": False},
    }
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path, df, kids


@pytest.mark.flow
@pytest.mark.usefixtures("prefect_server")
def test_cli_input_breaking_an_edit_exits_1(tmp_path, capsys):
    path, df, kids = tiny_spec(tmp_path)
    assert len(kids) == 3
    assert puf(["run", str(path), "--approve", "x"]) == 1
    err = capsys.readouterr().err
    said = err[err.index("puf: edit validation failed on the input file") :]  # after Prefect's log
    assert "edit[1] marital in ['never'] when age < 15: 3 records fail" in said
    # row positions, never a person id: the message reaches Prefect's logs (issue 15 item 8)
    assert f"(e.g. row {[int(k) + 1 for k in kids]})" in said  # rows counted from 1
    assert not any(pid in err for pid in df.loc[kids, "id"])
    assert "Traceback" not in said


def test_cli_edit_failure_exits_1_without_traceback(tmp_path, capsys, monkeypatch):
    """A stage's EditFailure reaches the user as its message and exit code 1."""
    path, df, _ = tiny_spec(tmp_path)
    spec_rules = parse_spec(yaml.safe_load(path.read_text())).edits

    def run_release(*args, **kwargs):
        check_edits(df, spec_rules, "PRB output")

    monkeypatch.setattr("flows.release.run_release", run_release)
    assert puf(["run", str(path), "--approve", "x"]) == 1
    err = capsys.readouterr().err
    assert err.startswith(
        "puf: PRB output breaks edit rules: edits[1] marital in ['never'] when age < 15 (3 records): "
    )
    assert "Traceback" not in err
