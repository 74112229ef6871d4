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
from typing import Any

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
from sdl_design.massc.treatment import cost_from, revise_rates
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
    tables = run_map(part.donor_pass1, parts, spec, req, what="massc donors pass 1")
    t = _lap(laps, "pass1", t)
    rng = _stage_rng(spec, "massc")
    plan = part.donor_plan(tables, req, rng)
    t = _lap(laps, "search", t)
    n_has = int(plan.size[plan.donor_p >= 0].sum())
    _say(f"{n_has} records have a donor ({plan.n_profiles} search profiles)", "partitioned")
    donors = _confidential(folder, "donors")
    donors.mkdir(parents=True)
    receive = partial(part.donor_receive, folder=str(donors))
    files = run_map.exchange(
        part.donor_send, part.donor_serve, receive, parts, spec, req, plan, what="massc donors"
    )
    t = _lap(laps, "exchange", t)
    profiles = chain.scan["profiles"]
    labels = part.massc_strata_labels(profiles, req)
    zvars = part.massc_study_variables(profiles, req)
    scores = part.profile_scores(profiles, req.sensitive) if req.sensitive else np.zeros(0)
    m = part.MasscInputs(spec, req, chain.inputs, profiles, labels)
    partials = run_map(
        part.moments_pass, parts, m, chain.psus, zvars, scores, str(donors),
        what="massc moments",
    )  # fmt: skip
    sums = part.combine_moments(partials, zvars, labels, chain.psus, parts[-1].stop)
    t = _lap(laps, "moments", t)
    psi, cost = part.massc_psi(spec, columns, sums)
    mom = sums.moments
    t = _lap(laps, "psi", t)
    _say(
        "substitution rates psi "
        + ", ".join(f"{h} {p:.4g}" for h, p in zip(labels, psi.rates, strict=True)),
        "partitioned",
    )
    # Steps II-III: substitution at psi (select), phi from the moments of z*, subsampling;
    # while delta is above gates.delta_max, meet_delta's revisions (revise_rates)
    cfg = massc_config(spec, pd.DataFrame(columns=list(columns)))
    n_rows, n_parts = parts[-1].stop, len(parts)
    groups = part.select_groups(run_map(part.select_pass1, parts, m, what="groups"))
    donors = str(_confidential(folder, "donors"))
    chosen = (str(folder / "select_psi"), str(folder / "select_phi"))
    chain.selected = chosen[1]

    def selections(plans: list, folders: list[str], what: str) -> list[int]:
        """Several selections in one exchange: the records each keeps."""
        for where in folders:
            Path(where).mkdir(parents=True, exist_ok=True)
        sels = part.Selections(plans, folders)
        got = run_map.exchange(
            part.select_send, part.select_serve, part.select_receive, parts, m, sels, what=what
        )
        return [sum(c[r] for c in got) for r in range(len(plans))]

    def select(rates, where: str) -> int:
        sel_plan = part.select_plan(groups, rates, rng, n_rows, n_parts)
        return selections([sel_plan], [where], f"massc selection ({Path(where).name})")[0]

    def treat(p: part.RatesPlan, c) -> part.PartitionedTreatment:
        select(p.psi.rates, chosen[0])
        treated = run_map(
            part.treated_pass, parts, m, zvars, donors, chosen[0], what="massc moments of z*"
        )
        phi, mom_t, n_sub = part.massc_phi(c, treated, zvars, p.moments, p.cost, n_rows)
        return part.PartitionedTreatment(phi, n_sub, select(phi.rates, chosen[1]), mom_t)

    def measure(tr: part.PartitionedTreatment) -> part.PartitionedDelta:
        b2 = part.combine_profiles(
            run_map(part.delta_pass1, parts, spec, req, donors, chosen, what="massc B(2) profiles")
        )
        s2 = part.profile_scores(b2, req.sensitive) if req.sensitive else np.zeros(0)
        got = run_map(
            part.delta_pass2, parts, m, scores, b2, s2, cfg.risk_basis, donors, chosen,
            what="massc delta",
        )  # fmt: skip
        return part.combine_delta(got, n_rows)

    rplan = part.RatesPlan(mom, psi, cost)
    tr = treat(rplan, cfg)
    dm = measure(tr)
    revisions = []
    if spec.gates.delta_max is not None:
        cfg, rplan, tr, dm, revisions = revise_rates(
            rplan, tr, cfg, dm, spec.gates.delta_max, treat, measure,
            lambda c: cost_from(sums.cost_sums, mom.N, c)[0],
        )  # fmt: skip
    psi, phi = rplan.psi, tr.phi
    n_sub, n_kept = tr.n_substituted, tr.n_retained
    il, epsilon = part.massc_loss(tr, rplan, sums)
    t = _lap(laps, "treatment", t)
    # Step IV: the retained records' weight and replicate weights calibrated to the
    # original's totals (calibrate_treated's, bit for bit), written to data/
    creq = pcal.calibration_request(spec, columns)
    treated = pcal.Treated(donors, chosen, np.asarray(phi.rates, dtype=float))

    def calibrations(creq: pcal.CalibrationRequest, trs: list, what: str) -> list[tuple]:
        """Step IV of several treatments in the same passes: (plan, factors) of each."""
        got = run_map(pcal.retained_count, parts, trs, what=f"{what}: retained records")
        offsets = [pcal.retained_offsets(parts, [c[r] for c in got]) for r in range(len(trs))]
        first = run_map(
            pcal.calibration_pass1, parts, m, creq, trs, offsets, what=f"{what}: pass 1"
        )
        plans = [
            pcal.calibration_plan([f[r] for f in first], creq, n_rows, offsets[r])
            for r in range(len(trs))
        ]
        todo = [r for r, p in enumerate(plans) if creq.controls or p.margins]
        if not todo:
            return [(p, None) for p in plans]
        second = run_map(
            pcal.calibration_pass2, parts, m, creq, [trs[r] for r in todo],
            [plans[r] for r in todo], [list(plans[r].margins) for r in todo],
            what=f"{what}: pass 2",
        )  # fmt: skip
        out = [(p, None) for p in plans]
        for k, r in enumerate(todo):

            def again(kept: list[str], r: int = r) -> list:  # after a domain is dropped
                got = run_map(
                    pcal.calibration_pass2, parts, m, creq, [trs[r]], [plans[r]], [kept],
                    what=f"{what}: pass 2 again",
                )  # fmt: skip
                return [g[0] for g in got]

            first_sums = [s[k] for s in second]
            cal = pcal.calibrate_by_partition(plans[r], creq, again, n_rows, first_sums)
            out[r] = (plans[r], cal)
        return out

    ((cplan, cal),) = calibrations(creq, [treated], "massc calibration")
    applied = run_map(
        pcal.calibration_apply, parts, m, creq, treated, cplan, cal, str(folder / "data"),
        what="massc calibration",
    )  # fmt: skip
    cal_tables, cal_metrics = pcal.calibration_summary(cplan, creq, cal, applied)
    t = _lap(laps, "calibration", t)
    # the replications of the whole treatment (massc_replications), a batch in the same
    # passes: each draws its two selections from its own Generator (one exchange for the
    # batch) and calibrates the weight only, to the controls and the declared domains the
    # release's weight alone keeps; epsilon from their study totals
    n_reps = int(spec.stages.massc.replications)
    if n_reps:
        wreq = pcal.weight_only(creq)
        if wreq.domains:
            ((wplan, wcal),) = calibrations(wreq, [treated], "massc replications' domains")
            wreq = pcal.replication_request(wreq, wplan.table if wcal is None else wcal.table)
        estimates = []
        batch = pcal.REPLICATIONS_AT_ONCE  # the memory of their exchanges and block sums
        for lo in range(0, n_reps, batch):
            reps = range(lo, min(lo + batch, n_reps))
            plans, folders, rtrs = [], [], []
            for r in reps:
                gen = pcal.replication_generator(spec, r)
                where = folder / "replications" / f"r{r:03d}"
                rchosen = (str(where / "select_psi"), str(where / "select_phi"))
                plans += [
                    part.select_plan(groups, psi.rates, gen, n_rows, n_parts),
                    part.select_plan(groups, phi.rates, gen, n_rows, n_parts),
                ]
                folders += list(rchosen)
                rtrs.append(pcal.Treated(donors, rchosen, treated.phi))
            what = f"massc replications {reps[0] + 1}-{reps[-1] + 1} of {n_reps}"
            selections(plans, folders, f"{what}: selections")
            done = calibrations(wreq, rtrs, what)
            got = run_map(
                pcal.replication_totals, parts, m, wreq, rtrs, [d[0] for d in done],
                [d[1] for d in done], zvars, what=f"{what}: totals",
            )  # fmt: skip
            estimates += [
                pcal.combine_replication_totals([g[k] for g in got], zvars, done[k][0].n2)
                for k in range(len(rtrs))
            ]
            del got, done
        shutil.rmtree(folder / "replications")  # their selections: original-to-masked maps
        eps_rep, rep_table = pcal.replication_epsilon(estimates, sums.truth, zvars)
        cal_tables["epsilon_replications"] = rep_table
        cal_metrics["epsilon_empirical"] = eps_rep
        cal_metrics["n_replications"] = float(n_reps)
    _lap(laps, "replications", t)
    _say(
        f"calibrated to the controls and {len(cal.kept) if cal else 0} domain margin(s): "
        f"weight factors {cal_metrics['calibration_factor_min']:.3f} to "
        f"{cal_metrics['calibration_factor_max']:.3f}",
        "partitioned",
    )
    _say(
        f"{n_sub} records substituted, {n_rows - n_kept} sampled out; phi "
        + ", ".join(f"{h} {p:.4g}" for h, p in zip(labels, phi.rates, strict=True))
        + f"; delta {dm.delta:.4f} after {len(revisions)} revision(s); epsilon {epsilon:.4f}",
        "partitioned",
    )

    return {
        "n_with_donor": n_has,
        "n_no_donor": float(n_rows - n_has),
        "n_no_donor_domain": float(plan.n_no_donor_domain),
        "share_substituted": n_sub / n_rows,
        "n_profiles": plan.n_profiles,
        # MasscStage's params (those made on the driver here)
        "params": massc_params(spec, cfg, labels, psi, phi),
        "strata": {h: int(n) for h, n in zip(labels, mom.N, strict=True)},
        "psi": {h: float(p) for h, p in zip(labels, psi.rates, strict=True)},
        "psi_method": psi.method,
        "phi": {h: float(p) for h, p in zip(labels, phi.rates, strict=True)},
        "phi_method": phi.method,
        "n_substituted": n_sub,
        "n_subsampled_out": n_rows - n_kept,
        "delta": dm.delta,
        "gate_rows": [g.as_dict() for g in delta_gates(spec, dm.delta)],
        "epsilon_formula": epsilon,
        "epsilon": max(epsilon, cal_metrics.get("epsilon_empirical", epsilon)),
        "n_delta_revisions": len(revisions),
        "budget_scale": cfg.budget_scale,
        "files": [Path(f).name for f in files],
        **laps,
        **cal_metrics,
        "tables": {**part.massc_tables(plan, sums, rplan, tr, dm, il), **cal_tables},
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
    first = [
        run_map(pas.assess_pass1, p, spec, req, f, what=f"assess pass 1, {name}")
        for f, (p, name) in enumerate(((chain.inputs, "original"), (parts, "released")))
    ]
    plan = pas.assess_plan(first, req)
    second = [
        run_map(pas.assess_pass2, p, spec, req, f, plan, what=f"assess pass 2, {name}")
        for f, (p, name) in enumerate(((chain.inputs, "original"), (parts, "released")))
    ]
    out = pas.assess_combine(plan, second)
    m = out.metrics
    # the risk of the published records: each one linked to its original record (the
    # retained ones in record order)
    retained = _retained(chain, run_map, parts)
    linked = pas.link(chain.inputs, parts, retained)
    risk = run_map(pas.risk_pass, linked, spec, req, plan, chain.selected, what="assess risk")
    originals = run_map(
        pas.original_profiles, chain.inputs, spec, req, plan, what="assess risk, original"
    )
    m |= pas.risk_metrics(risk, originals, int(m["n_released"]))
    attacks = _attacks(spec, design, released, original, chain, run_map, linked)
    m |= attacks
    # MASSC's delta of the published file against the original keys (any release)

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
    # the models (utility.models): each fitted on both files' cells
    got = [
        run_map(pas.model_pass, p, spec, req, f, plan, what=f"assess models, {name}")
        for f, (p, name) in enumerate(((chain.inputs, "original"), (parts, "released")))
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
        try:
            if check is not None:
                check(spec, columns)
        except part.PartitionError as e:
            raise SpecError([str(e)]) from e
    t0 = time.perf_counter()

    def fill(tmp: Path) -> dict[str, Any]:
        done: dict[str, Any] = {}
        cols, now = columns, parts
        # the driver's peak resident set by step (only small aggregates should reach it)
        peaks: dict[str, float | None] = {}
        resets = peak_reset()

        def peak(step: str) -> None:
            peaks[step] = peak_gib() if resets else None
            # what the step freed goes back to the system before the next one (at 5M records
            # the driver stayed at 2.4 GiB after MASSC without it); no gc.collect(): 0.3-0.5 s
            # a step in a process holding many objects, and the frames are freed by refcount
            return_freed_memory()
            peak_reset()

        with _mapper(runner, dask_address, workers, "partitioned") as run_map:
            # the input first, as the release flow: its edit rules (a failing one stops the
            # run), the risk stage's metrics, and the SEs every stage's damage is measured by
            t_scan = time.perf_counter()
            scan, scan_info = _scan(spec, columns, parts, run_map, runner)
            scan_seconds = time.perf_counter() - t_scan
            (tmp / "scan").mkdir()
            _write_tables(tmp / "scan", scan)
            chain = Chain(parts, scan, scan_info["psus"])
            peak("scan")
            if not scan["edits"]["passed"].all():
                raise GateFailed("edit validation failed on the input file", scan["edits"])
            for stage in stages:
                fn = PARTITIONED.get(stage.name)
                if fn is None and stage.name in MEASURED and not release:
                    continue
                if fn is None and stage.name in MEASURED:
                    (tmp / stage.name).mkdir()
                    try:
                        res = MEASURED[stage.name](
                            spec, cols, now, run_map, tmp / stage.name, chain
                        )
                    except part.PartitionError as e:
                        raise SpecError([str(e)]) from e
                    for name, table in res["tables"].items():
                        _stage_table(tmp / stage.name, name, table)
                    done[stage.name] = res
                    peak(stage.name)
                    continue
                if fn is None and reads_only(stage):
                    if stage.name not in MEASURED_BY_SCAN:
                        done.setdefault("not_measured", []).append(stage.name)
                    continue  # it only measures the records
                res = None
                if fn is not None:
                    (tmp / stage.name / "data").mkdir(parents=True)
                    try:
                        res = fn(spec, cols, now, run_map, tmp / stage.name, chain)
                    except part.PartitionError as e:
                        raise SpecError([str(e)]) from e
                if res is None:  # no partitioned path (for this spec)
                    shutil.rmtree(tmp / stage.name, ignore_errors=True)
                    done["stopped_before"] = stage.name
                    _say(
                        f"stopped before {stage.name}: it has no partitioned path yet (the "
                        f"records after {', '.join(k for k in done if k in PARTITIONED) or 'none'}"
                        f" are in {folder})",
                        "partitioned",
                    )
                    break
                chain.masked = chain.masked or bool(res.get("masks_design"))
                chain.drop_public += res.get("drop_public", [])
                if res.get("public_design"):  # a stage built the public file's design
                    chain.design = built_design(spec, res["public_design"])
                if res.get("unchanged"):  # the records stay as the previous stage left them
                    shutil.rmtree(tmp / stage.name)
                    done[stage.name] = res
                    peak(stage.name)
                    continue
                now = part.plan_partitions(tmp / stage.name / "data")
                cols = part.input_columns(tmp / stage.name / "data")
                # the damage so far: the records after this stage against the input's
                t = time.perf_counter()
                after = part.means_request(spec, cols, chain.public_design(spec))
                res["tables"]["se_ratios"] = part.se_ratio_rows(
                    scan["se"], _domain_means(run_map, now, spec, after, stage.name)
                )
                res["se_seconds"] = time.perf_counter() - t
                for name, table in res["tables"].items():
                    _stage_table(tmp / stage.name, name, table)
                done[stage.name] = res
                peak(stage.name)
            public = None
            if "stopped_before" not in done and release:
                t = time.perf_counter()
                results = stage_results(spec, done, cols)
                public = _public_files(spec, cols, now, run_map, tmp / "puf", chain, results)
                public["seconds"] = time.perf_counter() - t
                # the release's gates as the flow checks them: the stages' and the
                # assessment's metric gates, then the public file's

                rows = [
                    g for r in done.values() if isinstance(r, dict) for g in r.get("gate_rows", [])
                ]
                gates = pd.concat(
                    [validate_metric_gates(rows), public.pop("gates")], ignore_index=True
                )
                gates.to_csv(tmp / "gates.csv", index=False)
                public["gates_passed"] = int(gates["passed"].sum())
                public["gates"] = len(gates)
                public["gates_failed"] = gates.loc[~gates["passed"].astype(bool), "name"].tolist()
                if public["gates_failed"]:  # nothing that looks publishable is left behind
                    (tmp / "puf").rename(tmp / REFUSED)
                peak("public_files")
        if public is not None and public["gates_failed"]:
            _say(
                f"{len(public['gates_failed'])} of {public['gates']} gates failed "
                f"({'; '.join(public['gates_failed'])}): the files stay in {folder / REFUSED}, "
                "not to be published",
                "partitioned",
            )
        elif public is not None:
            left = done.get("not_measured", [])
            _say(
                "every stage that changes the records ran by partition; the public data files "
                f"are in {folder / 'puf'} ({public['records']} records, {public['columns']} "
                f"columns; {public['seconds']:.1f} s); gates: {public['gates_passed']} of "
                f"{public['gates']} pass (gates.csv); not published: "
                + (f"the measures of {', '.join(left)}, " if left else "")
                + "the approval (README.md and codebook.csv are in puf/)",
                "partitioned",
            )
        summary = {
            "records": parts[-1].stop,
            "partitions": len(parts),
            "runner": runner,
            "edit_rules_passed": int(scan["edits"]["passed"].sum()),
            "scan_seconds": scan_seconds,
            "driver_peak_gib": peaks,
            "public_files": public,
            "stages": {
                k: {m: v for m, v in r.items() if m != "tables"} if isinstance(r, dict) else r
                for k, r in done.items()
            },
        }
        (tmp / "run.json").write_text(json.dumps(summary, indent=1, default=float) + "\n")
        return done, scan, scan_seconds, public, peaks

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
