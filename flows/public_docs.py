"""What the analyst reads: the codebook and the public README (the methods that ran, with the
parameters an analyst may use for inference, and variance estimation in R, Stata, SAS, SUDAAN
and Python). Everything is read from the stage results of the run: a stage that did not run is
not described. The same per-column account feeds the board report (flows.report)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd

from sdl_design.describe import PAPERS, REPLICATES, pct
from sdl_design.public_summary import (
    RECORDS,
    VALUES_MAX,
    PsuKey,
    PublicSummary,
    public_summary,
    record_jkn_scales,
)
from sdl_design.spec import ReleaseSpec
from sdl_design.stages import assessment_of, described
from sdl_design.survey.design import UNIT_WEIGHT, SurveyDesign

if TYPE_CHECKING:
    from sdl_design.stage import StageResult

CLOSED_FORM = {
    "brr": "1/R",
    "fay": "1/(R(1-rho)^2)",
    "jk1": "(R-1)/R",
    "jkn": "(n_h-1)/n_h of the stratum whose PSU replicate r deletes",
    "sdr": "4/R",
    "bootstrap": "1/R",
}
METHOD_NAME = {
    "brr": "balanced repeated replication (BRR)",
    "fay": "Fay's BRR",
    "jk1": "delete-one jackknife (JK1)",
    "jkn": "stratified delete-one-PSU jackknife (JKn)",
    "sdr": "successive difference replication (SDR)",
    "bootstrap": "bootstrap",
}

# what flows.public_files.neutralize_formulas does, said in the public README
CSV_FORMULA_NOTE = (
    "In `puf.csv` and `codebook.csv` a text value that begins with =, +, -, @, a tab or a "
    "carriage return is written with a single quote (') in front, so that a spreadsheet shows "
    "it instead of running it as a formula; numbers are written as numbers, and `puf.parquet` "
    "keeps every value exactly as it is."
)


# the public file of the replicate weights' multipliers (columns replicate, rscale)
REPLICATE_SCALES = "replicate_scales.csv"


class PublicReadme(str):
    """The README text; `.codebook_notes` holds what the codebook adds per variable
    (treatment, top-code threshold and count), `.replicate_scales` the replicate weights'
    multipliers c_r (replicate, rscale: REPLICATE_SCALES; None without replicate weights)."""

    codebook_notes: dict[str, dict[str, Any]]
    replicate_scales: pd.DataFrame | None

    def __new__(
        cls,
        text: str,
        codebook_notes: dict[str, dict[str, Any]] | None = None,
        replicate_scales: pd.DataFrame | None = None,
    ):
        obj = super().__new__(cls, text)
        obj.codebook_notes = dict(codebook_notes or {})
        obj.replicate_scales = replicate_scales
        return obj


def column_span(cols: list[str]) -> str:
    """Columns in order as 'first .. last (n columns)' (one column: its name)."""
    return cols[0] if len(cols) == 1 else f"{cols[0]} .. {cols[-1]} ({len(cols)} columns)"


def _code(name: str) -> str:
    """A column (or a column_span of columns) as markdown code: `a` .. `b` (n columns)."""
    first, sep, rest = name.partition(" .. ")
    if not sep or not rest.endswith(" columns)"):
        return f"`{name}`"
    last, _, count = rest.rpartition(" (")
    return f"`{first}` .. `{last}` ({count}"


# ---------------------------------------------------------------- what was done to each column


def design_facts(spec: ReleaseSpec | None, results: Sequence[StageResult]) -> dict[str, Any]:
    """The published design: weight, strata/PSU names, whether they are pseudo labels and which
    stage made them, replicate method and rho. spec None (the report): from the results alone."""
    mask = next((r for r in results if r.masks_design), None)
    p = mask.params if mask is not None else {}
    a = assessment_of(results)
    roles = a.params.get("published_columns", {}) if a is not None else {}

    def role(name: str) -> str | None:
        return (roles.get(name) or [None])[0]

    pub = p.get("public_design") if isinstance(p.get("public_design"), dict) else {}
    d = spec.design if spec is not None else None
    rw = d.replicate_weights if d is not None else None
    method = pub.get("replicate_method") or p.get("replicate_method") or (rw.method if rw else None)
    if method is None and a is not None:  # "..., 70 jkn replicate weights"
        words = str(a.params.get("design_released", "")).split()
        method = words[-3] if len(words) >= 3 and words[-2:] == ["replicate", "weights"] else None

    def named(*vals: Any) -> str | None:  # the first value that is a column name
        return next((v for v in vals if isinstance(v, str) and v), None)

    names = [r.name for r in results]
    replaced = names[: names.index(mask.name)] if mask is not None else []
    return {
        "weight": pub.get("weight") or (d.weight if d is not None else role("weight") or ""),
        "strata": named(
            pub.get("strata"),
            getattr(d, "strata", None) if d is not None else role("stratum"),
        ),
        "psu": named(pub.get("psu"), getattr(d, "psu", None) if d is not None else role("PSU")),
        "replicate_weights": list(pub.get("replicate_weights") or []),
        "masked_by": mask.name if mask is not None else None,
        "method": method,
        "rho": pub.get("rho", p.get("rho", rw.rho if rw else None)),
        # the stages that ran before the masking stage rebuilt the replicate weights
        "replaced_after": replaced,
    }


def _describing(
    results: Sequence[StageResult], des: dict[str, Any]
) -> list[tuple[Any, StageResult]]:
    """(stage class, result) of the results that ran and changed something in the published
    file (Describes.public_no_effect), the stage that masked the design first, then the others
    in release order."""
    acted = [(c, r) for c, r in described(results) if c.public_no_effect(r, des) is None]
    return sorted(acted, key=lambda cr: not cr[1].masks_design)


def no_effect(results: Sequence[StageResult], des: dict[str, Any]) -> list[str]:
    """The sentences of the stages that ran but changed nothing in the published file."""
    said = (c.public_no_effect(r, des) for c, r in described(results))
    return [s for s in said if s is not None]


def column_treatments(
    spec: ReleaseSpec | None,
    results: Sequence[StageResult],
    columns: Sequence[str] | None = None,
) -> pd.DataFrame:
    """One row per published column (replicate weights as one row): its role and what was done
    to it, as the stages that ran describe it. columns: the published columns (default: those
    the assessment recorded). Columns: column, role, treatment."""
    a = assessment_of(results)
    roles: dict[str, list[str]] = a.params.get("published_columns", {}) if a is not None else {}
    role_of = {c: role for role, cols in roles.items() for c in cols}
    if columns is None:
        columns = [c for cols in roles.values() for c in cols]
    des = design_facts(spec, results)
    done: dict[str, list[str]] = {c: [] for c in columns}
    replicates = ""
    for cls, res in _describing(results, des):
        for c, texts in cls.public_treatments(res, des).items():
            if c == REPLICATES:
                replicates += "".join(texts)
            elif c in done:
                done[c] += texts
    reps = [c for c in columns if role_of.get(c) == "replicate weight"]
    rows = []
    for c in columns:
        if c in reps[1:]:
            continue
        name, role = (
            (column_span(reps), "replicate weights") if c in reps[:1] else (c, role_of.get(c))
        )
        what = done[c]
        if c in reps[:1]:
            what = [
                f"{METHOD_NAME.get(des['method'], des['method'])} replicate weights{replicates}"
            ]
        rows.append(
            {"column": name, "role": role or "", "treatment": "; ".join(what) or "unchanged"}
        )
    return pd.DataFrame(rows, columns=["column", "role", "treatment"])


def dropped_columns(results: Sequence[StageResult]) -> dict[str, str]:
    """Input columns not published, with why (as the assessment recorded them)."""
    a = assessment_of(results)
    return dict(a.params.get("dropped_columns", {})) if a is not None else {}


def dropped_groups(dropped: dict[str, str]) -> list[tuple[list[str], str]]:
    """The columns not published grouped by their reason, in order: (columns, why)."""
    by_why: dict[str, list[str]] = {}
    for c, why in dropped.items():
        by_why.setdefault(why, []).append(c)
    return [(cols, why) for why, cols in by_why.items()]


def dropped_lines(dropped: dict[str, str], listed: int = 4) -> list[str]:
    """The README's list of the columns not published: one line per reason, its columns named
    (more than `listed` of them: the first and last, and how many)."""
    out = []
    for cols, why in dropped_groups(dropped):
        named = (
            ", ".join(f"`{c}`" for c in cols)
            if len(cols) <= listed
            else f"`{cols[0]}` .. `{cols[-1]}` ({len(cols)} columns)"
        )
        out.append(f"- {named}: {why}")
    return out


# ---------------------------------------------------------------- replicate scale factors


def replicate_scales(
    puf: pd.DataFrame, weight: str, reps: list[str], method: str, rho: float | None, strata, psu
) -> np.ndarray:
    """The scale factor c_r of each replicate: V = sum_r c_r (theta_r - theta)^2 (the closed
    form of the method; JKn: (n_h-1)/n_h of the stratum of the PSU the replicate deletes).
    puf: the public frame, or its PSU rows (sdl_design.public_summary.psu_rows: the same
    factors)."""

    if RECORDS in puf.columns and method == "jkn":  # one row per stratum: records are PSUs
        return record_jkn_scales(puf, strata if strata in puf.columns else None, reps)
    des = SurveyDesign(
        puf,
        weight,
        strata if strata in puf.columns else None,
        psu if psu in puf.columns else None,
        replicate_weights=reps,
        method=method,
        rho=rho,
    )
    return np.asarray(des.rscales, dtype=float)


# ---------------------------------------------------------------- codebook


def codebook(
    puf: pd.DataFrame | PublicSummary, notes: dict[str, dict[str, Any]] | None = None
) -> pd.DataFrame:
    """One row per published variable: label, type, values/labels, missing codes, what was done
    to it and its top-code flag (threshold, records coded). puf: the public frame, or its
    PublicSummary (the partitioned release's, merged from its row groups)."""
    notes = notes or {}
    pub = puf if isinstance(puf, PublicSummary) else public_summary(puf)
    rows = []
    for c in pub.columns:
        st = pub.stats[c]
        info = notes.get(c, {})
        rows.append(
            {
                "variable": c,
                "label": info.get("label", ""),
                "type": "numeric" if st.numeric else "categorical",
                "dtype": st.dtype,
                "n_missing": st.n_missing,
                "missing_codes": info.get("missing_codes", ""),
                "n_distinct": st.n_distinct,
                "min": st.lo if st.n_distinct else None,
                "max": st.hi if st.n_distinct else None,
                "values": ""
                if st.numeric or st.n_distinct > VALUES_MAX
                else "; ".join(st.values or []),
                "treatment": info.get("treatment", ""),
                "topcoded": info.get("topcoded", ""),
            }
        )
    return pd.DataFrame(rows)


def _missing_codes(spec: ReleaseSpec) -> dict[str, str]:
    """Declared missing-value codes per variable (read defensively: the field may be absent)."""
    v = spec.variables
    codes = (
        getattr(v, "missing_codes", None)
        or getattr(v, "missing", None)
        or getattr(spec, "missing_codes", None)
        or getattr(spec, "missing", None)
        or {}
    )
    if hasattr(codes, "model_dump"):
        codes = codes.model_dump()
    if not isinstance(codes, dict):
        return {}
    return {
        str(k): "; ".join(map(str, c if isinstance(c, list | tuple) else [c]))
        for k, c in codes.items()
    }


# ---------------------------------------------------------------- README


def _readme_design(
    spec: ReleaseSpec, des: dict[str, Any], columns: list[str]
) -> tuple[str, str | None, str | None, list[str]]:
    """The published design the README's recipes use: weight, strata, PSU, replicate weights."""
    rw = spec.design.replicate_weights
    reps = [c for c in des["replicate_weights"] if c in columns] or (
        rw.resolve(columns) if rw else []
    )
    strata = des["strata"] if des["strata"] in columns else None
    psu = des["psu"] if des["psu"] in columns else None
    return des["weight"], strata, psu, reps


def psu_key(spec: ReleaseSpec, results: Sequence[StageResult], columns: list[str]) -> PsuKey | None:
    """The PSU rows the README's replicate scale factors are read from (public_summary's),
    for the public file's columns; None without replicate weights."""
    des = design_facts(spec, results)
    w, strata, psu, reps = _readme_design(spec, des, list(columns))
    if not reps:
        return None
    return PsuKey(w, strata, psu, tuple(reps), per_record=psu is None and des["method"] == "jkn")


def variance_notes(
    spec: ReleaseSpec, results: Sequence[StageResult], puf: pd.DataFrame | PublicSummary
) -> PublicReadme:
    """The public README: files, what was done to each variable, missing values, the methods
    that changed the file (cited by author and year) with the parameters analysts may use,
    variance estimation in R, Stata, SAS, SUDAAN and Python, and the references.
    `.codebook_notes` carries the codebook's per-variable additions, `.replicate_scales` the
    replicate weights' multipliers (replicate_scales.csv). puf: the public frame, or its
    PublicSummary with the PSU rows of psu_key (the partitioned release's)."""
    des = design_facts(spec, results)
    w, strata, psu, reps = _readme_design(spec, des, list(puf.columns))
    pub = (
        puf
        if isinstance(puf, PublicSummary)
        else public_summary(puf, psu_key(spec, results, list(puf.columns)), stats=False)
    )
    c = (
        replicate_scales(pub.psus, w, reps, des["method"], des["rho"], strata, psu)
        if reps
        else None
    )
    missing = missing_counts(puf)
    treat = column_treatments(spec, results, pub.columns)
    L = _readme_head(spec, pub, bool(strata or psu), bool(reps))
    L += [f"| {_code(t.column)} | {t.role} | {t.treatment} |" for t in treat.itertuples()]
    dropped = dropped_columns(results)
    if dropped:
        L += ["", "Not published:", "", *dropped_lines(dropped)]
    L += ["", "## Missing values", "", _missing_sentence(missing, pub.n)]
    L += ["", "## Disclosure limitation methods applied", ""]
    L += _methods(results, des)
    L += ["", "## Estimating variances", ""]
    design = {w, strata, psu, *reps}
    ex = _example(spec, pub, w, reps)
    na = any(col not in design for col in missing)
    L += _variance_section(w, strata, psu, reps, des, ex, c, na)
    L += _references("\n".join(L))
    L += [
        "",
        "## Disclaimer",
        "",
        "Do not attempt to identify any person, household or place; do not link this file to "
        "other files for that purpose.",
    ]
    notes = _codebook_notes(spec, results, des, treat, reps, pub.columns)
    scales = pd.DataFrame({"replicate": reps, "rscale": c}) if reps else None
    return PublicReadme("\n".join(L) + "\n", notes, scales)


def _readme_head(spec: ReleaseSpec, pub: PublicSummary, labels: bool, reps: bool) -> list[str]:
    """The README's title, files, record order and the head of the treatments table."""
    scales = (
        f", `{REPLICATE_SCALES}` (one row per replicate weight: its name and its variance "
        "multiplier c_r, read by the recipes under Estimating variances)"
        if reps
        else ""
    )
    return [
        f"# {spec.release.name} {spec.release.year}: public-use file",
        "",
        f"{pub.n:,} records, {len(pub.columns)} variables. Files: `puf.parquet` and `puf.csv` "
        "(the same records), `codebook.csv` (one row per variable: label, type, values, missing "
        f"values and codes, what was done to it, top-code flag){scales} and this README. The "
        "records are sorted by their published values"
        + (" (strata and PSUs first)" if labels else "")
        + ", not kept in the survey's order.",
        "",
        CSV_FORMULA_NOTE,
        "",
        "## What was done to each variable",
        "",
        "| variable | role | treatment |",
        "|---|---|---|",
    ]


def missing_counts(puf: pd.DataFrame | PublicSummary) -> dict[str, int]:
    """The published columns with missing values, with how many (file order)."""
    if isinstance(puf, PublicSummary):
        got = {c: puf.stats[c].n_missing for c in puf.columns}
    else:
        got = {str(c): int(puf[c].isna().sum()) for c in puf.columns}  # a column at a time
    return {c: n for c, n in got.items() if n}


def _missing_sentence(missing: dict[str, int], n: int) -> str:
    """What the README says of the missing values."""
    if not missing:
        return "No published variable has a missing value."
    counts = "; ".join(f"`{c}` {k:,} ({pct(k / n)})" for c, k in missing.items())
    return (
        f"Records without a value (empty in `puf.csv`, null in `puf.parquet`; the codebook's "
        f"`n_missing`): {counts}. Every recipe under Estimating variances estimates over the "
        "records with a value, keeping the others in the design (a domain: R's `na.rm = TRUE`)."
    )


def _methods(results: Sequence[StageResult], des: dict[str, Any]) -> list[str]:
    """The methods section: the stages that changed the file, then those that did not."""
    L = [line for cls, res in _describing(results, des) for line in cls.public_method(res, des)]
    if not L:
        L = ["No record or value was perturbed; only the columns listed above were removed.", ""]
    quiet = no_effect(results, des)
    if quiet:
        L += ["Also run, without changing this file:", "", *(f"- {q}" for q in quiet)]
    while L and not L[-1]:
        L.pop()
    return L


def _references(text: str) -> list[str]:
    """The references of the papers the text cites (by author and year)."""
    cited = [r.full for r in PAPERS.values() if r.cite in text]
    return ["", "## References", "", *(f"- {r}" for r in cited)] if cited else []


def _codebook_notes(
    spec: ReleaseSpec,
    results: Sequence[StageResult],
    des: dict[str, Any],
    treat: pd.DataFrame,
    reps: list[str],
    columns: list[str],
) -> dict[str, dict[str, Any]]:
    """Per published column, what the codebook adds: label, missing codes, treatment and
    top-code flag."""
    miss = _missing_codes(spec)
    labels = getattr(spec.variables, "labels", None) or {}
    tc: dict[str, list[str]] = {}
    for cls, res in _describing(results, des):
        for c, fields in cls.public_codebook(res).items():
            tc.setdefault(c, []).extend(fields.get("topcoded", []))
    per_col = {t.column: t.treatment for t in treat.itertuples()}
    role = {t.column: t.role for t in treat.itertuples()}
    pseudo = "pseudo-" if des["masked_by"] else ""
    default = {
        "weight": "final analysis weight",
        "stratum": f"{pseudo}stratum, for variance estimation",
        "PSU": f"{pseudo}PSU (numbered within {pseudo}stratum), for variance estimation",
        "key": "key variable (identifying; may be perturbed)",
        "sensitive": "sensitive study variable",
        "study": "study variable",
    }
    for i, c in enumerate(reps, 1):
        default[c] = (
            f"replicate weight {i} of {len(reps)} ({des['method']}; its multiplier c_r: "
            f"{REPLICATE_SCALES})"
        )
    for k in spec.variables.keys:  # published in its coding (global recoding)
        if k.bins is not None:
            default[k.name] = (
                "key variable in groups [a, b) labelled a-b (the exact values are not "
                "published; identifying; may be perturbed)"
            )
        elif k.map:
            default[k.name] = "key variable in grouped categories (identifying; may be perturbed)"
    notes: dict[str, dict[str, Any]] = {}
    for c in columns:
        given = labels.get(c) if isinstance(labels, dict) else None
        notes[c] = {
            "label": str(given or default.get(c) or default.get(role.get(c, ""), "")),
            "missing_codes": miss.get(c, ""),
            "treatment": per_col.get(c, "replicate weight" if c in reps else ""),
            "topcoded": "; ".join(tc.get(c, [])),
        }
    return notes


def _variance_section(
    w: str,
    strata: str | None,
    psu: str | None,
    reps: list[str],
    des: dict,
    ex: str,
    c: np.ndarray | None,
    na: bool,
) -> list[str]:
    """The README's variance estimation lines: the weight, Taylor linearization recipes (with
    strata or PSUs), replicate-weight recipes (with replicates: c their multipliers), else the
    independent-records warning. ex: the variable the recipes estimate; na: a published
    variable has missing values (the recipes say how they are left out)."""
    L = [f"Every estimate must use the weight `{w}`."]
    if w == UNIT_WEIGHT:  # an unweighted original file (design: {weight: null})
        L += [
            "",
            f"The original file carries no weights (an equal-probability sample): `{w}` is "
            "each record's weight of 1 in it, as the treatments described here left it; "
            "estimates are then sample means and shares, and totals count the sample, not a "
            "population.",
        ]
    if strata or psu:
        L += _taylor_recipes(w, strata, psu, ex, na)
    if reps and c is not None:
        L += _replicate_recipes(w, strata, psu, reps, des, ex, c, na)
    elif not (strata or psu):
        L += [
            "",
            "This file carries no strata, PSUs or replicate weights: treat it as a weighted "
            "sample of independent records (standard errors will then understate the true ones "
            "when the original sample was clustered).",
        ]
    return L


READ_PUF = 'puf <- arrow::read_parquet("puf.parquet")  # or: puf <- read.csv("puf.csv")'


def _taylor_recipes(w: str, strata: str | None, psu: str | None, ex: str, na: bool) -> list[str]:
    """Taylor linearization of the with-replacement design: R, Stata, SAS and SUDAAN (na:
    how each leaves out the records without a value)."""
    rm = ", na.rm = TRUE" if na else ""
    L = [
        "",
        "### Taylor linearization",
        "",
        "With-replacement (ultimate cluster) design: "
        + (f"strata `{strata}`, " if strata else "no strata, ")
        + (f"PSUs `{psu}` (numbered within strata)." if psu else "each record a PSU."),
        "",
        "```r",
        "library(survey)",
        READ_PUF,
        f"des <- svydesign(ids = ~{psu or 1}, strata = {'~' + strata if strata else 'NULL'}, "
        f"weights = ~{w}, nest = TRUE, data = puf)",
        f"svymean(~{ex}, des{rm})",
        "```",
        "",
        f"Stata: `svyset {psu or '_n'} [pw = {w}]{', strata(' + strata + ')' if strata else ''} vce(linearized)`  ",
        f"SAS: `proc surveymeans data=puf{' nomcar' if na else ''}; "
        f"{'strata ' + strata + '; ' if strata else ''}"
        f"{'cluster ' + psu + '; ' if psu else ''}weight {w}; var {ex}; run;`  ",
        f"SUDAAN: `proc descript data=puf design=wr; nest {strata or '_one_'} {psu or '_minus1_'}; "
        f"weight {w}; var {ex};`",
    ]
    if na:
        L += [
            "",
            "Records without a value: R's `na.rm = TRUE` leaves them out of the estimate but "
            "keeps them in the design (a domain of the records with a value), as SAS's `nomcar` "
            "and SUDAAN's default do. Stata's `svy: mean` drops them from the design (the same "
            "SE unless a PSU is left with no value); "
            f"`svy, subpop(if !missing({ex})): mean {ex}` keeps them, as R does.",
        ]
    return L


def _replicate_recipes(
    w: str,
    strata: str | None,
    psu: str | None,
    reps: list[str],
    des: dict,
    ex: str,
    c: np.ndarray,
    na: bool,
) -> list[str]:
    """Replicate weights: the variance formula with its multipliers c_r (replicate_scales.csv),
    then the recipes in R, Stata, SAS, SUDAAN and Python."""
    method, rho = des["method"], des["rho"]
    const = bool(np.all(c == c[0]))
    L = [
        "",
        "### Replicate weights",
        "",
        f"{len(reps)} replicate weights `{reps[0]}`"
        + (f" .. `{reps[-1]}`" if len(reps) > 1 else "")
        + f", {METHOD_NAME.get(method, method)}"
        + (f" with rho = {rho}" if method == "fay" else "")
        + ". Variance: V = sum over r of c_r (theta_r - theta)^2, centred on the full-sample "
        f"estimate theta (mse), overall scale 1, with c_r = {CLOSED_FORM.get(method, '?')}"
        + (f" = {float(c[0])!r} for every replicate" if const else "")
        + f". `{REPLICATE_SCALES}` holds each replicate weight's name (`replicate`) and its c_r "
        "(`rscale`).",
        "",
    ]
    L += _replicate_r_recipe(w, bool(strata or psu), ex, na)
    L += _replicate_jackknife_recipes(w, reps, c, const, ex)
    if na:
        L += [
            "",
            "With replicate weights, leaving out the records without a value (as every recipe "
            "here does) gives the domain estimate and its SE.",
        ]
    L += [
        "",
        f"Python (numpy and pandas; run it beside `puf.parquet` and `{REPLICATE_SCALES}`):",
        "",
        "```python",
        *_python_recipe(w, strata, psu, ex),
        "```",
    ]
    return L


def _replicate_r_recipe(w: str, taylor: bool, ex: str, na: bool) -> list[str]:
    """R (survey): svrepdesign with the multipliers c_r of replicate_scales.csv as rscales
    (mse); the file is read here unless the Taylor recipe read it."""
    read = [] if taylor else ["library(survey)", READ_PUF]
    return [
        "R (survey):",
        "",
        "```r",
        *read,
        f'scales <- read.csv("{REPLICATE_SCALES}")  # replicate: column name; rscale: its c_r',
        f"des <- svrepdesign(data = puf, weights = ~{w}, repweights = puf[scales$replicate],",
        '                   type = "other", scale = 1, rscales = scales$rscale, mse = TRUE,',
        "                   combined.weights = TRUE)",
        f"svymean(~{ex}, des{', na.rm = TRUE' if na else ''})",
        "```",
        "",
    ]


def _replicate_jackknife_recipes(
    w: str, reps: list[str], c: np.ndarray, const: bool, ex: str
) -> list[str]:
    """Stata, SAS and SUDAAN: the jackknife formula with the multipliers c_r (the same V for
    every replication method): one value when all are equal, else Stata and SUDAAN list them
    (one per replicate weight, in order) and SAS reads them from replicate_scales.csv."""
    every = f"{float(c[0])!r}" if const else " ".join(repr(float(v)) for v in c)
    sas_read = [
        f'proc import datafile="{REPLICATE_SCALES}" out=scales dbms=csv replace; run;',
        "data scales; set scales; JKCoefficient = rscale; run;  /* what JKCOEFS= reads */",
    ]
    L = [
        "Stata, SAS and SUDAAN (the jackknife formula with the multipliers c_r gives the same V "
        "for every replication method"
        + (
            "; Stata's multiplier() and SUDAAN's adjjack take one c_r per replicate weight, in "
            f"the order of `{REPLICATE_SCALES}`):"
            if not const
            else "):"
        ),
        "",
        "```stata",
        f"svyset [pw = {w}], jkrweight({reps[0]}-{reps[-1]}, multiplier({every})) vce(jackknife) mse",
        f"svy: mean {ex}",
        "```",
        "",
        "```sas",
        *([] if const else sas_read),
        "proc surveymeans data=puf varmethod=jackknife mean;",
        f"  weight {w};",
        f"  repweights {reps[0]}--{reps[-1]} / jkcoefs={every if const else 'scales'};",
        f"  var {ex};",
        "run;",
        "```",
        "",
        f"SUDAAN: `design=jackknife; weight {w}; jackwgts {reps[0]}--{reps[-1]} / adjjack={every};`",
    ]
    return L


def _example(spec: ReleaseSpec, pub: PublicSummary, w: str, reps: list[str]) -> str:
    """The variable the recipes estimate: the first numeric study variable published."""
    skip = {w, *reps}
    cands = [*spec.variables.study, *pub.columns]
    for c in cands:
        if c in pub.stats and c not in skip and pub.numeric(c):
            return str(c)
    return str(pub.columns[0])


def _python_recipe(w: str, strata: str | None, psu: str | None, ex: str) -> list[str]:
    """The Python recipe: the replicate SE of a mean over the records with a value (in a
    domain), and with strata or PSUs its Taylor SE."""
    L = [
        "import numpy as np",
        "import pandas as pd",
        "",
        'puf = pd.read_parquet("puf.parquet")',
        f'WEIGHT = "{w}"',
        f'SCALES = pd.read_csv("{REPLICATE_SCALES}")  # replicate: column name; rscale: its c_r',
        'REPS = list(SCALES["replicate"])',
        'C = SCALES["rscale"].to_numpy(dtype=float)',
        "",
        "",
        "def used(y, domain=None):",
        '    """y as floats (0 where not used) and the records used: in the domain, with a value."""',
        "    y = pd.Series(y).astype(float).to_numpy()",
        "    d = ~np.isnan(y)",
        "    if domain is not None:",
        "        d &= np.asarray(domain, dtype=bool)",
        "    return np.where(d, y, 0.0), d",
        "",
        "",
        "def mean_se(y, domain=None):",
        '    """Weighted mean of y over the records with a value (in the domain) and its replicate',
        "    standard error; the other records stay in the design with weight 0 (a domain, as",
        '    R\'s na.rm = TRUE)."""',
        "    y, d = used(y, domain)",
        "    w = puf[[WEIGHT, *REPS]].to_numpy(dtype=float) * d[:, None]",
        "    est = (w * y[:, None]).sum(axis=0) / w.sum(axis=0)  # full sample, then replicates",
        "    return float(est[0]), float(np.sqrt(np.sum(C * (est[1:] - est[0]) ** 2)))",
        "",
        "",
        f'print(mean_se(puf["{ex}"]))',
    ]
    if strata or psu:
        L += [
            "",
            "",
            "def mean_se_taylor(y, domain=None):",
            '    """Weighted mean of y over the records with a value (in the domain) and its Taylor',
            '    SE (PSUs with replacement within strata; the other records count as 0)."""',
            "    y, d = used(y, domain)",
            "    w = puf[WEIGHT].to_numpy(dtype=float) * d",
            "    m = np.sum(w * y) / np.sum(w)",
            "    z = pd.Series(w * (y - m) / np.sum(w))",
            f"    h = puf[{strata!r}]" if strata else "    h = pd.Series(0, index=puf.index)",
            f"    p = puf[{psu!r}]"
            if psu
            else "    p = pd.Series(np.arange(len(puf)), index=puf.index)",
            "    zt = z.groupby([h.to_numpy(), p.to_numpy()]).sum()  # PSU totals",
            "    g = zt.groupby(level=0)",
            "    n_h = g.transform('size')",
            "    dev = zt - g.transform('mean')",
            "    v = (n_h / (n_h - 1) * dev**2)[n_h > 1].sum()",
            "    return float(m), float(np.sqrt(v))",
            "",
            "",
            f'print(mean_se_taylor(puf["{ex}"]))',
        ]
    return L
