"""Great Expectations suites: edit rules on a survey file, threshold gates on metrics, output-file gates.

Each suite runs on an ephemeral GX context and returns a results table with one row per check:
name, passed, value, threshold, detail (what failed, by how much, example records).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from sdl_design.edits import rule_failures
from sdl_design.spec import ReleaseSpec

RESULT_COLUMNS = ["name", "passed", "value", "threshold", "detail"]
_ROW = "__row"


class GateFailed(RuntimeError):
    """A suite failed; `results` is its results table. report: the staged report of the
    attempt the failure closed (set by the release when it is written), for one_line."""

    def __init__(self, title: str, results: pd.DataFrame, report: Path | None = None):
        self.title, self.results, self.report = title, results, report
        failed, what = failed_checks(results)
        lines = [f"{title}: {len(failed)} of {len(results)} checks failed" + what]
        lines += [f"  - {name}: {detail}" for name, detail in failed]
        super().__init__("\n".join(lines))

    def __reduce__(self):  # picklable across Dask workers despite the extra arguments
        return type(self), (self.title, self.results, self.report)

    def one_line(self, shown: int = 5) -> str:
        """The refusal in one line: the title, each failed check (up to `shown`) with the
        first clause of its detail (the worst estimates are in the report), and the staged
        report's path when it was written."""
        failed, what = failed_checks(self.results)
        checks = "; ".join(f"{name}: {_gist(detail)}" for name, detail in failed[:shown])
        more = f"; and {len(failed) - shown} more" if len(failed) > shown else ""
        text = f"{self.title}: {len(failed)} of {len(self.results)} checks failed{what}"
        text += f" ({checks}{more})" if checks else ""
        if self.report is not None and Path(self.report).is_file():
            text += f"; the staged report: {self.report}"
        return " ".join(text.split())  # one line, whatever a detail holds


def _gist(detail: str) -> str:
    """A failed check's detail in brief: its first clause and the fix it names, if any."""
    parts = str(detail).split("; ")
    return "; ".join([parts[0], *(p for p in parts[1:] if p.startswith("fix: "))])


def _verdicts(passed: pd.Series) -> np.ndarray:
    """Each verdict as a bool: True (or 1, or the text 'true', as a CSV gives it back) holds,
    anything else (False, None, NaN, text) fails."""
    return passed.map(lambda v: str(v).strip().lower() in ("true", "1", "1.0")).to_numpy(bool)


def failed_checks(results: pd.DataFrame) -> tuple[list[tuple[str, str]], str]:
    """(name, detail) of each failed check of a results table, and what the table lacks (''
    when it is whole): a table without a verdict column counts every check as failed, a
    verdict stored as object (a gate that could not be evaluated: None) is a failure, a
    missing name is the check's row (counted from 1)."""
    lacks = [c for c in ("name", "passed", "detail") if c not in results.columns]
    what = (
        f" (the results table has no {', '.join(repr(c) for c in lacks)} column"
        f"{'s' if len(lacks) > 1 else ''})"
        if lacks
        else ""
    )
    n = len(results)
    passed = (
        _verdicts(results["passed"]) if "passed" in results.columns else np.zeros(n, dtype=bool)
    )
    names = results["name"] if "name" in results.columns else pd.Series([None] * n)
    details = results["detail"] if "detail" in results.columns else pd.Series([None] * n)
    out = []
    for i, (name, detail, ok) in enumerate(zip(names, details, passed, strict=True)):
        if ok:
            continue
        name = f"check {i + 1}" if name is None or pd.isna(name) else str(name)
        if "passed" not in results.columns:
            detail = "no verdict"
        out.append((name, "no detail" if detail is None or pd.isna(detail) else str(detail)))
    return out, what


def _gx():
    import great_expectations as gx
    import great_expectations.expectations as gxe
    from great_expectations.data_context.types.base import ProgressBarsConfig

    # GX sets this logger to INFO on import ('ephemeral docs site' lines on every context)
    logging.getLogger("great_expectations.data_context.types.base").setLevel(logging.WARNING)
    ctx = gx.get_context(mode="ephemeral")
    ctx.variables.progress_bars = ProgressBarsConfig(globally=False)
    return gx, gxe, ctx


