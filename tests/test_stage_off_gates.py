"""Issue 34 item 7: no gate reads a stage that did not run, and a gate failure is the release's
one-line refusal (exit 1) naming the staged report, never a traceback.

Per gate: a stage's own gate (prb.max_identification_risk, massc.delta) exists only when the
stage ran; the assessment's gates measure the published file whatever stages ran (the
re-identification gate, gates.xi, with PRB off: the attacks on the published file); delta_max
with MASSC off stays a gate on the published file when sensitive variables score the records,
and is refused by the spec check when none does (delta would only count the records published
with their original keys: 1.0 when nothing changes a key, the NMIHS run of the issue)."""

import pickle
from pathlib import Path

import pandas as pd
import pytest
import yaml
from helpers import MINI_SPEC, fast_spec

from expectations.suites import GateFailed, failed_checks, validate_metric_gates
from flows.cli import default_spec_text
from flows.cli import main as puf
from sdl_design.spec import SpecError, parse_spec
from sdl_design.stages import run_stages
from sdl_design.synth import make_survey

# the assessment's gates on the demo spec (delta_max, epsilon_max, xi, se_ratio set; a model)
ASSESSED = {
    "utility: median CI overlap of domain estimates",
    "utility: 5th percentile CI overlap of domain estimates",
    "utility: share of domain estimates more than 2 original SEs off",
    "utility: smallest CI overlap of a model coefficient",
    "utility: 10th percentile of published/original SE ratios",
    "utility: 90th percentile of published/original SE ratios",
    "utility: epsilon, largest relative error of a study total",
    "risk: share of original sample uniques re-identified (worst exact-match attack)",
    "risk: delta (MASSC) of the published file against the original keys",
    "risk: share of original PSUs given away by replicate-weight zero patterns",
}
PRB_GATE, MASSC_GATE = "prb.max_identification_risk", "massc.delta"
REID = "risk: share of original sample uniques re-identified (worst exact-match attack)"
DELTA = "risk: delta (MASSC) of the published file against the original keys"


def _mini(**changes) -> dict:
    data = yaml.safe_load(yaml.safe_dump(MINI_SPEC))
    data["gates"] = {"delta_max": 0.25, "xi": 0.395}
    for k, v in changes.items():
        node = data
        *head, last = k.split(".")
        for h in head:
            node = node.setdefault(h, {})
        node[last] = v
    return data


# ---------------------------------------------------------------- the spec check


@pytest.mark.parametrize(
    ("massc", "said"),
    [({"enabled": False}, "stages.massc.enabled: false"), (None, "no stages.massc")],
)
def test_delta_max_without_massc_or_sensitive_variable_is_refused(massc, said):
    """The NMIHS case: MASSC off (the tool's advice for a file without sensitive variables) and
    gates.delta_max set: refused before any work, naming the field, why and both fixes."""
    data = _mini(**{"variables.sensitive": [], "stages.massc": massc})
    with pytest.raises(SpecError) as ei:
        parse_spec(data)
    (line,) = ei.value.problems
    assert f"gates.delta_max: MASSC is off ({said}) and variables.sensitive is empty" in line
    assert "drop gates.delta_max" in line and "enable MASSC" in line
    data["gates"].pop("delta_max")  # the fix: no gate, the release goes on
    parse_spec(data)


def test_gates_measured_on_the_published_file_stay_valid_with_their_stage_off():
    """gates.xi with PRB off and gates.delta_max with MASSC off (sensitive variables declared)
    are gates on the published file: the spec stays valid."""
    no_prb = parse_spec(_mini(**{"stages.prb.enabled": False}))
    assert no_prb.stages.active("prb") is None and no_prb.gates.xi is not None
    no_massc = parse_spec(_mini(**{"stages.massc": {"enabled": False}}))
    assert no_massc.stages.active("massc") is None and no_massc.gates.delta_max is not None


