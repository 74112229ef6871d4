"""Preflight: the preconditions every enabled stage of a release run would meet, checked on the
spec and the input file before any work. Pure pandas/numpy; `preflight(spec, df)` lists each
problem as 'field: what is wrong; the fix' (empty when the run can start).

It complements ReleaseSpec.check_data (columns exist, design values present, weights
positive, single-PSU strata): here the types each stage reads, the when-conditions against the
data, the replicate weights against their declared method, the declared models' fits, and what
each enabled stage says it needs (sdl_design.describe.Describes.preflight_*: e.g. the
segment/PSU nesting of a swap, the strata subsampling could leave with a single PSU).
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd
import scipy.sparse as sp

from sdl_design.describe import Describes, NumberColumn
from sdl_design.edits import parse_condition
from sdl_design.io import read_input
from sdl_design.keys import coarsen
from sdl_design.messages import short_list
from sdl_design.psus import SINGLE_PSU_RISK_MAX, Psus, single_psu_chance, strata_psu
from sdl_design.spec import ReleaseSpec, SpecError, category_label
from sdl_design.stages import build_stages
from sdl_design.stages.assess.method import model_fits
from sdl_design.survey.design import DesignError, SurveyDesign
from sdl_design.survey.glm import FormulaError

__all__ = ["SINGLE_PSU_RISK_MAX", "preflight", "raise_problems", "single_psu_chance"]

_TOL = 1e-6  # relative tolerance of replicate factors (float32 files give ~1e-7)
_CHUNK = 8  # replicate columns read at a time (n x 8 floats: memory stays flat at 1M records)


def preflight(
    spec: ReleaseSpec, df: pd.DataFrame, models: Future[list[str]] | None = None
) -> list[str]:
    """Every problem the run would meet on df, once each ('field: problem; fix'); models: the
    declared models' problems (_models) when they are being checked beside."""
    stages: list[type[Describes]] = [type(s) for s in build_stages(spec)]
    out: list[str] = []
    out += _types(spec, df, [n for c in stages for n in c.preflight_numbers(spec)])
    out += _conditions(spec, df)
    out += _sensitive_labels(spec, df)
    out += [m for c in stages for m in c.preflight_design(spec, df)]
    if spec.design.replicate_weights is not None:
        out += _replicates(spec, df)
    out += [m for c in stages for m in c.preflight_data(spec, df)]
    out += [m for c in stages for m in c.preflight_fits(spec, df)]
    out += _models(spec, df) if models is None else models.result()
    return list(dict.fromkeys(out))


def _models(spec: ReleaseSpec, df: pd.DataFrame) -> list[str]:
    """Every declared model fits on the input under its design (the assessment fits it on the
    input and the published file; a singular fit there stopped the run after its work)."""

    models = spec.utility.models
    if not models or any(c not in df.columns for m in models for c in m.columns()):
        return []  # (missing columns: check_data names them)
    try:
        design = SurveyDesign.from_spec(df, spec.design)
    except (DesignError, ValueError):
        return []  # (the design's own problems are named by check_data)
    keys = {k.name: k for k in spec.variables.keys}
    out = []
    for i, m in enumerate(models):
        try:
            model_fits([df], [design], m.formula, m.family, keys, replicates=False)
        except FormulaError as e:
            out.append(str(e).replace("utility.models:", f"utility.models[{i}]:", 1))
    return out


def checked_input(spec: ReleaseSpec) -> tuple[pd.DataFrame, str]:
    """The input as the spec declares it (sdl_design.io.read_input) and its digest, checked to
    fit the spec and every enabled stage's preconditions (SpecError listing every problem)."""
    df, digest = read_input(spec)
    # the models' fits (1M records: 2.3 of 6.7 s of checks) beside the other checks
    with ThreadPoolExecutor(1, thread_name_prefix="puf-preflight") as pool:
        models = pool.submit(_models, spec, df)
        spec.check_data(df)
        raise_problems(preflight(spec, df, models))  # before any work
    return df, digest