def _run(
    df: pd.DataFrame,
    checks: list[tuple[str, Any]],
    suite: str,
    index_col: str,
    examples: int | None = 5,
) -> list[dict]:
    """Run (label, expectation) pairs on df; one raw result dict per check, in order, with up
    to `examples` failing index values (None: all)."""
    gx, _, ctx = _gx()
    bd = (
        ctx.data_sources.add_pandas(f"{suite}_src")
        .add_dataframe_asset(suite)
        .add_batch_definition_whole_dataframe("whole")
    )
    s = ctx.suites.add(gx.ExpectationSuite(name=suite, expectations=[e for _, e in checks]))
    vd = gx.ValidationDefinition(name=f"{suite}_vd", data=bd, suite=s)
    res = vd.run(
        batch_parameters={"dataframe": df},
        result_format={
            "result_format": "COMPLETE",
            "unexpected_index_column_names": [index_col],
            "partial_unexpected_count": 5,
        },
    )
    by_id = {r.expectation_config.id: r for r in res.results}
    out = []
    for label, exp in checks:
        r = by_id.get(exp.id)
        if r is None:  # a check GX gave no result for fails, saying so
            out.append(_no_result(label, len(df)))
            continue
        result = r.result or {}
        err = [
            v.get("exception_message")
            for v in (r.exception_info or {}).values()
            if isinstance(v, dict) and v.get("raised_exception")
        ]
        out.append(
            {
                "label": label,
                "success": bool(r.success),
                "unexpected_count": int(result.get("unexpected_count") or 0),
                "element_count": int(result.get("element_count") or len(df)),
                "examples": [
                    v.item() if isinstance(v, np.generic) else v
                    for v in (d.get(index_col) for d in (result.get("unexpected_index_list") or []))
                ][:examples],
                "missing_count": int(result.get("missing_count") or 0),
                "observed": result.get("observed_value"),
                "error": "; ".join(e for e in err if e),
            }
        )
    return out


def _no_result(label: str, n: int) -> dict:
    """The raw result of a check Great Expectations returned no result for: failed, with why."""
    return {
        "label": label,
        "success": False,
        "unexpected_count": 0,
        "element_count": n,
        "examples": [],
        "missing_count": 0,
        "observed": None,
        "error": "Great Expectations returned no result for this check",
    }


def _col(name: str):
    from great_expectations.expectations.row_conditions import Column

    return Column(name)


# ---------------------------------------------------------------- edit rules


def validate_edits(df: pd.DataFrame, rules: Sequence, id_column: str | None = None) -> pd.DataFrame:
    """Results table of the edit rules on df (examples are id_column values, else row numbers
    counted from 1, as in a spreadsheet). The release and `puf validate` give no id_column: a
    direct identifier's values never reach a message, a log or an artifact.

    Each rule evaluates itself once in pandas (sdl_design.edits: violations(), the one edit-rule
    implementation); GX gives each rule's verdict from a one-row table of the failing counts
    (one column per rule, expected 0), so the data are read once, not again by GX. A rule that
    cannot be evaluated (e.g. a column not in the data) fails with the reason.
    """
    if not rules:
        return pd.DataFrame(columns=RESULT_COLUMNS)

    idx = id_column if id_column and id_column in df.columns else _ROW
    ids = df[idx].to_numpy() if idx != _ROW else np.arange(1, len(df) + 1)
    return edit_verdicts(rules, rule_failures(df, rules, ids), idx.strip("_"))


def edit_verdicts(rules: Sequence, failures: list, what: str = "row") -> pd.DataFrame:
    """The results table of edit rules from their failures (sdl_design.edits.rule_failures
    of the file, or its partitions' combined): GX gives each rule's verdict from a one-row
    table of the failing counts; what: the name of the examples' ids (row or a column)."""
    return count_verdicts([rule.label(i) for i, rule in enumerate(rules)], failures, what)


