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

from sdl_design.partition import Partition, PartitionError, _write_partition, read_partition
from sdl_design.pseudo import PseudoPlan, apply_pseudo, pseudo_plan, pseudo_summary
from sdl_design.survey.design import first_of

if TYPE_CHECKING:
    from sdl_design.spec import ReleaseSpec

UNIT = ["stratum", "psu"]


def _labels(df: pd.DataFrame, spec: ReleaseSpec) -> pd.MultiIndex:
    """Each record's unit: (stratum, PSU) labels; stratum 0 when the design has no strata."""
    d = spec.design
    s = df[d.strata] if d.strata else pd.Series(0, index=df.index)
    return pd.MultiIndex.from_arrays([s.to_numpy(), df[d.psu].to_numpy()], names=UNIT)


def check_pseudo(spec: ReleaseSpec) -> None:
    """PartitionError naming the field when the pseudo design cannot be built by partition."""
    if not spec.design.psu:
        raise PartitionError(
            "design.psu: the pseudo design by partition groups the original PSUs; a file whose "
            "records are each their own PSU is dealt record by record (run it in memory, or "
            "give a PSU column)"
        )


def pseudo_units(part: Partition, spec: ReleaseSpec) -> pd.DataFrame:
    """Pass 1 on one partition: its units (stratum, psu labels) with their records and the
    global row of their first record."""
    check_pseudo(spec)
    d = spec.design
    df = read_partition(part, [c for c in (d.strata, d.psu) if c], spec)
    codes, units = pd.factorize(_labels(df, spec))
    out = pd.DataFrame({n: units.get_level_values(i) for i, n in enumerate(UNIT)})
    out["records"] = np.bincount(codes, minlength=len(units))
    out["first"] = part.start + first_of(codes, len(units))
    return out


def combine_units(parts: list[pd.DataFrame]) -> pd.DataFrame:
    """The whole input's units, sorted by (stratum, psu) (a unit may span partitions)."""
    units = pd.concat(parts, ignore_index=True)
    return (
        units.groupby(UNIT, sort=True)
        .agg(records=("records", "sum"), first=("first", "min"))
        .reset_index()
    )


def plan_of_units(
    spec: ReleaseSpec, columns: list[str], units: pd.DataFrame, rng: np.random.Generator
) -> tuple[PseudoPlan, np.ndarray]:
    """The stage's plan from one row per unit (rng: the stage's Generator) and the purity of
    each pseudo PSU (the largest share of its records from one unit), in the order of its
    first record, as psu_purity gives it on the records."""
    strata = units["stratum"].to_numpy() if spec.design.strata else None
    plan = pseudo_plan(spec, columns, strata, units["psu"].to_numpy(), rng, n=len(units))
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
    unit = pd.MultiIndex.from_frame(units[UNIT]).get_indexer(_labels(df, spec))
    if (unit < 0).any():
        raise PartitionError("design.psu: a partition has a PSU pass 1 did not see")
    return _write_partition(apply_pseudo(df, plan, unit, spec.design.weight), part, folder)


def pseudo_result(plan: PseudoPlan, purity: np.ndarray) -> dict[str, Any]:
    """PseudoDesignStage's params, metrics and notes, as a partitioned stage's result."""

    params, metrics, notes = pseudo_summary(plan.design, plan.public, purity)
    return {**metrics, "params": params, "notes": notes, "public_design": plan.public}
