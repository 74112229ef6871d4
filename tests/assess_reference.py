"""The assessment on whole frames: the reference the stage's passes are checked against. It
composes method.py's frame estimators (survey.design's domain estimates, the GLM on records,
the attacks on frames), not the passes' sums by profile and PSU."""

from __future__ import annotations

import pandas as pd

from sdl_design.keys import publish_coding
from sdl_design.plots import estimate_plots
from sdl_design.pseudo import se_fix
from sdl_design.stage import StageContext, StageResult
from sdl_design.stages.assess import REPORT_TABLES, SECTION
from sdl_design.stages.assess.method import (
    _epsilon_published,
    _notes,
    _psu_leak,
    _worst_se_text,
    _worst_terms,
    _worst_text,
    assess,
    assessment_gates,
    column_record,
    gate_variance,
    published_attacks,
    published_delta,
)


def assess_frames(df: pd.DataFrame, ctx: StageContext) -> StageResult:
    """AssessStage's result from the whole working frame and ctx.original in memory."""
    spec = ctx.spec
    released = publish_coding(df[ctx.published(list(df.columns))], spec.variables.keys)
    pdesign = ctx.public_design()
    variance = gate_variance(spec, released.columns, pdesign)
    a = assess(ctx.original, released, spec, variance=variance, design_released=pdesign)
    a.params.update(column_record(spec, ctx, list(released.columns)))
    m = dict(a.metrics)
    attacks, key = published_attacks(ctx.original, released, spec, pdesign, ctx.masked_design)
    m |= attacks
    a.params["intruder_key"] = key.describe()
    m |= published_delta(ctx.original, released, spec)
    m["epsilon_published"] = _epsilon_published(a.domain_estimates)
    if ctx.masked_design or not spec.design.publish_design_labels:
        m.update(_psu_leak(released, ctx.original, spec, pdesign))
    worst = a.worst(20)
    return StageResult(
        name="assess",
        data=df,
        params=a.params,
        metrics=m,
        tables={**a.tables, "worst_estimates": worst, "attacks": attacks.table},
        report_tables=REPORT_TABLES,
        section=SECTION,
        gates=assessment_gates(
            m,
            spec,
            _worst_text(worst),
            _worst_terms(a.model_coefficients),
            "; ".join(filter(None, [se_fix(ctx.previous), _worst_se_text(a.domain_estimates)])),
        ),
        figures=estimate_plots(a.domain_estimates, a.model_coefficients),
        notes=_notes(m, worst),
    )