def count_verdicts(labels: Sequence[str], failures: list, what: str = "row") -> pd.DataFrame:
    """The results table of record checks (labels) from their failures: per check (failing
    records, examples) or the reason it could not be evaluated (text), as rule_failures gives
    them; GX gives each check's verdict from a one-row table of the failing counts."""
    counts, details = [], []
    for f in failures:
        if isinstance(f, str):  # the rule could not be evaluated: the reason
            counts.append(float("nan"))
            details.append(f)
            continue
        n, examples = f
        counts.append(float(n))
        details.append("holds" if n == 0 else f"{n} records fail (e.g. {what} {examples})")
    _, gxe, _ = _gx()
    # one expectation over a table of one row per check (GX's cost grows faster than linearly
    # in expectations: 5,000 rules took 4 minutes as 5,000 expectations): its failing rows
    # are the checks that fail
    table = pd.DataFrame({"failing": counts, _ROW: np.arange(len(counts))})
    check = [("edit rules", gxe.ExpectColumnValuesToBeInSet(column="failing", value_set=[0.0]))]
    got = _run(table, check, "edits", _ROW, examples=None)[0]
    failed, broken = set(got["examples"]), got["error"]
    rows = []
    for i, (label, n, detail) in enumerate(zip(labels, counts, details, strict=True)):
        evaluated = not np.isnan(n)
        success = i not in failed
        if evaluated and not broken and success != (n == 0):
            broken = f"Great Expectations and the failing count {n:g} of {label} disagree"
        if broken:  # no verdict can be trusted: the check fails, saying why
            detail, evaluated = f"not evaluated ({broken}); {detail}", False
        rows.append(
            {
                "name": label,
                "passed": success and evaluated,
                "value": n if evaluated else 0.0,
                "threshold": "0 failing records",
                "detail": detail,
            }
        )
    return pd.DataFrame(rows, columns=RESULT_COLUMNS)


# ---------------------------------------------------------------- metric gates


def gate_frame(gates: Sequence[dict]) -> pd.DataFrame:
    """Gate dicts -> frame name, value, lower, upper (float, NaN where open), explain (text
    added to a failure: e.g. the worst estimates)."""
    f = pd.DataFrame(list(gates), columns=["name", "value", "lower", "upper", "explain"])
    f["explain"] = f["explain"].fillna("").astype(str)
    # a gate without a name is named by its place (its verdict still counts)
    f["name"] = [
        n if isinstance(n, str) and n else f"gate {i + 1} (no name)"
        for i, n in enumerate(f["name"])
    ]
    for c in ("value", "lower", "upper"):
        f[c] = pd.to_numeric(f[c], errors="coerce").astype(float)
    return f


def _threshold(lower: float, upper: float) -> str:
    lo, hi = (None if np.isnan(x) else x for x in (lower, upper))
    if lo is not None and hi is not None:
        return f"[{lo:g}, {hi:g}]"
    if lo is None and hi is None:
        return "no bound"
    return f">= {lo:g}" if lo is not None else f"<= {hi:g}"


def validate_metric_gates(gates: Sequence[dict]) -> pd.DataFrame:
    """Threshold gates on metrics (value within [lower, upper]) as a GX suite; results table."""
    f = gate_frame(gates)
    if f.empty:
        return pd.DataFrame(columns=RESULT_COLUMNS)
    _, gxe, _ = _gx()
    checks = [
        ("not_missing", gxe.ExpectColumnValuesToNotBeNull(column="value")),
        (
            "above_lower",
            gxe.ExpectColumnPairValuesAToBeGreaterThanB(
                column_A="value",
                column_B="lower",
                or_equal=True,
                ignore_row_if="either_value_is_missing",
            ),
        ),
        (
            "below_upper",
            gxe.ExpectColumnPairValuesAToBeGreaterThanB(
                column_A="upper",
                column_B="value",
                or_equal=True,
                ignore_row_if="either_value_is_missing",
            ),
        ),
    ]
    res = {r["label"]: r for r in _run(f, checks, "metric_gates", "name")}
    missing = f["value"].isna()
    below = f["lower"].notna() & ~(f["value"] >= f["lower"])
    above = f["upper"].notna() & ~(f["value"] <= f["upper"])
    # GX gives the verdict per check; the table says by how much. They must agree: when GX
    # could not evaluate a check or disagrees, no gate holds (the release is refused, saying
    # why), never a traceback.
    broken = [f"{r['label']}: {r['error']}" for r in res.values() if r["error"]]
    for label, fails in (
        ("not_missing", missing),
        ("above_lower", below & ~missing),
        ("below_upper", above & ~missing),
    ):
        if not res[label]["error"] and res[label]["success"] == bool(fails.any()):
            broken.append(f"{label}: Great Expectations and the results table disagree")
    rows = []
    for g, m, b, a in zip(f.itertuples(), missing, below, above, strict=True):
        if m:
            detail = "metric is missing"
        elif b:
            detail = f"{g.value:.6g} is below {g.lower:g} by {g.lower - g.value:.4g}"
        elif a:
            detail = f"{g.value:.6g} is above {g.upper:g} by {g.value - g.upper:.4g}"
        else:
            detail = "within bounds"
        if (m or b or a) and g.explain:
            detail += f"; {g.explain}"
        if broken:
            detail = f"not evaluated (the metric gate suite: {'; '.join(broken)}); {detail}"
        rows.append(
            {
                "name": g.name,
                "passed": not (m or b or a or broken),
                "value": g.value,
                "threshold": _threshold(g.lower, g.upper),
                "detail": detail,
            }
        )
    out = pd.DataFrame(rows, columns=RESULT_COLUMNS)
    return out


