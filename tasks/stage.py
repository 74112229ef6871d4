"""One thin Prefect wrapper for every stage."""

from __future__ import annotations

from prefect import task
from prefect.cache_policies import NO_CACHE

from sdl_design.blas import single_blas_thread
from sdl_design.engine.records import Records
from sdl_design.stage import Stage, StageContext, StageResult


@task(name="stage", cache_policy=NO_CACHE, task_run_name="{stage.name}")
def run_stage(stage: Stage, records: Records, ctx: StageContext) -> StageResult:
    """stage.run_partitions(records, ctx) as a Prefect task, on one BLAS thread (byte-identical
    on any CPU count)."""
    with single_blas_thread():
        return stage.run_partitions(records, ctx)
