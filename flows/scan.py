"""`puf scan`: the input read a partition at a time, in this process or on Dask workers: its
records, edit rules, key-profile risk (strata U/D/T/O, GenMASSC scores, log-linear tau1 and
tau2: the risk stage's metrics) and the SEs of the study variables
overall and in the utility domains (Taylor and replicate), without the whole file in one
process's memory. Orchestration only: the map and reduce functions are sdl_design.partition's;
workers read their own partitions and send back small aggregates, which are combined here in
partition order (the results do not depend on which worker ran what, or when).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import pandas as pd

from expectations.suites import GateFailed, edit_verdicts, validate_metric_gates
from flows.env import peak_gib, peak_reset, preload, return_freed_memory
from flows.public_files import write_public_by_partition
from flows.txn import CONFIDENTIAL_TABLES
from sdl_design import blocksum
from sdl_design import partition as part
from sdl_design import partition_assess as pas
from sdl_design import partition_calibration as pcal
from sdl_design import partition_final as pf
from sdl_design import partition_pseudo as pps
from sdl_design import partition_topcode as ptc
from sdl_design.assess import column_record, published_attacks
from sdl_design.massc.stage import delta_gates, massc_config, massc_params
from sdl_design.massc.treatment import MasscConfig, cost_from, revise_rates
from sdl_design.partition import combine_profiles, profile_scores
from sdl_design.prb import identification_risk_gate
from sdl_design.rng import release_seed, stage_rng
from sdl_design.spec import ReleaseSpec, SpecError, load_spec
from sdl_design.stage import (
    StageContext,
    StageResult,
    built_design,
    design_columns,
    public_design,
    reads_only,
)
from sdl_design.stages import RELEASE_STAGES
from sdl_design.utility import final_measures, final_tables, se_ratio_merge

Mapper = Callable[..., list]


class Exchange:
    """exchange(send, serve, receive, parts, *args, what=...): records move between partitions
    without passing through the driver. send(part_i, *args) gives one payload per partition
    j; serve(part_j, [payload i->j for every i], *args) one reply per partition i;
    receive(part_i, [reply j->i for every j], *args) the result, returned in partition order."""

    def __init__(self, map_fn: Mapper, exchange_fn: Callable[..., list]):
        self._map, self._exchange = map_fn, exchange_fn

    def __call__(self, fn: Callable, parts: Sequence, *args: Any, what: str) -> list:
        return self._map(fn, parts, *args, what=what)

    def exchange(
        self,
        send: Callable,
        serve: Callable,
        receive: Callable,
        parts: Sequence,
        *args: Any,
        what: str,
    ) -> list:
        return self._exchange((send, serve, receive), parts, args, what)


def _say(text: str, command: str = "scan") -> None:
    print(f"[puf {command}] {text}", file=sys.stderr, flush=True)


@contextmanager
def _mapper(
    runner: str, dask_address: str | None, workers: int, command: str = "scan"
) -> Iterator[Exchange]:
    """map(fn, partitions, *args, what=...) -> results in partition order, with progress: in
    this process (runner 'thread', one partition in memory at a time) or on a Dask cluster
    (the one at dask_address, else a local one of `workers` single-threaded processes)."""
    if runner == "thread":

        def local(fn: Callable, parts: Sequence, *args: Any, what: str) -> list:
            out = []
            for i, p in enumerate(parts, 1):
                out.append(fn(p, *args))
                _say(
                    f"{what}: partition {i}/{len(parts)} (records {p.start}-{p.stop - 1})", command
                )
            return out

        def local_exchange(fns: tuple, parts: Sequence, args: tuple, what: str) -> list:
            send, serve, receive = fns
            sent = local(send, parts, *args, what=f"{what}, requests")
            served = [serve(p, [s[j] for s in sent], *args) for j, p in enumerate(parts)]
            _say(f"{what}: served {len(parts)} partitions", command)
            return [receive(p, [r[i] for r in served], *args) for i, p in enumerate(parts)]

        yield Exchange(local, local_exchange)
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
            # once, not per task; hash=False: a fresh key each map (a key reused from the
            # previous map may be released under the new tasks: "lost dependencies")
            shared = _scattered(client, args)
            futures = [client.submit(fn, p, *shared, pure=False) for p in parts]
            for done, f in enumerate(as_completed(futures), 1):
                f.result()  # a worker's error is raised here, whole
                _say(f"{what}: {done}/{len(parts)} partitions", command)
            return client.gather(futures)  # in partition order

        def dask_exchange(fns: tuple, parts: Sequence, args: tuple, what: str) -> list:
            from operator import getitem

            send, serve, receive = fns
            shared = _scattered(client, args)
            n = len(parts)
            sent = [client.submit(send, p, *shared, pure=False) for p in parts]
            to = [
                [client.submit(getitem, sent[i], j, pure=False) for i in range(n)] for j in range(n)
            ]
            served = [client.submit(serve, parts[j], to[j], *shared, pure=False) for j in range(n)]
            back = [
                [client.submit(getitem, served[j], i, pure=False) for j in range(n)]
                for i in range(n)
            ]
            got = [client.submit(receive, parts[i], back[i], *shared, pure=False) for i in range(n)]
            for done, f in enumerate(as_completed(got), 1):
                f.result()
                _say(f"{what}: {done}/{n} partitions", command)
            return client.gather(got)

        yield Exchange(on_dask, dask_exchange)
    finally:
        client.close()
        if cluster is not None:
            cluster.close()


def _scattered(client: Any, args: tuple) -> list:
    """Each argument sent to every worker once, as one object (a dict or list is not split
    into its items; an empty one too)."""
    return [client.scatter([a], broadcast=True, hash=False)[0] for a in args]


def scan_folder(spec: ReleaseSpec) -> Path:
    """Where a scan writes by default: <output_dir>/<name>/scan-<year> (beside the year's
    release folder, never inside it)."""
    r = spec.release
    return Path(r.output_dir) / r.name / f"scan-{r.year}"


def _partitioned_input(
    spec_path: str | Path, runner: str, partitions: int | None, command: str = "scan"
) -> tuple[ReleaseSpec, list[str], list[part.Partition]]:
    """The spec, its Parquet input's columns and partitions (SpecError naming the fix)."""
    spec = load_spec(spec_path)
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
    _say(f"{parts[-1].stop} records in {len(parts)} partition(s) ({runner})", command)
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
        _say(f"{len(parts)} partition(s), not {partitions}: {why}", command)
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
    risk.csv and profiles.csv to out (whole or not at all) and returns them with the timings."""
    spec, columns, parts = _partitioned_input(spec_path, runner, partitions)
    t0 = time.perf_counter()
    with _mapper(runner, dask_address, workers) as run_map:
        tables, info = _scan(spec, columns, parts, run_map, runner)
    folder = Path(out) if out else scan_folder(spec)
    _replace(folder, lambda tmp: _write_tables(tmp, tables))
    return {
        "partitions": len(parts),
        "seconds": time.perf_counter() - t0,
        "folder": str(folder),
        **info,
        **tables,
    }


def _scan(
    spec: ReleaseSpec, columns: list[str], parts: list, run_map: Mapper, runner: str
) -> tuple[dict[str, pd.DataFrame], dict[str, Any]]:
    """The scan's tables (se, edits, risk_strata, risk, profiles) and its counts and laps."""

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


def _confidential(folder: Path, name: str) -> Path:
    """Where a stage's record-level map goes in a run's folder: under internal/ (a stage's
    folder <run>/<stage>/name -> <run>/internal/<stage>/name), never beside the public files."""
    return folder.parent / "internal" / folder.name / name


