"""Hostile specs and inputs are bounded and named (issue 35, first items): an alias bomb, a
spec of 20,000 rules, reserved column names, formula-leading header names, Ctrl-C, a closed
pipe and a gate verdict that could not be evaluated."""

from __future__ import annotations

import subprocess
import sys
import time

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
