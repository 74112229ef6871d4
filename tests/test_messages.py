"""Messages that say what to do (issue 36 part 6): "did you mean" for columns and spec keys,
YAML errors at the faulty line with the line shown, the choices for zero weights, and
suggested commands that keep every argument the user gave."""

from __future__ import annotations

import argparse
import copy
import re
import shlex
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import yaml
from helpers import MINI_SPEC

from flows.cli import _command
from flows.cli import main as puf
from sdl_design.io import read_input
from sdl_design.messages import did_you_mean, faulty_yaml_line
from sdl_design.spec import SpecError, load_spec, parse_spec

BASE = MINI_SPEC


def frame(n: int = 12) -> pd.DataFrame:
    rng = np.random.default_rng(1)
    return pd.DataFrame(
        {
            "id": [f"{i:04d}" for i in range(1, n + 1)],  # codes with leading zeros
            "w": rng.uniform(1, 3, n),
            "h": np.repeat([1, 2], n // 2),
            "p": np.tile([1, 1, 2, 2, 3, 3], n // 6),
            "age": rng.integers(0, 90, n),
            "sex": rng.choice(["f", "m"], n),
            "dia": rng.integers(0, 2, n),
            "inc": rng.uniform(0, 1e5, n),
        }
    )


def spec_problems(data: dict, df: pd.DataFrame | None = None) -> list[str]:
    with pytest.raises(SpecError) as ei:
        spec = parse_spec(data)
        if df is not None:
            spec.check_data(df)
    return ei.value.problems


def changed(**paths: object) -> dict:
    """BASE with dotted paths set ('variables.study': ['incc'])."""
    data = copy.deepcopy(BASE)
    for dotted, value in paths.items():
        *head, last = dotted.split("__")
        node = data
        for h in head:
            node = node[int(h)] if isinstance(node, list) else node[h]
        node[last] = value
    return data


# ---------------------------------------------------------------- did you mean


def test_did_you_mean_names_the_closest_or_nothing():
    assert did_you_mean("sexx", ["age", "sex", "income"]) == " (did you mean 'sex'?)"
    assert did_you_mean("Sex", ["age", "sex"]) == " (did you mean 'sex'?)"  # case only
    assert did_you_mean("AGE", ["age", "sex"]) == " (did you mean 'age'?)"
    assert did_you_mean("zzz", ["age", "sex"]) == ""
    assert did_you_mean("rw_1", ["rw_10", "rw_11", "rw_12"]).count("'rw_1") == 2  # two at most


@pytest.mark.parametrize(
    ("paths", "field", "wrong", "right"),
    [
        ({"variables__keys": [{"name": "age", "bins": [0, 18, 65, 120]}, "Sex"]}, "variables.keys[1]", "Sex", "sex"),
        ({"variables__study": ["incc"]}, "variables.study[0]", "incc", "inc"),
        ({"design__strata": "hh"}, "design.strata", "hh", "h"),
        ({"edits": [{"rule": "between", "column": "agee", "min": 0}]}, "edits[0]", "agee", "age"),
        ({"stages__prb__variables": ["age", "sx"]}, "stages.prb.variables[1]", "sx", "sex"),
    ],
)  # fmt: skip
def test_misspelled_column_gets_did_you_mean(paths, field, wrong, right):
    msg = "\n".join(spec_problems(changed(**paths), frame()))
    assert f"{field}: column '{wrong}' is not in the input file (did you mean '{right}'?)" in msg


def test_missing_code_of_a_misspelled_column(tmp_path):
    path = tmp_path / "in.parquet"
    frame().to_parquet(path, index=False)
    data = changed(release__input=str(path))
    data["variables"]["missing"] = {"incme": [99]}
    with pytest.raises(SpecError) as ei:
        read_input(parse_spec(data))
    assert ei.value.problems == [
        "variables.missing.incme: column 'incme' is not in the input file "
        "(did you mean 'inc'?); fix the name"
    ]


def test_scan_path_names_the_field_and_the_close_column():
    spec = parse_spec(changed(variables__study=["incc"]))
    (msg,) = spec.absent_columns(list(frame().columns), only=["incc"])
    assert msg.startswith("variables.study[0]: column 'incc' is not in the input file")
    assert "(did you mean 'inc'?)" in msg


@pytest.mark.parametrize(
    ("where", "key", "right"),
    [
        ((), "stagse", "stages"),
        (("stages", "prb"), "xii", "xi"),
        (("edits", 0), "colum", "column"),
        (("variables", "keys", 0), "binz", "bins"),
        (("design",), "wieght", "weight"),
    ],
)
def test_unknown_spec_key_gets_did_you_mean(where, key, right):
    data = copy.deepcopy(BASE)
    node = data
    for w in where:
        node = node[w]
    node[key] = 1
    loc = ".".join([*map(str, where), key]).replace("edits.0", "edits.0.between")
    assert f"{loc}: unknown key (did you mean '{right}'?); fix its spelling, or remove it" in (
        spec_problems(data)
    )


def test_unknown_spec_key_without_a_close_one_lists_the_keys():
    data = copy.deepcopy(BASE)
    data["stages"]["prb"]["zzzz"] = 1
    (msg,) = spec_problems(data)
    assert msg.startswith("stages.prb.zzzz: unknown key; remove it or check its spelling")
    assert "(keys here: enabled, xi, variables," in msg


def test_inline_topcode_rule_key():
    data = changed(stages__topcode={"inc": {"uppr": {"percentile": 99}}})
    assert (
        "stages.topcode.inc.uppr: unknown key (did you mean 'upper'?); fix its spelling, "
        "or remove it"
    ) in spec_problems(data)


# ---------------------------------------------------------------- YAML at the faulty line

# the measured case: a mis-indented first key of a mapping (line 35, 5 spaces among 4) that
# PyYAML reports at lines 31 (the enclosing mapping) and 36 (its correctly indented sibling)
MIS_INDENTED = "\n".join(
    [
        "release:",
        "  name: mis-indented",
        "  year: 2026",
        "  input: input/survey.parquet",
        "  seed: 1710067952095484995",
        "",
        "design:",
        "  weight: wt",
        "  strata: stratum",
        "  psu: psu",
        *["# a comment"] * 19,
        "variables:",
        "  direct_identifiers: [person_id, name]",  # line 31
        "  keys: [age, sex, race]",
        "  study: [income, bmi]",
        "  other:",
        "     keep: [education, pregnant]",  # line 35: 5 spaces, its sibling 4
        "    drop: [county]",  # line 36
        "",
        "stages:",
        "  risk: {enabled: true}",
        "",
    ]
)


def test_yaml_indentation_error_at_the_faulty_line(tmp_path, capsys):
    with pytest.raises(yaml.MarkedYAMLError) as ei:
        yaml.safe_load(MIS_INDENTED)
    assert (ei.value.context_mark.line + 1, ei.value.problem_mark.line + 1) == (31, 36)
    path = tmp_path / "spec.yaml"
    path.write_text(MIS_INDENTED)
    with pytest.raises(SpecError) as ei:
        load_spec(path)
    (msg,) = ei.value.problems
    head, shown, caret = msg.split("\n")
    assert head.startswith(f"{path}:35: this line is indented by 5 spaces where its block needs 4")
    assert "indent it by 4 spaces" in head and "YAML stopped at line 36" in head
    assert shown == "      35 |      keep: [education, pregnant]"
    assert caret.index("^") == shown.index("keep")
    # the command line says it once, without a traceback, exit 2
    assert puf(["validate", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.count("spec.yaml:35:") == 1 and "Traceback" not in err
    assert "35 |      keep: [education, pregnant]" in err


@pytest.mark.parametrize(
    ("text", "line", "shown", "says"),
    [
        # over-indented among siblings: PyYAML marks the line itself
        ("a:\n  b: 1\n   c: 2\n  d: 3\n", 3, "   c: 2", "indent it by 2 spaces"),
        # an under-indented first key: PyYAML marks its sibling below
        ("release:\n name: x\n  year: 2026\n", 2, " name: x", "indent it by 2 spaces"),
        # the first key of a nested mapping over-indented by a whole step
        ("v:\n  other:\n      keep: [a]\n    drop: [b]\nw: 1\n", 3, "      keep: [a]", "by 4"),
        # a bracket left open: where it opens
        ("release:\n  keys: [a, b\n  year: 2026\n", 2, "  keys: [a, b", "this [ is never closed"),
        ('release:\n  name: "x\n  year: 2026\n', 2, '  name: "x', 'this " is never closed'),
        ("release:\n  name: x\n\tyear: 2026\n", 3, " year: 2026", "a tab in the indentation"),
    ],
)
def test_yaml_errors_show_the_line_to_fix(tmp_path, text, line, shown, says):
    path = tmp_path / "spec.yaml"
    path.write_text(text)
    with pytest.raises(SpecError) as ei:
        load_spec(path)
    (msg,) = ei.value.problems
    assert msg.startswith(f"{path}:{line}: ")
    assert says in msg.split("\n")[0]
    assert msg.split("\n")[1] == f"      {line} | {shown}"


def test_faulty_line_found_for_every_one_space_shift_of_the_default_spec():
    """Every line of the default spec shifted by one space (3 or 5 spaces among 2 and 4) that
    breaks the YAML is reported at that line, whichever line PyYAML marks."""
    from flows.cli import default_spec_text

    lines = default_spec_text().splitlines()
    checked = 0
    for i, text in enumerate(lines):
        if not text.strip() or text.lstrip().startswith("#"):
            continue
        for shift in (-1, 1):
            width = len(text) - len(text.lstrip()) + shift
            if width < 0:
                continue
            trial = "\n".join([*lines[:i], " " * width + text.lstrip(), *lines[i + 1 :]])
            try:
                yaml.safe_load(trial)
                continue
            except yaml.MarkedYAMLError as e:
                assert faulty_yaml_line(trial, e)[0] == i, (i + 1, shift)
                checked += 1
    assert checked > 50


# ---------------------------------------------------------------- zero weights


@pytest.mark.parametrize("kind", ["csv", "parquet"])
def test_zero_weights_say_the_choices_and_the_command_works(tmp_path, kind):
    df = frame()
    df.loc[[0, 5], "w"] = 0.0
    src = tmp_path / f"survey.{kind}"
    df.to_csv(src, index=False) if kind == "csv" else df.to_parquet(src, index=False)
    spec = parse_spec(changed(release__input=str(src)))
    data, _ = read_input(spec)
    with pytest.raises(SpecError) as ei:
        spec.check_data(data)
    (msg,) = [p for p in ei.value.problems if p.startswith("design.weight")]
    assert msg.startswith("design.weight: column 'w' is 0 in 2 records (rows 1, 6)")
    assert "NHANES" in msg and "cannot keep such records" in msg
    assert "Either (1) drop them before the release" in msg
    assert "(2) if they belong in the public file, name in design.weight a weight" in msg
    # the command it gives runs, and its file passes
    code = re.search(r'python -c "(.*?)" and point release.input at (\S+) \(written', msg)
    assert code is not None, msg
    exec(code.group(1), {})  # noqa: S102 - the message's own command, on test data
    kept = tmp_path / code.group(2)
    assert kept.exists()
    spec = parse_spec(changed(release__input=str(kept)))
    data, _ = read_input(spec)
    spec.check_data(data)  # no problem left
    assert len(data) == 10 and (data["w"] > 0).all()
    assert data["id"].tolist() == [f"{i:04d}" for i in range(1, 13) if i not in (1, 6)]


def test_negative_weights_are_not_zero_weights():
    df = frame()
    df.loc[1, "w"] = -2.0
    (msg,) = spec_problems(BASE, df)
    assert msg.startswith("design.weight: column 'w' has values that are not > 0 (rows 2 ")
    assert "is 0 in" not in msg


# ---------------------------------------------------------------- suggested commands


@pytest.fixture
def no_server(monkeypatch):
    monkeypatch.delenv("PREFECT_API_URL", raising=False)


def _spec_file(tmp_path: Path) -> Path:
    path = tmp_path / "my spec.yaml"  # a space: the command quotes it
    path.write_text(yaml.safe_dump(changed(release__input="survey.parquet")))
    return path


def _suggested(err: str) -> list[str]:
    return [line.strip() for line in err.splitlines() if line.strip().startswith("puf ")]


def test_approval_refusal_keeps_every_argument(tmp_path, capsys, no_server):
    path = _spec_file(tmp_path)
    argv = ["run", str(path), "--year", "2027", "--runner", "dask"]
    argv += ["--dask-address", "tcp://x:1"]
    assert puf(argv) == 2
    err = capsys.readouterr().err
    with_approve, again = _suggested(err)
    assert with_approve.split("  ")[0] == shlex.join(["puf", *argv, "--approve", "NAME"])
    assert again == shlex.join(["puf", *argv])
    for arg in ("--year 2027", "--runner dask", "--dask-address tcp://x:1", "'"):
        assert arg in with_approve and arg in again
    assert "mini 2027 needs the review board's approval" in err


def test_partitioned_approval_refusal_keeps_every_argument(tmp_path, capsys, no_server):
    path = _spec_file(tmp_path)
    argv = ["partitioned", str(path), "--publish", "--partitions", "4", "--runner", "dask"]
    argv += ["--dask-address=tcp://x:1", "--approve", ""]  # a blank approver approves nothing
    assert puf(argv) == 2
    with_approve, again = _suggested(capsys.readouterr().err)
    kept = shlex.join(["puf", *argv[:-2]])
    assert with_approve.split("  ")[0] == f"{kept} --approve NAME"
    assert again == kept


def test_command_drops_and_adds_options():
    args = argparse.Namespace(argv=["partitioned", "s.yaml", "--out", "d", "--partitions", "3"])
    add = ["--publish", "--approve", "NAME"]
    assert _command(args, add=add, drop=["--out"]) == (
        "puf partitioned s.yaml --partitions 3 --publish --approve NAME"
    )
    args.argv = ["partitioned", "s.yaml", "--out=d", "--runner", "dask"]
    assert _command(args, drop=["--out"]) == "puf partitioned s.yaml --runner dask"
    # without main's argv: rebuilt from the parsed arguments, every one given kept
    args = argparse.Namespace(
        cmd="run", spec="s.yaml", approve=None, year=2027, runner="dask", dask_address="tcp://x:1"
    )
    assert _command(args, add=["--approve", "NAME"]) == (
        "puf run s.yaml --year 2027 --runner dask --dask-address tcp://x:1 --approve NAME"
    )


def test_workers_reach_the_run_and_the_scan_and_none_is_refused(tmp_path, capsys, monkeypatch):
    """--workers K: the release run by partition and the scan get K (their local workers);
    0 or a word is refused by name before any work."""
    import flows.cli as cli
    import flows.release as rel
    from sdl_design.spec import SpecError

    path = _spec_file(tmp_path)
    got = {}

    def stop(name):
        def fake(*args, **kw):
            got[name] = (args, kw)
            raise SpecError(["stopped by the test"])

        return fake

    monkeypatch.setattr(rel, "_call_flow", stop("run"))
    monkeypatch.setattr(cli, "run_scan", stop("scan"))
    argv = ["--partitions", "4", "--runner", "dask", "--workers", "1", "--approve", "ana"]
    assert puf(["run", str(path), *argv]) == 2
    assert got["run"][0][-2:] == (4, 1)  # partitions, workers
    assert puf(["scan", str(path), "--workers", "3"]) == 2
    assert got["scan"][0][-1] == 3
    capsys.readouterr()
    for bad in ("0", "two"):
        with pytest.raises(SystemExit) as e:
            puf(["run", str(path), "--partitions", "4", "--workers", bad])
        assert e.value.code == 2
        assert "--workers: give a whole number of workers, 1 or more" in capsys.readouterr().err