def _stage_table(folder: Path, name: str, table: pd.DataFrame) -> None:
    """A stage's table as CSV in its folder; a record-level map (txn.CONFIDENTIAL_TABLES)
    under internal/."""

    path = folder / f"{name}.csv"
    if f"{folder.name}/{name}.csv" in CONFIDENTIAL_TABLES:
        path = _confidential(folder, f"{name}.csv")
        path.parent.mkdir(parents=True, exist_ok=True)
    table.to_csv(path, index=False)


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


def partitioned_folder(spec: ReleaseSpec) -> Path:
    """Where `puf partitioned` writes by default: <output_dir>/<name>/partitioned-<year>
    (internal: it holds the original-to-masked pairs; never the release's public folder)."""
    r = spec.release
    return Path(r.output_dir) / r.name / f"partitioned-{r.year}"


def _stage_rng(spec: ReleaseSpec, stage: str) -> Any:

    return stage_rng(release_seed(spec.release.seed, spec.release.year), stage)


def _lap(laps: dict, name: str, t: float) -> float:
    now = time.perf_counter()
    laps[f"{name}_seconds"] = now - t
    return now


@dataclass
class Chain:
    """What a partitioned stage may read besides its input's partitions: the release input's
    partitions (the original records) and its scan (profiles, SEs, edits)."""

    inputs: list
    scan: dict[str, Any]
    psus: pd.DataFrame  # the input design's PSUs, (stratum, psu) sorted as SurveyDesign codes them
    masked: bool = False  # an earlier stage masked the design (its result's masks_design)
    drop_public: list[str] = field(default_factory=list)  # columns the stages never publish
    selected: str | None = None  # MASSC's d(2): which original records the later ones are
    design: Any = None  # the public file's design when a stage built one (else the spec's)

    def public_design(self, spec: ReleaseSpec) -> Any:
        """The DesignSection the records so far are read with (sdl_design.stage.public_design)."""
        return self.design if self.design is not None else spec.design


def _swap_stage(
    spec: ReleaseSpec, columns: list[str], parts: list, run_map: Mapper, folder: Path, chain: Chain
) -> dict[str, Any]:
    """The swap by partition: pass 1 reads each partition's segments and bounds, pass 2 its
    exact segment sums; the driver chooses the swaps, pseudo labels and replicate factors from
    those sums with the swap stage's Generator; every worker masks and writes its partitions."""
    req = part.swap_request(spec, columns)
    missing = [c for c in req.columns if c not in columns]
    if missing:
        raise part.PartitionError(
            f"the spec names columns {missing} that are not in the input; fix them"
        )
    laps: dict[str, float] = {}
    t = time.perf_counter()
    try:  # the swap's checks name the field to fix (design.segment, stages.swap.matching, ...)
        first = run_map(part.swap_pass1, parts, spec, req, what="swap pass 1")
        design = part.swap_design(first, req)
    except ValueError as e:
        raise part.PartitionError(str(e)) from e
    t = _lap(laps, "pass1", t)
    sums = run_map(part.swap_pass2, parts, spec, req, design, what="swap pass 2")
    t = _lap(laps, "pass2", t)
    masking, counts, tables = part.swap_masking(req, design, sums, _stage_rng(spec, "swap"))
    t = _lap(laps, "plan", t)
    n = f"{counts['n_pairs']} segment pairs swapped"
    _say(f"{n} ({counts['n_swapped']} of {counts['n_segments']} segments)", "partitioned")
    args = (spec, req, design.segment_labels, masking, str(folder / "data"))
    files = run_map(part.swap_apply, parts, *args, what="swap masking")
    _lap(laps, "masking", t)
    st = req.section
    settings = {
        "method": st.method,
        "rate": st.rate,
        "max_share": st.max_share,
        "cumulative": st.cumulative,
        "scope": st.scope,
    }
    return {
        **counts,
        "files": [Path(f).name for f in files],
        **laps,
        # SwapStage's params (its swap_segments' and the baseline's name)
        "params": {
            **settings,
            **counts,
            "replicate_method": st.replicate_method or req.dc["method"],
            "baseline": "2a" if st.method == "2b" else "2b",
        },
        "masks_design": True,  # pseudo strata and PSUs, rebuilt replicate weights
        "drop_public": [c for c in (spec.design.segment,) if c],  # SwapStage's
        "tables": tables,
    }


def _prb_stage(
    spec: ReleaseSpec, columns: list[str], parts: list, run_map: Mapper, folder: Path, chain: Chain
) -> dict[str, Any]:
    """PRB by partition: pass 1 counts each partition's cells of X_C and lists its partition
    sets, pass 2 gathers the singleton/doubleton units; the driver forms the blocks and draws
    IFPR with the PRB stage's Generator; every worker writes its records with the moved ones'
    values of C replaced (edit rules checked)."""
    req, st = part.prb_stage_request(spec)
    laps: dict[str, float] = {}
    t = time.perf_counter()
    tables = part.combine_prb_pass1(
        run_map(part.prb_pass1, parts, spec, req, what="prb pass 1"), req
    )
    t = _lap(laps, "pass1", t)
    units = run_map(part.prb_pass2, parts, spec, req, tables, what="prb pass 2")
    t = _lap(laps, "pass2", t)
    new, plan = part.prb_plan(req, st.xi, st.tuned, tables, units, _stage_rng(spec, "prb"))
    t = _lap(laps, "plan", t)
    m = plan["metrics"]
    _say(
        f"PRB changed {int(m['n_changed'])} of {int(m['n_units'])} singleton/doubleton records; "
        f"max exact identification risk {m['max_risk']:.4f} (xi {st.xi})",
        "partitioned",
    )
    files = run_map(part.prb_apply, parts, spec, req, new, str(folder / "data"), what="prb")
    t = _lap(laps, "apply", t)
    # the public README's tables: the transition probabilities (the category sums by
    # partition, in block sums) and the records each variable of C changed
    trq = part.prb_transition_request(tables, plan, req)
    sums = run_map(part.prb_transition_pass, parts, spec, req, tables, trq, what="prb transitions")
    docs = part.prb_doc_tables(trq, sums, parts[-1].stop, plan, new, req)
    _lap(laps, "transitions", t)
    metrics = pd.DataFrame({"metric": list(m), "value": list(m.values())})

    gate_rows = [identification_risk_gate(m["max_risk"], spec.gates.xi or st.xi).as_dict()]
    n_rows = parts[-1].stop
    return {
        **m,
        "share_changed": m["n_changed"] / max(n_rows, 1),
        "files": [Path(f).name for f in files],
        **laps,
        "gate_rows": gate_rows,
        # PrbStage's params (what the README reads of them)
        "params": {
            "xi": st.xi,
            "theta": m["theta"],
            "m0": int(m["m0"]),
            "method": st.method,
            "cells": list(req.names),
            "domains": [" x ".join(d) for d in req.domains],
        },
        "tables": {"metrics": metrics, **docs},
    }


