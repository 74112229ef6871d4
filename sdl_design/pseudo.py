"""A variance design for the public file when no stage masks the original one.

Masked variance units in the manner of NHANES' pseudo strata and PSUs: the original strata,
sorted by label, are collapsed into groups of at least two (so no pseudo stratum is an original
stratum); within each group the units (original PSUs, or records when each record is its own
PSU) are permuted at random within their original stratum and dealt in turn to K_g = m S_g
slots, slot j giving pseudo stratum j // m and pseudo PSU j % m. Each pseudo PSU is then a
random group of at least `min_units` units balanced over the group's original strata: for a
random partition of n units into m groups of n / m, E[m / (m - 1) sum_j (Z_j - Zbar)^2] =
n / (n - 1) sum_i (z_i - zbar)^2, the with-replacement estimator, so the pseudo design's
variances are unbiased for the original ones (the random-groups estimator), with fewer degrees
of freedom. Replicate weights (JKn or bootstrap) are built from the pseudo design, so their
zero patterns show pseudo PSUs, never original ones.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd
import scipy.sparse as sp

from sdl_design.codes import factorize
from sdl_design.keys import key_levels
from sdl_design.spec import SpecError
from sdl_design.stage import StageResult
from sdl_design.survey.design import DesignError, SurveyDesign

if TYPE_CHECKING:
    from sdl_design.stage import StageResult


@dataclass
class PseudoDesign:
    """Pseudo stratum and PSU of every record (labels 1..G and 1..m) and how they were made."""

    stratum: np.ndarray  # (n,) pseudo stratum label, 1..G in random order
    psu: np.ndarray  # (n,) pseudo PSU label within its pseudo stratum, 1..m
    n_strata: int  # G
    psus_per_stratum: int  # m
    units: str  # "PSU" (original PSUs grouped) or "record" (each record its own PSU)
    units_per_psu_min: int
    units_per_psu_median: float
    strata_per_group_min: int  # original strata collapsed into one group, at least
    # mean squared log ratio of its variances to the original's (None: not chosen on them)
    variance_loss: float | None = None


def _groups(unit_stratum_count: np.ndarray, need_units: int, need_strata: int) -> np.ndarray:
    """Consecutive original strata (in label order) into groups of at least need_strata strata
    and need_units units; a short tail joins the last group. Returns the group of each stratum."""
    H = len(unit_stratum_count)
    group = np.zeros(H, dtype=np.int64)
    g, units, strata = 0, 0, 0
    for h in range(H):
        group[h] = g
        units += int(unit_stratum_count[h])
        strata += 1
        if units >= need_units and strata >= need_strata:
            g, units, strata = g + 1, 0, 0
    if strata and g > 0:  # the tail is too small: merge it into the previous group
        group[group == g] = g - 1
    return group


@dataclass
class _Units:
    """The units of build_pseudo_design: each record's unit, each unit's original stratum, the
    units per stratum."""

    unit: np.ndarray  # (n,) unit of each record
    unit_h: np.ndarray  # (U,) original stratum of each unit
    per_h: np.ndarray  # (H,) units per original stratum
    is_psu: bool  # units are original PSUs (else records)


def _units(strata: np.ndarray | None, psu: np.ndarray | None, n: int) -> _Units:
    h = factorize(strata, sort=True)[0] if strata is not None else np.zeros(n, dtype=np.int64)
    H = int(h.max()) + 1
    if psu is None:
        unit = np.arange(n, dtype=np.int64)
    else:  # PSUs nested in strata
        unit = factorize(pd.MultiIndex.from_arrays([h, np.asarray(psu)]), sort=True)[0]
    U = int(unit.max()) + 1
    unit_h = np.zeros(U, dtype=np.int64)
    unit_h[unit] = h
    return _Units(unit, unit_h, np.bincount(unit_h, minlength=H), psu is not None)


def _deal(
    u: _Units, m: int, max_psus: int, min_units: int, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray, np.ndarray, int, np.ndarray]:
    """One draw of the dealing (module docstring) with m pseudo PSUs a pseudo stratum: each
    unit's pseudo stratum index and pseudo PSU (0-based), the labels 1..G of the pseudo strata
    in random order, G and the strata collapsed into each group."""
    U, H = len(u.unit_h), len(u.per_h)
    max_strata = max(1, int(max_psus) // m)
    c = max(int(min_units), -(-U // (m * max_strata)))  # units per pseudo PSU
    group = _groups(u.per_h, m * c, min(2, H))
    G0 = int(group.max()) + 1
    ug = group[u.unit_h]  # group of each unit
    units_g = np.bincount(ug, minlength=G0)
    S = np.maximum(1, units_g // (m * c))  # sub-strata per group
    # units of each group in stratum order, permuted at random within stratum
    order = np.lexsort((rng.random(U), u.unit_h, ug))
    start = np.r_[0, np.cumsum(units_g)[:-1]]
    pos = np.empty(U, dtype=np.int64)
    pos[order] = np.arange(U) - np.repeat(start, units_g)
    K = m * S
    offset = (rng.random(G0) * K).astype(np.int64)
    slot = (pos + offset[ug]) % K[ug]
    first = np.r_[0, np.cumsum(S)[:-1]]
    G = int(S.sum())
    label = rng.permutation(G) + 1
    return first[ug] + slot // m, slot % m, label, G, np.bincount(group, minlength=G0)


def _sums(z: np.ndarray, group: np.ndarray, G: int) -> np.ndarray:
    """The rows of z (units x q) summed by group (0..G-1), G x q: each group's rows added in
    row order (the indicator built as CSR directly: no COO conversion, the same bits)."""
    order = np.argsort(group, kind="stable")
    indptr = np.zeros(G + 1, dtype=np.int64)
    np.cumsum(np.bincount(group, minlength=G), out=indptr[1:])
    ind = sp.csr_matrix((np.ones(len(group)), order, indptr), shape=(G, len(group)))
    return np.asarray(ind @ z)


def _variances(z: np.ndarray, stratum: np.ndarray) -> np.ndarray:
    """With-replacement variance of each column of the unit totals z (units x q) in strata
    stratum (0-based): sum_h n_h / (n_h - 1) sum_i (z_hi - zbar_h)^2, strata of one unit out."""
    n_h = np.bincount(stratum)
    mean = _sums(z, stratum, len(n_h)) / np.maximum(n_h, 1)[:, None]
    dev = z - mean[stratum]
    f = np.where(n_h > 1, n_h / np.maximum(n_h - 1, 1), 0.0)[stratum]
    return (f[:, None] * dev * dev).sum(axis=0)


def _loss(scores: np.ndarray, v0: np.ndarray, stratum_u: np.ndarray, psu_u: np.ndarray) -> float:
    """Mean squared log ratio of the pseudo design's variances to the original's (v0) over the
    characteristics whose scores (units x q) are the columns: how far the SEs an analyst gets
    from the pseudo design are from the original ones."""
    m = int(psu_u.max()) + 1
    pid = stratum_u * m + psu_u
    used = np.bincount(pid) > 0  # np.unique's ids and inverse, by counting
    ids = np.flatnonzero(used)
    pid = (np.cumsum(used) - 1)[pid]
    v1 = _variances(_sums(scores, pid, len(ids)), ids // m)
    r = np.log(np.maximum(v1, 1e-12 * v0) / v0)
    return float(np.round(np.mean(r * r), 10))  # rounded: the same choice by partition


def _sizes(u: _Units, psus_per_stratum: int | None, min_units: int) -> list[int]:
    """The pseudo PSUs a pseudo stratum to try: the spec's; else 10 with records as units; else
    2 up to the most that hold min_units original PSUs each (at most 16)."""
    if psus_per_stratum:
        return [int(psus_per_stratum)]
    if not u.is_psu:
        return [10]
    return list(range(2, max(2, min(16, len(u.unit_h) // max(1, int(min_units)))) + 1))


def build_pseudo_design(
    strata: np.ndarray | None,
    psu: np.ndarray | None,
    rng: np.random.Generator,
    psus_per_stratum: int | None = None,
    max_psus: int = 100,
    min_units: int = 2,
    n: int | None = None,
    scores: np.ndarray | None = None,
    candidates: int = 1,
) -> PseudoDesign:
    """Pseudo strata and PSUs for records with original labels strata and psu (None: one
    stratum; each record its own PSU; n: the number of records when both are None);
    psus_per_stratum None: 2 with PSUs (without scores), 10 with records; at most about
    max_psus pseudo PSUs. See the module docstring. scores (units x q, units in sorted (stratum,
    PSU) order): the PSU totals of the linearized scores of q characteristics; with them,
    `candidates` dealings of each size (_sizes) are drawn and the one whose variances are
    closest to the original's (_loss) is kept: a variance-preserving choice among unbiased
    random-group designs."""
    if n is None:
        n = len(strata) if strata is not None else (len(psu) if psu is not None else 0)
    if n == 0:
        raise DesignError("pseudo design: the file has no records")
    u = _units(strata, psu, n)
    U = len(u.unit_h)
    search = scores is not None and u.is_psu and candidates > 1
    sizes = _sizes(u, psus_per_stratum, min_units) if search else [psus_per_stratum or 0]
    sizes = [s or (2 if psu is not None else 10) for s in sizes]
    if U < sizes[0] * min_units:
        raise DesignError(
            f"design.pseudo: {U} units ({'PSUs' if psu is not None else 'records'}) are too few "
            f"for {sizes[0]} pseudo PSUs of at least {min_units} units; lower "
            "design.pseudo.min_units or psus_per_stratum, or publish the design labels "
            "(design.publish_design_labels)"
        )
    best, best_loss = None, np.inf
    v0 = _variances(scores, u.unit_h) if search else None
    if search:
        keep = v0 > 1e-12 * v0.max(initial=0.0)
        scores, v0 = scores[:, keep], v0[keep]
        search = bool(keep.any())
    for m in sizes:
        for _ in range(candidates if search else 1):
            dealt = _deal(u, m, max_psus, min_units, rng)
            loss = _loss(scores, v0, dealt[0], dealt[1]) if search else 0.0
            if loss < best_loss:
                best, best_loss = (m, dealt), loss
    m, (stratum_u, psu_u, label, G, strata_per_group) = best
    per_psu = np.bincount(stratum_u * m + psu_u, minlength=G * m)
    return PseudoDesign(
        stratum=label[stratum_u[u.unit]],
        psu=psu_u[u.unit] + 1,
        n_strata=G,
        psus_per_stratum=m,
        units="PSU" if psu is not None else "record",
        units_per_psu_min=int(per_psu.min()),
        units_per_psu_median=float(np.median(per_psu)),
        strata_per_group_min=int(strata_per_group.min()),
        variance_loss=best_loss if search else None,
    )


UNIT = ["stratum", "psu"]
MIN_N = 30  # records a domain needs for its variance to steer the choice
MAX_SCORES = 400  # domain means that steer it at most (the largest domains)


def unit_labels(df: pd.DataFrame, spec: Any) -> pd.MultiIndex:
    """Each record's unit: (stratum, PSU) labels; stratum 0 when the design has no strata."""
    d = spec.design
    s = df[d.strata] if d.strata else pd.Series(0, index=df.index)
    return pd.MultiIndex.from_arrays([s.to_numpy(), df[d.psu].to_numpy()], names=UNIT)


