"""The pseudo design (sdl_design.pseudo) by partition: PseudoDesignStage's records, bit for
bit, when the records are in partitions.

build_pseudo_design deals units (original PSUs within strata) and draws one number per unit,
per group and per pseudo stratum: it needs the units, not the records. Pass 1 sends each
partition's units (stratum and PSU labels, their records and first record); the driver builds
the plan from one row per unit with the stage's Generator (the same draws) and the replicate
factors of each pseudo PSU; every worker labels its records and writes them with their
replicate weights (w times their pseudo PSU's factors)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd

from sdl_design.codes import factorize
from sdl_design.engine.partitions import Partition, PartitionError, _write_partition, read_partition
from sdl_design.pseudo import (
    UNIT,
    PseudoPlan,
    apply_pseudo,
    pseudo_plan,
    pseudo_scores,
    pseudo_summary,
    unit_labels,
    unit_score_sums,
)
from sdl_design.survey.design import first_of

if TYPE_CHECKING:
    from sdl_design.spec import ReleaseSpec


def pseudo_units(part: Partition, spec: ReleaseSpec) -> tuple[pd.DataFrame, pd.DataFrame | None]:
    """Pass 1 on one partition: its units (stratum, psu labels) with their records and the
    global row of their first record, and (when the choice is on: design.pseudo.candidates)
    its unit_score_sums. A design without PSUs: each record its own unit, labelled by its
    row, in record order."""
    d = spec.design
    if not d.psu:
        df = read_partition(part, [d.strata] if d.strata else [], spec)
        rows = np.arange(part.start, part.stop)
        stratum = df[d.strata].to_numpy() if d.strata else np.zeros(len(df), dtype=np.int64)
        units = pd.DataFrame({"stratum": stratum, "psu": rows, "records": 1, "first": rows})
        return units, None
    choose = d.pseudo.candidates > 1
    cols = [
        d.strata,
        d.psu,
        *((d.weight, *spec.variables.study, *_domain_vars(spec)) if choose else ()),
    ]
    df = read_partition(part, list(dict.fromkeys(c for c in cols if c)), spec)
    codes, units = factorize(unit_labels(df, spec))
    out = pd.DataFrame({n: units.get_level_values(i) for i, n in enumerate(UNIT)})
    out["records"] = np.bincount(codes, minlength=len(units))
    out["first"] = part.start + first_of(codes, len(units))
    return out, (unit_score_sums(df, spec) if choose else None)


def _domain_vars(spec: ReleaseSpec) -> list[str]:
    keys = [k.name for k in spec.variables.keys]
    return [v for g in spec.utility.domain_list(keys) for v in g]


def combine_units(
    parts: list[tuple[pd.DataFrame, pd.DataFrame | None]], records_as_units: bool = False
) -> tuple[pd.DataFrame, np.ndarray | None]:
    """The whole input's units, sorted by (stratum, psu) (a unit may span partitions), and
    their pseudo_scores when the partitions sent score sums."""
    units = pd.concat([u for u, _ in parts], ignore_index=True)
    if records_as_units:  # a design without PSUs: in record order
        return units, None
    units = (
        units.groupby(UNIT, sort=True)
        .agg(records=("records", "sum"), first=("first", "min"))
        .reset_index()
    )
    sums = [s for _, s in parts if s is not None]
    scores = pseudo_scores(pd.concat(sums, ignore_index=True), units) if sums else None
    return units, scores


def plan_of_units(
    spec: ReleaseSpec,
    columns: list[str],
    units: pd.DataFrame,
    rng: np.random.Generator,
    scores: np.ndarray | None = None,
) -> tuple[PseudoPlan, np.ndarray]:
    """The stage's plan from one row per unit (rng: the stage's Generator) and the purity of
    each pseudo PSU (the largest share of its records from one unit), in the order of its
    first record, as psu_purity gives it on the records."""
    strata = units["stratum"].to_numpy() if spec.design.strata else None
    psu = units["psu"].to_numpy() if spec.design.psu else None  # None: records as units
    plan = pseudo_plan(spec, columns, strata, psu, rng, n=len(units), scores=scores)
    key = plan.unit_psu  # each unit's pseudo PSU
    K = int(key.max()) + 1
    records = units["records"].to_numpy()
    best = np.zeros(K)
    np.maximum.at(best, key, records)
    first = np.full(K, np.iinfo(np.int64).max)
    np.minimum.at(first, key, units["first"].to_numpy())
    purity = (best / np.bincount(key, records, K))[np.argsort(first)]
    return plan, purity


def pseudo_apply(
    part: Partition, spec: ReleaseSpec, units: pd.DataFrame, plan: PseudoPlan, folder: str
) -> str:
    """The partition with its pseudo strata, PSUs and replicate weights (apply_pseudo), written
    to folder as part-<first record>.parquet; returns the path."""
    df = read_partition(part, None, spec)
    if not spec.design.psu:  # records as units, in record order
        unit = np.arange(part.start, part.stop)
        return _write_partition(apply_pseudo(df, plan, unit, spec.design.weight), part, folder)
    unit = pd.MultiIndex.from_frame(units[UNIT]).get_indexer(unit_labels(df, spec))
    if (unit < 0).any():
        raise PartitionError("design.psu: a partition has a PSU pass 1 did not see")
    return _write_partition(apply_pseudo(df, plan, unit, spec.design.weight), part, folder)


def pseudo_result(plan: PseudoPlan, purity: np.ndarray) -> dict[str, Any]:
    """PseudoDesignStage's params, metrics and notes, as a partitioned stage's result."""

    params, metrics, notes = pseudo_summary(plan.design, plan.public, purity)
    return {**metrics, "params": params, "notes": notes, "public_design": plan.public}