def raise_problems(problems: list[str]) -> None:
    """Raise SpecError (exit 2 in the CLI) listing the problems, if any."""
    if problems:
        raise SpecError(problems)


def _is_number(s: pd.Series) -> bool:
    return pd.api.types.is_numeric_dtype(s) and not pd.api.types.is_bool_dtype(s)


def _is_number_or_bool(s: pd.Series) -> bool:
    return pd.api.types.is_numeric_dtype(s) or pd.api.types.is_bool_dtype(s)


# ---------------------------------------------------------------- types each stage reads


def _types(spec: ReleaseSpec, df: pd.DataFrame, stages: list[NumberColumn]) -> list[str]:
    """Columns read as numbers (bins, sums, distances, top-coding) must be numbers: the binned
    keys and sensitive variables, and what the enabled stages read (stages); a column that
    guides a stage must vary."""
    v = spec.variables
    need = [
        NumberColumn(f"variables.keys[{i}].bins", k.name) for i, k in enumerate(v.keys) if k.bins
    ]
    need += [
        NumberColumn(f"variables.sensitive[{i}].bins", s.name)
        for i, s in enumerate(v.sensitive)
        if s.bins
    ]
    need += stages
    out = []
    for n in need:
        if n.column not in df.columns:
            continue  # check_data names it
        s = df[n.column]
        ok = _is_number_or_bool(s) if n.bool_ok else _is_number(s)
        if not ok:
            out.append(
                f"{n.field}: column '{n.column}' holds {s.dtype} values, not numbers; this stage "
                "reads it as numbers: recode it to numbers (or take it out of this list)"
            )
    for n in need:
        c = n.column
        if n.guides and c in df.columns and _is_number_or_bool(df[c]) and df[c].nunique() < 2:
            out.append(f"{n.field}: column '{c}' is constant; it cannot {n.guides}: remove it")
    return out


# ---------------------------------------------------------------- edit rules against the data


def _value_problem(s: pd.Series, value: Any) -> str | None:
    """Why a value can never equal a value of column s (None when it can)."""
    if value is None:
        return None
    if pd.api.types.is_bool_dtype(s):
        if not isinstance(value, (bool, np.bool_)):
            return f"column '{s.name}' holds true/false, the value {value!r} is not a boolean; write true or false"
        return None
    if pd.api.types.is_numeric_dtype(s):
        if isinstance(value, str):
            return (
                f"column '{s.name}' holds numbers, the value {value!r} is text: no record can "
                "match; write the number"
            )
        return None
    if isinstance(value, (int, float, np.number)) and not s.isin([value]).any():
        text = s.isin([str(value)]).any()
        return f"column '{s.name}' holds text, the value {value!r} is a number: no record " + (
            f"matches it; quote it ('{value}')" if text else "matches it; quote it as text"
        )
    return None


def _conditions(spec: ReleaseSpec, df: pd.DataFrame) -> list[str]:
    """Each edit rule's when-clauses and in_set values compare like with like."""
    out = []
    for i, rule in enumerate(spec.edits):
        for col, op, value in parse_condition(rule.when) if rule.when else []:
            if col not in df.columns:
                continue
            s = df[col]
            if op in ("<", "<=", ">", ">="):
                num_col, num_val = _is_number(s), isinstance(value, (int, float, np.number))
                if num_col != num_val or isinstance(value, bool):
                    out.append(
                        f"edits[{i}].when: '{col} {op} {value!r}' orders column '{col}' "
                        f"({s.dtype}) against {type(value).__name__} {value!r}; compare numbers "
                        "with numbers (or text with quoted text)"
                    )
                continue
            for v in value if isinstance(value, list) else [value]:
                why = _value_problem(s, v)
                if why:
                    out.append(f"edits[{i}].when: in '{rule.when}', {why}")
                    break
        values = getattr(rule, "values", None)
        column = getattr(rule, "column", None)
        if values is not None and column in df.columns:
            for v in values:
                why = _value_problem(df[column], v)
                if why:
                    out.append(f"edits[{i}].values: {why}")
                    break
    return out


