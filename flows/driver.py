"""The one driver of a release's stages: each stage's passes (run_partitions) on the records so
far, in release order, over a store of them: held in this process's memory (the release in
memory: one partition) or in Parquet partitions (a partition at a time, in threads or on Dask
workers); then the public files and the gates, by partition in both. Orchestration only: the
statistics are the stages'."""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import pandas as pd

from expectations.suites import validate_metric_gates
from flows.public_files import write_public_by_partition
from flows.txn import CONFIDENTIAL_TABLES
from sdl_design.blas import single_blas_thread
from sdl_design.engine import partitions as part
from sdl_design.engine.partitions import FramePartition
from sdl_design.engine.records import Records, Run, in_memory, release_held, run_in_memory
from sdl_design.spec import ReleaseSpec
from sdl_design.stage import (
    StageContext,
    StageResult,
    changed_release,
    design_columns,
    reads_only,
)
from sdl_design.stages import reads_only_batches

# a stage's call on the records so far: stage.run_partitions (the flow's: a Prefect task)
Call = Callable[[Any, Records, StageContext], StageResult]


def call_stage(stage: Any, records: Records, ctx: StageContext) -> StageResult:
    """stage.run_partitions(records, ctx) on one BLAS thread (the same bits on any CPU count)."""
    with single_blas_thread():
        return stage.run_partitions(records, ctx)


class Steps(Protocol):
    def start(self, name: str) -> float: ...
    def done(self, name: str, t0: float) -> None: ...


class Quiet:
    """Steps without lines (the partitioned command prints its own)."""

    def start(self, name: str) -> float:
        return time.perf_counter()

    def done(self, name: str, t0: float) -> None:
        return None


@dataclass
class MemoryStore:
    """The records so far held in this process: the working frame, the original's labels (a
    stage's passes read it as one partition)."""

    original: pd.DataFrame
    df: pd.DataFrame = field(init=False)
    n_input: int = field(init=False)

    def __post_init__(self) -> None:
        self.df = self.original
        self.n_input = len(self.original)

    def step(self, stage: Any, ctx: StageContext, call: Call) -> StageResult:
        """The stage on the working frame, which becomes the frame it wrote."""
        result = run_in_memory(stage, self.df, ctx, call)
        only_measured(stage, result, result.data is not self.df)
        self.df, result.data = result.data, None
        return result

    def public_records(self, ctx: StageContext, folder: Path) -> Records:
        """The records after the stages, for the public files; the original's records are
        not read past here (the record map needs its length and MASSC's selection): freed
        before the files are written, as the release always freed them."""
        records = in_memory(self.df, ctx).at(folder)
        self.original = self.original.iloc[:0]
        records.run.inputs = [FramePartition(self.original, 0, self.n_input)]
        return records

    def release(self, records: Records) -> None:
        """After the public files: the records held are not read again (freed before the
        report and the publication)."""
        release_held(records)
        self.df = self.df.iloc[:0]


@dataclass
class PartitionStore:
    """The records so far in Parquet partitions: each stage writes the records after it to
    <folder>/<stage>/data (its tables beside them when tables). keep False: a stage's records
    are deleted once the next stage has written its own (the disk holds two stages' records,
    not every stage's; the input is never deleted)."""

    run: Run
    parts: list
    columns: list[str]
    folder: Path
    tables: bool = True
    after: Callable[[Any, Records, StageResult], None] | None = None
    keep: bool = True
    original: pd.DataFrame = field(init=False)  # the input's columns, no record

    def __post_init__(self) -> None:
        self.original = pd.DataFrame(columns=self.columns)

    @property
    def n_input(self) -> int:
        return self.run.n_input

    def records(self, name: str) -> Records:
        (self.folder / name / "data").mkdir(parents=True)
        return Records(self.run, self.parts, self.columns, self.folder / name)

    def step(self, stage: Any, ctx: StageContext, call: Call) -> StageResult:
        """The stage on the partitions so far, which become the ones it wrote (when it did)."""
        records = self.records(stage.name)
        result = call(stage, records, ctx)
        data = records.folder / "data"
        wrote = any(data.glob("*.parquet"))
        only_measured(stage, result, wrote)
        if wrote:  # the stage wrote the records after it
            consumed, self.parts = self.parts, part.plan_partitions(data)
            self.columns = part.input_columns(data)
            if self.after is not None:
                self.after(stage, records, result)
            if not self.keep:
                self._drop(consumed)
        else:  # the records stay as the previous stage left them
            data.rmdir()
        if self.tables:
            for name, table in result.tables.items():
                stage_table(records, name, table)
        if records.folder.exists() and not any(records.folder.iterdir()):
            records.folder.rmdir()
        return result

    def _drop(self, parts: list) -> None:
        """The data folders of a stage's records under this store's folder, deleted (the
        records no later step reads)."""
        for data in {Path(q.path).parent for p in parts for q in p.pieces}:
            if data.name == "data" and data.parent.parent == self.folder:
                shutil.rmtree(data)

    def public_records(self, ctx: StageContext, folder: Path) -> Records:
        return Records(self.run, self.parts, self.columns, folder)

    def release(self, records: Records) -> None:
        return None


