"""The records so far, by partition: what a stage's passes read (its partitions and columns,
the release input's partitions and scan) and where it writes (its folder: data/ for its
records, internal/ for its record-level maps), and the StageResult it returns."""

from __future__ import annotations

import shutil
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from sdl_design.engine.cache import CACHE
from sdl_design.engine.exchange import Exchange, Fold, say
from sdl_design.engine.partitions import (
    MEMORY,
    FramePartition,
    Partition,
    _write_partition,
    combine_pass1,
    held,
    means_request,
    memory_folder,
    partition_columns,
    partition_identity,
    profile_pass,
    psus_of,
    read_partition,
    release_memory,
    retained_in,
    scan_columns,
    written_identity,
)
from sdl_design.stage import Gate, StageContext, StageResult


@dataclass
class Run:
    """What every stage of a partitioned run may read besides the records so far: the map
    over partitions, the release input's partitions and its scan (profiles, SEs, edits, the
    risk measures) and PSUs; and which original records the later ones are (MASSC's d(2))."""

    run_map: Exchange
    inputs: list[Partition]
    scan: Mapping[str, pd.DataFrame]
    # the input design's PSUs, (stratum, psu) sorted as SurveyDesign codes them (None: the
    # scan's table "psus", computed when read)
    psus_table: pd.DataFrame | None = None
    selected: str | None = None  # the folder of the selection that kept the released records
    counted: dict = field(default_factory=dict, repr=False)  # retained(), by selection written

    @property
    def psus(self) -> pd.DataFrame:
        return self.scan["psus"] if self.psus_table is None else self.psus_table

    @property
    def n_input(self) -> int:
        """The records of the release input."""
        return self.inputs[-1].stop

    def retained(self, parts: Sequence[Partition]) -> list[int]:
        """Each input partition's records in the released file (d(2), else all): counted once
        for a selection as written (the final stage and the assessment's risk both ask; at
        15M the second map waited minutes behind the assessment's)."""
        if not self.selected:
            return [p.stop - p.start for p in self.inputs]
        key = (self.selected, *(written_identity(self.selected, p) for p in self.inputs))
        if key not in self.counted:
            self.counted[key] = self.run_map(
                retained_in, self.inputs, self.selected, what="retained records"
            )
        return self.counted[key]


@dataclass
class Records:
    """The records so far by partition and the folder the stage running on them writes to
    (sink: a memory folder, for records held in this process; see in_memory)."""

    run: Run
    parts: list[Partition]
    columns: list[str]
    folder: Path
    laps: dict[str, float] = field(default_factory=dict)
    _t: float = field(default_factory=time.perf_counter)
    sink: str | None = None
    frame: pd.DataFrame | None = None  # held in memory: the working frame, the original's labels
    scratches: dict[str, str] = field(default_factory=dict)  # scratch(): name -> memory folder

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
        return self.sink if self.sink is not None else str(self.folder / "data")

    def confidential(self, name: str) -> Path:
        """Where a stage's record-level map goes: under internal/ (a stage's folder
        <run>/<stage>/name -> <run>/internal/<stage>/name), never beside the public files."""
        return self.folder.parent / "internal" / self.folder.name / name

    def scratch(self, name: str, confidential: bool = False) -> str:
        """The folder (made) a stage's passes write to and read back within the stage: under
        the stage's folder, or under internal/ when confidential (an original-to-masked map);
        for records held in memory a memory folder, the same one for the same name, released
        with the records (release_held)."""
        if self.sink is not None and self.sink.startswith(MEMORY):
            if name not in self.scratches:
                self.scratches[name] = memory_folder(name)
            return self.scratches[name]
        path = self.confidential(name) if confidential else self.folder / name
        path.mkdir(parents=True, exist_ok=True)
        return str(path)

    def drop_scratch(self, name: str) -> None:
        """The scratch folders under name let go (a memory folder's frames, or the folder)."""
        for key in [k for k in self.scratches if k == name or k.startswith(f"{name}/")]:
            release_memory(self.scratches.pop(key))
        if self.sink is None or not self.sink.startswith(MEMORY):
            shutil.rmtree(self.folder / name, ignore_errors=True)

    def lap(self, name: str) -> None:
        """The seconds since the last lap, as <name>_seconds (name "": seconds)."""
        now = time.perf_counter()
        self.laps[f"{name}_seconds" if name else "seconds"] = now - self._t
        self._t = now

    def at(self, folder: Path) -> Records:
        """The same records, for a stage writing to folder."""
        return replace(self, folder=folder, laps={}, _t=time.perf_counter())

    def say(self, text: str) -> None:
        """A progress line of the run (none for records held in memory: the run's step lines
        say what runs)."""
        if self.sink is None:
            say(text, "partitioned")


def _one_partition(
    fn: Callable, parts: Sequence, *args: Any, what: str, fold: Fold | None = None
) -> list:
    """The map over records held in memory: fn on each partition in turn, in this thread."""
    if fold is None:
        return [fn(p, *args) for p in parts]
    for p in parts:
        fold(fn(p, *args))
    return []


