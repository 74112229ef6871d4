"""Prefect tasks of the flow backbone: load, edit validation, gates, publish."""

from __future__ import annotations

import pandas as pd
from prefect import task
from prefect.cache_policies import NO_CACHE

from expectations.suites import validate_edits
from sdl_design.preflight import checked_input
from sdl_design.spec import ReleaseSpec


@task(name="load", cache_policy=NO_CACHE)
def load_task(spec: ReleaseSpec) -> tuple[pd.DataFrame, str]:
    """Read the input as the spec declares it (sdl_design.io.read_input: Parquet or CSV read as
    text and typed, declared missing codes; the embedded default survey when none) and check
    it fits the spec."""
    return checked_input(spec)


@task(name="edit-validation", cache_policy=NO_CACHE)
def edits_task(df: pd.DataFrame, spec: ReleaseSpec) -> pd.DataFrame:
    # examples are row positions, never a direct identifier: the results reach Prefect's logs
    # (GateFailed) and artifacts (issue 15 item 8)
    return validate_edits(df, spec.edits)