# ---------------------------------------------------------------- sensitivity labels


def _sensitive_labels(spec: ReleaseSpec, df: pd.DataFrame) -> list[str]:
    """Binned sensitive variables: every bin has a score; distinct values never share a label."""
    out = []
    for i, s in enumerate(spec.variables.sensitive):
        if s.name not in df.columns:
            continue
        col = df[s.name]
        if s.bins is not None:
            if not _is_number(col):
                continue  # _types names it
            cats = pd.unique(coarsen(col, s.bins))
            listed = {category_label(k) for k in s.sensitivity}
            missing = sorted({category_label(c) for c in cats} - listed)
            if missing:
                hint = " (out_of_range: values outside the bins or missing: widen the bins)"
                out.append(
                    f"variables.sensitive[{i}].sensitivity: bins {missing[:8]} of '{s.name}' "
                    "have no sensitivity score; add them"
                    + (hint if "out_of_range" in missing else "")
                )
            continue
        uniq = pd.unique(col.dropna())
        labels = pd.Series([category_label(u) for u in uniq], dtype=object)
        clash = labels[labels.duplicated(keep=False)]
        if len(clash):
            vals = [repr(u) for u, d in zip(uniq, labels.duplicated(keep=False), strict=True) if d]
            out.append(
                f"variables.sensitive[{i}].name: values {short_list(vals, 8)} of '{s.name}' are "
                "different values with one category label; recode them to one spelling"
            )
    return out


# ---------------------------------------------------------------- design structure