def test_cli_refuses_the_nmihs_spec_in_words(tmp_path, capsys):
    """`puf run` on the spec of the issue's NMIHS run: exit 2 before any work (no flow, no
    traceback), the one problem said once."""
    data = _mini(**{"variables.sensitive": [], "stages.massc": {"enabled": False}})
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    assert puf(["run", str(path), "--approve", "x"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.count("puf: release spec is not valid") == 1
    assert "gates.delta_max: MASSC is off" in err


# ---------------------------------------------------------------- the gate set by stage


@pytest.fixture(scope="module")
def demo():
    data = yaml.safe_load(default_spec_text())
    data["stages"]["massc"]["replications"] = 0
    data["stages"]["swap"]["enabled"] = False  # no gate of its own; the slowest stage here
    return data, make_survey(seed=data["release"]["seed"], n_persons=1500)


@pytest.mark.parametrize(
    "off",
    [("massc",), ("prb",), ("prb", "massc")],
    ids=["massc-off", "prb-off", "only-topcode"],
)
def test_a_stage_gate_exists_only_when_its_stage_ran(demo, off):
    """Each stage turned off in turn: its own gate is gone, the assessment's gates on the
    published file are all there (gates.xi and delta_max set in every run)."""
    data, df = demo
    data = yaml.safe_load(yaml.safe_dump(data))
    for s in off:
        data["stages"][s]["enabled"] = False
    spec = parse_spec(data)
    res = run_stages(spec, df)
    ran = {r.name for r in res}
    assert not ran & set(off)
    names = {g.name for r in res for g in r.gates}
    own = {PRB_GATE} - ({PRB_GATE} if "prb" in off else set())
    own |= {MASSC_GATE} - ({MASSC_GATE} if "massc" in off else set())
    assert names == ASSESSED | own
    by_stage = {g.name: r.name for r in res for g in r.gates}
    assert {by_stage[n] for n in ASSESSED} == {"assess"}


# ---------------------------------------------------------------- the suites' messages


def test_a_results_table_without_a_column_is_named_not_a_key_error():
    """A results table without its verdict, name or detail column: every check without a
    verdict counts as failed and the message names the missing columns (no KeyError)."""
    table = pd.DataFrame({"value": [1.0, 2.0], "threshold": ["<= 1", "<= 1"]})
    text = str(GateFailed("release gates failed", table))
    assert text.splitlines() == [
        "release gates failed: 2 of 2 checks failed (the results table has no 'name', "
        "'passed', 'detail' columns)",
        "  - check 1: no verdict",
        "  - check 2: no verdict",
    ]
    # the KeyError: a spec without edit rules adds an empty (object) edits table to the
    # gates, so the verdicts became objects and `~passed` integers read as column labels
    gates = pd.DataFrame([{"name": "risk: d", "passed": False, "detail": "1 is above 0.25"}])
    gates = pd.concat([pd.DataFrame(columns=gates.columns), gates], ignore_index=True)
    assert gates["passed"].dtype == object
    assert str(GateFailed("g", gates)).splitlines() == [
        "g: 1 of 1 checks failed",
        "  - risk: d: 1 is above 0.25",
    ]
    # verdicts as a CSV gives them back (text), or missing: only 'True' holds
    csv = pd.DataFrame({"name": ["a", "b", "c"], "passed": ["True", "False", None]})
    failed, what = failed_checks(csv)
    assert failed == [("b", "no detail"), ("c", "no detail")]
    assert what == " (the results table has no 'detail' column)"


def test_one_line_refusal_names_the_failed_checks_and_the_report(tmp_path):
    table = pd.DataFrame(
        {
            "name": ["risk: x", "utility: y", "output: z"],
            "passed": [False, True, False],
            "detail": ["1 is above 0.4 by 0.6; declared keys: 100%", "within bounds", "a\nb"],
        }
    )
    report = tmp_path / "report.html"
    e = GateFailed("release gates failed; nothing was published", table, report)
    assert "\n" not in e.one_line() and "the staged report" not in e.one_line()  # not written
    report.write_text("<html></html>")
    assert e.one_line() == (
        "release gates failed; nothing was published: 2 of 3 checks failed (risk: x: 1 is above "
        f"0.4 by 0.6; output: z: a b); the staged report: {report}"
    )
    again = pickle.loads(pickle.dumps(e))  # across Dask workers, with its report
    assert again.report == report and again.one_line() == e.one_line()


def test_metric_gates_that_cannot_be_evaluated_fail_saying_why(monkeypatch):
    """Great Expectations failing on the metric suite refuses the release with the reason in
    each gate's detail, instead of a RuntimeError traceback; a gate without a name is named by
    its place."""
    import expectations.suites as suites

    real = suites._run

    def broken(df, checks, suite, index_col, examples=5):
        out = real(df, checks, suite, index_col, examples)
        out[0]["error"] = "column 'value' not found"
        return out

    monkeypatch.setattr(suites, "_run", broken)
    res = validate_metric_gates(
        [{"name": "a", "value": 0.1, "upper": 0.25}, {"value": 0.5, "lower": 0.2, "upper": 0.9}]
    )
    assert res["name"].tolist() == ["a", "gate 2 (no name)"]
    assert not res["passed"].any()
    assert all("not evaluated (the metric gate suite: not_missing: column 'value' not found)" in d
               for d in res["detail"])  # fmt: skip


# ---------------------------------------------------------------- a whole release


@pytest.mark.flow
@pytest.mark.usefixtures("prefect_server")
@pytest.mark.parametrize("partitions", [None, 2], ids=["in-memory", "by-partition"])
def test_failing_gate_is_a_one_line_refusal_naming_the_staged_report(tmp_path, capsys, partitions):
    """PRB, MASSC and the swap off, gates.xi and delta_max set: the untreated file fails the
    re-identification gate measured on it. The run ends with exit 1 and one line (the failed
    checks, the staged report's path), no traceback; the gates are the assessment's and the
    output checks, no stage gate of a stage that did not run."""
    path = fast_spec(tmp_path, 1500, **{"gates.xi": 0.395})
    argv = ["run", str(path), "--approve", "x"] + (["--partitions", "2"] if partitions else [])
    assert puf(argv) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err
    said = [ln for ln in err.splitlines() if not ln.startswith("[puf")]
    assert len(said) == 1 and said[0].startswith("puf: release gates failed"), err[-2000:]
    assert f"{REID}: " in said[0]
    report = said[0].split("; the staged report: ")[1]
    assert report.endswith("staged/internal/report.html") and Path(report).is_file()
    gates = pd.read_csv(Path(report).with_name("gates.csv"))
    names = {n for n in gates["name"] if not n.startswith("output: ")}
    assert PRB_GATE not in names and MASSC_GATE not in names
    assert {REID, DELTA} <= names <= ASSESSED
    failed = set(gates.loc[~gates["passed"].astype(bool), "name"])
    assert REID in failed