def _massc_stage(
    spec: ReleaseSpec,
    columns: list[str],
    parts: list,
    run_map: Exchange,
    folder: Path,
    chain: Chain,
) -> dict[str, Any]:
    """MASSC by partition as far as it is built, Steps I-IV (the release's `_main`, bit for
    bit). The donor search: pass 1 lists each partition's search profiles; the driver
    searches donor profiles with the MASSC stage's Generator; each record draws its donor
    record, which the partition holding it sends back (worker to worker, not through the
    driver); the substituted file tilde (with the donor's row in __donor: confidential) goes
    to donors/. The risk strata (the scan's profile counts), the moments of eq. 8a, the
    original's totals and Taylor variances and the costs by partition in block sums
    (sdl_design.blocksum); psi on the driver. The selections at psi and at phi (records
    exchanged to the partition that owns their group) with phi from the moments of z*, delta,
    and meet_delta's revisions while delta is above gates.delta_max. Step IV: the retained
    records' weight and replicate weights calibrated to the original's totals (three passes,
    sdl_design.partition_calibration) and written to data/; the replications of the whole
    treatment (their own selections, the weight's calibration and study totals) and the
    empirical epsilon."""

    req = part.massc_request(spec, columns)
    laps: dict[str, float] = {}
    t = time.perf_counter()
    search, files, rng, t = _massc_donors(spec, req, parts, run_map, folder, laps, t)
    m, zvars, scores, sums, t = _massc_moments(spec, req, parts, run_map, folder, chain, laps, t)
    psi, cost = part.massc_psi(spec, columns, sums)
    t = _lap(laps, "psi", t)
    _say("substitution rates psi " + _by_stratum(m.labels, psi.rates), "partitioned")
    # Steps II-III: substitution at psi (select), phi from the moments of z*, subsampling;
    # while delta is above gates.delta_max, meet_delta's revisions (revise_rates)
    cfg = massc_config(spec, pd.DataFrame(columns=list(columns)))
    groups = part.select_groups(run_map(part.select_pass1, parts, m, what="groups"))
    chosen = (str(folder / "select_psi"), str(folder / "select_phi"))
    chain.selected = chosen[1]
    donors = str(_confidential(folder, "donors"))
    run = _MasscPasses(spec, req, parts, run_map, m, zvars, scores, donors, chosen, groups, rng)
    done = run.treatment(part.RatesPlan(sums.moments, psi, cost), cfg, sums)
    il, epsilon = part.massc_loss(done.tr, done.plan, sums)
    t = _lap(laps, "treatment", t)
    # Step IV: the retained records' weight and replicate weights calibrated to the
    # original's totals (calibrate_treated's, bit for bit), written to data/
    creq = pcal.calibration_request(spec, columns)
    treated = pcal.Treated(donors, chosen, np.asarray(done.tr.phi.rates, dtype=float))
    cal, cal_tables, cal_metrics = run.calibration(creq, treated, folder)
    t = _lap(laps, "calibration", t)
    n_reps = int(spec.stages.massc.replications)
    if n_reps:
        eps_rep, rep_table = _massc_replications(run, creq, treated, done, sums, folder)
        cal_tables["epsilon_replications"] = rep_table
        cal_metrics["epsilon_empirical"] = eps_rep
        cal_metrics["n_replications"] = float(n_reps)
    _lap(laps, "replications", t)
    _say_massc_treatment(run, done, epsilon, cal, cal_metrics)
    return {
        **_massc_counts(run, search, sums, done, epsilon, cal_metrics),
        "files": [Path(f).name for f in files],
        **laps,
        **cal_metrics,
        "tables": {
            **part.massc_tables(search, sums, done.plan, done.tr, done.dm, il),
            **cal_tables,
        },
    }


def _by_stratum(labels: list[str], rates: Any) -> str:
    """A stratum's rate after its label, for the progress lines ("U 0.05, D 0.1")."""
    return ", ".join(f"{h} {p:.4g}" for h, p in zip(labels, rates, strict=True))


def _massc_donors(
    spec: ReleaseSpec,
    req: part.MasscRequest,
    parts: list,
    run_map: Exchange,
    folder: Path,
    laps: dict[str, float],
    t: float,
) -> tuple[part.DonorPlan, list, np.random.Generator, float]:
    """Step I, the donor search: the partitions' search profiles (pass 1), the driver's
    search of donor profiles with the MASSC stage's Generator, and the exchange in which each
    record draws its donor record from the partition that holds it; the substituted file
    goes to donors/ (confidential). The plan, the files written, the Generator (to be drawn
    on by the selections) and the lap's end."""
    tables = run_map(part.donor_pass1, parts, spec, req, what="massc donors pass 1")
    t = _lap(laps, "pass1", t)
    rng = _stage_rng(spec, "massc")
    search = part.donor_plan(tables, req, rng)
    t = _lap(laps, "search", t)
    n_has = _with_donor(search)
    _say(f"{n_has} records have a donor ({search.n_profiles} search profiles)", "partitioned")
    donors = _confidential(folder, "donors")
    donors.mkdir(parents=True)
    receive = partial(part.donor_receive, folder=str(donors))
    files = run_map.exchange(
        part.donor_send, part.donor_serve, receive, parts, spec, req, search, what="massc donors"
    )
    t = _lap(laps, "exchange", t)
    return search, files, rng, t


def _massc_moments(
    spec: ReleaseSpec,
    req: part.MasscRequest,
    parts: list,
    run_map: Exchange,
    folder: Path,
    chain: Chain,
    laps: dict[str, float],
    t: float,
) -> tuple[part.MasscInputs, Any, np.ndarray, part.PlanSums, float]:
    """The risk strata (the scan's profile counts), the study variables z and the sensitive
    risk scores; the moments of eq. 8a, the original's totals and Taylor variances and the
    costs' sums by partition, combined in block sums. The records' inputs, z, the scores,
    the plan's sums and the lap's end."""
    profiles = chain.scan["profiles"]
    labels = part.massc_strata_labels(profiles, req)
    zvars = part.massc_study_variables(profiles, req)
    scores = part.profile_scores(profiles, req.sensitive) if req.sensitive else np.zeros(0)
    m = part.MasscInputs(spec, req, chain.inputs, profiles, labels)
    donors = str(_confidential(folder, "donors"))
    partials = run_map(
        part.moments_pass, parts, m, chain.psus, zvars, scores, donors, what="massc moments"
    )
    sums = part.combine_moments(partials, zvars, labels, chain.psus, parts[-1].stop)
    t = _lap(laps, "moments", t)
    return m, zvars, scores, sums, t