def _one_exchange(fns: tuple, parts: Sequence, args: tuple, what: str) -> list:
    send, serve, receive = fns
    sent = [send(p, *args) for p in parts]
    served = [serve(p, [s[j] for s in sent], *args) for j, p in enumerate(parts)]
    return [receive(p, [r[i] for r in served], *args) for i, p in enumerate(parts)]


IN_MEMORY = Exchange(_one_partition, _one_exchange)


class FrameScan(Mapping):
    """The scan of the original held in memory, each table computed when first read: the key
    profiles (profile_pass) and the design's PSUs (psus_of), on its one partition as the
    partitioned scan makes them."""

    NAMES = ("profiles", "psus")

    def __init__(self, spec: Any, original: Partition):
        self._spec, self._original = spec, original
        self._tables: dict[str, pd.DataFrame] = {}
        self._lock = threading.Lock()

    def __getitem__(self, name: str) -> pd.DataFrame:
        if name not in self.NAMES:
            raise KeyError(name)
        with self._lock:
            if name not in self._tables:
                self._tables[name] = self._compute(name)
            return self._tables[name]

    def _compute(self, name: str) -> pd.DataFrame:
        if name == "profiles":
            return profile_pass(self._original, self._spec)
        req = means_request(self._spec, partition_columns(self._original))
        df = read_partition(self._original, scan_columns(self._spec, req), self._spec)
        return combine_pass1([psus_of(df, req)]).psus

    def __iter__(self) -> Iterator[str]:
        return iter(self.NAMES)

    def __len__(self) -> int:
        return len(self.NAMES)


def in_memory(df: pd.DataFrame, ctx: StageContext) -> Records:
    """The working frame as the records so far: one partition held in memory (the original
    file the run's input), what the stage writes held in a memory folder. Records fewer than
    the original's (MASSC's retained ones, labelled as in the original and in its order) are
    its selection (Run.selected, a memory folder of __sel)."""
    original = [FramePartition.of(ctx.original)]
    parts = original if df is ctx.original else [FramePartition.of(df)]
    run = Run(IN_MEMORY, original, FrameScan(ctx.spec, original[0]))
    if df is not ctx.original and not df.index.equals(ctx.original.index):
        at = ctx.original.index.get_indexer(df.index)
        if (at < 0).any() or (np.diff(at) <= 0).any():
            raise ValueError(
                "the records after the stages are not the original's, labelled as in it and in "
                "its order: a stage reordered or relabelled them"
            )
        run.selected = memory_folder(f"{ctx.stage}-selected")
        sel = np.zeros(len(ctx.original), dtype=bool)
        sel[at] = True
        _write_partition(pd.DataFrame({"__sel": sel}), original[0], run.selected)
    return Records(run, parts, list(df.columns), Path(), sink=memory_folder(ctx.stage), frame=df)


def run_in_memory(
    stage: Any,
    df: pd.DataFrame,
    ctx: StageContext,
    call: Callable[[Any, Records, StageContext], StageResult] | None = None,
) -> StageResult:
    """A stage's passes (run_partitions, or call(stage, records, ctx): the flow's task) on the
    working frame as one partition held in memory: held_result's result."""
    records = in_memory(df, ctx)
    try:
        result = (call or _run_partitions)(stage, records, ctx)
    except BaseException:
        release_held(records)
        raise
    return held_result(records, result)


def _run_partitions(stage: Any, records: Records, ctx: StageContext) -> StageResult:
    return stage.run_partitions(records, ctx)


def release_held(records: Records) -> None:
    """The memory folders of records held in memory (its scratch folders too), released, and
    what the partition cache kept of their partitions (known by tokens no later stage's
    partition has)."""
    for name in list(records.scratches):
        release_memory(records.scratches.pop(name))
    for p in [*records.parts, *records.run.inputs]:
        if isinstance(p, FramePartition):
            CACHE.forget(partition_identity(p))
    release_memory(records.data)
    if records.run.selected:
        release_memory(records.run.selected)


def held_result(records: Records, result: StageResult) -> StageResult:
    """The result of a stage run on records held in memory (in_memory), with the frame it wrote
    (the working frame's index; a stage whose kernel reads the whole frame, Records.frame,
    returns it as result.data), or the working frame when it writes none; without the run's
    laps and facts (the flow times the stage); a frame of fewer records is labelled with the
    records its selection kept (Run.selected: MASSC's d(2)). The records' memory folders are
    released."""
    frames = held(records.data)
    kept = held(records.run.selected) if records.run.selected else []
    release_held(records)
    if result.data is not None:  # the whole frame's kernel: its own result
        return result
    for k in records.laps:
        result.metrics.pop(k, None)
    result.facts = {}
    df = records.frame
    if frames:
        (out,) = frames
        index = df.index
        if len(out) != len(df) and kept:  # the records the stage's selection kept
            index = df.index[kept[0]["__sel"].to_numpy(dtype=bool)]
        result.data = out.set_axis(index)
    else:
        result.data = df
    return result


class Passes:
    """A stage written once, as its passes over partitions (run_partitions): run(df, ctx) is
    the one-partition case, the working frame held in memory."""

    def run(self, df: pd.DataFrame, ctx: StageContext) -> StageResult:
        return run_in_memory(self, df, ctx)


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
    section: str | None = None,
    figures: dict[str, bytes] | None = None,
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
        section=section,
        figures=dict(figures or {}),
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