def _factor_blocks(
    df: pd.DataFrame, cols: list[str], w: np.ndarray, p: Psus
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(records zero per PSU, G x R), (PSU factor W/w, its smallest value in the PSU, G x R),
    (factor constant within every PSU, R): _CHUNK columns at a time, records in PSU order."""
    zc, F, const = [], [], []
    ws = (w if p.order is None else w[p.order])[:, None]
    for a in range(0, len(cols), _CHUNK):
        W = df[cols[a : a + _CHUNK]].to_numpy(dtype=float)
        ratio = (W if p.order is None else W[p.order]) / ws
        zc.append(np.add.reduceat((ratio == 0).astype(np.int64), p.starts, axis=0))
        lo = np.minimum.reduceat(ratio, p.starts, axis=0)
        hi = np.maximum.reduceat(ratio, p.starts, axis=0)
        const.append((hi - lo).max(axis=0) <= _TOL * np.maximum(np.abs(hi).max(axis=0), 1.0))
        F.append(lo)
    return np.hstack(zc), np.hstack(F), np.concatenate(const)


def _replicates(spec: ReleaseSpec, df: pd.DataFrame) -> list[str]:
    """Replicate weights against their declared method: count and pattern of deleted PSUs,
    the factors of the other PSUs, PSUs per stratum."""
    rs = spec.design.replicate_weights
    cols = [c for c in spec.replicate_columns(df) if c in df.columns]
    w_col = spec.design.weight
    design = strata_psu(spec, df)
    if not cols or design is None or w_col not in df.columns:
        return []
    strata, psu = design
    not_num = [c for c in cols if not _is_number(df[c])]
    if not_num:
        return [
            f"design.replicate_weights: columns {short_list(not_num, 8)} hold no numbers; replicate "
            "weights must be numeric"
        ]
    w = pd.to_numeric(df[w_col], errors="coerce").to_numpy(dtype=float)
    p = Psus(df, strata, psu)
    if not (np.isfinite(w).all() and (w > 0).all()):
        return []  # check_data names the weights
    method = rs.method
    if method in ("brr", "fay"):
        bad = p.n_h != 2
        if bad.any():
            return [
                f"{_METHOD}: {method} needs exactly 2 PSUs per stratum; strata {p.strata(bad)} of "
                f"'{strata}' have {short_list(sorted(set(p.n_h[bad].tolist())), 8)} PSUs: declare the "
                "method the weights were made with (jkn for a delete-one jackknife), or pair the PSUs"
            ]
    f = _factors(df, cols, w, p)
    out = []
    if f.partial.any():
        out.append(
            f"design.replicate_weights: replicates {short_list(np.array(cols)[f.partial], 8)} give weight "
            "0 to some but not all records of a PSU; a replicate keeps or drops whole PSUs: check "
            f"design.psu ('{psu}') is the PSU the replicates were made with"
        )
    if method in ("jkn", "jk1"):
        out += _jackknife_problems(method, cols, p, f)
    elif method == "brr":
        out += _brr_problems(cols, p, f)
    elif method == "fay" and f.const.all():
        out += _fay_problems(float(rs.rho or 0.0), cols, f)
    elif method == "bootstrap":
        out += _bootstrap_problems(cols, p, f)
    return out


_METHOD = "design.replicate_weights.method"  # the field a wrong method is reported on
_LOOKS_JKN = " (they look like JKn: set method: jkn)"


@dataclass(frozen=True, eq=False)
class _Factors:
    """The replicate factors W/w per PSU and what they say of the design: F (the smallest
    factor in each PSU, G x R), const (factor constant within every PSU, R), deleted (every
    record of the PSU at weight 0, G x R), partial (some but not all records of a PSU at 0,
    R), n_del (PSUs deleted, R), d_psu (the first PSU deleted, R), expect (the JKn factors
    given d_psu, G x R) and jkn_like (every replicate follows the JKn pattern)."""

    F: np.ndarray
    const: np.ndarray
    deleted: np.ndarray
    partial: np.ndarray
    n_del: np.ndarray
    d_psu: np.ndarray
    expect: np.ndarray
    jkn_like: bool


def _factors(df: pd.DataFrame, cols: list[str], w: np.ndarray, p: Psus) -> _Factors:
    """The factors of the replicate columns cols against the full-sample weight w."""
    zc, F, const = _factor_blocks(df, cols, w, p)
    R = len(cols)
    deleted = zc == p.n_p[:, None]  # every record of the PSU at weight 0
    partial = ((zc > 0) & ~deleted).any(axis=0)
    n_del = deleted.sum(axis=0)
    # the JKn pattern: one PSU deleted, the rest of its stratum scaled by n_h/(n_h-1), 1 elsewhere
    jkn_like = False
    d_psu = deleted.argmax(axis=0)
    same = p.psu_h[:, None] == p.psu_h[d_psu][None, :]
    nh_del = p.n_h[p.psu_h[d_psu]].astype(float)
    expect = np.where(same, (nh_del / np.maximum(nh_del - 1.0, 1.0))[None, :], 1.0)
    expect[d_psu, np.arange(R)] = 0.0
    if const.all() and (n_del == 1).all():
        jkn_like = bool(np.allclose(F, expect, rtol=_TOL, atol=_TOL))
    return _Factors(F, const, deleted, partial, n_del, d_psu, expect, jkn_like)


def _jackknife_problems(method: str, cols: list[str], p: Psus, f: _Factors) -> list[str]:
    """jkn or jk1: one PSU deleted per replicate, each PSU once, the others scaled by
    n_h/(n_h-1) (jkn) or G/(G-1) (jk1)."""
    bad = f.n_del != 1
    if bad.any():
        return [
            f"{_METHOD}: {method} replicates delete exactly one PSU each, but replicates "
            f"{short_list(np.array(cols)[bad], 8)} delete {short_list(sorted(set(f.n_del[bad].tolist())), 8)} "
            "PSUs; declare the method the weights were made with"
        ]
    out = []
    twice = np.bincount(f.d_psu, minlength=p.G) > 1
    if twice.any():
        out.append(
            f"{_METHOD}: {method}: {int(twice.sum())} PSUs are deleted by more than one "
            "replicate; each PSU is deleted once: check the replicate columns"
        )
    if f.const.all():
        expect = f.expect
        if method == "jk1":
            expect = np.full((p.G, len(cols)), p.G / (p.G - 1.0))
            expect[f.d_psu, np.arange(len(cols))] = 0.0
        ok = np.isclose(f.F, expect, rtol=_TOL, atol=_TOL).all(axis=0)
        if not ok.all():
            scale = "n_h/(n_h-1)" if method == "jkn" else "G/(G-1)"
            hint = _LOOKS_JKN if f.jkn_like else ""
            out.append(
                f"{_METHOD}: {method} replicates scale the other PSUs by {scale}, but "
                f"replicates {short_list(np.array(cols)[~ok], 8)} do not{hint}; declare the "
                "method the weights were made with"
            )
    return out


def _brr_problems(cols: list[str], p: Psus, f: _Factors) -> list[str]:
    """brr: every replicate drops one of the 2 PSUs of every stratum."""
    per = np.asarray(sp.csr_matrix((np.ones(p.G), (p.psu_h, np.arange(p.G)))) @ f.deleted)
    bad = (per != 1).any(axis=0)
    if not bad.any():
        return []
    return [
        f"{_METHOD}: brr replicates drop one of the 2 PSUs of every stratum, but replicates "
        f"{short_list(np.array(cols)[bad], 8)} do not" + (_LOOKS_JKN if f.jkn_like else "")
    ]


def _fay_problems(rho: float, cols: list[str], f: _Factors) -> list[str]:
    """fay (factors constant within PSUs): every factor is rho or 2 - rho."""
    ok = (np.isclose(f.F, rho, atol=_TOL) | np.isclose(f.F, 2.0 - rho, atol=_TOL)).all(axis=0)
    if ok.all():
        return []
    return [
        f"{_METHOD}: fay replicates with rho {rho:g} scale PSUs by {rho:g} or {2 - rho:g}, "
        f"but replicates {short_list(np.array(cols)[~ok], 8)} do not; check rho and the method"
        + (_LOOKS_JKN if f.jkn_like else "")
    ]


def _bootstrap_problems(cols: list[str], p: Psus, f: _Factors) -> list[str]:
    """bootstrap: not JKn, and (factors constant within PSUs) multiplicities of a Rao-Wu
    bootstrap drawing n_h - 1 or n_h PSUs per stratum."""
    if f.jkn_like:
        return [
            f"{_METHOD}: declared bootstrap, but the replicate weights are JKn (each replicate "
            "deletes one PSU and scales the rest of its stratum by n_h/(n_h-1)); their "
            "variances would be wrong by far: set method: jkn"
        ]
    if not f.const.all():
        return []
    nh = p.n_h[p.psu_h].astype(float)[:, None]
    S = sp.csr_matrix((np.ones(p.G), (p.psu_h, np.arange(p.G))), shape=(p.H, p.G))
    ok = np.zeros(len(cols), dtype=bool)
    for less in (1.0, 0.0):  # Rao-Wu: m_h = n_h - 1 draws; or m_h = n_h draws
        counts = f.F * (nh - less) / nh
        integer = np.isclose(counts, np.round(counts), atol=1e-6).all(axis=0)
        drawn = np.asarray(S @ np.round(counts))  # H x R
        m_h = (p.n_h - less)[:, None]
        ok |= integer & np.isclose(drawn, m_h).all(axis=0)
    if ok.all():
        return []
    return [
        f"{_METHOD}: bootstrap replicate factors are multiplicities (integer counts of "
        "draws times n_h/(n_h-1)), but replicates "
        f"{short_list(np.array(cols)[~ok], 8)} are not; declare the method the weights "
        "were made with"
    ]
