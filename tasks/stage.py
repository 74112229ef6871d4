"""One thin Prefect wrapper for every stage: run it, or run some of its replications."""

from __future__ import annotations

from typing import Any

import pandas as pd
from prefect import task
from prefect.cache_policies import NO_CACHE

from sdl_design.blas import single_blas_thread
from sdl_design.stage import SharedInput, Stage, StageContext, StageResult


@task(name="stage", cache_policy=NO_CACHE, task_run_name="{stage.name}")
def run_stage(stage: Stage, df: pd.DataFrame, ctx: StageContext) -> StageResult:
    """stage.run(df, ctx) as a Prefect task, on one BLAS thread (byte-identical on any CPU count)."""
    with single_blas_thread():
        return stage.run(df, ctx)


def prepare_replications(stage: Any, df: pd.DataFrame, ctx: StageContext) -> SharedInput:
    """stage.prepare_replications(df, ctx) on one BLAS thread, as run_stage runs the stage (the
    plan's rates must be the run's bits); in the flow process, not a task: its result stays here."""
    with single_blas_thread():
        return stage.prepare_replications(df, ctx)


@task(name="replications", cache_policy=NO_CACHE, task_run_name="{stage.name}-replications")
def replicate_stage(stage: Any, shared: SharedInput, indices: list[int]) -> Any:
    """stage.replicate(shared, indices) as a Prefect task (one chunk of replications)."""
    with single_blas_thread():
        return stage.replicate(shared, indices)
