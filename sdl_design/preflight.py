"""Preflight: the preconditions every enabled stage of a release run would meet, checked on the
spec and the input file before any work. Pure pandas/numpy; `preflight(spec, df)` lists each
problem as 'field: what is wrong; the fix' (empty when the run can start).

It complements ReleaseSpec.check_data (columns exist, design values present, weights
positive, single-PSU strata): here the types each stage reads, the when-conditions against the
data, the segment/PSU nesting the swap needs, the replicate weights against their declared
method, and the strata MASSC subsampling could leave with a single PSU.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd
import scipy.sparse as sp

from sdl_design.edits import parse_condition
from sdl_design.keys import coarsen
from sdl_design.messages import short_list
from sdl_design.spec import ReleaseSpec, SpecError, category_label

# chance (at the worst-case rates phi_min) that subsampling leaves a stratum with < 2 PSUs,
# above which the release is refused before it starts
SINGLE_PSU_RISK_MAX = 1e-3
_TOL = 1e-6  # relative tolerance of replicate factors (float32 files give ~1e-7)
_CHUNK = 8  # replicate columns read at a time (n x 8 floats: memory stays flat at 1M records)


def preflight(spec: ReleaseSpec, df: pd.DataFrame) -> list[str]:
    """Every problem the run would meet on df, once each ('field: problem; fix')."""
    out: list[str] = []
    out += _types(spec, df)
    out += _conditions(spec, df)
    out += _sensitive_labels(spec, df)
    if spec.stages.active("swap") is not None:
        out += _swap(spec, df)
    if spec.design.replicate_weights is not None:
        out += _replicates(spec, df)
    if spec.stages.active("massc") is not None:
        out += _subsampling(spec, df)
        out += _controls(spec, df)
    risk = spec.stages.active("risk")
    if risk is not None and risk.loglinear:
        out += _key_cells(spec, df)
    out += _models(spec, df)
    return list(dict.fromkeys(out))


def _key_cells(spec: ReleaseSpec, df: pd.DataFrame) -> list[str]:
    """The risk stage's log-linear table: at most MAX_CELLS cells of the keys' published
    levels (risk.loglinear_risk refuses more, after the work before it)."""
    from sdl_design.keys import key_levels
    from sdl_design.risk import MAX_CELLS

    keys = [k for k in spec.variables.keys if k.name in df.columns]
    sizes = {k.name: len(key_levels(df[k.name], k)[1]) for k in keys}
    cells = float(np.prod(np.array(list(sizes.values()), dtype=float)))
    if cells <= MAX_CELLS:
        return []
    worst = max(sizes, key=sizes.get)
    return [
        f"variables.keys: the keys' full table would have {cells:,.0f} cells (levels {sizes}), "
        f"more than the risk stage's {MAX_CELLS:,}; coarsen '{worst}' ({sizes[worst]:,} "
        "levels) with bins or map, or drop a key"
    ]


def _controls(spec: ReleaseSpec, df: pd.DataFrame) -> list[str]:
    """MASSC's calibration controls: every record needs its value (a missing value is a margin
    of its own, and a margin of a record or two becomes infeasible once subsampling draws)."""
    out = []
    for i, k in enumerate(spec.stages.massc.calibration.controls):
        if k.name not in df.columns:
            continue
        miss = df[k.name].isna().to_numpy()
        if miss.any():
            rows = ", ".join(str(r + 1) for r in np.flatnonzero(miss)[:5])
            out.append(
                f"stages.massc.calibration.controls[{i}]: '{k.name}' is missing in "
                f"{int(miss.sum())} records (rows {rows}); calibration needs every record's "
                "value: correct or impute them, or drop the control"
            )
    return out


def _models(spec: ReleaseSpec, df: pd.DataFrame) -> list[str]:
    """Every declared model fits on the input under its design (the assessment fits it on the
    input and the published file; a singular fit there stopped the run after its work)."""
    from sdl_design.assess import model_fits
    from sdl_design.design import DesignError, SurveyDesign
    from sdl_design.glm import FormulaError

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


def raise_problems(problems: list[str]) -> None:
    """Raise SpecError (exit 2 in the CLI) listing the problems, if any."""
    if problems:
        raise SpecError(problems)


def _is_number(s: pd.Series) -> bool:
    return pd.api.types.is_numeric_dtype(s) and not pd.api.types.is_bool_dtype(s)


def _is_number_or_bool(s: pd.Series) -> bool:
    return pd.api.types.is_numeric_dtype(s) or pd.api.types.is_bool_dtype(s)


# ---------------------------------------------------------------- types each stage reads


def _types(spec: ReleaseSpec, df: pd.DataFrame) -> list[str]:
    """Columns a stage reads as numbers (bins, sums, distances, top-coding) must be numbers."""
    need: list[tuple[str, str, bool]] = []  # (field, column, bool allowed)
    v, st = spec.variables, spec.stages
    need += [(f"variables.keys[{i}].bins", k.name, False) for i, k in enumerate(v.keys) if k.bins]
    need += [
        (f"variables.sensitive[{i}].bins", s.name, False)
        for i, s in enumerate(v.sensitive)
        if s.bins
    ]
    if (swap := st.active("swap")) is not None:
        need += [(f"stages.swap.matching[{i}]", c, True) for i, c in enumerate(swap.matching)]
    if (prb := st.active("prb")) is not None:
        need += [(f"stages.prb.partition.{c}", c, False) for c, b in prb.partition.items() if b]
    if (massc := st.active("massc")) is not None:
        need += [(f"variables.study[{i}]", c, True) for i, c in enumerate(v.study)]
        if massc.substrata:
            need += [
                (f"stages.massc.substrata.variables[{i}]", c, False)
                for i, c in enumerate(massc.substrata.variables)
            ]
        need += [
            (f"stages.massc.calibration.controls[{i}].bins", k.name, False)
            for i, k in enumerate(massc.calibration.controls)
            if k.bins
        ]
    if (top := st.active("topcode")) is not None:
        need += [(f"stages.topcode.{c}", c, False) for c in top.columns]
    out = []
    for field, col, bool_ok in need:
        if col not in df.columns:
            continue  # check_data names it
        s = df[col]
        ok = _is_number_or_bool(s) if bool_ok else _is_number(s)
        if not ok:
            out.append(
                f"{field}: column '{col}' holds {s.dtype} values, not numbers; this stage "
                "reads it as numbers: recode it to numbers (or take it out of this list)"
            )
    if swap is not None:
        for i, c in enumerate(swap.matching):
            if c in df.columns and _is_number_or_bool(df[c]) and df[c].nunique() < 2:
                out.append(
                    f"stages.swap.matching[{i}]: column '{c}' is constant; it cannot guide the "
                    "swap: remove it"
                )
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


class _Psus:
    """PSUs nested in strata: record -> PSU code g, PSU -> stratum psu_h, PSUs per stratum,
    and the records in PSU order (order, None when already so; PSU p holds the records
    starts[p]:starts[p + 1] of that order)."""

    def __init__(self, df: pd.DataFrame, strata: str, psu: str):
        h, self.h_labels = pd.factorize(df[strata], sort=True)
        p_code, p_labels = pd.factorize(df[psu], sort=True)
        g, uniq = pd.factorize(h.astype(np.int64) * max(len(p_labels), 1) + p_code, sort=True)
        self.g = g.astype(np.int64)
        self.psu_h = (uniq // max(len(p_labels), 1)).astype(np.int64)
        self.G, self.H = len(self.psu_h), len(self.h_labels)
        self.n_h = np.bincount(self.psu_h, minlength=self.H)
        self.n_p = np.bincount(self.g, minlength=self.G)
        # None: the file is already in PSU order (no gather needed)
        self.order = None if (np.diff(self.g) >= 0).all() else np.argsort(self.g, kind="stable")
        self.starts = np.r_[0, np.cumsum(self.n_p)[:-1]]

    def strata(self, mask: np.ndarray) -> str:
        return short_list(list(self.h_labels[np.flatnonzero(mask)]), 8)


def _design_columns(spec: ReleaseSpec, df: pd.DataFrame) -> tuple[str, str] | None:
    d = spec.design
    strata, psu = getattr(d, "strata", None), getattr(d, "psu", None)
    if not strata or not psu or strata not in df.columns or psu not in df.columns:
        return None
    if df[strata].isna().any() or df[psu].isna().any():
        return None  # check_data names the missing values
    return strata, psu


def _swap(spec: ReleaseSpec, df: pd.DataFrame) -> list[str]:
    """The swap moves whole segments between PSUs of a stratified design."""
    d, st = spec.design, spec.stages.swap
    out = []
    if not d.segment:
        out.append(
            "design.segment: stages.swap is enabled but the design names no segment column; the "
            "swap moves whole segments (SSUs) between PSUs: name the segment column in "
            "design.segment, or set stages.swap.enabled: false"
        )
    if not getattr(d, "strata", None) or not getattr(d, "psu", None):
        out.append(
            "stages.swap: the swap needs design.strata and design.psu (it swaps segments between "
            "PSUs within strata); name them, or set stages.swap.enabled: false"
        )
    cols = _design_columns(spec, df)
    if cols is None:
        return out
    strata, psu = cols
    if d.segment and d.segment in df.columns and not df[d.segment].isna().any():
        pairs = df[[strata, psu, d.segment]].drop_duplicates()
        n_psu = pairs.groupby(d.segment, sort=True, observed=True).size()
        spans = n_psu[n_psu > 1]
        if len(spans):
            out.append(
                f"design.segment: {len(spans)} segments of '{d.segment}' lie in more than one PSU "
                f"(e.g. {short_list(list(spans.index), 8)}); segments must be nested in PSUs: give each "
                f"segment a label unique across PSUs (e.g. '{psu}' and '{d.segment}' combined)"
            )
    if st.replicate_method in ("brr", "fay"):
        p = _Psus(df, strata, psu)
        bad = p.n_h != 2
        if bad.any():
            out.append(
                f"stages.swap.replicate_method: {st.replicate_method} needs exactly 2 PSUs per "
                f"stratum; strata {p.strata(bad)} of '{strata}' have "
                f"{short_list(sorted(set(p.n_h[bad].tolist())), 8)}: use jkn or bootstrap"
            )
    return out


def _factor_blocks(
    df: pd.DataFrame, cols: list[str], w: np.ndarray, p: _Psus
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
    design = _design_columns(spec, df)
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
    p = _Psus(df, strata, psu)
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


def _factors(df: pd.DataFrame, cols: list[str], w: np.ndarray, p: _Psus) -> _Factors:
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


def _jackknife_problems(method: str, cols: list[str], p: _Psus, f: _Factors) -> list[str]:
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


def _brr_problems(cols: list[str], p: _Psus, f: _Factors) -> list[str]:
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


def _bootstrap_problems(cols: list[str], p: _Psus, f: _Factors) -> list[str]:
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


# ---------------------------------------------------------------- MASSC subsampling


def single_psu_chance(n_p: np.ndarray, psu_h: np.ndarray, n_strata: int, phi: float) -> np.ndarray:
    """Per stratum, the chance that systematic selection at rate phi within each PSU (n_p
    records; PSU p in stratum psu_h[p]) leaves fewer than two PSUs with a record: PSU p keeps
    one with probability q_p = min(1, n_p phi), independently across PSUs, so with s PSUs sure
    (q = 1) the chance is 0 (s >= 2), prod(1 - q) (s = 1), or prod(1 - q) (1 + sum q/(1 - q))
    (s = 0) over the others."""
    q = np.minimum(1.0, np.asarray(n_p, dtype=float) * phi)
    sure = np.bincount(psu_h, weights=q >= 1.0, minlength=n_strata)
    unsure = q < 1.0
    qu = np.where(unsure, q, 0.0)
    log0 = np.bincount(psu_h, weights=np.log1p(-qu), minlength=n_strata)
    odds = np.bincount(psu_h, weights=qu / (1.0 - qu), minlength=n_strata)
    p0 = np.exp(log0)  # no uncertain PSU keeps a record
    return np.where(sure >= 2, 0.0, np.where(sure == 1, p0, p0 * (1.0 + odds)))


def _subsampling(spec: ReleaseSpec, df: pd.DataFrame) -> list[str]:
    """Strata that MASSC's nested subsampling could leave with fewer than two PSUs.

    Records are kept within each PSU by systematic selection at their stratum's rate phi_h >=
    phi_min, so a PSU of n_p records keeps floor or ceiling of n_p phi: it loses every record
    only when n_p phi < 1, with probability at most 1 - n_p phi_min. With the swap, a PSU holds
    at least its number of segments times the smallest segment size."""
    cols = _design_columns(spec, df)
    if cols is None:
        return []
    strata, psu = cols
    p = _Psus(df, strata, psu)
    phi_min = spec.stages.massc.phi_min
    n_p = p.n_p.astype(float)
    seg = spec.design.segment
    if spec.stages.active("swap") is not None and seg and seg in df.columns:
        s_code = pd.factorize(df[seg])[0]
        seg_size = np.bincount(s_code)
        pairs = np.unique(p.g * (len(seg_size) + 1) + s_code)  # distinct (PSU, segment)
        n_seg = np.bincount(pairs // (len(seg_size) + 1), minlength=p.G).astype(float)
        n_p = np.minimum(n_p, n_seg * float(seg_size.min()))
    risk = single_psu_chance(n_p, p.psu_h, p.H, phi_min)
    bad = (p.n_h >= 2) & (risk > SINGLE_PSU_RISK_MAX)
    if not bad.any():
        return []
    smallest = int(p.n_p[np.isin(p.psu_h, np.flatnonzero(bad))].min())
    return [
        f"design.psu: MASSC subsampling (stages.massc, rates >= phi_min {phi_min:g}) could leave "
        f"strata {p.strata(bad)} of '{strata}' with a single PSU (chance up to "
        f"{float(risk[bad].max()):.1%}; their smallest PSU has {smallest} record(s), and a PSU "
        f"of n records keeps none with chance 1 - n x phi when n x phi < 1): collapse those "
        "strata with a neighbouring stratum or merge their small PSUs"
    ]