@dataclass
class _MasscPasses:
    """MASSC's passes after the moments, on the substituted file (donors/) and the original:
    the selections at psi and phi with the stage's Generator (d(1), d(2) in chosen), the
    moments of z*, delta and the calibrations of Step IV (of the release's treatment or a
    batch of replications in the same passes)."""

    spec: ReleaseSpec
    req: part.MasscRequest
    parts: list
    run_map: Exchange
    m: part.MasscInputs
    zvars: Any  # the study variables z (part.massc_study_variables)
    scores: np.ndarray  # the input's key profiles' risk scores (sensitive variables)
    donors: str  # the substituted file tilde
    chosen: tuple[str, str]  # the selections' folders: at psi (d(1)), at phi (d(2))
    groups: pd.DataFrame  # the selection groups (part.select_groups)
    rng: np.random.Generator  # the MASSC stage's, past the donor search

    @property
    def n_rows(self) -> int:
        """The records of the input (and of the substituted file)."""
        return self.parts[-1].stop

    def select_plan(self, rates: np.ndarray, rng: np.random.Generator) -> part.SelectPlan:
        """The selection of the groups at rates by stratum, drawn from rng."""
        return part.select_plan(self.groups, rates, rng, self.n_rows, len(self.parts))

    def selections(self, plans: list, folders: list[str], what: str) -> list[int]:
        """Several selections in one exchange: the records each keeps."""
        for where in folders:
            Path(where).mkdir(parents=True, exist_ok=True)
        sels = part.Selections(plans, folders)
        got = self.run_map.exchange(
            part.select_send, part.select_serve, part.select_receive, self.parts, self.m, sels,
            what=what,
        )  # fmt: skip
        return [sum(c[r] for c in got) for r in range(len(plans))]

    def select(self, rates: np.ndarray, where: str) -> int:
        """One selection at rates with the stage's Generator: the records it keeps."""
        plan = self.select_plan(rates, self.rng)
        return self.selections([plan], [where], f"massc selection ({Path(where).name})")[0]

    def treat(self, p: part.RatesPlan, c: MasscConfig) -> part.PartitionedTreatment:
        """Substitution at psi, phi (eq. 10) from the moments of z*, subsampling at phi."""
        self.select(p.psi.rates, self.chosen[0])
        treated = self.run_map(
            part.treated_pass, self.parts, self.m, self.zvars, self.donors, self.chosen[0],
            what="massc moments of z*",
        )  # fmt: skip
        phi, mom_t, n_sub = part.massc_phi(c, treated, self.zvars, p.moments, p.cost, self.n_rows)
        return part.PartitionedTreatment(phi, n_sub, self.select(phi.rates, self.chosen[1]), mom_t)

    def measure(self, tr: part.PartitionedTreatment, risk_basis: str) -> part.PartitionedDelta:
        """delta (eq. 3) of the treated file (tr's selections in chosen): its B(2) key
        profiles, then the records' risk on risk_basis."""
        req, parts, donors, chosen = self.req, self.parts, self.donors, self.chosen
        found = self.run_map(
            part.delta_pass1, parts, self.spec, req, donors, chosen, what="massc B(2) profiles"
        )
        b2 = part.combine_profiles(found)
        s2 = part.profile_scores(b2, req.sensitive) if req.sensitive else np.zeros(0)
        got = self.run_map(
            part.delta_pass2, parts, self.m, self.scores, b2, s2, risk_basis, donors, chosen,
            what="massc delta",
        )  # fmt: skip
        return part.combine_delta(got, self.n_rows)

    def treatment(self, rplan: part.RatesPlan, cfg: MasscConfig, sums: part.PlanSums) -> _Treatment:
        """Steps II-III at psi, then meet_delta's revisions (revise_rates) while delta is
        above gates.delta_max."""
        measure = partial(self.measure, risk_basis=cfg.risk_basis)
        tr = self.treat(rplan, cfg)
        dm = measure(tr)
        if self.spec.gates.delta_max is None:
            return _Treatment(cfg, rplan, tr, dm, [])
        return _Treatment(
            *revise_rates(
                rplan, tr, cfg, dm, self.spec.gates.delta_max, self.treat, measure,
                lambda c: cost_from(sums.cost_sums, sums.moments.N, c)[0],
            )
        )  # fmt: skip

    def calibrations(
        self, creq: pcal.CalibrationRequest, trs: list[pcal.Treated], what: str
    ) -> list[tuple]:
        """Step IV of several treatments in the same passes: (plan, factors) of each."""
        parts, m, n_rows = self.parts, self.m, self.n_rows
        got = self.run_map(pcal.retained_count, parts, trs, what=f"{what}: retained records")
        offsets = [pcal.retained_offsets(parts, [c[r] for c in got]) for r in range(len(trs))]
        first = self.run_map(
            pcal.calibration_pass1, parts, m, creq, trs, offsets, what=f"{what}: pass 1"
        )
        plans = [
            pcal.calibration_plan([f[r] for f in first], creq, n_rows, offsets[r])
            for r in range(len(trs))
        ]
        todo = [r for r, p in enumerate(plans) if creq.controls or p.margins]
        if not todo:
            return [(p, None) for p in plans]
        second = self.run_map(
            pcal.calibration_pass2, parts, m, creq, [trs[r] for r in todo],
            [plans[r] for r in todo], [list(plans[r].margins) for r in todo],
            what=f"{what}: pass 2",
        )  # fmt: skip
        out = [(p, None) for p in plans]
        for k, r in enumerate(todo):
            again = partial(self._pass2_again, creq, trs[r], plans[r], what)
            first_sums = [s[k] for s in second]
            cal = pcal.calibrate_by_partition(plans[r], creq, again, n_rows, first_sums)
            out[r] = (plans[r], cal)
        return out

    def _pass2_again(
        self,
        creq: pcal.CalibrationRequest,
        tr: pcal.Treated,
        plan: pcal.CalibrationPlan,
        what: str,
        kept: list[str],
    ) -> list:
        """One treatment's calibration pass 2 again, after a domain is dropped."""
        got = self.run_map(
            pcal.calibration_pass2, self.parts, self.m, creq, [tr], [plan], [kept],
            what=f"{what}: pass 2 again",
        )  # fmt: skip
        return [g[0] for g in got]

    def calibration(
        self, creq: pcal.CalibrationRequest, treated: pcal.Treated, folder: Path
    ) -> tuple[pcal.CalibrationFactors | None, dict[str, pd.DataFrame], dict[str, float]]:
        """Step IV of the release's treatment: the retained records' weight and replicate
        weights calibrated, written to data/; the factors, the tables and the metrics."""
        ((cplan, cal),) = self.calibrations(creq, [treated], "massc calibration")
        applied = self.run_map(
            pcal.calibration_apply, self.parts, self.m, creq, treated, cplan, cal,
            str(folder / "data"), what="massc calibration",
        )  # fmt: skip
        cal_tables, cal_metrics = pcal.calibration_summary(cplan, creq, cal, applied)
        return cal, cal_tables, cal_metrics


class _Treatment(NamedTuple):
    """MASSC's treatment after meet_delta's revisions (revise_rates' result): the config, the
    rates plan (its psi, eq. 9), the treatment (phi, eq. 10; d(1), d(2)), its delta (eq. 3)
    and the revisions."""

    cfg: MasscConfig
    plan: part.RatesPlan
    tr: part.PartitionedTreatment
    dm: part.PartitionedDelta
    revisions: list


def _massc_replications(
    run: _MasscPasses,
    creq: pcal.CalibrationRequest,
    treated: pcal.Treated,
    done: _Treatment,
    sums: part.PlanSums,
    folder: Path,
) -> tuple[float, pd.DataFrame]:
    """The replications of the whole treatment (massc_replications), a batch in the same
    passes: each draws its two selections from its own Generator (one exchange for the
    batch) and calibrates the weight only, to the controls and the declared domains the
    release's weight alone keeps; the empirical epsilon and its table from their study
    totals."""
    n_reps = int(run.spec.stages.massc.replications)
    wreq = pcal.weight_only(creq)
    if wreq.domains:
        ((wplan, wcal),) = run.calibrations(wreq, [treated], "massc replications' domains")
        wreq = pcal.replication_request(wreq, wplan.table if wcal is None else wcal.table)
    estimates = []
    batch = pcal.REPLICATIONS_AT_ONCE  # the memory of their exchanges and block sums
    for lo in range(0, n_reps, batch):
        reps = range(lo, min(lo + batch, n_reps))
        estimates += _replication_batch(run, wreq, treated, done, reps, folder)
    shutil.rmtree(folder / "replications")  # their selections: original-to-masked maps
    return pcal.replication_epsilon(estimates, sums.truth, run.zvars)