# ---------------------------------------------------------------- output file


def output_checks(spec: ReleaseSpec, masked_design: bool) -> tuple[list[str], list[str]]:
    """(columns that must not be in the PUF, columns that must be in it)."""
    d = spec.design
    required = [d.weight, *spec.variables.key_names, *spec.variables.study]
    if masked_design:  # the masked or pseudo labels (a design may have neither)
        required += [c for c in (d.strata, d.psu) if c]
    return spec.unpublished_columns(masked_design), list(dict.fromkeys(required))


def validate_output(
    puf: pd.DataFrame,
    spec: ReleaseSpec,
    replicate_columns: Sequence[str],
    masked_design: bool,
    detail: pd.DataFrame | None = None,
) -> pd.DataFrame:
    """Gates on the public file: no identifiers or original labels, required columns, weights,
    edits. detail: the public records with each coded key's values before its published coding
    (the edit rules read values, and a coding only coarsens them)."""
    _, gxe, _ = _gx()
    rows = _column_rows(list(puf.columns), spec, masked_design)
    idx = _ROW
    reps = [c for c in replicate_columns if c in puf.columns]
    # GX reads only the checked columns: given the whole file it copied and hashed every
    # column (its batch fingerprint, under 1 GB), 3 s of the gates at 1M records
    w = spec.design.weight
    frame = pd.DataFrame({w: puf[w]} if w in puf.columns else {}, index=puf.index)
    frame[_ROW] = np.arange(1, len(puf) + 1)  # rows counted from 1
    if reps:
        frame["__replicate_min"] = _row_min(puf, reps)
    checks = []
    for label, kind in output_record_checks(spec, list(puf.columns), reps):
        if kind == "positive":
            e = gxe.ExpectColumnValuesToBeBetween(
                column=spec.design.weight, min_value=0, strict_min=True
            )
        elif kind == "not_null":
            e = gxe.ExpectColumnValuesToNotBeNull(column=spec.design.weight)
        else:
            e = gxe.ExpectColumnValuesToBeBetween(column="__replicate_min", min_value=0)
        checks.append((label, e))
    for r in _run(frame, checks, "output_file", idx):
        rows.append(
            {
                "name": r["label"],
                "passed": r["success"],
                "value": float(r["unexpected_count"]),
                "threshold": "0 failing records",
                "detail": "holds"
                if r["success"]
                else (
                    r["error"]
                    or f"{r['unexpected_count']} records fail (e.g. rows {r['examples']})"
                ),
            }
        )
    edits = validate_edits(puf if detail is None else detail, spec.edits)
    edits["name"] = "output: " + edits["name"]
    return pd.concat([pd.DataFrame(rows, columns=RESULT_COLUMNS), edits], ignore_index=True)


def output_record_checks(
    spec: ReleaseSpec, columns: Sequence[str], replicate_columns: Sequence[str]
) -> list[tuple[str, str]]:
    """(label, kind) of the public file's record checks: the weight positive ('positive') and
    present ('not_null'), the replicate weights >= 0 ('replicate_min')."""
    out = []
    w = spec.design.weight
    if w in columns:
        out += [(f"output: weight {w} positive", "positive")]
        out += [(f"output: weight {w} not missing", "not_null")]
    reps = [c for c in replicate_columns if c in columns]
    if reps:
        label = f"output: replicate weights {reps[0]}..{reps[-1]} ({len(reps)}) >= 0"
        out.append((label, "replicate_min"))
    return out


