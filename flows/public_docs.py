"""What the analyst reads: the codebook and the public README (the methods that ran, with the
parameters an analyst may use for inference, and variance estimation in R, Stata, SAS, SUDAAN
and Python). Everything is read from the stage results of the run: a stage that did not run is
not described. The same per-column account feeds the board report (flows.report)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd

from sdl_design.describe import REPLICATES
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


class PublicReadme(str):
    """The README text; `.codebook_notes` holds what the codebook adds per variable
    (treatment, top-code threshold and count)."""

    codebook_notes: dict[str, dict[str, Any]]

    def __new__(cls, text: str, codebook_notes: dict[str, dict[str, Any]] | None = None):
        obj = super().__new__(cls, text)
        obj.codebook_notes = dict(codebook_notes or {})
        return obj


def _span(cols: list[str]) -> str:
    return cols[0] if len(cols) == 1 else f"{cols[0]} .. {cols[-1]} ({len(cols)} columns)"


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
    }


def _describing(results: Sequence[StageResult]) -> list[tuple[Any, StageResult]]:
    """(stage class, result) of the results that ran, the stage that masked the design first,
    then the others in release order."""
    return sorted(described(results), key=lambda cr: not cr[1].masks_design)


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
    for cls, res in _describing(results):
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
        name, role = (_span(reps), "replicate weights") if c in reps[:1] else (c, role_of.get(c))
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


def _runs(c: np.ndarray) -> tuple[np.ndarray, list[int]]:
    """Run-length encoding of the scale factors (values, run lengths)."""
    starts = np.r_[0, np.flatnonzero(np.diff(c) != 0) + 1]
    return c[starts], np.diff(np.r_[starts, len(c)]).tolist()


def _num_list(x: np.ndarray) -> str:
    return ", ".join(repr(float(v)) for v in x)


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
    """The public README: files, what was done to each variable, the methods that ran with the
    parameters analysts may use, and variance estimation in R, Stata, SAS, SUDAAN and Python.
    `.codebook_notes` carries the codebook's per-variable additions. puf: the public frame, or
    its PublicSummary with the PSU rows of psu_key (the partitioned release's)."""
    des = design_facts(spec, results)
    w, strata, psu, reps = _readme_design(spec, des, list(puf.columns))
    pub = (
        puf
        if isinstance(puf, PublicSummary)
        else public_summary(puf, psu_key(spec, results, list(puf.columns)), stats=False)
    )
    treat = column_treatments(spec, results, pub.columns)
    L: list[str] = [
        f"# {spec.release.name} {spec.release.year}: public-use file",
        "",
        f"{pub.n:,} records, {len(pub.columns)} variables. Files: `puf.parquet` and `puf.csv` (the "
        "same records), `codebook.csv` (one row per variable: label, type, values, missing codes, "
        "what was done to it, top-code flag) and this README. The records are in a random order.",
        "",
        CSV_FORMULA_NOTE,
        "",
        "## What was done to each variable",
        "",
        "| variable | role | treatment |",
        "|---|---|---|",
    ]
    L += [f"| `{t.column}` | {t.role} | {t.treatment} |" for t in treat.itertuples()]
    dropped = dropped_columns(results)
    if dropped:
        L += ["", "Not published: " + "; ".join(f"`{c}` ({why})" for c, why in dropped.items())]
    L += ["", "## Disclosure limitation methods applied", ""]
    methods = [line for cls, res in _describing(results) for line in cls.public_method(res, des)]
    if not methods:
        L.append("No record or value was perturbed; only the columns listed above were removed.")
    L += methods
    L += ["", "## Estimating variances", ""]
    L += _variance_section(pub, w, strata, psu, reps, des, _example(spec, pub, w, reps))
    L += [
        "",
        "## Disclaimer",
        "",
        "Do not attempt to identify any person, household or place; do not link this file to "
        "other files for that purpose.",
    ]
    notes: dict[str, dict[str, Any]] = {}
    miss = _missing_codes(spec)
    labels = getattr(spec.variables, "labels", None) or {}
    tc: dict[str, list[str]] = {}
    for cls, res in _describing(results):
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
        default[c] = f"replicate weight {i} of {len(reps)} ({des['method']})"
    for k in spec.variables.keys:  # published in its coding (global recoding)
        if k.bins is not None:
            default[k.name] = (
                "key variable in groups [a, b) labelled a-b (the exact values are not "
                "published; identifying; may be perturbed)"
            )
        elif k.map:
            default[k.name] = "key variable in grouped categories (identifying; may be perturbed)"
    for c in pub.columns:
        given = labels.get(c) if isinstance(labels, dict) else None
        notes[c] = {
            "label": str(given or default.get(c) or default.get(role.get(c, ""), "")),
            "missing_codes": miss.get(c, ""),
            "treatment": per_col.get(c, "replicate weight" if c in reps else ""),
            "topcoded": "; ".join(tc.get(c, [])),
        }
    return PublicReadme("\n".join(L) + "\n", notes)


def _variance_section(
    pub: PublicSummary,
    w: str,
    strata: str | None,
    psu: str | None,
    reps: list[str],
    des: dict,
    ex: str,
) -> list[str]:
    """The README's variance estimation lines: the weight, Taylor linearization recipes (with
    strata or PSUs), replicate-weight recipes (with replicates), else the independent-records
    warning. ex: the variable the recipes estimate."""
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
        L += _taylor_recipes(w, strata, psu, ex)
    if reps:
        L += _replicate_recipes(pub, w, strata, psu, reps, des, ex)
    elif not (strata or psu):
        L += [
            "",
            "This file carries no strata, PSUs or replicate weights: treat it as a weighted "
            "sample of independent records (standard errors will then understate the true ones "
            "when the original sample was clustered).",
        ]
    return L


def _taylor_recipes(w: str, strata: str | None, psu: str | None, ex: str) -> list[str]:
    """Taylor linearization of the with-replacement design: R, Stata, SAS and SUDAAN."""
    return [
        "",
        "### Taylor linearization",
        "",
        "With-replacement (ultimate cluster) design: "
        + (f"strata `{strata}`, " if strata else "no strata, ")
        + (f"PSUs `{psu}` (numbered within strata)." if psu else "each record a PSU."),
        "",
        "```r",
        "library(survey)",
        'puf <- arrow::read_parquet("puf.parquet")',
        f"des <- svydesign(ids = ~{psu or 1}, strata = {'~' + strata if strata else 'NULL'}, "
        f"weights = ~{w}, nest = TRUE, data = puf)",
        f"svymean(~{ex}, des)",
        "```",
        "",
        f"Stata: `svyset {psu or '_n'} [pw = {w}]{', strata(' + strata + ')' if strata else ''} vce(linearized)`  ",
        f"SAS: `proc surveymeans data=puf; {'strata ' + strata + '; ' if strata else ''}"
        f"{'cluster ' + psu + '; ' if psu else ''}weight {w}; var {ex}; run;`  ",
        f"SUDAAN: `proc descript data=puf design=wr; nest {strata or '_one_'} {psu or '_minus1_'}; "
        f"weight {w}; var {ex};`",
    ]


def _replicate_recipes(
    pub: PublicSummary,
    w: str,
    strata: str | None,
    psu: str | None,
    reps: list[str],
    des: dict,
    ex: str,
) -> list[str]:
    """Replicate weights: the variance formula with its multipliers c_r, then the recipes in
    R, Stata, SAS, SUDAAN and Python."""
    method, rho = des["method"], des["rho"]
    R = len(reps)
    c = replicate_scales(pub.psus, w, reps, method, rho, strata, psu)
    const = bool(np.allclose(c, c[0], rtol=0, atol=0))
    L = [
        "",
        "### Replicate weights",
        "",
        f"{R} replicate weights `{_span(reps)}`, {METHOD_NAME.get(method, method)}"
        + (f" with rho = {rho}" if method == "fay" else "")
        + f". Variance: V = sum over r of c_r (theta_r - theta)^2, centred on the full-sample "
        f"estimate theta (mse), with c_r = {CLOSED_FORM.get(method, '?')}"
        + (
            f" = {float(c[0])!r} for every replicate."
            if const
            else " (one value per replicate, below)."
        ),
        "",
    ]
    L += _replicate_r_recipe(w, reps, c, const, ex)
    L += _replicate_jackknife_recipes(w, reps, c, ex)
    L += [
        "",
        "Python (numpy and pandas; the release's own checks run exactly this code):",
        "",
        "```python",
        *_python_recipe(w, reps, c, const, strata, psu, ex),
        "```",
    ]
    return L


def _replicate_r_recipe(w: str, reps: list[str], c: np.ndarray, const: bool, ex: str) -> list[str]:
    """R (survey): svrepdesign with the multipliers c_r as rscales (mse)."""
    vals, runs = _runs(c)
    cvec = (
        f"{float(c[0])!r}"
        if const
        else f"rep(c({_num_list(vals)}), c({', '.join(map(str, runs))}))"
    )
    return [
        "R (survey):",
        "",
        "```r",
        f"rscales <- {cvec}",
        f'des <- svrepdesign(data = puf, weights = ~{w}, repweights = "{_regex(reps)}",',
        '                   type = "other", scale = 1, rscales = rscales, mse = TRUE,',
        "                   combined.weights = TRUE)",
        f"svymean(~{ex}, des)",
        "```",
        "",
    ]


def _replicate_jackknife_recipes(w: str, reps: list[str], c: np.ndarray, ex: str) -> list[str]:
    """Stata, SAS and SUDAAN: the jackknife formula with one multiplier c_r per replicate
    (the same V for every replication method)."""
    rlist = f"{reps[0]}-{reps[-1]}"
    return [
        "Stata (the jackknife formula with one multiplier c_r per replicate gives the same V "
        "for every method):",
        "",
        "```stata",
        f"svyset [pw = {w}], jkrweight({rlist}, multiplier({_stata_mult(c, len(reps))})) vce(jackknife) mse",
        f"svy: mean {ex}",
        "```",
        "",
        "SAS (JKCOEFS are the c_r):",
        "",
        "```sas",
        "proc surveymeans data=puf varmethod=jackknife mean;",
        f"  weight {w};",
        f"  repweights {reps[0]}--{reps[-1]} / jkcoefs=({' '.join(repr(float(v)) for v in c)});",
        f"  var {ex};",
        "run;",
        "```",
        "",
        f"SUDAAN: `design=jackknife; weight {w}; jackwgts {reps[0]}--{reps[-1]} / adjjack="
        f"{' '.join(repr(float(v)) for v in c)};`",
    ]


def _example(spec: ReleaseSpec, pub: PublicSummary, w: str, reps: list[str]) -> str:
    """The variable the recipes estimate: the first numeric study variable published."""
    skip = {w, *reps}
    cands = [*spec.variables.study, *pub.columns]
    for c in cands:
        if c in pub.stats and c not in skip and pub.numeric(c):
            return str(c)
    return str(pub.columns[0])


def _regex(reps: list[str]) -> str:
    import os
    import re

    pre = os.path.commonprefix(reps).rstrip("0123456789")
    if pre and all(re.fullmatch(r"\d+", c[len(pre) :]) for c in reps):
        return f"^{re.escape(pre)}[0-9]+$"
    return "^(" + "|".join(re.escape(c) for c in reps) + ")$"


def _stata_mult(c: np.ndarray, R: int) -> str:
    return " ".join(repr(float(v)) for v in c)


def _python_recipe(
    w: str,
    reps: list[str],
    c: np.ndarray,
    const: bool,
    strata: str | None,
    psu: str | None,
    ex: str,
) -> list[str]:
    L = [
        "import numpy as np",
        "import pandas as pd",
        "",
        'puf = pd.read_parquet("puf.parquet")',
        f'WEIGHT = "{w}"',
        f'REPS = [f"{_fmt_reps(reps)}" for i in range(1, {len(reps) + 1})]'
        if _fmt_reps(reps)
        else f"REPS = {reps!r}",
        f"C = np.full({len(reps)}, {float(c[0])!r})"
        if const
        else f"C = np.repeat([{_num_list(_runs(c)[0])}], [{', '.join(map(str, _runs(c)[1]))}])",
        "",
        "",
        "def mean_se(y, domain=None):",
        '    """Weighted mean of y (in the domain) and its replicate standard error."""',
        "    y = np.asarray(y, dtype=float)",
        "    d = np.ones(len(y)) if domain is None else np.asarray(domain, dtype=float)",
        "    w = puf[[WEIGHT, *REPS]].to_numpy(dtype=float) * d[:, None]",
        "    est = (w * y[:, None]).sum(axis=0) / w.sum(axis=0)  # full sample, then replicates",
        "    return est[0], float(np.sqrt(np.sum(C * (est[1:] - est[0]) ** 2)))",
        "",
        "",
        f'print(mean_se(puf["{ex}"]))',
    ]
    if strata or psu:
        L += [
            "",
            "",
            "def mean_se_taylor(y):",
            '    """Weighted mean and its Taylor SE (PSUs with replacement within strata)."""',
            "    y = np.asarray(y, dtype=float)",
            "    w = puf[WEIGHT].to_numpy(dtype=float)",
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
            "    return m, float(np.sqrt(v))",
            "",
            "",
            f'print(mean_se_taylor(puf["{ex}"]))',
        ]
    return L


def _fmt_reps(reps: list[str]) -> str:
    """An f-string pattern naming the replicate columns (rw_001 .. rw_070 -> 'rw_{i:03d}'), or ''."""
    import os
    import re

    pre = os.path.commonprefix(reps).rstrip("0123456789")
    tails = [c[len(pre) :] for c in reps]
    if not pre or not all(re.fullmatch(r"\d+", t) for t in tails):
        return ""
    width = len(tails[0])
    pad = all(len(t) == width for t in tails)
    if [int(t) for t in tails] != list(range(1, len(reps) + 1)):
        return ""
    if pad and width > 1:
        return pre + "{i:0" + str(width) + "d}"
    if all(t == str(int(t)) for t in tails):
        return pre + "{i}"
    return ""