def _replication_batch(
    run: _MasscPasses,
    wreq: pcal.CalibrationRequest,
    treated: pcal.Treated,
    done: _Treatment,
    reps: range,
    folder: Path,
) -> list[np.ndarray]:
    """A batch of replications in the same passes: their selections at psi and phi (one
    exchange), the weight's calibration and each one's study totals."""
    n_reps = int(run.spec.stages.massc.replications)
    plans, folders, rtrs = [], [], []
    for r in reps:
        gen = pcal.replication_generator(run.spec, r)
        where = folder / "replications" / f"r{r:03d}"
        rchosen = (str(where / "select_psi"), str(where / "select_phi"))
        plans += [
            run.select_plan(done.plan.psi.rates, gen),
            run.select_plan(done.tr.phi.rates, gen),
        ]
        folders += list(rchosen)
        rtrs.append(pcal.Treated(run.donors, rchosen, treated.phi))
    what = f"massc replications {reps[0] + 1}-{reps[-1] + 1} of {n_reps}"
    run.selections(plans, folders, f"{what}: selections")
    cals = run.calibrations(wreq, rtrs, what)
    got = run.run_map(
        pcal.replication_totals, run.parts, run.m, wreq, rtrs, [c[0] for c in cals],
        [c[1] for c in cals], run.zvars, what=f"{what}: totals",
    )  # fmt: skip
    return [
        pcal.combine_replication_totals([g[k] for g in got], run.zvars, cals[k][0].n2)
        for k in range(len(rtrs))
    ]


def _say_massc_treatment(
    run: _MasscPasses,
    done: _Treatment,
    epsilon: float,
    cal: pcal.CalibrationFactors | None,
    cal_metrics: dict[str, float],
) -> None:
    """The progress lines of Step IV and of the treatment."""
    _say(
        f"calibrated to the controls and {len(cal.kept) if cal else 0} domain margin(s): "
        f"weight factors {cal_metrics['calibration_factor_min']:.3f} to "
        f"{cal_metrics['calibration_factor_max']:.3f}",
        "partitioned",
    )
    tr, n_rows = done.tr, run.n_rows
    _say(
        f"{tr.n_substituted} records substituted, {n_rows - tr.n_retained} sampled out; phi "
        + _by_stratum(run.m.labels, tr.phi.rates)
        + f"; delta {done.dm.delta:.4f} after {len(done.revisions)} revision(s); "
        f"epsilon {epsilon:.4f}",
        "partitioned",
    )


def _with_donor(search: part.DonorPlan) -> int:
    """The records whose search profile has a donor profile."""
    return int(search.size[search.donor_p >= 0].sum())


def _massc_counts(
    run: _MasscPasses,
    search: part.DonorPlan,
    sums: part.PlanSums,
    done: _Treatment,
    epsilon: float,
    cal_metrics: dict[str, float],
) -> dict[str, Any]:
    """The MASSC stage's counts, rates by stratum (psi, phi), params, delta and its gates."""
    labels, n_rows, n_has = run.m.labels, run.n_rows, _with_donor(search)
    psi, phi, tr = done.plan.psi, done.tr.phi, done.tr
    return {
        "n_with_donor": n_has,
        "n_no_donor": float(n_rows - n_has),
        "n_no_donor_domain": float(search.n_no_donor_domain),
        "share_substituted": tr.n_substituted / n_rows,
        "n_profiles": search.n_profiles,
        # MasscStage's params (those made on the driver here)
        "params": massc_params(run.spec, done.cfg, labels, psi, phi),
        "strata": {h: int(n) for h, n in zip(labels, sums.moments.N, strict=True)},
        "psi": {h: float(p) for h, p in zip(labels, psi.rates, strict=True)},
        "psi_method": psi.method,
        "phi": {h: float(p) for h, p in zip(labels, phi.rates, strict=True)},
        "phi_method": phi.method,
        "n_substituted": tr.n_substituted,
        "n_subsampled_out": n_rows - tr.n_retained,
        "delta": done.dm.delta,
        "gate_rows": [g.as_dict() for g in delta_gates(run.spec, done.dm.delta)],
        "epsilon_formula": epsilon,
        "epsilon": max(epsilon, cal_metrics.get("epsilon_empirical", epsilon)),
        "n_delta_revisions": len(done.revisions),
        "budget_scale": done.cfg.budget_scale,
    }


def _topcode_stage(
    spec: ReleaseSpec,
    columns: list[str],
    parts: list,
    run_map: Exchange,
    folder: Path,
    chain: Chain,
) -> dict[str, Any]:
    """Top-coding by partition (TopcodeStage's records and table, bit for bit): pass 1 sends
    each partition's groups with block sums and the thresholds' candidates (again with twice
    as many while a percentile's crossing lies beyond them; the values of a group whose
    crossing is too close to call); the driver sets the thresholds; pass 2 sends the coded
    records for the replacements; every worker writes its records."""
    treq = ptc.topcode_request(spec, columns)
    t = time.perf_counter()
    out = ptc.run_topcode(run_map, parts, spec, treq, str(folder / "data"))
    table, rounds, gathered = out["table"], out["rounds"], out["groups_gathered"]
    laps = {"seconds": time.perf_counter() - t}
    coded_n = {c: int(table.loc[table["column"] == c, "n_coded"].sum()) for c, _ in treq.rules}
    _say(
        "top-coded "
        + ", ".join(f"{c}: {n} records" for c, n in coded_n.items())
        + f" (thresholds from {rounds} round(s) of candidates"
        + (f", {gathered} group(s) gathered" if gathered else "")
        + ")",
        "partitioned",
    )
    return {
        **out["metrics"],
        "rounds": rounds,
        "groups_gathered": gathered,
        "params": out["params"],
        **laps,
        "tables": {"thresholds": table},
    }


def _pseudo_stage(
    spec: ReleaseSpec,
    columns: list[str],
    parts: list,
    run_map: Exchange,
    folder: Path,
    chain: Chain,
) -> dict[str, Any]:
    """The pseudo design by partition (PseudoDesignStage's records, bit for bit): when an
    earlier stage masked the design (the swap) it builds nothing and the records stay as they
    are; else pass 1 sends each partition's original PSUs, the driver deals them into pseudo
    strata and PSUs and builds the replicate factors with the stage's Generator, and every
    worker writes its records with their pseudo labels and replicate weights."""

    if chain.masked:
        return {
            "built": False,
            "unchanged": True,
            "note": "The design was masked by an earlier stage: no pseudo design built.",
            "tables": {},
        }
    t = time.perf_counter()
    units = pps.combine_units(run_map(pps.pseudo_units, parts, spec, what="pseudo design: PSUs"))
    plan, purity = pps.plan_of_units(spec, columns, units, _stage_rng(spec, "pseudo_design"))
    args = (spec, units, plan, str(folder / "data"))
    files = run_map(pps.pseudo_apply, parts, *args, what="pseudo design")
    out = pps.pseudo_result(plan, purity)
    _say(out["notes"][0], "partitioned")
    return {
        **out,
        "files": [Path(f).name for f in files],
        "seconds": time.perf_counter() - t,
        "masks_design": True,
        "tables": {},
    }


def _public_files(
    spec: ReleaseSpec,
    columns: list[str],
    parts: list,
    run_map: Exchange,
    folder: Path,
    chain: Chain,
    results: list | None = None,
) -> dict[str, Any]:
    """puf.parquet and puf.csv from the last stage's partitions, as the release writes them
    (its public columns and order): the design the public file is read with is the spec's or
    the pseudo design's, the columns the stages drop (the swap's segment) left out; with the
    stages' results (stage_results), README.md and codebook.csv as the release writes them."""

    design = chain.public_design(spec)
    built = design_columns(design, columns)
    linked = pas.link(chain.inputs, parts, _retained(chain, run_map, parts))
    rows = run_map(pas.input_rows, linked, chain.selected, what="public files: record map")
    return write_public_by_partition(
        run_map, parts, spec, columns, chain.masked, chain.drop_public, built, folder,
        results=results, design=design, labels=[c for c in (design.strata, design.psu) if c],
        input_rows=(np.concatenate(rows), chain.inputs[-1].stop),
    )  # fmt: skip