def _study_block(df: pd.DataFrame, spec: Any) -> tuple[np.ndarray, np.ndarray]:
    """The numeric study variables as records x k (missing as 0) and their observed flags."""
    cols = [
        c
        for c in spec.variables.study
        if c in df.columns
        and (pd.api.types.is_numeric_dtype(df[c]) or pd.api.types.is_bool_dtype(df[c]))
    ]
    Y = df[cols].to_numpy(dtype=float, na_value=np.nan) if cols else np.zeros((len(df), 0))
    seen = ~np.isnan(Y)
    return np.where(seen, Y, 0.0), seen.astype(float)


def unit_score_sums(df: pd.DataFrame, spec: Any) -> pd.DataFrame:
    """A pass over records (a file or a partition): for each unit (stratum, PSU), utility domain
    (overall, spec.utility's domains; keys in their published coding) and level, the records
    and sum w m y and sum w m of each numeric study variable (m: y observed): the sums the PSU
    totals of the domain means' linearized scores follow from (pseudo_scores)."""
    keys = {k.name: k for k in spec.variables.keys}
    w = df[spec.design.weight].to_numpy(dtype=float)
    Y, M = _study_block(df, spec)
    k = Y.shape[1]
    block = np.concatenate([np.ones((len(df), 1)), w[:, None] * M * Y, w[:, None] * M], axis=1)
    ucode, units = factorize(unit_labels(df, spec))
    groupings = [[]] + spec.utility.domain_list(list(keys))
    out = []
    for g, vars_ in enumerate(groupings):
        if any(v not in df.columns for v in vars_):
            continue
        cell = np.zeros(len(df), dtype=np.int64)
        names = np.array([""], dtype=object)
        for v in vars_:
            codes, levels = key_levels(df[v], keys.get(v, v))
            lab = np.array([str(x) for x in levels], dtype=object)
            cell = cell * len(lab) + codes
            names = (names[:, None] + "|" + lab[None, :]).ravel()
        pair, at = np.unique(ucode * len(names) + cell, return_inverse=True)
        sums = np.zeros((len(pair), block.shape[1]))
        np.add.at(sums, at, block)
        frame = pd.DataFrame(
            sums, columns=["n", *[f"y{j}" for j in range(k)], *[f"x{j}" for j in range(k)]]
        )
        unit = units[pair // len(names)]
        frame.insert(0, "level", names[pair % len(names)])
        frame.insert(0, "domain", g)
        for i, name in enumerate(UNIT):
            frame.insert(i, name, unit.get_level_values(i))
        out.append(frame)
    return pd.concat(out, ignore_index=True)


def pseudo_scores(sums: pd.DataFrame, units: pd.DataFrame) -> np.ndarray:
    """The PSU totals of the linearized scores z = w m (y - R_d) / X_d of every numeric study
    variable's mean in every domain with at least MIN_N records, units x q, in the order of
    units (its stratum, psu columns): from unit_score_sums (summed over partitions)."""
    by = [*UNIT, "domain", "level"]
    s = sums.groupby(by, sort=True).sum()
    k = (s.shape[1] - 1) // 2
    wide = s.unstack(["domain", "level"], fill_value=0.0)
    wide = wide.reindex(pd.MultiIndex.from_frame(units[UNIT]), fill_value=0.0)
    n = wide["n"].to_numpy().sum(axis=0)
    overall = wide["n"].columns.get_level_values("domain").to_numpy() == 0
    z, z_all, n_dom = [], [], []
    for j in range(k):
        Sy, Sx = wide[f"y{j}"].to_numpy(), wide[f"x{j}"].to_numpy()
        X = Sx.sum(axis=0)
        ok = (n >= MIN_N) & (X > 0)
        R = Sy[:, ok].sum(axis=0) / X[ok]
        zj = (Sy[:, ok] - R * Sx[:, ok]) / X[ok]  # the ratio's linearized scores
        z.append(zj[:, ~overall[ok]])
        z_all.append(zj[:, overall[ok]])
        n_dom.append(n[ok][~overall[ok]])
    if not z:
        return np.zeros((len(units), 0))
    z_dom, z_all = np.concatenate(z, axis=1), np.concatenate(z_all, axis=1)
    if z_dom.shape[1] > MAX_SCORES:  # the largest domains (ties in order): the work bounded
        keep = np.sort(np.argsort(-np.concatenate(n_dom), kind="stable")[:MAX_SCORES])
        z_dom = z_dom[:, keep]
    # each overall mean weighs sqrt(domain means / overall means) of them (its scores repeated):
    # the estimates analysts quote first count more, the domains still decide
    reps = max(1, round(np.sqrt(z_dom.shape[1] / max(1, z_all.shape[1]))))
    return np.concatenate([*([z_all] * reps), z_dom], axis=1)


def psu_purity(original_psu: np.ndarray, pseudo_psu: np.ndarray) -> np.ndarray:
    """For each pseudo PSU (any hashable label per record), the largest share of its records
    that come from one original PSU: 1 means the pseudo PSU is (part of) one original PSU."""
    p = factorize(pseudo_psu)[0]
    o = factorize(original_psu)[0]
    pair = factorize(p.astype(np.int64) * (int(o.max()) + 1) + o)[0]
    cnt = np.bincount(pair)
    pair_p = np.zeros(len(cnt), dtype=np.int64)
    pair_p[pair] = p
    best = np.zeros(int(p.max()) + 1)
    np.maximum.at(best, pair_p, cnt)
    return best / np.bincount(p)


def _replicate_names(spec: Any, columns: list[str], count: int) -> tuple[list[str], list[str]]:
    """(new replicate column names, original replicate columns they replace). The new ones are
    named for what they are, never with the producer's names: design.pseudo.replicate_prefix
    (default 'pseudo_<method>_', e.g. pseudo_jkn_001) and their number."""
    d = spec.design
    old = d.replicate_weights.resolve(list(columns)) if d.replicate_weights else []
    prefix = d.pseudo.replicate_prefix or f"pseudo_{d.pseudo.replicate_method}_"
    return [f"{prefix}{i + 1:03d}" for i in range(count)], old


@dataclass
class PseudoPlan:
    """A file's pseudo design: the pseudo stratum and PSU of each of its units (records, or
    original PSUs when the records are in partitions), the replicate factors of each pseudo
    PSU (constant within a pseudo PSU for JKn and the bootstrap: built on one row per pseudo
    PSU, the values with_replicates gives on the whole file), and the columns they go in."""

    design: PseudoDesign  # labels of each unit
    unit_psu: np.ndarray  # each unit's row of factors
    factors: np.ndarray  # pseudo PSUs x R
    strata: str  # the pseudo strata's column
    psu: str  # the pseudo PSUs' column
    names: list[str]  # the replicate columns built
    old: list[str]  # the original replicate columns they replace
    public: dict[str, Any]  # the public file's design


def pseudo_plan(
    spec: Any,
    columns: list[str],
    strata: np.ndarray | None,
    psu: np.ndarray | None,
    rng: np.random.Generator,
    n: int | None = None,
    scores: np.ndarray | None = None,
) -> PseudoPlan:
    """The spec's pseudo design (design.pseudo) of units with original labels strata and psu
    (build_pseudo_design; a file's records, or one row per original PSU: the same labels per
    unit and the same draws of rng), then its replicate factors (rng's next draws); columns:
    the file's; scores: pseudo_scores of the units (None: no variance-preserving choice).
    SpecError names the field when a new column's name is taken."""

    d, p = spec.design, spec.design.pseudo
    sc, pc = d.strata or p.strata, d.psu or p.psu
    clash = [
        f"design.pseudo.{f}: column '{c}' is already in the data; give the pseudo {f} another name"
        for f, c, own in (("strata", sc, d.strata), ("psu", pc, d.psu))
        if own is None and c in columns
    ]
    if clash:
        raise SpecError(clash)
    des = build_pseudo_design(
        strata,
        psu,
        rng,
        p.psus_per_stratum,
        p.max_psus,
        p.min_units,
        n=n,
        scores=scores,
        candidates=p.candidates,
    )
    m = des.psus_per_stratum
    key = des.stratum.astype(np.int64) * (m + 1) + des.psu
    rows, unit_psu = np.unique(key, return_inverse=True)
    one = pd.DataFrame({"h": rows // (m + 1), "p": rows % (m + 1), "w": np.ones(len(rows))})
    f = SurveyDesign(one, weight="w", strata="h", psu="p").with_replicates(
        p.replicate_method, seed=rng, n_replicates=p.replicates, prefix="__rw"
    )
    names, old = _replicate_names(spec, columns, f.shape[1])
    taken = [c for c in names if c in columns and c not in old]
    if taken:
        raise SpecError(
            [
                f"design.pseudo.replicate_prefix: replicate columns {taken[:3]} are already in "
                "the data; give another prefix"
            ]
        )
    rscales = np.asarray(f.attrs.get("rscales"), dtype=float)
    public = {
        "weight": d.weight,
        "strata": sc,
        "psu": pc,
        "replicate_weights": names,
        "replicate_method": p.replicate_method,
        "rscales": sorted({round(float(r), 12) for r in rscales}),
        "replaced_replicate_weights": old,
    }
    return PseudoPlan(des, unit_psu, f.to_numpy(), sc, pc, names, old, public)


def apply_pseudo(df: pd.DataFrame, plan: PseudoPlan, unit: np.ndarray, weight: str) -> pd.DataFrame:
    """df (a whole file or a partition; unit: each record's unit in the plan) with its pseudo
    strata and PSUs and the pseudo design's replicate weights (w times the factors of the
    record's pseudo PSU) where the original replicate weights began."""
    data = df.copy()
    data[plan.strata] = plan.design.stratum[unit]
    data[plan.psu] = plan.design.psu[unit]
    w = data[weight].to_numpy(dtype=float)
    reps = pd.DataFrame(
        w[:, None] * plan.factors[plan.unit_psu[unit]], index=data.index, columns=plan.names
    )
    old = set(plan.old)
    cols = list(data.columns)
    at = cols.index(plan.old[0]) if plan.old else len(cols)  # new columns where the old began
    keep = [c for c in cols if c not in old]
    at = len([c for c in cols[:at] if c not in old])
    return pd.concat([data[keep[:at]], reps, data[keep[at:]]], axis=1)


def pseudo_summary(
    des: PseudoDesign, public: dict[str, Any], purity: np.ndarray
) -> tuple[dict[str, Any], dict[str, float], list[str]]:
    """PseudoDesignStage's params, metrics and notes of a built pseudo design (purity: of each
    pseudo PSU, in order of its first record)."""
    G, m = des.n_strata, des.psus_per_stratum
    R = len(public["replicate_weights"])
    params = {
        "built": True,
        "pseudo_strata": G,
        "pseudo_psus": G * m,
        "psus_per_stratum": m,
        "units": des.units,
        "units_per_pseudo_psu_min": des.units_per_psu_min,
        "units_per_pseudo_psu_median": des.units_per_psu_median,
        "original_strata_per_pseudo_stratum_min": des.strata_per_group_min,
        "n_replicates": R,
        "public_design": public,
    }
    metrics = {
        "pseudo_strata": float(G),
        "pseudo_psus": float(G * m),
        "n_replicates": float(R),
        "psu_purity_max": float(purity.max()),
        "psu_purity_mean": float(purity.mean()),
    }
    unit = "original PSUs" if des.units == "PSU" else "records (each its own PSU)"
    method = {"jkn": "JKn, delete one pseudo PSU", "bootstrap": "Rao-Wu bootstrap"}[
        public["replicate_method"]
    ]
    notes = [
        f"Pseudo design for the public file: {G} pseudo {'stratum' if G == 1 else 'strata'} "
        f"(each from at least "
        f"{des.strata_per_group_min} original strata) of {m} pseudo PSUs, each a random "
        f"group of at least {des.units_per_psu_min} {unit} balanced over the original "
        f"strata; {R} replicate weights ({method}, scale {public['rscales']}) built from it"
        + (
            f" replace the {len(public['replaced_replicate_weights'])} original ones."
            if public["replaced_replicate_weights"]
            else "."
        ),
        f"Largest share of a pseudo PSU from one original PSU: {purity.max():.1%} "
        "(no original PSU can be read off the pseudo labels or the replicate zero patterns).",
    ]
    return params, metrics, notes


def se_fix(previous: Sequence[StageResult]) -> str:
    """What a failing SE-ratio gate names as the fix when the public file's design is a pseudo
    design (previous: the stages' results so far; '' when none built one)."""
    built = [r.params for r in previous if (r.params or {}).get("pseudo_strata")]
    if not built:
        return ""
    p = built[-1]
    return (
        f"fix: the pseudo design ({p['pseudo_strata']} pseudo strata of {p['psus_per_stratum']} "
        "PSUs) has fewer degrees of freedom than the original: publish the original labels "
        "(design.publish_design_labels: true) where they may be published, or give it more "
        "designs to choose from (design.pseudo.candidates) or set "
        "design.pseudo.psus_per_stratum"
    )
