"""Hostile specs and inputs are bounded and named (issue 35, first items): an alias bomb, a
spec of 20,000 rules, reserved column names, formula-leading header names, Ctrl-C, a closed
pipe and a gate verdict that could not be evaluated."""

from __future__ import annotations

import subprocess
import sys
import time

import numpy as np
import pandas as pd
import pytest
import yaml
from helpers import DEFAULT_SPEC

from sdl_design.spec import SPEC_NODES_MAX, SpecError, parse_spec, read_spec_yaml


def test_alias_bomb_refused_at_once():
    """Nine levels of nine aliases (4.4e9 nodes expanded) are counted, not walked, and refused
    with the count; a spec that uses an alias or two still reads."""
    lines = ['a0: &a0 ["x", "x", "x", "x", "x", "x", "x", "x", "x"]']
    lines += [f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 9) + "]" for i in range(1, 10)]
    t0 = time.perf_counter()
    with pytest.raises(SpecError, match=r"aliases expand to 4,412,961,516 YAML nodes"):
        read_spec_yaml("\n".join(lines))
    assert time.perf_counter() - t0 < 1.0
    assert 9**10 > SPEC_NODES_MAX
    ok = read_spec_yaml("bins: &b [0, 18, 65]\nkeys: [{name: age, bins: *b}]")
    assert ok["keys"][0]["bins"] == [0, 18, 65]


def test_twenty_thousand_rules_refused_naming_the_field():
    data = yaml.safe_load(DEFAULT_SPEC.read_text())
    data["edits"] = [{"rule": "not_null", "column": "sex"}] * 20_000
    with pytest.raises(SpecError, match=r"edits"):
        parse_spec(data)


def test_reserved_column_names_refused_by_name():
    from sdl_design.synth import make_survey

    spec = parse_spec(yaml.safe_load(DEFAULT_SPEC.read_text()))
    df = make_survey(1500).assign(__donor=1.0)
    spec.variables.other.keep.append("__donor")
    with pytest.raises(SpecError, match=r"__donor begin with '__'"):
        spec.check_data(df)


def test_formula_header_names_quoted_in_the_csv(tmp_path):
    from flows.public_files import neutralize_formulas, write_csv

    df = pd.DataFrame({'=HYPERLINK("http://x")': ["=1+1", "a"], "ok": [-3.0, 2.0]})
    write_csv(neutralize_formulas(df), tmp_path / "puf.csv")
    header, first, _ = (tmp_path / "puf.csv").read_text().split("\n", 2)
    assert header.startswith("\"'=HYPERLINK") and first.startswith("'=1+1,-3.0")


def test_formula_cells_found_per_distinct_value_as_per_record():
    """_neutralize tests each distinct value once; it quotes exactly the cells a test of every
    record would: text leading with a prefix, never numbers (-1 in a mixed column), missing
    values or unhashable objects' texts other than by their own value."""
    from flows.public_files import FORMULA_PREFIXES, _neutralize

    rng = np.random.default_rng(7)
    pool = ["=1+1", "a", "-x", "@b", "\tt", "", "+", "ok", "\rz", "é="]
    text = [pool[i] for i in rng.integers(0, len(pool), 500)]
    mixed = [*text[:400], -1, 2.5, True, None, np.nan, "-1", -1.0, "x", 0, "=0"] * 1
    cases = [
        pd.Series(text, dtype=object),
        pd.Series(text, dtype="string"),
        pd.Series(text, dtype="string[pyarrow]"),
        pd.Series(mixed, dtype=object),
        pd.Series([["=a"], "=b", "c"], dtype=object),
    ]
    for s in cases:
        want = [isinstance(x, str) and x.startswith(FORMULA_PREFIXES) for x in s]
        got = _neutralize(s)
        for x, y, quoted in zip(s, got, want, strict=True):
            if quoted:
                assert y == "'" + x
            else:
                assert y is x or y == x or (pd.isna(x) and pd.isna(y)), (x, y)
    same = pd.Series(["a", "b"], dtype=object)
    assert _neutralize(same) is same


def test_ctrl_c_exits_130_in_one_line(monkeypatch, capsys):
    import flows.cli as cli

    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "cmd_validate", interrupted)
    assert cli.main(["validate", "spec.yaml"]) == 130
    err = capsys.readouterr().err
    assert err.strip() == "puf: interrupted; nothing was published"


