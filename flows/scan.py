"""`puf scan`: the input read a partition at a time, in this process or on Dask workers: its
records, edit rules, key-profile risk (strata U/D/T/O, GenMASSC scores, log-linear tau1 and
tau2: the risk stage's metrics) and the SEs of the study variables
overall and in the utility domains (Taylor and replicate), without the whole file in one
process's memory. Orchestration only: the map and reduce functions are sdl_design.engine.partitions's;
workers read their own partitions and send back small aggregates, which are combined here in
partition order (the results do not depend on which worker ran what, or when).
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pandas as pd

from expectations.suites import GateFailed, edit_verdicts
from flows.driver import PartitionStore, StageRun
from flows.env import peak_gib, peak_reset, preload, return_freed_memory
from sdl_design.engine import partitions as part
from sdl_design.engine.exchange import Exchange, mapper, say
from sdl_design.engine.records import Records, Run, run_record
from sdl_design.spec import ReleaseSpec, SpecError, load_spec, with_year
from sdl_design.stage import StageResult, public_design, reads_only
from sdl_design.stages import build_stages
from sdl_design.survey import blocksum

Mapper = Callable[..., list]


def scan_folder(spec: ReleaseSpec) -> Path:
    """Where a scan writes by default: <output_dir>/<name>/scan-<year> (beside the year's
    release folder, never inside it)."""
    r = spec.release
    return Path(r.output_dir) / r.name / f"scan-{r.year}"


def partitioned_input(
    spec_path: str | Path,
    runner: str,
    partitions: int | None,
    command: str = "scan",
    year: int | None = None,
) -> tuple[ReleaseSpec, list[str], list[part.Partition]]:
    """The spec (its release.year replaced by year when given), its Parquet input's columns
    and partitions (SpecError naming the fix)."""
    spec = with_year(load_spec(spec_path), year)
    if spec.release.input is None:
        raise SpecError(
            [
                "release.input: the partitioned path reads a Parquet file by partition; the "
                "embedded default survey has no file (write it with `puf demo` and give its path)"
            ]
        )
    try:
        columns = part.input_columns(spec.release.input)
        parts = part.plan_partitions(spec.release.input, partitions)
    except part.PartitionError as e:
        raise SpecError([str(e)]) from e

    groups = len({(q.path, g) for p in parts for q in p.pieces for g in q.row_groups})
    blocks = blocksum.n_blocks(parts[-1].stop)
    say(f"{parts[-1].stop} records in {len(parts)} partition(s) ({runner})", command)
    if partitions and len(parts) < partitions:
        if groups < partitions:
            why = (
                f"the input has {groups} row group(s) and a row group is split only at a block "
                "boundary; write it with smaller row groups (e.g. "
                "pyarrow.parquet.write_table(table, path, row_group_size=262_144)) to read it "
                "in more parts"
            )
        elif blocks > 1:
            why = (
                f"a partition holds whole blocks of {blocksum.BLOCK:,} records (the input has {blocks}), "
                "so that the driver receives block sums, not records' terms"
            )
        else:
            why = "a partition ends where a row group ends, and the row groups are of unequal sizes"
        say(f"{len(parts)} partition(s), not {partitions}: {why}", command)
    return spec, columns, parts


def run_scan(
    spec_path: str | Path,
    runner: str = "thread",
    dask_address: str | None = None,
    partitions: int | None = None,
    out: str | Path | None = None,
    workers: int = 2,
) -> dict[str, Any]:
    """Scan the spec's Parquet input by partition; writes se.csv, edits.csv, risk_strata.csv,
    key_risk.csv and profiles.csv to out (whole or not at all) and returns them with the timings."""
    spec, columns, parts = partitioned_input(spec_path, runner, partitions)
    t0 = time.perf_counter()
    with mapper(runner, dask_address, workers) as run_map:
        tables, info = scan_tables(spec, columns, parts, run_map, runner)
    folder = Path(out) if out else scan_folder(spec)
    _replace(folder, lambda tmp: _write_tables(tmp, tables))
    return {
        "partitions": len(parts),
        "seconds": time.perf_counter() - t0,
        "folder": str(folder),
        **info,
        **tables,
    }


def scan_tables(
    spec: ReleaseSpec,
    columns: list[str],
    parts: list,
    run_map: Mapper,
    runner: str,
    se: bool = True,
) -> tuple[dict[str, pd.DataFrame], dict[str, Any]]:
    """The scan's tables (se, edits, risk_strata, risk, profiles) and its counts and laps;
    se False: not the input's SEs (no pass 2: a release measures the published file)."""

    try:
        req = part.means_request(spec, columns)
    except part.PartitionError as e:
        raise SpecError([str(e)]) from e
    missing = [c for c in part.scan_columns(spec, req) if c not in columns]
    if missing:
        raise SpecError(spec.absent_columns(columns, only=missing))  # each with "did you mean"
    t0 = time.perf_counter()
    if runner == "dask":  # the edit verdicts' Great Expectations, imported while workers map
        preload(("great_expectations", "great_expectations.expectations"))
    first = run_map(part.scan_pass1, parts, spec, req, se, what="pass 1")
    t1 = time.perf_counter()
    agg = part.combine_scan(first)
    t2 = time.perf_counter()
    second = []
    if se:
        levels, ratios = agg["means"].levels, part.ratios(agg["means"])
        second = run_map(part.scan_pass2, parts, spec, req, levels, ratios, what="pass 2")
    t3 = time.perf_counter()
    edits = edit_verdicts(spec.edits, agg["edits"], "row")
    strata = part.strata_counts(agg["profiles"]).rename_axis("stratum").reset_index(name="records")
    risk = part.scan_risk(spec, agg["profiles"])
    tables = {
        **({"se": part.domain_means(req, agg["means"], second)} if se else {}),
        "edits": edits,
        "risk_strata": strata,
        "key_risk": pd.DataFrame({"metric": list(risk), "value": list(risk.values())}),
        "profiles": agg["profiles"],
    }
    info = {
        "records": agg["records"],
        "pass1_seconds": t1 - t0,
        "combine_seconds": t2 - t1,
        "pass2_seconds": t3 - t2,
        "psus": agg["means"].psus,  # the design's PSUs, (stratum, psu) sorted
    }
    return tables, info