def stage_results(spec: ReleaseSpec, done: dict[str, Any], columns: list[str]) -> list:
    """The partitioned stages' results as StageResults (data None) with the params, metrics,
    tables, notes, masks_design and drop_public the public README and codebook read (the
    in-memory stages' for the same records); the assessment's params: the published and
    dropped columns (column_record on the input's columns). columns: the last stage's."""

    out: list[StageResult] = []
    for name, res in done.items():
        if not isinstance(res, dict) or name in MEASURED:
            continue
        metrics = {
            k: float(v)
            for k, v in res.items()
            if isinstance(v, int | float | np.number) and not isinstance(v, bool)
        }
        params = res.get("params") or ({"built": res["built"]} if "built" in res else {})
        out.append(
            StageResult(
                name,
                None,
                params=params,
                metrics=metrics,
                tables=dict(res.get("tables", {})),
                notes=list(res.get("notes") or ([res["note"]] if "note" in res else [])),
                masks_design=bool(res.get("masks_design")),
                drop_public=list(res.get("drop_public", [])),
            )
        )
    if "assess" in done:
        original = pd.DataFrame(columns=part.input_columns(spec.release.input))
        ctx = StageContext(original, spec, "assess", out)
        masked = any(r.masks_design for r in out)
        drop = [c for r in out for c in r.drop_public]
        released = spec.published_columns(
            columns, masked, drop, design_columns(public_design(spec, out), columns)
        )
        a = done["assess"]
        metrics = {
            k: float(v) for k, v in a.items() if isinstance(v, int | float) and k != "seconds"
        }
        out.append(
            StageResult("assess", None, params=column_record(spec, ctx, released), metrics=metrics)
        )
    return out


def _assess_stage(
    spec: ReleaseSpec,
    columns: list[str],
    parts: list,
    run_map: Exchange,
    folder: Path,
    chain: Chain,
) -> dict[str, Any]:
    """AssessStage's measures and gates by partition (sdl_design.partition_assess): the
    records after the last stage in their public columns and design (the spec's, or the
    pseudo design's) against the input's: the domain estimates (two passes over
    each file), the models (their cells), the re-identification, sample uniques, delta and
    PSU leak of the published records (each linked to its original record by MASSC's d(2)),
    the pMSE (its propensity model fitted by partition) and AssessStage's gates on them."""

    design = chain.public_design(spec)
    released = spec.published_columns(
        columns, chain.masked, chain.drop_public, design_columns(design, columns)
    )
    original = part.input_columns(spec.release.input)
    req = pas.assess_request(
        spec, original, released, design_released=chain.design, masked_design=chain.masked
    )
    t = time.perf_counter()
    files = ((chain.inputs, "original"), (parts, "released"))
    first = [
        run_map(pas.assess_pass1, p, spec, req, f, what=f"assess pass 1, {name}")
        for f, (p, name) in enumerate(files)
    ]
    plan = pas.assess_plan(first, req)
    second = [
        run_map(pas.assess_pass2, p, spec, req, f, plan, what=f"assess pass 2, {name}")
        for f, (p, name) in enumerate(files)
    ]
    out = pas.assess_combine(plan, second)
    m = out.metrics
    attacks = _assess_risk(m, spec, req, plan, chain, run_map, parts, (design, released, original))
    # the models (utility.models): each fitted on both files' cells
    got = [
        run_map(pas.model_pass, p, spec, req, f, plan, what=f"assess models, {name}")
        for f, (p, name) in enumerate(files)
    ]
    coefs, model_m = pas.model_fits(plan, got)
    m |= model_m
    # pMSE: the propensity model of membership in the published file, fitted by partition
    m |= pas.pmse_by_partition(run_map, (chain.inputs, parts), spec, req, plan)
    # AssessStage's gates on these metrics, checked as the release checks them (its metric
    # gate suite)
    gates = pas.assess_gates(spec, out.domain_estimates, coefs, m)
    verdicts = validate_metric_gates([g.as_dict() for g in gates])
    m["gates_passed"] = float(verdicts["passed"].sum())
    m["gates"] = float(len(verdicts))
    _say_assessment(m, verdicts)
    return {
        **m,
        "seconds": time.perf_counter() - t,
        "unchanged": True,  # it measures; the records stay as they are
        "tables": {
            "domain_estimates": out.domain_estimates,
            "model_coefficients": coefs,
            "attacks": attacks.table,
            "gates": verdicts,
        },
        "gate_rows": [g.as_dict() for g in gates],
    }


def _assess_risk(
    m: dict[str, float],
    spec: ReleaseSpec,
    req: pas.AssessRequest,
    plan: pas.AssessPlan,
    chain: Chain,
    run_map: Exchange,
    parts: list,
    files: tuple[Any, list[str], list[str]],
) -> Any:
    """The risk of the published records, each linked to its original record (the retained
    ones in record order): re-identification and sample uniques, the attacks, and MASSC's
    delta of the published file against the original keys (any release); their metrics
    added to m. files: the public design, the released and the original columns. The
    attacks (their metrics and table)."""
    design, released, original = files
    retained = _retained(chain, run_map, parts)
    linked = pas.link(chain.inputs, parts, retained)
    risk = run_map(pas.risk_pass, linked, spec, req, plan, chain.selected, what="assess risk")
    originals = run_map(
        pas.original_profiles, chain.inputs, spec, req, plan, what="assess risk, original"
    )
    m |= pas.risk_metrics(risk, originals, int(m["n_released"]))
    attacks = _attacks(spec, design, released, original, chain, run_map, linked)
    m |= attacks
    sensitive = spec.variables.sensitive
    published = combine_profiles([r.profiles for r in risk])
    profiles = chain.scan["profiles"]
    deltas = run_map(
        pas.delta_pass,
        pas.link_back(chain.inputs, parts, retained),
        spec, req, plan, chain.selected, profiles,
        profile_scores(profiles, sensitive) if sensitive else np.zeros(0),
        published,
        profile_scores(published, sensitive) if sensitive else np.zeros(0),
        what="assess delta",
    )  # fmt: skip
    m |= pas.delta_metrics(deltas, profiles)
    return attacks


def _say_assessment(m: dict[str, float], verdicts: pd.DataFrame) -> None:
    """The assessment's progress lines: its gates, then its measures."""
    failed = verdicts.loc[~verdicts["passed"].astype(bool), "name"].tolist()
    _say(
        f"assessment gates: {int(m['gates_passed'])} of {len(verdicts)} pass"
        + (f"; failed: {'; '.join(failed)}" if failed else ""),
        "partitioned",
    )
    _say(
        f"assessed {int(m['n_estimates'])} domain estimates ({int(m['n_reliable'])} reliable): "
        f"median CI overlap {m.get('overlap_median', float('nan')):.3f}, "
        f"{m['share_abs_std_bias_gt2']:.1%} more than 2 SEs off, SE ratio median "
        f"{m.get('se_ratio_median', float('nan')):.3f}; epsilon {m['epsilon_published']:.4f}; "
        f"{m.get('reid_share_worst', m['reid_share']):.2%} of the original sample uniques "
        "re-identified (worst attack), "
        f"{m['unique_share_published']:.2%} sample uniques published; smallest CI overlap of a "
        f"model coefficient {m.get('model_overlap_min', float('nan')):.3f}; "
        f"{m.get('psu_recoverable', 0.0):.1%} of the original PSUs recoverable from the "
        f"replicate weights; delta {m['delta_published']:.4f}; pMSE ratio "
        f"{m['pmse_ratio']:.3f}",
        "partitioned",
    )