def test_gate_failed_reads_a_verdict_that_could_not_be_evaluated():
    from expectations.suites import GateFailed

    r = pd.DataFrame(
        {
            "name": ["a", "b", "c"],
            "passed": pd.Series([True, None, False], dtype=object),
            "detail": ["x", "y", "z"],
        }
    )
    assert str(GateFailed("gates", r)).splitlines() == [
        "gates: 2 of 3 checks failed",
        "  - b: y",
        "  - c: z",
    ]


@pytest.mark.flow  # a subprocess
def test_closed_pipe_ends_quietly(tmp_path):
    from flows.cli import write_demo_spec

    path = write_demo_spec(tmp_path, n_persons=1500)
    cmd = f"{sys.executable} -m flows.cli validate {path} | head -1"
    out = subprocess.run(cmd, shell=True, capture_output=True, text=True, timeout=300)
    assert out.stdout.startswith("spec ") and len(out.stdout.splitlines()) == 1
    assert "Traceback" not in out.stderr and "BrokenPipe" not in out.stderr, out.stderr


# ---------------------------------------------------------------- unreadable inputs


def _bad_inputs(tmp):
    """(case, spec path, words the message must hold) for each way an input cannot be read."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from flows.cli import write_demo_spec

    spec = write_demo_spec(tmp / "base", n_persons=1500)
    data = yaml.safe_load(spec.read_text())
    df = pd.read_parquet(tmp / "base" / "input" / "default_survey.parquet")
    text = df.to_csv(index=False)
    lines = text.split("\n")
    files = {}
    files["latin1_header.csv"] = text.replace("region", "régïon", 1).encode("latin-1")
    deep = lines.copy()
    cells = deep[700].split(",")
    cells[1] += "é"
    deep[700] = ",".join(cells)
    files["latin1_deep.csv"] = "\n".join(deep).encode("latin-1")
    ragged = lines.copy()
    ragged[300] += ",x,y"
    files["ragged.csv"] = "\n".join(ragged).encode()
    files["empty.csv"] = b""
    whole = (tmp / "base" / "input" / "default_survey.parquet").read_bytes()
    files["trunc.parquet"] = whole[: len(whole) // 2]
    table = pa.Table.from_pandas(df.assign(tags=[[1, 2]] * len(df)), preserve_index=False)
    pq.write_table(table, tmp / "lists.parquet")
    out = []
    for name, blob in files.items():
        (tmp / name).write_bytes(blob)
    expect = {
        "latin1_header.csv": ["latin1_header.csv", "not utf-8 text", "release.encoding"],
        "latin1_deep.csv": ["latin1_deep.csv", "not utf-8 text", "release.encoding"],
        "ragged.csv": ["row 300 of ragged.csv", "94 cells", "92 columns"],
        "empty.csv": ["empty.csv is empty"],
        "trunc.parquet": ["trunc.parquet is not a readable Parquet file"],
        "lists.parquet": ["tags (list<", "variables.other.drop"],
    }
    for name, words in expect.items():
        d = {**data, "release": {**data["release"], "input": str(tmp / name)}}
        if name == "lists.parquet":
            d["variables"] = {**data["variables"], "other": {"keep": ["tags", "education"]}}
        path = tmp / f"{name}.yaml"
        path.write_text(yaml.safe_dump(d, sort_keys=False))
        out.append((name, path, words))
    latin_spec = tmp / "latin1_spec.yaml"
    latin_spec.write_bytes((spec.read_text() + "# café\n").encode("latin-1"))
    out.append(("latin1_spec.yaml", latin_spec, ["is not UTF-8 text", "save it as UTF-8"]))
    return out, df


def test_unreadable_inputs_exit_2_naming_the_file_without_values(tmp_path, capsys):
    """Each unreadable file or spec: `puf validate` and `puf run` exit 2 with one named
    message, no traceback, no value of the data, nothing written."""
    from flows.cli import main

    cases, df = _bad_inputs(tmp_path)
    values = [str(v) for v in df["person_id"].head(400)] + [str(df["name"].iloc[299])]
    for name, path, words in cases:
        for cmd in (["validate", str(path)], ["run", str(path), "--approve", "x"]):
            assert main(cmd) == 2, (name, cmd)
            err = capsys.readouterr().err
            assert all(w in err for w in words), (name, err)
            assert "Traceback" not in err and not any(v in err for v in values), (name, err)
    assert not list(tmp_path.rglob("public"))


def test_declared_encoding_reads_a_latin1_file(tmp_path, capsys):
    from flows.cli import main

    cases, _ = _bad_inputs(tmp_path)
    path = next(p for n, p, _ in cases if n == "latin1_deep.csv")
    data = yaml.safe_load(path.read_text())
    data["release"]["encoding"] = "latin-1"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    assert main(["validate", str(path)]) == 0
    data["release"]["encoding"] = "no-such-codec"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    assert main(["validate", str(path)]) == 2
    assert "release.encoding" in capsys.readouterr().err


# ---------------------------------------------------------------- preconditions run meets


@pytest.fixture(scope="module")
def demo():
    from sdl_design.synth import make_survey

    return parse_spec(yaml.safe_load(DEFAULT_SPEC.read_text())), make_survey(1500)


def test_validate_names_a_missing_calibration_control(demo):
    """One missing age: `run` stopped in MASSC's calibration (the missing margin of one record
    infeasible after subsampling); preflight names the control and the row."""
    from sdl_design.preflight import preflight

    spec, df = demo
    df = df.copy()
    df.loc[5, "age"] = np.nan
    got = [p for p in preflight(spec, df) if "calibration.controls" in p]
    assert got == [
        "stages.massc.calibration.controls[1]: 'age' is missing in 1 records (rows 6); "
        "calibration needs every record's value: correct or impute them, or drop the control"
    ]


def test_validate_names_a_model_that_cannot_be_fitted(demo):
    """A key of one level per record: the declared model's equations are singular; preflight
    fits it on the input and names the model and the term (run stopped in the assessment)."""
    from sdl_design.preflight import preflight

    spec, df = demo
    df = df.assign(race=[f"r{i}" for i in range(len(df))])
    got = [p for p in preflight(spec, df) if p.startswith("utility.models[0]")]
    assert len(got) == 1 and "'race' has 1500 levels" in got[0] and "singular" in got[0]


def test_validate_names_a_key_table_too_large(demo, monkeypatch):
    import sdl_design.risk as risk
    from sdl_design.preflight import preflight

    spec, df = demo
    monkeypatch.setattr(risk, "MAX_CELLS", 1000)
    got = [p for p in preflight(spec, df) if p.startswith("variables.keys")]
    assert len(got) == 1 and "more than the risk stage's 1,000" in got[0] and "'age'" in got[0]


@pytest.mark.flow  # a subprocess and a release started
@pytest.mark.usefixtures("prefect_server")
def test_ctrl_c_during_a_run_exits_130_in_one_line(tmp_path):
    """SIGINT while the release runs (against the session's server: no temporary one to
    start): exit 130, one line, no traceback, nothing published."""
    import os
    import signal

    from prefect.settings import PREFECT_API_URL

    from flows.cli import write_demo_spec

    path = write_demo_spec(tmp_path, n_persons=1500)
    proc = subprocess.Popen(
        [sys.executable, "-m", "flows.cli", "run", str(path), "--approve", "x"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PREFECT_API_URL": PREFECT_API_URL.value()},
    )
    deadline = time.time() + 120
    seen = ""
    while "edit validation" not in seen and time.time() < deadline:  # the run has begun
        seen += proc.stderr.readline()
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    assert "Traceback" not in err and "Crash detected" not in err, err
    assert err.strip().splitlines()[-1] == "puf: interrupted; nothing was published"
    assert not list(tmp_path.rglob("public"))


def test_interrupt_line_is_the_last_even_when_a_service_logs_after_it(capfd):
    """After Ctrl-C's one line, a logger outside Prefect's tree ('EventsWorker', whose queue
    warns at exit of the items it could not send) prints nothing (seen once in a run under
    load: its warning came after the line)."""
    import argparse
    import logging

    from flows import cli

    def interrupted(_):
        raise KeyboardInterrupt

    handler = logging.StreamHandler(sys.stderr)
    worker = logging.getLogger("EventsWorker")
    worker.addHandler(handler)
    try:
        assert cli._dispatch(argparse.Namespace(func=interrupted)) == 130
        worker.warning("Still processing items: 1 items remaining...")
        err = capfd.readouterr().err
    finally:  # (logging is turned on again after every test: conftest)
        worker.removeHandler(handler)
    assert err.strip().splitlines() == ["puf: interrupted; nothing was published"]


def test_thousands_of_rules_get_their_own_verdicts():
    """2,000 rules (every tenth failing) judged through one GX expectation over their counts:
    each verdict and count is the rule's own (was one expectation per rule: 4 minutes for
    5,000 rules in `puf validate`)."""
    from expectations.suites import validate_edits
    from sdl_design.spec import parse_spec

    data = yaml.safe_load(DEFAULT_SPEC.read_text())
    data["edits"] = [
        {"rule": "between", "column": "bmi", "min": 10, "max": 80 if i % 10 else 30}
        for i in range(2000)
    ]
    spec = parse_spec(data)
    from sdl_design.synth import make_survey

    df = make_survey(1500)
    res = validate_edits(df, spec.edits)
    bad = int(((df["bmi"] < 10) | (df["bmi"] > 30)).sum())
    assert bad > 0 and len(res) == 2000
    assert res["passed"].tolist() == [bool(i % 10) for i in range(2000)]
    assert res["value"].tolist() == [0.0 if i % 10 else float(bad) for i in range(2000)]


@pytest.mark.flow  # a subprocess under a file-size limit
def test_file_size_limit_exits_3_in_one_line(tmp_path):
    """`ulimit -f`: what cannot be written (the temporary Prefect server's database first)
    ends the run with exit 3 and one line, no traceback, nothing published."""
    import os
    import resource

    from flows.cli import write_demo_spec

    path = write_demo_spec(tmp_path / "demo", n_persons=1500)
    env = {**os.environ, "PREFECT_HOME": str(tmp_path / "prefect")}
    env["PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS"] = "5"  # its database cannot grow

    def limit():
        resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))

    out = subprocess.run(
        [sys.executable, "-m", "flows.cli", "run", str(path), "--approve", "x"],
        capture_output=True,
        text=True,
        env=env,
        preexec_fn=limit,
        timeout=300,
    )
    assert out.returncode == 3, out.stderr[-2000:]
    assert "Traceback" not in out.stderr, out.stderr[-2000:]
    said = [ln for ln in out.stderr.splitlines() if ln.startswith("puf:")]
    assert len(said) == 1 and "nothing was published" in said[0], out.stderr[-2000:]
    assert not list(tmp_path.rglob("public"))


def test_validate_names_failing_rows_from_1_never_identifiers(tmp_path, capsys):
    """A failing edit rule in `puf validate`: its example rows counted from 1, never the values
    of the declared direct identifier (person_id)."""
    from flows.cli import main, write_demo_spec

    path = write_demo_spec(tmp_path, n_persons=1500)
    data = yaml.safe_load(path.read_text())
    df = pd.read_parquet(path.parent / data["release"]["input"])
    df.loc[[3, 7], "bmi"] = 5.0
    df.to_parquet(path.parent / data["release"]["input"], index=False)
    assert main(["validate", str(path)]) == 1
    out = capsys.readouterr().out
    assert "edit[2] bmi between 10 and 80: 2 records fail (e.g. row [4, 8])" in out
    assert not any(pid in out for pid in df["person_id"])


def test_an_error_raised_while_an_interrupt_is_handled_exits_130(capsys):
    """Prefect's task engine, interrupted while it creates a task run, raises ValueError('Task
    run is not set') from the KeyboardInterrupt: still an interrupt (exit 130, one line, its
    log records dropped); a ValueError of its own is not swallowed."""
    import argparse
    import logging

    from flows.cli import _dispatch, _KnownErrorFilter

    def interrupted(args):
        try:
            raise KeyboardInterrupt
        except KeyboardInterrupt:
            raise ValueError("Task run is not set")  # noqa: B904 - as Prefect raises it

    assert _dispatch(argparse.Namespace(func=interrupted)) == 130
    assert capsys.readouterr().err.strip() == "puf: interrupted; nothing was published"
    try:
        interrupted(None)
    except ValueError as e:
        record = logging.LogRecord("prefect.flow_runs", 40, "", 0, "failed", (), (type(e), e, None))
    assert not _KnownErrorFilter(set()).filter(record)

    def broken(args):
        raise ValueError("a bug")

    with pytest.raises(ValueError, match="a bug"):
        _dispatch(argparse.Namespace(func=broken))