def _domain_means(
    run_map: Mapper, parts: Sequence, spec: ReleaseSpec, req: Any, what: str
) -> pd.DataFrame:
    """The SE table of the partitions' records (two passes)."""
    first = run_map(part.means_only_pass1, parts, spec, req, what=f"SEs of the {what}, pass 1")
    agg = part.combine_pass1(first)
    levels, ratios = agg.levels, part.ratios(agg)
    second = run_map(
        part.scan_pass2, parts, spec, req, levels, ratios, what=f"SEs of the {what}, pass 2"
    )
    return part.domain_means(req, agg, second)


def _write_tables(folder: Path, tables: dict[str, pd.DataFrame]) -> None:
    for name, t in tables.items():
        t.to_csv(folder / f"{name}.csv", index=False)


def _replace(folder: Path, fill: Callable[[Path], Any]) -> Any:
    """Fill a temporary folder beside folder, then rename it to folder, replacing an earlier
    run's whole (nothing half-written is left on failure)."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    for stale in folder.parent.glob(f".{folder.name}.tmp-*"):  # a killed run's, whose
        pid = stale.name.rsplit("-", 1)[-1]  # process is gone
        if pid.isdigit() and not Path(f"/proc/{pid}").exists():
            shutil.rmtree(stale, ignore_errors=True)
    tmp = folder.parent / f".{folder.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        out = fill(tmp)
        old = folder.parent / f".{folder.name}.old-{os.getpid()}"
        if folder.exists():
            folder.rename(old)
        tmp.rename(folder)
        shutil.rmtree(old, ignore_errors=True)
        return out
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


# the public files of a partitioned run whose gates failed (puf/ is never left looking ready)
REFUSED = "puf-gates-failed"


def partitioned_folder(spec: ReleaseSpec) -> Path:
    """Where `puf partitioned` writes by default: <output_dir>/<name>/partitioned-<year>
    (internal: it holds the original-to-masked pairs; never the release's public folder)."""
    r = spec.release
    return Path(r.output_dir) / r.name / f"partitioned-{r.year}"


def run_partitioned(
    spec_path: str | Path,
    runner: str = "thread",
    dask_address: str | None = None,
    partitions: int | None = None,
    out: str | Path | None = None,
    workers: int = 2,
    release: bool = True,
    damage: bool = True,
    year: int | None = None,
) -> dict[str, Any]:
    """The spec's release stages by partition (year: the release's year, default the spec's),
    in release order, each on the previous one's records (StageRun on the Parquet partitions).
    When release, the measuring stages too, then the public files
    (puf/: the data files, README.md and codebook.csv) and the release's gates (gates.csv);
    release False: the records and tables of the stages that change them. First it scans the
    input as `puf scan` does (scan/: its edit rules, which stop the run when one fails, the
    risk measures, its SEs). out (default partitioned_folder) gets, per stage,
    <stage>/data/part-<first record>.parquet (the records after that stage, in record order)
    and its tables (record-level maps under internal/), among them se_ratios.csv: the SE of
    every study variable's mean overall and in every utility domain on the records after
    the stage, against the input's (damage False: not measured; a published run measures
    what the release measures); run.json says what ran, its counts and metrics. Workers on
    other machines need out on a disk they share. Returns the run's summary with each
    stage's StageResult under "stages"."""

    spec, columns, parts = partitioned_input(spec_path, runner, partitions, "partitioned", year)
    folder = Path(out) if out else partitioned_folder(spec)
    stages = build_stages(spec)
    check_partitions(stages, spec, columns)
    t0 = time.perf_counter()
    fill = _PartitionedRun(
        spec, columns, parts, stages, folder, release, runner, dask_address, workers
    )
    fill.damage = damage
    results, scan, scan_seconds, public, peaks = spec_errors(_replace, folder, fill)
    return {
        "records": parts[-1].stop,
        "partitions": len(parts),
        "seconds": time.perf_counter() - t0,
        "folder": str(folder),
        "scan": scan,
        "scan_seconds": scan_seconds,
        "stages": {r.name: r for r in results},
        "public_files": public,
        "driver_peak_gib": peaks,
    }


def check_partitions(stages: list, spec: ReleaseSpec, columns: list[str]) -> None:
    """What a stage refuses by partition (its check_partitions), refused before any work, in
    full: SpecError naming the field."""
    for stage in stages:
        check = getattr(stage, "check_partitions", None)
        if check is not None:
            spec_errors(check, spec, columns)


def spec_errors(fn: Callable, *args: Any) -> Any:
    """fn(*args), a PartitionError raised as the SpecError naming the field to fix."""
    try:
        return fn(*args)
    except part.PartitionError as e:
        raise SpecError([str(e)]) from e


class _PartitionedRun:
    """run_partitioned's fill of the temporary folder _replace renames: the scan of the
    input, then the release's stages by partition (StageRun on the Parquet partitions), then
    the public files and the release's gates; the progress lines and run.json. The results
    and the driver's peak resident set by step are kept as it goes."""

    def __init__(
        self,
        spec: ReleaseSpec,
        columns: list[str],
        parts: list,
        stages: list,
        folder: Path,
        release: bool,
        runner: str,
        dask_address: str | None,
        workers: int,
    ):
        self.spec, self.parts, self.stages = spec, parts, stages
        self.cols, self.folder, self.release = columns, folder, release
        # mapper's: in this process, or on Dask (at dask_address, else a local cluster)
        self.runner, self.dask_address, self.workers = runner, dask_address, workers
        self.results: list[StageResult] = []
        # the driver's peak resident set by step (only small aggregates should reach it)
        self.peaks: dict[str, float | None] = {}
        self.resets = False
        self.scan: dict[str, pd.DataFrame] = {}
        self.damage = True  # the SEs of the records after each stage against the input's

    def __call__(self, tmp: Path) -> tuple:
        """Fill tmp: (the stages' results, the scan's tables, its seconds, the public files'
        summary or None, the driver's peaks)."""
        self.resets = peak_reset()
        with mapper(self.runner, self.dask_address, self.workers, "partitioned") as run_map:
            scan_seconds, run = self._scan_input(run_map, tmp)
            after = self._damage if self.damage else None
            store = PartitionStore(run, self.parts, self.cols, tmp, after=after)
            driver = StageRun(self.spec, self.stages, store, after=self.peak)
            self.results = driver.results
            driver.run_stages(skip=lambda s: reads_only(s) and not self.release)
            for r in self.results:
                r.metrics.setdefault("seconds", driver.timings[r.name])
            public = self._release(driver, tmp) if self.release else None
        self._say_outcome(public)
        self._write_summary(tmp, scan_seconds, public)
        return self.results, self.scan, scan_seconds, public, self.peaks

    def peak(self, step: str) -> None:
        """The driver's peak resident set during step."""
        self.peaks[step] = peak_gib() if self.resets else None
        # what the step freed goes back to the system before the next one (at 5M records
        # the driver stayed at 2.4 GiB after MASSC without it); no gc.collect(): 0.3-0.5 s
        # a step in a process holding many objects, and the frames are freed by refcount
        return_freed_memory()
        peak_reset()

    def _scan_input(self, run_map: Exchange, tmp: Path) -> tuple[float, Run]:
        """The input first, as the release flow: its edit rules (a failing one stops the
        run), the risk measures, and the SEs every stage's damage is measured by, written to
        scan/. Its seconds and the run every stage reads."""
        t_scan = time.perf_counter()
        scan, scan_info = scan_tables(
            self.spec, self.cols, self.parts, run_map, self.runner, se=self.damage
        )
        scan_seconds = time.perf_counter() - t_scan
        (tmp / "scan").mkdir()
        _write_tables(tmp / "scan", scan)
        self.scan = scan
        self.peak("scan")
        if not scan["edits"]["passed"].all():
            raise GateFailed("edit validation failed on the input file", scan["edits"])
        return scan_seconds, Run(run_map, self.parts, scan, scan_info["psus"])

    def _damage(self, stage: Any, records: Records, result: StageResult) -> None:
        """The SEs of the records after a stage against the input's (se_ratios, unless the
        stage measured its own), read with the public design after it."""
        if "se_ratios" in result.tables:
            return
        t = time.perf_counter()
        pdesign = public_design(self.spec, [*self.results, result])
        data = records.folder / "data"
        parts, cols = part.plan_partitions(data), part.input_columns(data)
        after = part.means_request(self.spec, cols, pdesign)
        table = part.se_ratio_rows(
            self.scan["se"], _domain_means(records.run_map, parts, self.spec, after, stage.name)
        )
        result.metrics["se_seconds"] = time.perf_counter() - t
        result.tables["se_ratios"] = table

    def _release(self, driver: StageRun, tmp: Path) -> dict[str, Any]:
        """The public files (puf/) of the records so far, then the release's gates as the
        flow checks them: the stages' metric gates, then the public file's (gates.csv); puf/
        becomes REFUSED when one fails. Their summary."""
        t = time.perf_counter()
        public, gates = driver.public_files(tmp / "puf")
        public["seconds"] = time.perf_counter() - t
        gates.to_csv(tmp / "gates.csv", index=False)
        public["gates_passed"] = int(gates["passed"].sum())
        public["gates"] = len(gates)
        public["gates_failed"] = gates.loc[~gates["passed"].astype(bool), "name"].tolist()
        if public["gates_failed"]:  # nothing that looks publishable is left behind
            (tmp / "puf").rename(tmp / REFUSED)
        self.peak("public_files")
        return public

    def _say_outcome(self, public: dict[str, Any] | None) -> None:
        """The run's last progress line: the gates that failed, or where the public files
        are and what is not published."""
        folder = self.folder
        if public is not None and public["gates_failed"]:
            say(
                f"{len(public['gates_failed'])} of {public['gates']} gates failed "
                f"({'; '.join(public['gates_failed'])}): the files stay in {folder / REFUSED}, "
                "not to be published",
                "partitioned",
            )
        elif public is not None:
            say(
                "every stage ran by partition; the public data files are in "
                f"{folder / 'puf'} ({public['records']} records, {public['columns']} "
                f"columns; {public['seconds']:.1f} s); gates: {public['gates_passed']} of "
                f"{public['gates']} pass (gates.csv); not published: the approval (README.md "
                "and codebook.csv are in puf/)",
                "partitioned",
            )

    def _write_summary(self, tmp: Path, scan_seconds: float, public: dict | None) -> None:
        """run.json: what ran, its counts and metrics (not its tables)."""
        summary = {
            "records": self.parts[-1].stop,
            "partitions": len(self.parts),
            "runner": self.runner,
            "edit_rules_passed": int(self.scan["edits"]["passed"].sum()),
            "scan_seconds": scan_seconds,
            "driver_peak_gib": self.peaks,
            "public_files": public,
            "stages": {r.name: run_record(r) for r in self.results},
        }
        (tmp / "run.json").write_text(json.dumps(summary, indent=1, default=float) + "\n")
