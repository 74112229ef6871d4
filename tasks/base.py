"""The record each stage hands to the flow, and the glue from a spec to a SurveyDesign."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pandas as pd


@dataclass
class StageOutput:
    """What a stage did: the treated frame plus a small record for the manifest, gates and report."""

    name: str
    data: pd.DataFrame
    params: dict[str, Any] = field(default_factory=dict)  # parameters chosen (report, manifest)
    metrics: dict[str, float] = field(default_factory=dict)  # flat; manifest key "<name>.<metric>"
    tables: dict[str, pd.DataFrame] = field(default_factory=dict)  # internal/<name>/<table>.csv
    gates: list[dict[str, Any]] = field(default_factory=list)  # {name, value, lower, upper}
    figures: dict[str, bytes] = field(default_factory=dict)  # PNG bytes for the report
    drop_public: list[str] = field(default_factory=list)  # columns never to publish
    notes: list[str] = field(default_factory=list)  # sentences for the report
    report_tables: list[str] = field(default_factory=list)  # tables the report shows, in order
    se_ratio_table: str | None = None  # the table of SE ratios the registry keeps, if any


def gate(name: str, value: float, lower: float | None = None, upper: float | None = None) -> dict:
    """One threshold check for the metrics gate suite."""
    return {"name": name, "value": float(value), "lower": lower, "upper": upper}


def design_from_spec(df: pd.DataFrame, spec, replicates: bool = True):
    """The SurveyDesign the spec describes on df (replicate weights when the spec has them)."""
    from sdl_design.design import SurveyDesign

    d = spec.design
    rw = spec.replicate_columns(df) if (replicates and d.replicate_weights) else []
    return SurveyDesign(
        df,
        weight=d.weight,
        strata=d.strata,
        psu=d.psu,
        segment=d.segment,
        replicate_weights=rw or None,
        method=d.replicate_weights.method if rw else None,
        rho=d.replicate_weights.rho if rw else None,
    )
