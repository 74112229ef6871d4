import copy
from importlib import resources

import numpy as np
import pandas as pd
import pytest
import yaml
from helpers import MINI_SPEC

from sdl_design.keys import coarsen, key_frame
from sdl_design.rng import stage_rng
from sdl_design.spec import SpecError, load_spec, parse_condition, parse_spec

BASE = MINI_SPEC


def frame(n=12):
    rng = np.random.default_rng(1)
    return pd.DataFrame(
        {
            "id": [f"r{i}" for i in range(n)],
            "w": rng.uniform(1, 3, n),
            "h": np.repeat([1, 2], n // 2),
            "p": np.tile([1, 1, 2, 2, 3, 3], n // 6),
            "age": rng.integers(0, 90, n),
            "sex": rng.choice(["f", "m"], n),
            "dia": rng.integers(0, 2, n),
            "inc": rng.uniform(0, 1e5, n),
        }
    )


def with_change(path, value):
    data = copy.deepcopy(BASE)
    node = data
    for p in path[:-1]:
        node = node[p]
    if value is KeyError:
        del node[path[-1]]
    else:
        node[path[-1]] = value
    return data


def problems(data, df=None):
    with pytest.raises(SpecError) as ei:
        spec = parse_spec(data)
        if df is not None:
            spec.check_data(df)
    return "\n".join(ei.value.problems)


def test_valid_spec_and_data():
    spec = parse_spec(BASE)
    spec.check_data(frame())
    assert spec.variables.key_names == ["age", "sex"]


def test_default_spec_is_valid():
    spec = parse_spec(
        yaml.safe_load(resources.files("flows").joinpath("default_spec.yaml").read_text())
    )
    assert spec.stages.prb.xi == 0.395 and spec.design.replicate_weights.method == "jkn"


def test_unknown_key_named():
    msg = problems(with_change(["design", "wieght"], "w"))
    assert "design.wieght" in msg and "unknown key" in msg


def test_missing_section_named():
    assert "variables: Field required" in problems(with_change(["variables"], KeyError))


def test_wrong_type_named():
    msg = problems(with_change(["release", "year"], "twenty"))
    assert msg.startswith("release.year:") and "integer" in msg


def test_xi_out_of_range_named():
    msg = problems(with_change(["stages", "prb", "xi"], 0.6))
    assert "stages.prb.xi" in msg and "0.5" in msg
    assert "gates.xi" in problems(with_change(["gates"], {"xi": 0.3}))


def test_fay_needs_rho_and_logit_needs_bounds():
    msg = problems(
        with_change(["design", "replicate_weights"], {"columns": "rw_*", "method": "fay"})
    )
    assert "design.replicate_weights" in msg and "rho" in msg
    massc = {"calibration": {"method": "logit", "controls": ["sex"]}}
    msg = problems(with_change(["stages", "massc"], massc))
    assert "stages.massc.calibration" in msg and "bounds" in msg


def test_bad_condition_and_thresholds():
    edits = [{"rule": "in_set", "column": "sex", "values": ["f"], "when": "age <<< 3"}]
    assert "edits.0" in problems(with_change(["edits"], edits))
    assert "gates.se_ratio" in problems(with_change(["gates"], {"se_ratio": [1.2, 0.8]}))
    assert "stages.massc.psi_max" in problems(with_change(["stages", "massc"], {"psi_max": 0.5}))


def test_massc_strata_options_named():
    msg = problems(with_change(["stages", "massc"], {"strata_merge": {"X": "NU"}}))
    assert "stages.massc.strata_merge" in msg
    msg = problems(with_change(["stages", "massc"], {"substrata": {"variables": ["inc"], "k": 1}}))
    assert "stages.massc.substrata.k" in msg
    spec = parse_spec(
        with_change(["stages", "massc"], {"substrata": {"variables": ["income_x"], "k": 3}})
    )
    with pytest.raises(SpecError, match=r"stages.massc.substrata.variables\[0\]"):
        spec.check_data(frame())


def test_missing_column_named_with_field():
    df = frame().drop(columns=["sex"])
    msg = problems(BASE, df)
    assert "variables.keys[1]: column 'sex' is not in the input file" in msg


def test_single_psu_stratum():
    df = frame()
    df.loc[df.h == 2, "p"] = 1
    assert "design.strata: 1 strata have a single PSU (2)" in problems(BASE, df)


def test_non_positive_and_missing_weights():
    df = frame()
    df.loc[0, "w"] = 0.0
    df.loc[1, "w"] = -2.0
    msg = problems(BASE, df)
    assert "design.weight: column 'w' is 0 in 1 record (rows 1). " in msg  # with the choices
    assert "design.weight: column 'w' has values that are not > 0 (rows 2 " in msg
    df = frame()
    df.loc[3, "p"] = np.nan
    assert "column 'p' is missing in rows 4;" in problems(BASE, df)


def test_sensitive_unlisted_category_and_empty_file():
    df = frame()
    df.loc[0, "dia"] = 9
    assert "variables.sensitive[0].sensitivity: categories ['9']" in problems(BASE, df)
    assert "no records" in problems(BASE, frame().iloc[:0])


def test_load_spec_resolves_paths(tmp_path):
    data = with_change(["release", "input"], "data/in.parquet")
    p = tmp_path / "s.yaml"
    p.write_text(yaml.safe_dump(data))
    spec = load_spec(p)
    assert spec.release.input == (tmp_path / "data" / "in.parquet").resolve()
    assert spec.release.output_dir == (tmp_path / "releases").resolve()
    with pytest.raises(SpecError, match="no file at"):
        load_spec(tmp_path / "nope.yaml")


def test_parse_condition():
    assert parse_condition("age < 15 and sex == 'male'") == [
        ("age", "<", 15),
        ("sex", "==", "male"),
    ]
    assert parse_condition("x in [1, 2]") == [("x", "in", [1, 2])]


def test_coarsen_bins_left_closed():
    s = pd.Series([0, 17, 18, 64.9, 65, 119, 120])
    assert coarsen(s, [0, 18, 65, 120]).tolist() == [
        "0-18",
        "0-18",
        "18-65",
        "18-65",
        "65-120",
        "65-120",
        "out_of_range",
    ]
    kf = key_frame(frame(), parse_spec(BASE).variables.keys)
    assert list(kf.columns) == ["age", "sex"] and set(kf["age"]) <= {"0-18", "18-65", "65-120"}


def test_stage_rng_independent_and_reproducible():
    a = stage_rng(5, "swap").random(3)
    assert np.array_equal(a, stage_rng(5, "swap").random(3))
    assert not np.array_equal(a, stage_rng(5, "prb").random(3))
    assert not np.array_equal(a, stage_rng(6, "swap").random(3))


def test_replicate_method_in_any_case():
    """R writes type="JKn", Stata BRR: the spec takes the method's name in any case."""
    for given, want in (("JKn", "jkn"), ("BRR", "brr"), ("Bootstrap", "bootstrap")):
        rw = {"columns": "rw_*", "method": given}
        spec = parse_spec(with_change(["design", "replicate_weights"], rw))
        assert spec.design.replicate_weights.method == want
    bad = {"columns": "rw_*", "method": "jk2"}
    assert "method" in problems(with_change(["design", "replicate_weights"], bad))
