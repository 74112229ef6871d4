"""`puf scan`: the input read a partition at a time, in this process or on Dask workers: its
records, edit rules, key-profile risk (strata U/D/T/O, GenMASSC scores, log-linear tau1 and
tau2: the risk stage's metrics) and the SEs of the study variables
overall and in the utility domains (Taylor and replicate), without the whole file in one
process's memory. Orchestration only: the map and reduce functions are sdl_design.partition's;
workers read their own partitions and send back small aggregates, which are combined here in
partition order (the results do not depend on which worker ran what, or when).
"""

from __future__ import annotations

import logging
import os
import shutil
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pandas as pd

from sdl_design import partition as part
from sdl_design.spec import ReleaseSpec, SpecError, load_spec

Mapper = Callable[..., list]


def _say(text: str) -> None:
    print(f"[puf scan] {text}", file=sys.stderr, flush=True)


@contextmanager
def _mapper(runner: str, dask_address: str | None, workers: int) -> Iterator[Mapper]:
    """map(fn, partitions, *args, what=...) -> results in partition order, with progress: in
    this process (runner 'thread', one partition in memory at a time) or on a Dask cluster
    (the one at dask_address, else a local one of `workers` single-threaded processes)."""
    if runner == "thread":

        def local(fn: Callable, parts: Sequence, *args: Any, what: str) -> list:
            out = []
            for i, p in enumerate(parts, 1):
                out.append(fn(p, *args))
                _say(f"{what}: partition {i}/{len(parts)} (records {p.start}-{p.stop - 1})")
            return out

        yield local
        return
    if runner != "dask":
        raise ValueError(f"runner must be 'thread' or 'dask', not {runner!r}")
    from distributed import Client, LocalCluster, as_completed

    cluster = None
    if dask_address:
        client = Client(dask_address)
    else:
        logging.getLogger("distributed").setLevel(logging.WARNING)  # no start-up chatter
        cluster = LocalCluster(
            n_workers=workers,
            threads_per_worker=1,
            processes=True,
            dashboard_address=None,
            silence_logs=logging.WARNING,
        )
        client = Client(cluster)
    try:

        def on_dask(fn: Callable, parts: Sequence, *args: Any, what: str) -> list:
            shared = [client.scatter(a, broadcast=True) for a in args]  # once, not per task
            futures = [client.submit(fn, p, *shared, pure=False) for p in parts]
            for done, f in enumerate(as_completed(futures), 1):
                f.result()  # a worker's error is raised here, whole
                _say(f"{what}: {done}/{len(parts)} partitions")
            return client.gather(futures)  # in partition order

        yield on_dask
    finally:
        client.close()
        if cluster is not None:
            cluster.close()


def scan_folder(spec: ReleaseSpec) -> Path:
    """Where a scan writes by default: <output_dir>/<name>/scan-<year> (beside the year's
    release folder, never inside it)."""
    r = spec.release
    return Path(r.output_dir) / r.name / f"scan-{r.year}"


def run_scan(
    spec_path: str | Path,
    runner: str = "thread",
    dask_address: str | None = None,
    partitions: int | None = None,
    out: str | Path | None = None,
    workers: int = 2,
) -> dict[str, Any]:
    """Scan the spec's Parquet input by partition; writes se.csv, edits.csv, risk_strata.csv,
    risk.csv and profiles.csv to out (whole or not at all) and returns them with the timings."""
    from expectations.suites import edit_verdicts

    spec = load_spec(spec_path)
    if spec.release.input is None:
        raise SpecError(
            [
                "release.input: the scan reads a Parquet file by partition; the embedded "
                "default survey has no file (write it with `puf demo` and give its path)"
            ]
        )
    try:
        columns = part.input_columns(spec.release.input)
        parts = part.plan_partitions(spec.release.input, partitions)
        req = part.means_request(spec, columns)
    except part.PartitionError as e:
        raise SpecError([str(e)]) from e
    missing = [c for c in part.scan_columns(spec, req) if c not in columns]
    if missing:
        raise SpecError([f"the spec names columns {missing} that are not in the input; fix them"])
    groups = sum(len(p.row_groups) for p in parts)
    _say(f"{parts[-1].stop} records in {len(parts)} partition(s) ({runner})")
    if partitions and len(parts) < partitions and groups < partitions:
        _say(
            f"{len(parts)} partition(s), not {partitions}: the input has {groups} row group(s) "
            "and a row group is never split; write it with smaller row groups (e.g. "
            "pyarrow.parquet.write_table(table, path, row_group_size=250_000)) to read it in "
            "more parts"
        )
    t0 = time.perf_counter()
    with _mapper(runner, dask_address, workers) as run_map:
        if runner == "dask":  # the edit verdicts' Great Expectations, imported while workers map
            from flows.env import preload

            preload(("great_expectations", "great_expectations.expectations"))
        first = run_map(part.scan_pass1, parts, spec, req, what="pass 1")
        t1 = time.perf_counter()
        agg = part.combine_scan(first)
        levels, ratios = agg["means"].levels, part.ratios(agg["means"])
        t2 = time.perf_counter()
        second = run_map(part.scan_pass2, parts, spec, req, levels, ratios, what="pass 2")
    t3 = time.perf_counter()
    se = part.domain_means(req, agg["means"], second)
    edits = edit_verdicts(spec.edits, agg["edits"], "row")
    strata = part.strata_counts(agg["profiles"]).rename_axis("stratum").reset_index(name="records")
    risk = part.scan_risk(spec, agg["profiles"])
    tables = {
        "se": se,
        "edits": edits,
        "risk_strata": strata,
        "risk": pd.DataFrame({"metric": list(risk), "value": list(risk.values())}),
        "profiles": agg["profiles"],
    }
    folder = Path(out) if out else scan_folder(spec)
    _write(folder, tables)
    return {
        "records": agg["records"],
        "partitions": len(parts),
        "seconds": time.perf_counter() - t0,
        "pass1_seconds": t1 - t0,
        "combine_seconds": t2 - t1,
        "pass2_seconds": t3 - t2,
        "folder": str(folder),
        **tables,
    }


def _write(folder: Path, tables: dict[str, pd.DataFrame]) -> None:
    """The tables as CSV in folder, replacing an earlier scan's whole: written to a temporary
    folder beside it, then renamed."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = folder.parent / f".{folder.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        for name, t in tables.items():
            t.to_csv(tmp / f"{name}.csv", index=False)
        old = folder.parent / f".{folder.name}.old-{os.getpid()}"
        if folder.exists():
            folder.rename(old)
        tmp.rename(folder)
        shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
