"""One thin Prefect wrapper for every stage: run it, or run some of its replications."""

from __future__ import annotations

from typing import Any

from prefect import task
from prefect.cache_policies import NO_CACHE

from sdl_design.blas import single_blas_thread
from sdl_design.engine.records import Records
from sdl_design.stage import SharedInput, Stage, StageContext, StageResult


@task(name="stage", cache_policy=NO_CACHE, task_run_name="{stage.name}")
def run_stage(stage: Stage, records: Records, ctx: StageContext) -> StageResult:
    """stage.run_partitions(records, ctx) as a Prefect task, on one BLAS thread (byte-identical
    on any CPU count)."""
    with single_blas_thread():
        return stage.run_partitions(records, ctx)


@task(name="replications", cache_policy=NO_CACHE, task_run_name="{stage.name}-replications")
def replicate_stage(stage: Any, shared: SharedInput, indices: list[int]) -> Any:
    """stage.replicate(shared, indices) as a Prefect task (one chunk of replications)."""
    with single_blas_thread():
        return stage.replicate(shared, indices)