def only_measured(stage: Any, result: StageResult, wrote: bool) -> None:
    """A stage that says it only measures the records (reads_only: it may run beside its
    neighbours) and changed the release anyway is an error, not a guess."""
    changed = changed_release(result, wrote) if reads_only(stage) else []
    if changed:
        raise RuntimeError(
            f"stage {stage.name} says it only measures the records (reads_only) but changed "
            f"{', '.join(changed)}; set reads_only = False on it"
        )


def stage_table(records: Records, name: str, table: pd.DataFrame) -> None:
    """A stage's table as CSV in its folder; a record-level map (txn.CONFIDENTIAL_TABLES)
    where its record-level maps go (Records.confidential)."""
    path = records.folder / f"{name}.csv"
    if f"{records.folder.name}/{name}.csv" in CONFIDENTIAL_TABLES:
        path = records.confidential(f"{name}.csv")
        path.parent.mkdir(parents=True, exist_ok=True)
    table.to_csv(path, index=False)


class Store(Protocol):
    original: pd.DataFrame  # the input (in memory), or its columns

    @property
    def n_input(self) -> int: ...
    def step(self, stage: Any, ctx: StageContext, call: Call) -> StageResult: ...
    def public_records(self, ctx: StageContext, folder: Path) -> Records: ...
    def release(self, records: Records) -> None: ...


class StageRun:
    """The release's stages on a store, in release order (consecutive stages that only measure
    the records at once, in threads: each sees the results before them, as in order), then its
    public files and gates. after(step): called after each step (the partitioned command's
    peaks)."""

    def __init__(
        self,
        spec: ReleaseSpec,
        stages: list,
        store: Store,
        call: Call = call_stage,
        steps: Steps | None = None,
        after: Callable[[str], None] | None = None,
    ):
        self.spec, self.stages, self.store, self.call = spec, stages, store, call
        self.steps = steps or Quiet()
        self.after = after or (lambda step: None)
        self.results: list[StageResult] = []
        self.timings: dict[str, float] = {}
        self.ctx = StageContext(store.original, spec)

    def run_stages(self, skip: Callable[[Any], bool] = lambda stage: False) -> None:
        """Every stage (not those skip says), its result appended to results."""
        for batch in reads_only_batches(self.stages):
            batch = [s for s in batch if not skip(s)]
            if not batch:
                continue
            names = " + ".join(s.name for s in batch)
            t0 = self.steps.start(names)
            if len(batch) > 1:
                done = self._at_once(batch)
            else:
                done = [self._timed(batch[0], self.ctx.for_stage(batch[0].name, self.results))]
            for stage, (result, seconds) in zip(batch, done, strict=True):
                self.timings[stage.name] = seconds
                self.results.append(result)
            self.steps.done(names, t0)
            self.after(names)

    def _timed(self, stage: Any, ctx: StageContext) -> tuple[StageResult, float]:
        t0 = time.perf_counter()
        result = self.store.step(stage, ctx, self.call)
        return result, time.perf_counter() - t0

    def _at_once(self, batch: list) -> list[tuple[StageResult, float]]:
        import contextvars

        ctxs = [self.ctx.for_stage(s.name, self.results) for s in batch]
        with ThreadPoolExecutor(len(batch), thread_name_prefix="puf-stage") as pool:
            futures = [
                pool.submit(contextvars.copy_context().run, self._timed, s, c)
                for s, c in zip(batch, ctxs, strict=True)
            ]
            return [f.result() for f in futures]

    def public_files(self, folder: Path) -> tuple[dict[str, Any], pd.DataFrame]:
        """puf.parquet, puf.csv, README.md and codebook.csv of the records so far into folder
        (the confidential record map beside it: folder/../internal/record_map.parquet), as
        the release publishes them (its public columns, order and design; the columns the
        stages drop left out); with the gates: the stages' metric gates, then the public
        file's. (Their summary, the gates.)"""
        records = self.store.public_records(self.ctx, folder)
        # the stages' context (the original file, its design and what they cached) freed
        self.ctx = StageContext(self.store.original, self.spec)
        ctx = self.ctx.for_stage("", self.results)
        try:
            public = _public_files(self.spec, records, ctx, self.results)
        finally:
            self.store.release(records)
        rows = [g.as_dict() for r in self.results for g in r.gates]
        gates = pd.concat([validate_metric_gates(rows), public.pop("gates")], ignore_index=True)
        return public, gates


def _public_files(
    spec: ReleaseSpec, records: Records, ctx: StageContext, results: list[StageResult]
) -> dict[str, Any]:
    """write_public_by_partition of the records so far: the design the public file is read
    with (the spec's or the one a stage built), the columns the stages drop left out, the
    stages' results for README.md and codebook.csv, the record map."""
    design = ctx.public_design()
    columns, run = records.columns, records.run
    built = design_columns(design, columns)
    drop = [c for r in results for c in r.drop_public]
    linked = part.link(run.inputs, records.parts, run.retained(records.parts))
    rows = run.run_map(part.input_rows, linked, run.selected, what="public files: record map")
    return write_public_by_partition(
        run.run_map, records.parts, spec, columns, ctx.masked_design, drop, built,
        records.folder, results=results, design=design,
        labels=[c for c in (design.strata, design.psu) if c],
        input_rows=(np.concatenate(rows), run.n_input),
    )  # fmt: skip