def record_failures(
    df: pd.DataFrame,
    spec: ReleaseSpec,
    replicate_columns: Sequence[str],
    ids: np.ndarray,
    examples: int = 5,
) -> list:
    """output_record_checks' failures on df's records, as rule_failures gives them (failing
    records and the ids of the first `examples`): missing values fail only 'not_null', as a
    GX column check skips them."""
    reps = [c for c in replicate_columns if c in df.columns]
    out = []
    for _, kind in output_record_checks(spec, list(df.columns), reps):
        if kind == "replicate_min":
            x = _row_min(df, reps)
            bad = ~np.isnan(x) & (x < 0)
        else:
            x = pd.to_numeric(df[spec.design.weight], errors="coerce").to_numpy(dtype=float)
            bad = np.isnan(x) if kind == "not_null" else ~np.isnan(x) & ~(x > 0)
        out.append((int(bad.sum()), np.asarray(ids)[bad][:examples].tolist()))
    return out


def _row_min(df: pd.DataFrame, columns: Sequence[str]) -> np.ndarray:
    """Each record's smallest value of columns, missing values skipped (NaN: all missing), as
    df[columns].min(axis=1): a column at a time, no copy of the columns as one frame."""
    x = df[columns[0]].to_numpy(dtype=float, na_value=np.nan, copy=True)
    for c in columns[1:]:
        np.fmin(x, df[c].to_numpy(dtype=float, na_value=np.nan), out=x)
    return x


def output_verdicts(
    columns: Sequence[str],
    spec: ReleaseSpec,
    replicate_columns: Sequence[str],
    masked_design: bool,
    records: list,
    edits: list,
) -> pd.DataFrame:
    """validate_output's table from the public file's columns and its record checks' and edit
    rules' failures (record_failures, rule_failures: a file written by partition, combined)."""
    reps = [c for c in replicate_columns if c in columns]
    labels = [label for label, _ in output_record_checks(spec, columns, reps)]
    checks = count_verdicts(labels, records, "row")
    rules = edit_verdicts(spec.edits, edits)
    rules["name"] = "output: " + rules["name"]
    cols = pd.DataFrame(_column_rows(list(columns), spec, masked_design), columns=RESULT_COLUMNS)
    return pd.concat([cols, checks, rules], ignore_index=True)


def _column_rows(columns: list[str], spec: ReleaseSpec, masked_design: bool) -> list[dict]:
    """The public file's column checks: no forbidden column, every required one."""
    _, gxe, _ = _gx()
    forbidden, required = output_checks(spec, masked_design)
    rows = []
    names = forbidden + [c for c in columns if str(c).startswith("__")]
    cols = pd.DataFrame(
        {
            "column": names + required,
            "present": [c in columns for c in names] + [c in columns for c in required],
            "kind": ["forbidden"] * len(names) + ["required"] * len(required),
        }
    )
    present = sorted(cols.loc[cols.present & (cols.kind == "forbidden"), "column"])
    absent = [c for c in required if c not in columns]
    checks = [
        (
            "forbidden",
            gxe.ExpectColumnValuesToBeInSet(
                column="present", value_set=[False], row_condition=_col("kind") == "forbidden"
            ),
        ),
        (
            "required",
            gxe.ExpectColumnValuesToBeInSet(
                column="present", value_set=[True], row_condition=_col("kind") == "required"
            ),
        ),
    ]
    forb, req = _run(cols, checks, "output_columns", "column")
    rows.append(
        {
            "name": "output: no direct identifiers, original design labels or internal columns",
            "passed": forb["success"],
            "value": float(forb["unexpected_count"]),
            "threshold": "0 columns",
            "detail": "none present" if forb["success"] else f"present: {present}",
        }
    )
    rows.append(
        {
            "name": f"output: the {len(required)} weight, key, study and design columns present",
            "passed": req["success"],
            "value": float(req["unexpected_count"]),
            "threshold": "0 missing",
            "detail": "all present" if req["success"] else f"missing: {absent}",
        }
    )
    return rows
