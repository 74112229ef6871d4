"""The release stages in release order: the one list a new stage joins."""

from __future__ import annotations

from collections.abc import Sequence

import pandas as pd

from sdl_design.blas import single_blas_thread
from sdl_design.describe import Describes
from sdl_design.spec import ReleaseSpec
from sdl_design.stage import Stage, StageContext, StageResult, reads_only
from sdl_design.stages.assess import AssessStage
from sdl_design.stages.final import FinalStage
from sdl_design.stages.massc import MasscStage
from sdl_design.stages.prb import PrbStage
from sdl_design.stages.pseudo import PseudoDesignStage
from sdl_design.stages.risk import RiskStage
from sdl_design.stages.swap import SwapStage
from sdl_design.stages.topcode import TopcodeStage

RELEASE_STAGES = [
    RiskStage,
    SwapStage,
    PrbStage,
    MasscStage,
    TopcodeStage,
    PseudoDesignStage,  # a design for the public file when no earlier stage masked it
    FinalStage,
    AssessStage,
]


def described(results: Sequence[StageResult]) -> list[tuple[type[Describes], StageResult]]:
    """(stage class, result) of each stage that ran, in release order."""
    by_name = {r.name: r for r in results}
    return [(c, by_name[c.name]) for c in RELEASE_STAGES if c.name in by_name]


def assessment_of(results: Sequence[StageResult]) -> StageResult | None:
    """The assessment's result: the result of the stage that says it assesses the published
    file (Describes.assesses), else the result that recorded the published columns."""
    own = next((r for c, r in described(results) if c.assesses), None)
    if own is not None:
        return own
    return next((r for r in results if "published_columns" in (r.params or {})), None)


def build_stages(spec: ReleaseSpec) -> list[Stage]:
    """The enabled stages of the spec, in release order (sdl_design.stages.RELEASE_STAGES)."""
    return [s for cls in RELEASE_STAGES if (s := cls.from_spec(spec)) is not None]


def run_stages(spec: ReleaseSpec, original: pd.DataFrame) -> list[StageResult]:
    """Every enabled stage in order on the original file, without orchestration (no Prefect, no
    replications): what the release flow does between edit validation and the gates."""
    ctx = StageContext(original, spec)
    results: list[StageResult] = []
    df = original
    for stage in build_stages(spec):
        with single_blas_thread():  # the same bits whatever the CPU count
            result = stage.run(df, ctx.for_stage(stage.name, results))
        results.append(result)
        df = result.data
    return results


def reads_only_batches(stages: Sequence[Stage]) -> list[list[Stage]]:
    """The stages in release order, consecutive stages that only measure the records together
    (sdl_design.stage.reads_only: they may run at once); every other stage alone."""
    out: list[list[Stage]] = []
    for s in stages:
        if out and reads_only(s) and reads_only(out[-1][-1]):
            out[-1].append(s)
        else:
            out.append([s])
    return out
