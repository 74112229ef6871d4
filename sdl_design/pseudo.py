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

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd

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


def build_pseudo_design(
    strata: np.ndarray | None,
    psu: np.ndarray | None,
    rng: np.random.Generator,
    psus_per_stratum: int | None = None,
    max_psus: int = 100,
    min_units: int = 2,
    n: int | None = None,
) -> PseudoDesign:
    """Pseudo strata and PSUs for records with original labels strata and psu (None: one
    stratum; each record its own PSU; n: the number of records when both are None);
    psus_per_stratum None: 2 with PSUs, 10 with records;
    at most about max_psus pseudo PSUs. See the module docstring."""
    if n is None:
        n = len(strata) if strata is not None else (len(psu) if psu is not None else 0)
    if n == 0:
        raise DesignError("pseudo design: the file has no records")
    m = int(psus_per_stratum or (2 if psu is not None else 10))
    h = pd.factorize(strata, sort=True)[0] if strata is not None else np.zeros(n, dtype=np.int64)
    H = int(h.max()) + 1
    if psu is None:
        unit = np.arange(n, dtype=np.int64)
    else:  # PSUs nested in strata
        unit = pd.factorize(pd.MultiIndex.from_arrays([h, np.asarray(psu)]), sort=True)[0]
    U = int(unit.max()) + 1
    unit_h = np.zeros(U, dtype=np.int64)
    unit_h[unit] = h
    per_h = np.bincount(unit_h, minlength=H)
    if U < m * min_units:
        raise DesignError(
            f"design.pseudo: {U} units ({'PSUs' if psu is not None else 'records'}) are too few "
            f"for {m} pseudo PSUs of at least {min_units} units; lower design.pseudo.min_units "
            "or psus_per_stratum, or publish the design labels (design.publish_design_labels)"
        )
    max_strata = max(1, int(max_psus) // m)
    c = max(int(min_units), -(-U // (m * max_strata)))  # units per pseudo PSU
    group = _groups(per_h, m * c, min(2, H))
    G0 = int(group.max()) + 1
    ug = group[unit_h]  # group of each unit
    units_g = np.bincount(ug, minlength=G0)
    S = np.maximum(1, units_g // (m * c))  # sub-strata per group
    # units of each group in stratum order, permuted at random within stratum
    order = np.lexsort((rng.random(U), unit_h, ug))
    start = np.r_[0, np.cumsum(units_g)[:-1]]
    pos = np.empty(U, dtype=np.int64)
    pos[order] = np.arange(U) - np.repeat(start, units_g)
    K = m * S
    offset = (rng.random(G0) * K).astype(np.int64)
    slot = (pos + offset[ug]) % K[ug]
    sub = slot // m
    first = np.r_[0, np.cumsum(S)[:-1]]
    stratum_u = first[ug] + sub  # global pseudo stratum index of each unit
    psu_u = slot % m
    G = int(S.sum())
    label = rng.permutation(G) + 1
    per_psu = np.bincount(stratum_u * m + psu_u, minlength=G * m)
    strata_per_group = np.bincount(group, minlength=G0)
    return PseudoDesign(
        stratum=label[stratum_u[unit]],
        psu=psu_u[unit] + 1,
        n_strata=G,
        psus_per_stratum=m,
        units="PSU" if psu is not None else "record",
        units_per_psu_min=int(per_psu.min()),
        units_per_psu_median=float(np.median(per_psu)),
        strata_per_group_min=int(strata_per_group.min()),
    )


def psu_purity(original_psu: np.ndarray, pseudo_psu: np.ndarray) -> np.ndarray:
    """For each pseudo PSU (any hashable label per record), the largest share of its records
    that come from one original PSU: 1 means the pseudo PSU is (part of) one original PSU."""
    p = pd.factorize(pseudo_psu)[0]
    o = pd.factorize(original_psu)[0]
    pair = pd.factorize(p.astype(np.int64) * (int(o.max()) + 1) + o)[0]
    cnt = np.bincount(pair)
    pair_p = np.zeros(len(cnt), dtype=np.int64)
    pair_p[pair] = p
    best = np.zeros(int(p.max()) + 1)
    np.maximum.at(best, pair_p, cnt)
    return best / np.bincount(p)


def _replicate_names(spec: Any, columns: list[str], count: int) -> tuple[list[str], list[str]]:
    """(new replicate column names, original replicate columns they replace). The spec's own
    names when it lists as many; its glob's prefix when the glob is 'prefix*'; else
    design.pseudo.replicate_prefix."""
    d = spec.design
    old = d.replicate_weights.resolve(list(columns)) if d.replicate_weights else []
    given = d.replicate_weights.columns if d.replicate_weights else None
    if isinstance(given, list) and len(given) == count:
        return list(given), old
    prefix = d.pseudo.replicate_prefix
    if isinstance(given, str) and (mt := re.fullmatch(r"([^*?\[\]]+)\*", given)):
        prefix = mt.group(1)
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
) -> PseudoPlan:
    """The spec's pseudo design (design.pseudo) of units with original labels strata and psu
    (build_pseudo_design; a file's records, or one row per original PSU: the same labels per
    unit and the same draws of rng), then its replicate factors (rng's next draws); columns:
    the file's. SpecError names the field when a new column's name is taken."""

    d, p = spec.design, spec.design.pseudo
    sc, pc = d.strata or p.strata, d.psu or p.psu
    clash = [
        f"design.pseudo.{f}: column '{c}' is already in the data; give the pseudo {f} another name"
        for f, c, own in (("strata", sc, d.strata), ("psu", pc, d.psu))
        if own is None and c in columns
    ]
    if clash:
        raise SpecError(clash)
    des = build_pseudo_design(strata, psu, rng, p.psus_per_stratum, p.max_psus, p.min_units, n=n)
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


def pseudo_frame(
    df: pd.DataFrame, spec: Any, rng: np.random.Generator
) -> tuple[pd.DataFrame, PseudoDesign, dict[str, Any]]:
    """df with pseudo strata and PSUs (in the spec's strata/psu columns, or the pseudo section's
    new columns when the design has none) and replicate weights of the pseudo design replacing
    the original ones. Returns the frame, the design and the public design's columns."""
    d = spec.design
    plan = pseudo_plan(
        spec,
        list(df.columns),
        df[d.strata].to_numpy() if d.strata else None,
        df[d.psu].to_numpy() if d.psu else None,
        rng,
        n=len(df),
    )
    data = apply_pseudo(df, plan, np.arange(len(df)), d.weight)
    return data, plan.design, plan.public


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
        f"Pseudo design for the public file: {G} pseudo strata (each from at least "
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


def pseudo_public_method(res: StageResult, des: dict[str, Any]) -> list[str]:
    """The public README's section on the pseudo design."""
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
