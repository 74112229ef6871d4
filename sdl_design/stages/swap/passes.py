"""The swap stage by partition (paper 003): the segment design, the masking plan and its
application, a partition at a time (sdl_design.engine.partitions reads the partitions)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd

from sdl_design.blas import single_blas_thread
from sdl_design.engine.partitions import Partition, PartitionError, _write_partition, read_partition
from sdl_design.stages.swap.method import (
    Masking,
    SegmentDesign,
    SegmentPass1,
    aggregates_from_sums,
    apply_masking,
    combine_segment_pass1,
    matching_variance,
    plan_counts,
    plan_masking,
    segment_design,
    segment_pass1,
    segment_pass2,
    swap_pairs,
)
from sdl_design.survey.design import (
    resolve_replicates,
)
from sdl_design.survey.exactsum import add_limbs_at

if TYPE_CHECKING:
    from sdl_design.spec import ReleaseSpec


# ---------------------------------------------------------------- segment swap (paper 003)


@dataclass(frozen=True)
class SwapRequest:
    """The swap of a spec on a partitioned input: its design columns (dc, as
    swap.design_columns gives them) and its stages.swap section."""

    dc: dict
    matching: tuple[str, ...]
    section: Any

    @property
    def columns(self) -> list[str]:
        """The columns passes 1 and 2 read."""
        d = self.dc
        design = [d["weight"], d["strata"], d["psu"], d["segment"]]
        return list(dict.fromkeys([*design, *self.matching]))


def swap_request(spec: ReleaseSpec, columns: Sequence[str]) -> SwapRequest:
    """The spec's swap (its design's replicate weights resolved on the input's columns)."""

    section = spec.stages.active("swap")
    if section is None:
        raise PartitionError("stages.swap: the spec has no active swap stage; enable it")
    d = spec.design
    if not (d.strata and d.psu and d.segment):
        raise PartitionError(
            "design.strata, design.psu, design.segment: the swap moves segments between PSUs "
            "within strata; give all three columns"
        )
    rs = d.replicate_weights
    reps = resolve_replicates(list(columns), rs.columns) if rs else []
    dc = {
        "weight": d.weight,
        "strata": d.strata,
        "psu": d.psu,
        "segment": d.segment,
        "replicate_weights": reps,
        "method": rs.method if reps else None,
        "rho": rs.rho if reps else None,
    }
    return SwapRequest(dc, tuple(section.matching), section)


def swap_pass1(part: Partition, spec: ReleaseSpec, req: SwapRequest) -> SegmentPass1:
    """Pass 1 of the swap on one partition: its segments with their stratum and PSU, and the
    bounds of the sums' terms (swap.segment_pass1)."""
    d = req.dc
    df = read_partition(part, req.columns, spec)
    return segment_pass1(df, d["weight"], d["strata"], d["psu"], d["segment"], req.matching)


def swap_pass2(
    part: Partition, spec: ReleaseSpec, req: SwapRequest, design: SegmentDesign
) -> tuple[np.ndarray, np.ndarray]:
    """Pass 2 on one partition: exact limb sums of w and w x by segment (swap.segment_pass2)
    for the segments it has (their indices, and the limbs: small beside all segments')."""
    d = req.dc
    df = read_partition(part, req.columns, spec)
    codes = pd.Index(design.segment_labels).get_indexer(df[d["segment"]])
    if (codes < 0).any():
        raise PartitionError(f"design.segment: a '{d['segment']}' label is not in pass 1's table")
    present, local = np.unique(codes, return_inverse=True)
    limbs = segment_pass2(df, d["weight"], d["segment"], req.matching, design, local, len(present))
    return present, limbs


def swap_design(partials: Sequence[SegmentPass1], req: SwapRequest) -> SegmentDesign:
    """The whole input's segments, PSUs and strata and the grids of pass 2's exact sums."""
    return segment_design(combine_segment_pass1(partials), req.matching)


@single_blas_thread()  # as the in-memory stage runs (sdl_design.blas)
def swap_masking(
    req: SwapRequest,
    design: SegmentDesign,
    partials: Sequence[tuple[np.ndarray, np.ndarray]],
    rng: np.random.Generator,
    method: str | None = None,
) -> tuple[Masking, dict[str, Any], dict[str, pd.DataFrame]]:
    """On the driver, from pass 2's segment sums alone: the swaps, the pseudo labels and the
    replicate factors (swap.plan_masking; rng: the swap stage's Generator), with the plan's
    counts and its tables (the confidential pairs; the matching variances before and after)."""
    limbs = np.zeros((3, len(design.segment_labels), 2 * len(req.matching)))
    for present, part_limbs in partials:
        limbs = add_limbs_at(limbs, present, part_limbs)
    agg = aggregates_from_sums(design, limbs, req.matching)
    st, d = req.section, req.dc
    plan, masking = plan_masking(
        agg,
        d,
        rng,
        st.replicate_method or d["method"],
        st.rho if st.rho is not None else d["rho"],
        rate=st.rate,
        method=method or st.method,
        max_share=st.max_share,
        cumulative=st.cumulative,
        scope=st.scope,
    )
    tables = {
        "pairs": swap_pairs(agg, plan, method or st.method, st.cumulative),
        "matching_variance": matching_variance(plan, req.matching).reset_index(),
    }
    return masking, plan_counts(agg, plan), tables


def swap_apply(
    part: Partition,
    spec: ReleaseSpec,
    req: SwapRequest,
    segment_labels: np.ndarray,
    masking: Masking,
    folder: str,
) -> str:
    """The masked partition (every column; pseudo strata and PSUs, rebuilt replicate weights)
    written to folder as part-<first record>.parquet (whole or not at all); returns the path."""
    data = masked_records(read_partition(part, None, spec), req, segment_labels, masking)
    return _write_partition(data, part, folder)


def masked_records(
    df: pd.DataFrame,
    req: SwapRequest,
    segment_labels: np.ndarray,
    masking: Masking,
    columns: Sequence[str] | None = None,
) -> pd.DataFrame:
    """Records with pseudo strata and PSUs and the rebuilt replicate weights (apply_masking):
    what swap_apply writes, or a baseline's records, derived when read (partitions.Derived;
    columns: those read, the replicate weights rebuilt only when among them)."""
    d = req.dc
    codes = pd.Index(segment_labels).get_indexer(df[d["segment"]])
    if (codes < 0).any():
        raise PartitionError(f"design.segment: a '{d['segment']}' label is not in pass 1's table")
    if columns is not None and masking.factors is not None:
        reps = set(masked_design(req, masking)["replicate_weights"])
        if not reps & set(columns):  # the pseudo labels only
            masking = replace(masking, factors=None)
    return apply_masking(df, d, codes, masking)[0]


def masked_design(req: SwapRequest, masking: Masking) -> dict[str, Any]:
    """The design the masked records are read with: pseudo labels in the strata and PSU
    columns, the rebuilt replicate weights (in place, or new columns when their number
    differs) with their method and scales."""
    d, st = req.dc, req.section
    if masking.factors is None:
        return dict(d)
    old = list(d["replicate_weights"])
    reps = old if len(old) == masking.factors.shape[1] else list(masking.factors.columns)
    rho = st.rho if st.rho is not None else d["rho"]
    return {**d, "replicate_weights": reps, "method": masking.method, "rho": rho,
            "rscales": masking.rscales}  # fmt: skip