def _attacks(
    spec: ReleaseSpec,
    design: Any,
    released: list[str],
    original: list[str],
    chain: Chain,
    run_map: Exchange,
    linked: list,
) -> Any:
    """AssessStage's attacks on the published file (assess.published_attacks) on the columns
    they read, gathered from the partitions with each published record's original record."""

    rel_cols, orig_cols = pas.attack_columns(spec, released, original)
    got = run_map(pas.attack_released, linked, spec, rel_cols, chain.selected, what="attacks")
    rel = pd.concat([g[0] for g in got], ignore_index=True)
    rel.index = pd.Index(np.concatenate([g[1] for g in got]))
    orig = pd.concat(
        run_map(pas.attack_original, chain.inputs, spec, orig_cols, what="attacks, original"),
        ignore_index=True,
    )
    return published_attacks(orig, rel, spec, design, chain.masked)[0]


def _retained(chain: Chain, run_map: Exchange, parts: list) -> list[int]:
    """Each original partition's records in the published file (MASSC's d(2), else all)."""

    if chain.selected:
        return run_map(pas.retained_in, chain.inputs, chain.selected, what="retained records")
    return [p.stop - p.start for p in chain.inputs]


def _final_stage(
    spec: ReleaseSpec,
    columns: list[str],
    parts: list,
    run_map: Exchange,
    folder: Path,
    chain: Chain,
) -> dict[str, Any]:
    """FinalStage's SE table and measures by partition (sdl_design.partition_final): the
    broad characteristics of each file decided over its partitions, their means with Taylor
    and replicate SEs (the original in its design, the records so far in the public one), the
    table as se_ratio_table makes it; the sample uniques before and after (profile counts) and
    the records with a key changed (each linked to its original record)."""

    t = time.perf_counter()
    original = part.input_columns(spec.release.input)
    req = pf.final_request(spec, original, columns, chain.public_design(spec))
    tables = []
    for f, (p, name) in enumerate(((chain.inputs, "original"), (parts, "released"))):
        plan = pf.final_plan(
            run_map(pf.final_pass1, p, spec, req, f, what=f"final, {name}"), req, f
        )
        first = run_map(pf.final_means1, p, spec, plan, what=f"final SEs, {name}, pass 1")
        agg = part.combine_pass1(first)
        levels, R = agg.levels, part.ratios(agg)
        second = run_map(
            pf.final_means2, p, spec, plan, levels, R, what=f"final SEs, {name}, pass 2"
        )
        tables.append(pf.se_table(plan, first, second))
    out = se_ratio_merge(*tables)
    after = combine_profiles(run_map(pf.key_profiles, parts, spec, what="final: key profiles"))
    linked = pas.link(chain.inputs, parts, _retained(chain, run_map, parts))
    changed = run_map(pf.keys_changed, linked, spec, chain.selected, what="final: keys changed")
    n = sum(c[0] for c in changed)
    metrics, notes = final_measures(
        out,
        pf.unique_share(chain.scan["profiles"]),
        pf.unique_share(after),
        sum(c[1] for c in changed) / n if n else 0.0,
        n / chain.inputs[-1].stop,
    )
    _say(notes[0], "partitioned")
    return {
        **metrics,
        "notes": notes,
        "seconds": time.perf_counter() - t,
        "unchanged": True,
        "tables": final_tables(out),
        "report_tables": ["se_ratio_summary", "se_ratios"],  # as FinalStage's result
        "se_ratio_table": "se_ratios",
    }


# the public files of a partitioned run whose gates failed (puf/ is never left looking ready)
REFUSED = "puf-gates-failed"

# the release stages that have a partitioned path (sdl_design.partition's map and reduce);
# a stage's function returns None where its partitioned path does not cover the spec
PARTITIONED = {
    "swap": _swap_stage,
    "prb": _prb_stage,
    "massc": _massc_stage,
    "topcode": _topcode_stage,
    "pseudo_design": _pseudo_stage,
}
# measuring stages whose measures the scan makes by partition (scan/risk.csv)
MEASURED_BY_SCAN = ("risk",)
# measuring stages with a partitioned path (their measures of the records so far)
MEASURED = {"final": _final_stage, "assess": _assess_stage}
# what a stage's partitioned path refuses in a spec, checked before anything runs
# (PartitionError naming the field): (spec, input columns) -> None
PARTITIONED_CHECKS = {"massc": pcal.check_massc, "topcode": ptc.topcode_request}


def run_partitioned(
    spec_path: str | Path,
    runner: str = "thread",
    dask_address: str | None = None,
    partitions: int | None = None,
    out: str | Path | None = None,
    workers: int = 2,
    release: bool = True,
) -> dict[str, Any]:
    """The spec's release stages that have a partitioned path, in release order, each on the
    previous one's partitions (the swap, PRB, MASSC and top-coding); stops before the first
    stage that has none, and says which. When every stage ran (and release), the assessment,
    the public files (puf/: the data files, README.md and codebook.csv) and the release's
    gates (gates.csv); release False: the
    stages' records and tables only. First it scans the input as `puf scan` does (scan/: its edit rules,
    which stop the run when one fails, the risk stage's metrics, its SEs). out (default
    partitioned_folder) gets, per stage, <stage>/data/part-<first record>.parquet (the records
    after that stage, in record order: the same records, bit for bit, as the in-memory stages
    give) and its tables (the swap's pairs.csv is confidential), among them se_ratios.csv: the
    SE of every study variable's mean overall and in every utility domain on the records after
    the stage, against the input's (Taylor and replicate); run.json says what ran, its counts
    and metrics and where it stopped. Workers on other machines need out on a disk they share."""

    spec, columns, parts = _partitioned_input(spec_path, runner, partitions, "partitioned")
    folder = Path(out) if out else partitioned_folder(spec)
    stages = [s for s in (c.from_spec(spec) for c in RELEASE_STAGES) if s is not None]
    for stage in stages:  # a spec the chain would refuse later is refused now, in full
        check = PARTITIONED_CHECKS.get(stage.name)
        if check is not None:
            _spec_errors(check, spec, columns)
    t0 = time.perf_counter()
    fill = _PartitionedRun(
        spec, columns, parts, stages, folder, release, runner, dask_address, workers
    )
    stages_done, scan, scan_seconds, public, peaks = _replace(folder, fill)
    return {
        "records": parts[-1].stop,
        "partitions": len(parts),
        "seconds": time.perf_counter() - t0,
        "folder": str(folder),
        "scan": scan,
        "scan_seconds": scan_seconds,
        "stages": stages_done,
        "public_files": public,
        "driver_peak_gib": peaks,
    }


def _spec_errors(fn: Callable, *args: Any) -> Any:
    """fn(*args), a PartitionError raised as the SpecError naming the field to fix."""
    try:
        return fn(*args)
    except part.PartitionError as e:
        raise SpecError([str(e)]) from e


