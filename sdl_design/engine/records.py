"""The records so far, by partition: what a stage's passes read (its partitions and columns,
the release input's partitions and scan) and where it writes (its folder: data/ for its
records, internal/ for its record-level maps), and the StageResult it returns."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from sdl_design.engine.exchange import Exchange, say
from sdl_design.engine.partitions import Partition, retained_in
from sdl_design.stage import Gate, StageResult


@dataclass
class Run:
    """What every stage of a partitioned run may read besides the records so far: the map
    over partitions, the release input's partitions and its scan (profiles, SEs, edits, the
    risk measures) and PSUs; and which original records the later ones are (MASSC's d(2))."""

    run_map: Exchange
    inputs: list[Partition]
    scan: dict[str, pd.DataFrame]
    psus: pd.DataFrame  # the input design's PSUs, (stratum, psu) sorted as SurveyDesign codes them
    selected: str | None = None  # the folder of the selection that kept the released records

    @property
    def n_input(self) -> int:
        """The records of the release input."""
        return self.inputs[-1].stop

    def retained(self, parts: Sequence[Partition]) -> list[int]:
        """Each input partition's records in the released file (d(2), else all)."""
        if self.selected:
            return self.run_map(retained_in, self.inputs, self.selected, what="retained records")
        return [p.stop - p.start for p in self.inputs]


@dataclass
class Records:
    """The records so far by partition and the folder the stage running on them writes to."""

    run: Run
    parts: list[Partition]
    columns: list[str]
    folder: Path
    laps: dict[str, float] = field(default_factory=dict)
    _t: float = field(default_factory=time.perf_counter)

    @property
    def run_map(self) -> Exchange:
        return self.run.run_map

    @property
    def n(self) -> int:
        """The records so far."""
        return self.parts[-1].stop

    @property
    def data(self) -> str:
        """Where the stage writes its records (part-<first record>.parquet)."""
        return str(self.folder / "data")

    def confidential(self, name: str) -> Path:
        """Where a stage's record-level map goes: under internal/ (a stage's folder
        <run>/<stage>/name -> <run>/internal/<stage>/name), never beside the public files."""
        return self.folder.parent / "internal" / self.folder.name / name

    def lap(self, name: str) -> None:
        """The seconds since the last lap, as <name>_seconds (name "": seconds)."""
        now = time.perf_counter()
        self.laps[f"{name}_seconds" if name else "seconds"] = now - self._t
        self._t = now

    def at(self, folder: Path) -> Records:
        """The same records, for a stage writing to folder."""
        return replace(self, folder=folder, laps={}, _t=time.perf_counter())

    def say(self, text: str) -> None:
        """A progress line of the run."""
        say(text, "partitioned")


def numbers(fields: dict[str, Any]) -> dict[str, float]:
    """The numeric items of fields (not booleans) as floats: a result's metrics."""
    return {
        k: float(v)
        for k, v in fields.items()
        if isinstance(v, int | float | np.number) and not isinstance(v, bool)
    }


def passes_result(
    name: str,
    fields: dict[str, Any],
    records: Records | None = None,
    *,
    params: dict[str, Any] | None = None,
    tables: dict[str, pd.DataFrame] | None = None,
    gates: Sequence[Gate] = (),
    notes: Sequence[str] = (),
    masks_design: bool = False,
    drop_public: Sequence[str] = (),
    report_tables: Sequence[str] = (),
    se_ratio_table: str | None = None,
) -> StageResult:
    """A stage's result by partition: its numeric fields (and the records' laps) as metrics,
    the others (files written, rates by stratum) its facts, for run.json."""
    fields = {**fields, **(records.laps if records is not None else {})}
    metrics = numbers(fields)
    return StageResult(
        name,
        None,
        params=dict(params or {}),
        metrics=metrics,
        tables=dict(tables or {}),
        gates=list(gates),
        notes=list(notes),
        masks_design=masks_design,
        drop_public=list(drop_public),
        report_tables=list(report_tables),
        se_ratio_table=se_ratio_table,
        facts={k: v for k, v in fields.items() if k not in metrics},
    )


def run_record(result: StageResult) -> dict[str, Any]:
    """What run.json and the run's summary say of a stage's result: its metrics, what it
    recorded of its run, its params and notes (not its tables)."""
    out: dict[str, Any] = {**result.metrics, **result.facts}
    if result.params:
        out["params"] = result.params
    if result.notes:
        out["notes"] = result.notes
    return out
