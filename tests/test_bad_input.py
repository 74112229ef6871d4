"""Bad input (issue 15, 10-11 and 13; issue 13, 5-7): one small case per input class through
`puf run` in process. A refused input exits 2 before any work, names the field, prints no
traceback and leaves no public/; an input the missing-value policy accepts keeps its values
and goes through every stage."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml
from helpers import DEFAULT_SPEC, ROOT

from flows.cli import main
from sdl_design.io import read_input
from sdl_design.keys import MISSING, coarsen, key_frame
from sdl_design.spec import parse_spec

N = 1200  # the smallest default survey the seed allows, rounded up


@pytest.fixture(scope="module")
def survey() -> pd.DataFrame:
    from sdl_design.synth import make_survey

    seed = yaml.safe_load(DEFAULT_SPEC.read_text())["release"]["seed"]
    return make_survey(n_persons=N, seed=seed)


def write_case(tmp: Path, df: pd.DataFrame, fmt: str, spec_edit=None) -> Path:
    """The survey as input/s.<fmt> and a spec that points at it (output in tmp)."""
    data = yaml.safe_load(DEFAULT_SPEC.read_text())
    (tmp / "input").mkdir(parents=True)
    path = tmp / "input" / f"s.{fmt}"
    if fmt == "csv":
        df.to_csv(path, index=False)
    else:
        df.to_parquet(path, index=False)
    data["release"]["input"] = f"input/s.{fmt}"
    data["release"]["output_dir"] = "."
    data["stages"]["massc"]["replications"] = 0
    if spec_edit:
        spec_edit(data)
    spec = tmp / "spec.yaml"
    spec.write_text(yaml.safe_dump(data, sort_keys=False))
    return spec


def set_rows(df: pd.DataFrame, col: str, rows: list[int], value) -> pd.DataFrame:
    df = df.copy()
    if isinstance(value, str) and df[col].dtype != "str":
        df[col] = df[col].astype(object)
    df.loc[rows, col] = value
    return df


def rescale(df: pd.DataFrame) -> pd.DataFrame:
    """Weights normalised to the sample size (a common producer convention)."""
    df = df.copy()
    k = len(df) / df["wt"].sum()
    reps = [c for c in df.columns if c.startswith("rw_")]
    df[["wt", *reps]] = df[["wt", *reps]] * k
    return df


def huge_income(df):
    return set_rows(df, "income", [5, 6, 7], 1e300)


# (case, format, mutate the data, edit the spec, text that must be in stderr: the field and
# the problem in its own words). Rows in the messages are counted from 1: row k+1 = index k.
REFUSED = [
    (
        "text weight",
        "csv",
        lambda d: set_rows(d, "wt", [3, 7], "abc"),
        None,
        ["design.weight", "'wt'", "not numeric", "rows 4, 8"],
    ),
    (
        "inf weight",
        "parquet",
        lambda d: set_rows(d, "wt", [2], np.inf),
        None,
        ["design.weight", "infinite", "rows 3"],
    ),
    (
        "1e300 weight",
        "parquet",
        lambda d: set_rows(d, "wt", [9], 1e300),
        None,
        ["design.weight", "beyond 1e+15", "rows 10"],
    ),
    (
        "negative replicate",
        "parquet",
        lambda d: set_rows(d, "rw_005", [1, 2], -3.0),
        None,
        ["design.replicate_weights", "'rw_005'", "not >= 0", "rows 2, 3"],
    ),
    (
        "inf replicate",
        "csv",
        lambda d: set_rows(d, "rw_010", [4], np.inf),
        None,
        ["design.replicate_weights", "'rw_010'", "infinite", "rows 5"],
    ),
    (
        "1e300 study",
        "parquet",
        huge_income,
        None,
        ["variables.study[0]", "'income'", "beyond 1e+15", "rows 6, 7, 8"],
    ),
    (
        "text in numeric study",
        "csv",
        lambda d: set_rows(d, "bmi", [0], "NA"),
        None,
        ["variables.study[1]", "'bmi'", "not numeric", "'NA'", "variables.missing"],
    ),
    (
        "NaN in binned sensitive",
        "parquet",
        lambda d: set_rows(d, "income", [11], np.nan),
        None,
        ["variables.sensitive[2].sensitivity", "'income'", "nan:", "rows 12"],
    ),
    (
        "missing PSU",
        "parquet",
        lambda d: set_rows(d, "psu", [0], np.nan),
        None,
        ["design", "'psu'", "rows 1"],
    ),
    (
        "normalised weights",
        "parquet",
        rescale,
        None,
        ["design.weight", "normalised", "population", "weights_normalised: true"],
    ),
    (
        "missing code of no column",
        "parquet",
        lambda d: d,
        lambda s: s["variables"].update(missing={"incme": [99]}),
        ["variables.missing", "incme"],
    ),
]


@pytest.mark.parametrize("case", REFUSED, ids=[c[0] for c in REFUSED])
def test_refused_before_any_work(tmp_path, capsys, survey, case):
    _, fmt, mutate, spec_edit, said = case
    spec = write_case(tmp_path, mutate(survey), fmt, spec_edit)
    rc = main(["run", str(spec), "--approve", "test"])
    err = capsys.readouterr().err
    assert rc == 2, err
    for text in said:
        assert text in err, (text, err)
    assert "Traceback" not in err and err.count("\n  - ") >= 1
    assert not list(tmp_path.rglob("public")) and not (tmp_path / "default-survey").exists()
    assert main(["validate", str(spec)]) == 2  # puf validate refuses it the same way
    err = capsys.readouterr().err
    assert all(text in err for text in said) and "Traceback" not in err


def test_misleading_messages_gone(tmp_path, capsys, survey):
    """Text weights are 'not numeric' (not 'not positive'), infinite ones 'infinite' (not
    'missing'); several problems give one message each, in one run (issue 15, 13)."""
    spec = write_case(tmp_path / "text", set_rows(survey, "wt", [3], "abc"), "csv")
    assert main(["run", str(spec), "--approve", "t"]) == 2
    err = capsys.readouterr().err
    assert "not numeric" in err and "positive" not in err and "missing in" not in err
    df = set_rows(set_rows(survey, "wt", [3], "inf"), "rw_001", [5], -1.0)
    df = set_rows(df, "bmi", [8], 1e300)
    spec = write_case(tmp_path / "inf", df, "csv")
    assert main(["run", str(spec), "--approve", "t"]) == 2
    lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("  - ")]
    assert len(lines) == 3, lines
    assert "'wt'" in lines[0] and "infinite" in lines[0] and "missing" not in lines[0]
    assert "'rw_001'" in lines[1] and "not >= 0" in lines[1]
    assert "'bmi'" in lines[2] and "beyond 1e+15" in lines[2]


def _dup_csv(tmp: Path, survey: pd.DataFrame) -> Path:
    spec = write_case(tmp, survey, "csv")
    path = tmp / "input" / "s.csv"
    df = survey.assign(income_copy=survey["income"] * 8)
    text = df.to_csv(index=False).replace("income_copy", "income", 1)
    path.write_text(text)
    return spec


def test_duplicated_csv_header(tmp_path, capsys, survey):
    spec = _dup_csv(tmp_path, survey)
    assert main(["run", str(spec), "--approve", "t"]) == 2
    err = capsys.readouterr().err
    assert "release.input" in err and "['income']" in err and "more than once" in err
    assert "Traceback" not in err and not list(tmp_path.rglob("public"))


def test_duplicated_parquet_column(tmp_path, capsys, survey):
    spec = write_case(tmp_path, survey, "parquet")
    t = pa.Table.from_pandas(survey, preserve_index=False)
    t = t.append_column("bmi", t.column("bmi"))
    pq.write_table(t, tmp_path / "input" / "s.parquet")
    assert pq.read_schema(tmp_path / "input" / "s.parquet").names.count("bmi") == 2
    assert main(["run", str(spec), "--approve", "t"]) == 2
    err = capsys.readouterr().err
    assert "['bmi']" in err and "more than once" in err and "Traceback" not in err
    assert not list(tmp_path.rglob("public"))


@pytest.mark.flow  # a subprocess
def test_subprocess_exit_2_without_traceback(tmp_path, survey):
    """The real command line: the same refusal, no Prefect traceback before it."""
    spec = _dup_csv(tmp_path, survey)
    out = subprocess.run(
        [sys.executable, "-m", "flows.cli", "run", str(spec), "--approve", "t"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 2, out.stderr
    assert "more than once" in out.stderr and "Traceback" not in out.stderr
    assert out.stderr.count("puf: release spec is not valid") == 1


# ---------------------------------------------------------------- inputs that must pass


def _read(tmp: Path, df: pd.DataFrame, fmt: str, spec_edit=None):
    spec_path = write_case(tmp, df, fmt, spec_edit)
    from sdl_design.spec import load_spec

    spec = load_spec(spec_path)
    out, digest = read_input(spec)
    spec.check_data(out)  # no SpecError
    return spec, out, digest


def test_csv_na_category_and_county_codes_survive(tmp_path, survey):
    """'NA' is a race category, county '0001' keeps its zeros; numbers stay numbers."""
    df = survey.copy()
    df.loc[df.index[:40], "race"] = "NA"
    df["county"] = df["county"].str.replace("c", "0")  # c001 -> 0001
    spec, out, _ = _read(tmp_path, df, "csv")
    assert (out["race"] == "NA").sum() == 40 and out["race"].isna().sum() == 0
    assert out["county"].tolist() == df["county"].tolist() and "0001" in set(out["county"])
    assert out["age"].dtype.kind == "i" and out["wt"].dtype.kind == "f"
    assert out["pregnant"].dtype.kind == "i"  # undeclared numeric column: numbers
    for c in ["wt", "rw_002", "income", "bmi", "age", "stratum", "psu"]:  # as pandas parses them
        ref = pd.read_csv(spec.release.input, usecols=[c])[c]
        assert out[c].dtype == ref.dtype and np.array_equal(out[c].to_numpy(), ref.to_numpy())


def test_declared_missing_codes_and_blank_cells(tmp_path, survey):
    df = survey.copy()
    df["bmi"] = df["bmi"].astype(object)
    df.loc[[0, 1], "bmi"] = -9
    df.loc[[2], "bmi"] = ""  # blank cell of a numeric column: missing
    df.loc[[3, 4, 5], "race"] = "?"
    spec, out, _ = _read(
        tmp_path, df, "csv", lambda s: s["variables"].update(missing={"bmi": [-9], "race": ["?"]})
    )
    assert out["bmi"].isna().to_numpy().nonzero()[0].tolist() == [0, 1, 2]
    assert out["race"].isna().to_numpy().nonzero()[0].tolist() == [3, 4, 5]
    assert out["bmi"].dtype.kind == "f" and (out["race"] == "NA").sum() == 0


def test_normalised_weights_declared(tmp_path, survey):
    """Weights summing to n are refused unless declared; declared, the data pass unchanged."""
    from sdl_design.spec import SpecError

    df = rescale(survey)
    with pytest.raises(SpecError, match="design.weight: the weights of 'wt' sum to"):
        _read(tmp_path / "plain", df, "parquet")
    _, out, _ = _read(
        tmp_path / "declared", df, "parquet", lambda s: s["design"].update(weights_normalised=True)
    )
    assert out["wt"].sum() == pytest.approx(len(df), rel=1e-12)


def test_missing_is_its_own_key_category_not_out_of_range():
    s = pd.Series([5.0, np.nan, 95.0, 30.0])
    lab = coarsen(s, [0, 18, 91])
    assert lab[0] == "0-18" and lab[2] == "out_of_range" and lab[3] == "18-91"
    assert pd.isna(lab[1])  # missing is not a value outside the bins
    kf = key_frame(pd.DataFrame({"age": s, "sex": ["f", None, "m", "f"]}), ["sex"])
    assert kf["sex"].tolist() == ["f", MISSING, "m", "f"]


def test_release_with_missing_key_and_study_variable(survey):
    """5% missing in a key (race) and a study variable (bmi) go through every stage: missing
    keys count as one more category, bmi is estimated over its observed records."""
    from sdl_design.risk import cell_sizes
    from sdl_design.stages import run_stages
    from sdl_design.utility import broad_characteristics, domain_mean_se

    data = yaml.safe_load(DEFAULT_SPEC.read_text())
    data["stages"]["massc"]["replications"] = 0
    data["variables"]["missing"] = {"race": ["?"], "bmi": [-9]}
    spec = parse_spec(data)
    rng = np.random.default_rng(5)
    df = survey.copy()
    race_na, bmi_na = rng.random(N) < 0.05, rng.random(N) < 0.05
    df.loc[race_na, "race"] = np.nan
    df.loc[bmi_na, "bmi"] = np.nan
    spec.check_data(df)
    # risk counts: the missing race is one category (brute force over the coarsened keys)
    keys = spec.variables.keys
    coded = pd.DataFrame({k.name: coarsen(df[k.name], k.bins) for k in keys}).fillna("<NA>")
    brute = coded.groupby(list(coded.columns), dropna=False)["age"].transform("size")
    assert cell_sizes(df, keys).tolist() == brute.tolist()
    # domain mean of bmi: the weighted mean over its observed records
    chars = broad_characteristics(df[["bmi", "age"]], domains=[])
    est = domain_mean_se(df, chars, "wt", "stratum", "psu")
    got = est.set_index("variable").loc["bmi", "estimate"]
    obs = ~bmi_na
    assert got == pytest.approx(np.average(df.loc[obs, "bmi"], weights=df.loc[obs, "wt"]))

    results = run_stages(spec, df)
    assert [r.name for r in results] == [
        "risk",
        "swap",
        "prb",
        "massc",
        "topcode",
        "pseudo_design",
        "final",
        "assess",
    ]
    final = results[-1].data
    assert final["bmi"].isna().any() and final["race"].isna().any()
    assess = results[-1].tables["domain_estimates"]
    bmi = assess[assess["variable"] == "bmi"]
    overall = bmi[(bmi["domain"] == "all") & (bmi["statistic"] == "mean")].iloc[0]
    assert overall["n_original"] == obs.sum()  # the domain of observed values
    assert overall["estimate_original"] == pytest.approx(got)
    assert 0 < overall["n_released"] <= obs.sum() and overall["reliable"]
    # every cell with observed released records has an estimate
    assert np.isfinite(bmi.loc[bmi["n_released"] > 0, "estimate_released"]).all()
    assert (assess["level"].astype(str).str.contains("missing")).any()  # race: its own level


def test_typing_leaves_a_typed_frame_alone_and_changes_only_what_it_must(survey):
    """A frame whose columns already fit the spec comes back as it is (no copy of 1M records x
    90 columns); a declared missing code is made missing in its column and nowhere else."""
    from sdl_design.io import type_input

    spec = parse_spec(yaml.safe_load(DEFAULT_SPEC.read_text()))
    assert type_input(survey, spec, text=False) is survey
    data = yaml.safe_load(DEFAULT_SPEC.read_text())
    data["variables"]["missing"] = {"bmi": [-9]}
    df = set_rows(survey, "bmi", [3, 7], -9.0)
    typed = type_input(df, parse_spec(data), text=False)
    assert typed is not df and typed["bmi"].isna().sum() == df["bmi"].isna().sum() + 2
    assert np.isnan(typed["bmi"].to_numpy()[[3, 7]]).all()
    pd.testing.assert_frame_equal(typed.drop(columns="bmi"), df.drop(columns="bmi"))


def test_value_checks_name_the_same_values_with_the_two_reduction_shortcut(survey, monkeypatch):
    """check_data's messages on weights, replicate weights and numeric keys and study variables
    are the same whether columns whose smallest and largest values need no message skip the
    record-by-record checks (the shortcut) or not, for each kind of bad value and for none."""
    import sdl_design.spec as S
    from sdl_design.spec import SpecError

    spec = parse_spec(yaml.safe_load(DEFAULT_SPEC.read_text()))
    rep = spec.replicate_columns(survey)[3]
    cases = {
        "clean": {},
        "missing weight": {"wt": np.nan},
        "zero weight": {"wt": 0.0},
        "negative weight": {"wt": -2.0},
        "huge weight": {"wt": 1e16},
        "infinite replicate": {rep: np.inf},
        "negative replicate": {rep: -1.0},
        "zero and -0 replicate": {rep: -0.0},
        "missing study value": {"bmi": np.nan},
        "huge study value": {"bmi": -1e16},
        "infinite key": {"age": np.inf},
    }

    def messages(df: pd.DataFrame) -> str:
        try:
            spec.check_data(df)
        except SpecError as e:
            return str(e)
        return ""

    for name, bad in cases.items():
        df = survey.copy()
        for c, v in bad.items():
            df[c] = df[c].astype(float)
            df.loc[df.index[[3, 40]], c] = v
        with monkeypatch.context() as m:
            m.setattr(S, "_within", lambda *a, **k: False)
            want = messages(df)
        got = messages(df)
        assert got == want, name
        assert bool(got) == (name not in ("clean", "zero and -0 replicate", "missing study value"))