class _PartitionedRun:
    """run_partitioned's fill of the temporary folder _replace renames: the scan of the
    input, then the release stages by partition, each on the previous one's records (the
    measuring ones on the records so far), then the public files and the release's gates;
    the progress lines and run.json. What the stages did, the records so far (their
    partitions and columns) and the driver's peak resident set by step are kept as it goes."""

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
        self.folder, self.release = folder, release
        # _mapper's: in this process, or on Dask (at dask_address, else a local cluster)
        self.runner, self.dask_address, self.workers = runner, dask_address, workers
        self.done: dict[str, Any] = {}
        self.cols, self.now = columns, parts  # the records so far
        # the driver's peak resident set by step (only small aggregates should reach it)
        self.peaks: dict[str, float | None] = {}
        self.resets = False
        self.scan: dict[str, pd.DataFrame] = {}
        self.chain: Chain

    def __call__(self, tmp: Path) -> tuple:
        """Fill tmp: (the stages' results, the scan's tables, its seconds, the public files'
        summary or None, the driver's peaks)."""
        self.resets = peak_reset()
        with _mapper(self.runner, self.dask_address, self.workers, "partitioned") as run_map:
            scan_seconds = self._scan_input(run_map, tmp)
            for stage in self.stages:
                if not self._stage(stage, run_map, tmp):
                    break
            public = None
            if "stopped_before" not in self.done and self.release:
                public = self._release(run_map, tmp)
        self._say_outcome(public)
        self._write_summary(tmp, scan_seconds, public)
        return self.done, self.scan, scan_seconds, public, self.peaks

    def peak(self, step: str) -> None:
        """The driver's peak resident set during step."""
        self.peaks[step] = peak_gib() if self.resets else None
        # what the step freed goes back to the system before the next one (at 5M records
        # the driver stayed at 2.4 GiB after MASSC without it); no gc.collect(): 0.3-0.5 s
        # a step in a process holding many objects, and the frames are freed by refcount
        return_freed_memory()
        peak_reset()

    def _scan_input(self, run_map: Exchange, tmp: Path) -> float:
        """The input first, as the release flow: its edit rules (a failing one stops the
        run), the risk stage's metrics, and the SEs every stage's damage is measured by,
        written to scan/. Its seconds."""
        t_scan = time.perf_counter()
        scan, scan_info = _scan(self.spec, self.cols, self.parts, run_map, self.runner)
        scan_seconds = time.perf_counter() - t_scan
        (tmp / "scan").mkdir()
        _write_tables(tmp / "scan", scan)
        self.scan, self.chain = scan, Chain(self.parts, scan, scan_info["psus"])
        self.peak("scan")
        if not scan["edits"]["passed"].all():
            raise GateFailed("edit validation failed on the input file", scan["edits"])
        return scan_seconds

    def _stage(self, stage: Any, run_map: Exchange, tmp: Path) -> bool:
        """One release stage: a measuring one on the records so far (release only), one that
        only measures skipped (the scan's, else listed as not measured), one that changes
        the records by its partitioned path. False where it has none: the run stops."""
        fn = PARTITIONED.get(stage.name)
        if fn is None and stage.name in MEASURED:
            if self.release:
                self._measure(stage.name, run_map, tmp)
            return True
        if fn is None and reads_only(stage):
            if stage.name not in MEASURED_BY_SCAN:
                self.done.setdefault("not_measured", []).append(stage.name)
            return True  # it only measures the records
        res = None
        if fn is not None:
            (tmp / stage.name / "data").mkdir(parents=True)
            res = _spec_errors(
                fn, self.spec, self.cols, self.now, run_map, tmp / stage.name, self.chain
            )
        if res is None:  # no partitioned path (for this spec)
            self._stop_before(stage.name, tmp)
            return False
        self._changed(stage.name, res, run_map, tmp)
        return True

    def _measure(self, name: str, run_map: Exchange, tmp: Path) -> None:
        """A measuring stage (MEASURED) on the records so far: its results and tables."""
        (tmp / name).mkdir()
        res = _spec_errors(
            MEASURED[name], self.spec, self.cols, self.now, run_map, tmp / name, self.chain
        )
        for table_name, table in res["tables"].items():
            _stage_table(tmp / name, table_name, table)
        self._finish(name, res)

    def _stop_before(self, name: str, tmp: Path) -> None:
        """The run stops before a stage that has no partitioned path (for this spec)."""
        shutil.rmtree(tmp / name, ignore_errors=True)
        self.done["stopped_before"] = name
        _say(
            f"stopped before {name}: it has no partitioned path yet (the "
            f"records after {', '.join(k for k in self.done if k in PARTITIONED) or 'none'}"
            f" are in {self.folder})",
            "partitioned",
        )

    def _changed(self, name: str, res: dict[str, Any], run_map: Exchange, tmp: Path) -> None:
        """After a stage that ran by partition: what the chain reads of its result (the
        design masked or built, the columns never published); its records become the records
        so far (unless unchanged), with the damage so far: the SEs of the records after it
        against the input's (se_ratios); its tables."""
        spec, chain = self.spec, self.chain
        chain.masked = chain.masked or bool(res.get("masks_design"))
        chain.drop_public += res.get("drop_public", [])
        if res.get("public_design"):  # a stage built the public file's design
            chain.design = built_design(spec, res["public_design"])
        if res.get("unchanged"):  # the records stay as the previous stage left them
            shutil.rmtree(tmp / name)
            self._finish(name, res)
            return
        self.now = part.plan_partitions(tmp / name / "data")
        self.cols = part.input_columns(tmp / name / "data")
        t = time.perf_counter()
        after = part.means_request(spec, self.cols, chain.public_design(spec))
        res["tables"]["se_ratios"] = part.se_ratio_rows(
            self.scan["se"], _domain_means(run_map, self.now, spec, after, name)
        )
        res["se_seconds"] = time.perf_counter() - t
        for table_name, table in res["tables"].items():
            _stage_table(tmp / name, table_name, table)
        self._finish(name, res)

    def _finish(self, name: str, res: dict[str, Any]) -> None:
        """A stage done: its result kept, the driver's peak during it."""
        self.done[name] = res
        self.peak(name)

    def _release(self, run_map: Exchange, tmp: Path) -> dict[str, Any]:
        """The public files (puf/) of the records so far, then the release's gates as the
        flow checks them: the stages' and the assessment's metric gates, then the public
        file's (gates.csv); puf/ becomes REFUSED when one fails. Their summary."""
        t = time.perf_counter()
        results = stage_results(self.spec, self.done, self.cols)
        public = _public_files(
            self.spec, self.cols, self.now, run_map, tmp / "puf", self.chain, results
        )
        public["seconds"] = time.perf_counter() - t
        rows = [
            g for r in self.done.values() if isinstance(r, dict) for g in r.get("gate_rows", [])
        ]
        gates = pd.concat([validate_metric_gates(rows), public.pop("gates")], ignore_index=True)
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
            _say(
                f"{len(public['gates_failed'])} of {public['gates']} gates failed "
                f"({'; '.join(public['gates_failed'])}): the files stay in {folder / REFUSED}, "
                "not to be published",
                "partitioned",
            )
        elif public is not None:
            left = self.done.get("not_measured", [])
            _say(
                "every stage that changes the records ran by partition; the public data files "
                f"are in {folder / 'puf'} ({public['records']} records, {public['columns']} "
                f"columns; {public['seconds']:.1f} s); gates: {public['gates_passed']} of "
                f"{public['gates']} pass (gates.csv); not published: "
                + (f"the measures of {', '.join(left)}, " if left else "")
                + "the approval (README.md and codebook.csv are in puf/)",
                "partitioned",
            )

    def _write_summary(self, tmp: Path, scan_seconds: float, public: dict | None) -> None:
        """run.json: what ran, its counts and metrics (not its tables) and where it stopped."""
        summary = {
            "records": self.parts[-1].stop,
            "partitions": len(self.parts),
            "runner": self.runner,
            "edit_rules_passed": int(self.scan["edits"]["passed"].sum()),
            "scan_seconds": scan_seconds,
            "driver_peak_gib": self.peaks,
            "public_files": public,
            "stages": {
                k: {m: v for m, v in r.items() if m != "tables"} if isinstance(r, dict) else r
                for k, r in self.done.items()
            },
        }
        (tmp / "run.json").write_text(json.dumps(summary, indent=1, default=float) + "\n")
