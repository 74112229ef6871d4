"""What the analyst reads: the codebook and the public README (the methods that ran, with the
parameters an analyst may use for inference, and variance estimation in R, Stata, SAS, SUDAAN
and Python). Everything is read from the stage results of the run: a stage that did not run is
not described. The same per-column account feeds the board report (flows.report)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd

from sdl_design.public_summary import VALUES_MAX, PsuKey, PublicSummary, public_summary
from sdl_design.spec import ReleaseSpec

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


def _by_name(results: Sequence[StageResult]) -> dict[str, StageResult]:
    return {r.name: r for r in results}


def _fmt(x: float) -> str:
    return f"{x:,.6g}"


def _pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def _span(cols: list[str]) -> str:
    return cols[0] if len(cols) == 1 else f"{cols[0]} .. {cols[-1]} ({len(cols)} columns)"


# ---------------------------------------------------------------- what was done to each column


def design_facts(spec: ReleaseSpec | None, results: Sequence[StageResult]) -> dict[str, Any]:
    """The published design: weight, strata/PSU names, whether they are pseudo labels and which
    stage made them, replicate method and rho. spec None (the report): from the results alone."""
    mask = next((r for r in results if r.masks_design), None)
    p = mask.params if mask is not None else {}
    a = _by_name(results).get("assess")
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


def column_treatments(
    spec: ReleaseSpec | None,
    results: Sequence[StageResult],
    columns: Sequence[str] | None = None,
) -> pd.DataFrame:
    """One row per published column (replicate weights as one row): its role and what was done
    to it, from the stage results that ran. columns: the published columns (default: those the
    assessment recorded). Columns: column, role, treatment."""
    r = _by_name(results)
    roles: dict[str, list[str]] = (
        r["assess"].params.get("published_columns", {}) if "assess" in r else {}
    )
    role_of = {c: role for role, cols in roles.items() for c in cols}
    if columns is None:
        columns = [c for cols in roles.values() for c in cols]
    des = design_facts(spec, results)
    done: dict[str, list[str]] = {c: [] for c in columns}
    if "swap" in r:
        p = r["swap"].params
        for c in (des["strata"], des["psu"]):
            if c in done:
                done[c].append(
                    f"pseudo-design label: {p.get('n_swapped', '?')} of {p.get('n_segments', '?')} "
                    f"segments ({_pct(p.get('share_swapped', 0.0))}) swapped between PSUs "
                    "(paper 003, method " + str(p.get("method", "")) + "), labels renumbered"
                )
    elif des["masked_by"]:
        for c in (des["strata"], des["psu"]):
            if c in done:
                done[c].append(f"pseudo-design label built by the {des['masked_by']} stage")
    if "prb" in r:
        res = r["prb"]
        ch = res.tables.get("changed_by_variable")
        shares = {} if ch is None else dict(zip(ch["variable"], ch["share_changed"], strict=True))
        theta = res.params.get("theta", float("nan"))
        for c in done:
            if c in shares:
                done[c].append(
                    f"post-randomized by PRB (paper 002; theta {theta:.4f}): "
                    f"{_pct(shares[c])} of records changed"
                )
    if "massc" in r:
        res = r["massc"]
        m, p = res.metrics, res.params
        n_sub = int(m.get("n_substituted", 0))
        for c in p.get("substitute_columns") or []:
            if c in done:
                done[c].append(
                    f"substituted by MASSC (paper 000): {n_sub} records "
                    f"({_pct(m.get('share_substituted', 0.0))}) took a donor's values"
                    if n_sub
                    else "eligible for MASSC substitution; no record was substituted"
                )
        cal = p.get("calibration") or {}
        if des["weight"] in done:
            done[des["weight"]].append(
                f"divided by the MASSC retention rate and calibrated ({cal.get('method', '?')}) "
                f"to the original totals; factors {m.get('calibration_factor_min', float('nan')):.3f}"
                f" to {m.get('calibration_factor_max', float('nan')):.3f}"
            )
    if "topcode" in r:
        for c, _n, text in _topcodes(r["topcode"]):
            if c in done:
                done[c].append(text)
    reps = [c for c in columns if role_of.get(c) == "replicate weight"]
    rows = []
    for c in columns:
        if c in reps[1:]:
            continue
        name, role = (_span(reps), "replicate weights") if c in reps[:1] else (c, role_of.get(c))
        what = done[c]
        if c in reps[:1]:
            what = [
                f"{METHOD_NAME.get(des['method'], des['method'])} replicate weights"
                + (
                    " rebuilt for the masked design"
                    if des["masked_by"] == "swap"
                    else f" built by the {des['masked_by']} stage"
                    if des["masked_by"]
                    else ""
                )
                + ("; each recalibrated as the full-sample weight" if "massc" in r else "")
            ]
        rows.append(
            {"column": name, "role": role or "", "treatment": "; ".join(what) or "unchanged"}
        )
    return pd.DataFrame(rows, columns=["column", "role", "treatment"])


def _topcodes(res: StageResult) -> list[tuple[str, int, str]]:
    """(column, records coded, sentence) for every coded side of every top-coded column."""
    t = res.tables.get("thresholds")
    if t is None or not len(t):
        return []
    out = []
    for row in t.itertuples():
        n = int(row.n_coded)
        word = "top-coded" if row.side == "upper" else "bottom-coded"
        rep = getattr(row, "replacement", np.nan)
        if row.replace == "mean" and n and pd.notna(rep):
            how = f"; those values replaced by their weighted mean {_fmt(rep)} (total preserved)"
        elif n:
            how = "; those values set to the threshold"
        else:
            how = ""
        out.append((row.column, n, f"{word} at {_fmt(row.threshold)}: {n} records{how}"))
    return out


def dropped_columns(results: Sequence[StageResult]) -> dict[str, str]:
    """Input columns not published, with why (as the assessment recorded them)."""
    r = _by_name(results)
    return dict(r["assess"].params.get("dropped_columns", {})) if "assess" in r else {}


# ---------------------------------------------------------------- replicate scale factors


def replicate_scales(
    puf: pd.DataFrame, weight: str, reps: list[str], method: str, rho: float | None, strata, psu
) -> np.ndarray:
    """The scale factor c_r of each replicate: V = sum_r c_r (theta_r - theta)^2 (the closed
    form of the method; JKn: (n_h-1)/n_h of the stratum of the PSU the replicate deletes).
    puf: the public frame, or its PSU rows (sdl_design.public_summary.psu_rows: the same
    factors)."""
    from sdl_design.design import SurveyDesign
    from sdl_design.public_summary import RECORDS, record_jkn_scales

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
    r = _by_name(results)
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
    ran = [n for n in ("swap", "prb", "massc", "topcode") if n in r]
    if des["masked_by"] and des["masked_by"] != "swap":
        ran.insert(0, des["masked_by"])
    if not ran:
        L.append("No record or value was perturbed; only the columns listed above were removed.")
    for name in ran:
        L += _method_section(name, r[name], spec, des)
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
    tc = {}
    if "topcode" in r:
        for c, _n, text in _topcodes(r["topcode"]):
            tc.setdefault(c, []).append(text)
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


def _method_section(name: str, res: StageResult, spec: ReleaseSpec, des: dict) -> list[str]:
    p, m = res.params, res.metrics
    if name == "swap":
        return [
            "### Masked design (segment swapping, paper 003)",
            "",
            f"{p.get('n_swapped')} of {p.get('n_segments')} segments "
            f"({_pct(p.get('share_swapped', 0.0))}) were swapped between PSUs, each partner chosen "
            "so that the variances of the matching characteristics change as little as possible "
            f"(method {p.get('method')}). The published `{des['strata']}` and `{des['psu']}` are "
            "pseudo-strata and pseudo-PSUs, renumbered; replicate weights were rebuilt for them. "
            "Use them as ordinary strata and PSUs (below); standard errors stay close to those "
            "of the original design (the release's SE-ratio gate checks them).",
            "",
        ]
    if name == "prb":
        L = [
            "### Post-randomization of key variables (PRB, paper 002)",
            "",
            f"Records in key cells (combinations of {', '.join(p.get('cells', []))}) held by one or "
            "two records were grouped in blocks of similar weight; within a block each record kept "
            f"its cell with probability 1 - theta/t_j and moved to each of the m - 1 other cells "
            f"with probability theta/((m-1) t_j) (t_j: the records of its cell in the block; "
            f"theta = {p.get('theta', float('nan')):.6f}; at least m0 = {p.get('m0')} cells per "
            f"block). A record that moved took all of {', '.join(_prb_vars(res))} from a record of "
            f"its new cell. {int(m.get('n_changed', 0)):,} records ({_pct(m.get('share_changed', 0.0))}) "
            "changed; the exact identification risk of every block is at most "
            f"xi = {p.get('xi')}.",
            "",
            "Transition probabilities for inference (P[a, b] = P(published = b | original = a), "
            "weighted by the design weight, on each variable's published coding; a misclassification "
            "model or the estimator T_original = (P')^-1 T_published of weighted category totals "
            "uses them). Diagonal by category (the share of each category's weight left unchanged):",
            "",
        ]
        tr = res.tables.get("transitions")
        if tr is not None and len(tr):
            diag = tr[tr["original"] == tr["published"]]
            for v, g in diag.groupby("variable", sort=False):
                L.append(
                    f"- `{v}`: "
                    + "; ".join(
                        f"{a} {pv:.4f}" for a, pv in zip(g["original"], g["p"], strict=True)
                    )
                )
            L += ["", "Full matrices (off-diagonal entries > 0):", ""]
            for v, g in tr.groupby("variable", sort=False):
                off = g[g["original"] != g["published"]]
                if len(off):
                    L.append(
                        f"- `{v}`: "
                        + "; ".join(
                            f"{a}->{b} {pv:.4f}"
                            for a, b, pv in zip(
                                off["original"], off["published"], off["p"], strict=True
                            )
                        )
                    )
        ch = res.tables.get("changed_by_variable")
        if tr is not None and len(tr):
            kept = tr[tr["original"] == tr["published"]].groupby("variable")["p"].min()
            within = [v for v, pv in kept.items() if pv >= 1.0 - 1e-12]
            if within:
                L += [
                    "",
                    f"{', '.join(f'`{v}`' for v in within)}: never moved to another published "
                    "category (PRB partitions on it).",
                ]
        if ch is not None and len(ch):
            L += [
                "",
                "Share of records whose value changed: "
                + "; ".join(
                    f"`{v}` {_pct(s)}"
                    for v, s in zip(ch["variable"], ch["share_changed"], strict=True)
                )
                + ".",
            ]
        return [*L, ""]
    if name == "massc":
        cal = p.get("calibration") or {}
        controls = [c["name"] if isinstance(c, dict) else str(c) for c in cal.get("controls", [])]
        phi = p.get("phi") or {}
        n_out = int(m.get("n_subsampled_out", 0))
        n_sub = int(m.get("n_substituted", 0))
        L = [
            "### Substitution, subsampling and calibration (MASSC, paper 000)",
            "",
            "Records were grouped by risk: U, D, T, O = the record's key combination is held by "
            "1, 2, 3, or 4 and more records. "
            + (
                f"{n_sub:,} records ({_pct(m.get('share_substituted', 0.0))}) had their "
                f"{', '.join(p.get('substitute_columns') or [])} replaced by a similar donor's. "
                if n_sub
                else "No record was substituted"
                + (
                    " (no donor within the record's cell of the declared domains). "
                    if int(m.get("n_no_donor_domain", 0)) >= int(m.get("n_no_donor", -1)) > 0
                    else ". "
                )
            )
            + f"{n_out:,} records were removed by subsampling at the retention rates "
            + ", ".join(f"{h} {v:.3f}" for h, v in phi.items())
            + f" ({p.get('selection', '')}); the weight `{des['weight']}` was divided by the rate and then "
            f"calibrated ({cal.get('method', '?')}"
            + (f", bounds {cal['bounds']}" if cal.get("bounds") else "")
            + ") so that the weighted totals of "
            + (", ".join(f"`{c}`" for c in controls) or "no control")
            + " equal those of the original file"
            + (" (and of the declared domains)" if cal.get("domain_margins") else "")
            + ". Each replicate weight was recalibrated the same way, so replicate variances "
            "include the calibration.",
            "",
        ]
        return L
    if name == "topcode":
        L = ["### Top- and bottom-coding (paper 004)", ""]
        for c, _, text in _topcodes(res):
            L.append(f"- `{c}`: {text}.")
        L += [
            "",
            "The codebook's `topcoded` column repeats these; a coded record is recognised by its "
            "value (the threshold, or the replacement mean).",
            "",
        ]
        return L
    said = " ".join(str(n) for n in res.notes) or (
        "Pseudo-strata and pseudo-PSUs were formed for this file and replicate weights built "
        "from them."
    )
    return [
        "### Pseudo-design for variance estimation",
        "",
        f"The published `{des['strata']}` and `{des['psu']}` are not the survey's strata and PSUs: "
        + said
        + " Use them as ordinary strata and PSUs (below).",
        "",
    ]


def _prb_vars(res: StageResult) -> list[str]:
    ch = res.tables.get("changed_by_variable")
    if ch is not None and len(ch):
        return list(ch["variable"])
    return list(res.params.get("cells", []))


def _variance_section(
    pub: PublicSummary,
    w: str,
    strata: str | None,
    psu: str | None,
    reps: list[str],
    des: dict,
    ex: str,
) -> list[str]:
    L = [f"Every estimate must use the weight `{w}`."]
    if strata or psu:
        L += [
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
    if reps:
        method, rho = des["method"], des["rho"]
        R = len(reps)
        c = replicate_scales(pub.psus, w, reps, method, rho, strata, psu)
        const = bool(np.allclose(c, c[0], rtol=0, atol=0))
        L += [
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
        vals, runs = _runs(c)
        cvec = (
            f"{float(c[0])!r}"
            if const
            else f"rep(c({_num_list(vals)}), c({', '.join(map(str, runs))}))"
        )
        rlist = f"{reps[0]}-{reps[-1]}"
        L += [
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
            "Stata (the jackknife formula with one multiplier c_r per replicate gives the same V "
            "for every method):",
            "",
            "```stata",
            f"svyset [pw = {w}], jkrweight({rlist}, multiplier({_stata_mult(c, R)})) vce(jackknife) mse",
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
            "",
            "Python (numpy and pandas; the release's own checks run exactly this code):",
            "",
            "```python",
            *_python_recipe(w, reps, c, const, strata, psu, ex),
            "```",
        ]
    elif not (strata or psu):
        L += [
            "",
            "This file carries no strata, PSUs or replicate weights: treat it as a weighted "
            "sample of independent records (standard errors will then understate the true ones "
            "when the original sample was clustered).",
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
