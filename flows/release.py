"""The release flow: load -> edits -> risk -> swap -> PRB -> MASSC -> top-coding -> metrics -> gates
-> approval -> publish -> registry."""

from __future__ import annotations

# first: a deployment loads this file by path (not through flows/__init__), and the CPU
# kernels are pinned only when sdl_design is imported before numpy (sdl_design.cpu)
import sdl_design  # noqa: F401

# isort: split

import contextlib
import hashlib
import shutil
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Literal

import pandas as pd
from prefect import flow
from prefect.flow_runs import pause_flow_run
from prefect.input import RunInput
from prefect.utilities.annotations import quote
from pydantic import Field, field_validator

from expectations.suites import GateFailed
from flows import publish as pub
from flows.driver import MemoryStore, PartitionStore, StageRun, Store
from flows.env import preload, return_freed_memory
from flows.manifest import Manifest
from flows.progress import PROGRESS, flow_run_url, prints_to_run_log
from flows.public_files import (
    public_names,
)
from flows.registry import se_ratio_tables
from flows.report import post_artifacts, render_report
from flows.scan import check_partitions, partitioned_input, scan_tables
from flows.server_guard import install as _guard_prefect_server
from flows.tune import tune_dir
from flows.txn import (
    PARTITIONED,
    PublishError,
    RegistryError,
    ReleaseLocked,
    ReleaseRejected,
    Transaction,
    fault,
)
from sdl_design.engine.exchange import Exchange, mapper
from sdl_design.engine.records import Records, Run
from sdl_design.io import file_digest
from sdl_design.spec import ReleaseSpec, SpecError, load_spec, seed_warnings, with_year
from sdl_design.stage import (
    StageContext,
    StageResult,
)
from sdl_design.stages import RELEASE_STAGES, build_stages, reads_only_batches
from tasks.core import edits_task, load_task
from tasks.stage import run_stage

_guard_prefect_server()  # Prefect's temporary server dies with this process (kill -9 too)


class ReleaseApproval(RunInput):
    """The board's decision on a staged release: who decides (required, not blank) and what."""

    decision: Literal["approved", "rejected"] = Field(
        description="approved publishes the staged files; rejected keeps the published release"
    )
    approver: str = Field(
        pattern=r"\S", max_length=200, description="who decides (name or id); required"
    )
    comment: str = Field(default="", description="optional")

    @field_validator("approver")
    @classmethod
    def _strip(cls, v: str) -> str:
        v = v.strip()
        if not v:
            raise ValueError("approver is required")
        return v


def _lap(manifest: Manifest, name: str, t0: float) -> None:
    """Record a step's wall time in the manifest (internal only); the step's freed memory goes
    back to the system before the next step."""
    manifest.timings_s[name] = round(time.perf_counter() - t0, 3)
    return_freed_memory()


def _progress(step: int, total: int, name: str, t0: float | None = None) -> float:
    """A step's line on the terminal: its start (returns the start time) or, given t0, its end."""
    if t0 is None:
        return PROGRESS.start(step, total, name)
    PROGRESS.done(step, total, name, t0)
    return t0


def _absorb(manifest: Manifest, out: StageResult, seconds: float) -> None:
    """A stage's result into the manifest: its wall time and its passes' laps (the metrics
    named *seconds) to the timings, the rest to the metrics."""
    manifest.timings_s[out.name] = round(seconds, 3)
    for k in [k for k in out.metrics if k.endswith("seconds")]:
        manifest.timings_s[f"{out.name}.{k}"] = round(out.metrics.pop(k), 3)
    manifest.absorb(out)


def _tables(outputs: list[StageResult], gates: pd.DataFrame | None) -> dict[str, pd.DataFrame]:
    tables = {f"{o.name}/{k}": v for o in outputs for k, v in o.tables.items()}
    if gates is not None:
        tables["gates"] = gates
    return tables


def _tune_map(spec: ReleaseSpec) -> list[StageResult]:
    """The risk-utility map of the last `puf tune` of this spec, shown in the report when there."""

    png = tune_dir(spec) / "risk_utility_map.png"
    if not png.is_file():
        return []
    note = f"From `puf tune` ({png.parent}): candidates.csv and recommended_spec.yaml are there."
    return [
        StageResult(
            "tune",
            None,
            figures={"risk_utility_map": png.read_bytes()},
            notes=[note],
            section="Risk-utility map of the tuning run",
        )
    ]


def _report_writer(outputs: list[StageResult], spec: ReleaseSpec):
    def write(manifest: Manifest, path: Path) -> None:

        shown = [*outputs, *_tune_map(spec)]
        render_report(manifest, shown, path, stages=[cls.name for cls in RELEASE_STAGES])

    return write


def close_attempt(
    txn: Transaction,
    spec: ReleaseSpec,
    manifest: Manifest,
    outputs: list[StageResult],
    gates: pd.DataFrame | None,
    status: str,
    reason: str | None,
    post: Callable[..., list[str]] | None = None,
) -> None:
    """End an attempt that does not publish: its record (no public files) in its folder, the
    registry told, the artifacts posted again with the status (post); the published release,
    its files and its registry row untouched."""
    manifest.status = status
    manifest.reason = reason
    if gates is not None:
        manifest.set_gates(gates)
    record = txn.staged / "internal"
    try:
        pub.write_record(record, manifest, _tables(outputs, gates), _report_writer(outputs, spec))
    except OSError as e:  # (a print in the flow would be a log record below the quiet level)
        PROGRESS.say(f"WARNING: could not write the attempt's record in {record}: {e}")
    txn.close(status, reason, manifest, se_ratio_tables(outputs))
    if post is not None:
        post(manifest, results=outputs, folder=txn.staged)


def staged_report(txn: Transaction) -> Path:
    """The report of an attempt a refusal closed (close_attempt writes it), for the refusal's
    one line (GateFailed.one_line names it when it was written)."""
    return txn.staged / "internal" / "report.html"


def _post(
    manifest: Manifest,
    staged: Path | None = None,
    results: Sequence[StageResult] = (),
    folder: Path | None = None,
) -> list[str]:
    """The run's artifacts; their keys, the board's verdict first. With staged (before the
    approval): the staged report and assessment too. folder: where the files linked from the
    verdict are (default staged)."""

    verdict = pub.post_verdict(manifest, results, staged or folder)
    if staged is None:
        return verdict + post_artifacts(manifest)
    return verdict + post_artifacts(manifest, staged=staged, results=results)


def _run_name() -> str:
    """The flow run's name: "<survey> <year>" (read from the spec the run was given)."""
    import yaml
    from prefect.runtime import flow_run

    params = flow_run.parameters or {}
    try:
        rel = yaml.safe_load(Path(params["spec_path"]).read_text())["release"]
        year = params.get("year") or _scheduled_year() or rel["year"]
        return f"{rel['name']} {year}"
    except Exception:  # noqa: BLE001 - a name is never worth a failed run
        return "puf-release"


# log_prints off: a task's print would become a log record below the quiet level, off the
# terminal (the partitions' progress lines); prints_to_run_log tees them to the run's log
@flow(name="puf-release", log_prints=False, flow_run_name=_run_name)
def release_flow(
    spec_path: str,
    approve: str | None = None,
    year: int | None = None,
    runner: str = "thread",
    dask_address: str | None = None,
    approval_poll_s: int = 10,
    partitions: int | None = None,
    workers: int = 2,
) -> Manifest:
    """Run one release of the spec; returns the manifest. Raises on a failed edit, gate or approval
    (the published release stays as it was), ReleaseLocked when another run holds the name and
    year, RegistryError or PublishError when the release cannot be recorded or moved.
    partitions: the records read a partition at a time (about that many; the same public files),
    `workers` at once where the run starts them (no dask_address)."""
    spec = load_spec(spec_path)
    if year is None:
        year = _scheduled_year()
    if year is not None:
        spec.release.year = int(year)

    def decide(staged: Path, keys: list[str]) -> dict:
        return _approval(spec, approve, approval_poll_s, staged, keys)

    run = ReleaseRun(spec, spec_path, runner, dask_address, partitions, decide, _post, workers)
    with prints_to_run_log():  # the partitions' progress lines to the run's log too
        return run.publish()


class _Steps:
    """The run's step numbers, 1..total without a gap: one number per step line a person reads
    (stages measured at once are one step)."""

    def __init__(self, total: int):
        self.total, self.n = total, 0

    def start(self, name: str) -> float:
        self.n += 1
        return _progress(self.n, self.total, name)

    def done(self, name: str, t0: float) -> None:
        _progress(self.n, self.total, name, t0)


def publish_gated(
    txn: Transaction,
    spec: ReleaseSpec,
    manifest: Manifest,
    results: list[StageResult],
    gates: pd.DataFrame,
    records: Callable[[], pd.DataFrame],
    steps: _Steps,
    decide: Callable[[Path, list[str]], dict],
    post: Callable[..., list[str]] | None = None,
) -> Path:
    """The one publish sequence, in memory and by partition: the gated release staged whole
    (the board sees what would go out; its artifacts posted), the board's decision, then the
    release published (its folder returned) or the attempt closed as rejected (raises
    ReleaseRejected). records: the record map, read when the files are staged."""
    t0 = steps.start("files")
    writer = _report_writer(results, spec)
    tables, record_map_ = _tables(results, gates), records()
    staged = txn.stage(
        lambda folder: pub.write_stage(
            folder,
            manifest,
            tables,
            writer,
            fault=fault,
            prepared=txn.prepared_public,
            record_map=record_map_,
        )  # fmt: skip
    )
    ratios = se_ratio_tables(results)
    txn.awaiting_approval(manifest, ratios)
    keys = post(manifest, staged=staged, results=results) if post else []
    _lap(manifest, "files", t0)
    steps.done("files", t0)
    t0 = steps.start("approval")
    decision = decide(staged, keys)
    steps.done("approval", t0)
    manifest.approval = manifest.approval.model_copy(update=decision)
    if decision["decision"] != "approved":
        reason = f"rejected by {decision['approver']}: {decision['comment']}"
        close_attempt(txn, spec, manifest, results, gates, "rejected", reason, post)
        raise ReleaseRejected(f"release {reason}")
    t0 = steps.start("publish")
    manifest.status = "published"
    manifest.reason = None
    pub.write_record(staged / "internal", manifest, {}, writer)  # with the decision
    folder = txn.publish(manifest, ratios)
    if post:
        post(manifest, results=results, folder=folder)
    _lap(manifest, "publish", t0)
    steps.done("publish", t0)
    return folder


class ReleaseRun:
    """One release of a spec, in memory or by partition (the same driver, StageRun, on a
    MemoryStore or a PartitionStore): the input and its edit rules, the stages, the public
    files and the gates, the board's decision, the publication. decide(staged, artifact keys):
    the board's decision; post(manifest, ...): the run's artifacts (in a flow run)."""

    def __init__(
        self,
        spec: ReleaseSpec,
        spec_path: str | Path,
        runner: str,
        dask_address: str | None,
        partitions: int | None,
        decide: Callable[[Path, list[str]], dict],
        post: Callable[..., list[str]] | None,
        workers: int = 2,
    ):
        self.spec, self.spec_path, self.partitions = spec, str(spec_path), partitions
        self.runner, self.dask_address, self.workers = runner, dask_address, workers
        self.decide, self.post = decide, post
        self.stages = build_stages(spec)
        # load, edit validation, each batch of stages, gates, files, approval, publish
        self.steps = _Steps(len(reads_only_batches(self.stages)) + 6)
        self.laps: dict[str, float] = {}
        self.summary: dict[str, Any] = {}  # what `puf partitioned --publish` prints

    def publish(self) -> Manifest:
        """The release published; its manifest. Raises GateFailed (an edit rule or a gate
        failed: nothing published), ReleaseRejected, and what the transaction raises."""
        weak = seed_warnings(self.spec.release.seed)
        if weak:
            PROGRESS.say("warning: " + "; ".join(weak))
        t0 = time.perf_counter()
        with Transaction.begin(self.spec) as txn:
            work = txn.folder / PARTITIONED
            try:
                with self._mapper() as run_map:
                    return self._publish(txn, work, run_map)
            finally:
                shutil.rmtree(work, ignore_errors=True)  # the records after each stage
                self.summary["seconds"] = time.perf_counter() - t0

    def _mapper(self) -> Any:
        if self.partitions is None and self.runner == "thread":  # the records held here
            return contextlib.nullcontext(None)
        # by partition: --partitions N, or on Dask the input's own row groups
        return mapper(self.runner, self.dask_address, self.workers, "partitioned")

    def _publish(self, txn: Transaction, work: Path, run_map: Exchange | None) -> Manifest:
        store, edits, digest = self._input(run_map, work)
        manifest = Manifest.new(self.spec, pub.sha256_file(Path(self.spec_path)), digest)
        manifest.timings_s.update(self.laps)
        manifest.counts.n_input = store.n_input
        txn.open(manifest)
        work.mkdir(exist_ok=True)
        driver = StageRun(self.spec, self.stages, store, _call_stage, self.steps, _freed)
        results, gates = driver.results, None
        try:
            if not edits["passed"].all():
                self._refuse(
                    txn, manifest, results, edits, "edit validation failed on the input file"
                )
            driver.run_stages()
            for r in results:
                _absorb(manifest, r, driver.timings[r.name])
            gates = self._gates(driver, txn, manifest, work)
            folder = publish_gated(
                txn, self.spec, manifest, results, gates,
                lambda: _record_map(work), self.steps, self.decide, self.post,
            )  # fmt: skip
            PROGRESS.say(f"published {manifest.release.release_id} to {folder}")
            return manifest
        except (GateFailed, ReleaseRejected, RegistryError, PublishError, ReleaseLocked):
            raise
        except BaseException as e:
            if txn.state in ("running", "awaiting_approval"):
                try:
                    why = f"{type(e).__name__}: {e}"
                    close_attempt(
                        txn, self.spec, manifest, results, gates, "failed", why, self.post
                    )
                except Exception:  # noqa: BLE001 - keep the original error visible
                    pass
            raise

    def _refuse(
        self,
        txn: Transaction,
        manifest: Manifest,
        results: list[StageResult],
        verdicts: pd.DataFrame,
        why: str,
    ) -> None:
        """The attempt closed as rejected (its record and report written): raises GateFailed."""
        err = GateFailed(why, verdicts)
        close_attempt(txn, self.spec, manifest, results, verdicts, "rejected", str(err), self.post)
        err.report = staged_report(txn)
        raise err

    def _input(self, run_map: Exchange | None, work: Path) -> tuple[Store, pd.DataFrame, str]:
        """The input as the store of the records so far, its edit rules' verdicts and its
        digest: read whole (load and edit validation as tasks), or planned in partitions and
        scanned (the edit rules, the risk measures and the PSUs, a partition at a time)."""
        spec, steps = self.spec, self.steps
        t0 = steps.start("load")
        if run_map is None:
            import pyarrow.parquet  # noqa: F401 - the reader's modules, before the preload thread

            preload()  # Great Expectations and matplotlib, while the input is read
            original, digest = load_task(quote(spec))
            self._lap("load", t0)
            t0 = steps.start("edit validation")
            edits = edits_task(quote(original), quote(spec))
            self._lap("edits", t0, "edit validation")
            return MemoryStore(original), edits, digest
        _, columns, parts = partitioned_input(
            self.spec_path, self.runner, self.partitions, "partitioned", spec.release.year
        )
        check_partitions(self.stages, spec, columns)
        digest = input_digest(spec.release.input)
        self._lap("load", t0)
        t0 = steps.start("edit validation")
        scan, info = scan_tables(spec, columns, parts, run_map, self.runner, se=False)
        self._lap("scan", t0, "edit validation")
        self.summary.update(scan=scan, records=parts[-1].stop, partitions=len(parts))
        run = Run(run_map, parts, scan, info["psus"])
        return (
            PartitionStore(run, parts, columns, work, tables=False, keep=False),
            scan["edits"],
            digest,
        )

    def _lap(self, name: str, t0: float, step: str | None = None) -> None:
        self.laps[name] = round(time.perf_counter() - t0, 3)
        self.steps.done(step or name, t0)
        return_freed_memory()

    def _gates(
        self, driver: StageRun, txn: Transaction, manifest: Manifest, work: Path
    ) -> pd.DataFrame:
        """The public files of the records after the stages (into the attempt's folder, staged
        when every gate passes), then the gates on them: raises GateFailed when one fails."""
        t0 = self.steps.start("gates")
        public, gates = driver.public_files(work / "puf")
        public["seconds"] = time.perf_counter() - t0
        public["gates"], public["gates_passed"] = len(gates), int(gates["passed"].sum())
        public["gates_failed"] = gates.loc[~gates["passed"].astype(bool), "name"].tolist()
        self.summary.update(public_files=public, stages={r.name: r for r in driver.results})
        manifest.counts.n_output = int(public["records"])
        digests = public["files"]
        txn.prepare_public(lambda folder: _move_public(work / "puf", folder, digests))
        fault("gates")  # recovery tests: the public files may be half moved here
        _lap(manifest, "gates", t0)
        self.steps.done("gates", t0)
        manifest.set_gates(gates)
        if not gates["passed"].all():
            why = "release gates failed; nothing was published"
            self._refuse(txn, manifest, driver.results, gates, why)
        manifest.status = "gated"
        return gates


def _freed(step: str) -> None:
    """After a step: what it freed goes back to the system before the next (at 300,000
    records, without it the in-memory peak from MASSC on was 0.2-0.4 GiB higher)."""
    return_freed_memory()


def _record_map(work: Path) -> pd.DataFrame:
    """The record map the public files were written with (read when the release is staged)."""
    return pd.read_parquet(work / "internal" / "record_map.parquet")


def _call_stage(stage: Any, records: Records, ctx: StageContext) -> StageResult:
    """A stage's call as the flow's task (quoted: Prefect does not walk the records)."""
    return run_stage(quote(stage), quote(records), quote(ctx))


def _scheduled_year() -> int | None:
    """The year of a scheduled deployment run (None for runs started by hand)."""
    from prefect.runtime import deployment, flow_run

    if deployment.id is None:
        return None
    start = flow_run.scheduled_start_time
    return int(start.year) if start is not None else None


def _approval(
    spec: ReleaseSpec, approve: str | None, poll_s: int, staged: Path, keys: list[str]
) -> dict:
    if not spec.approval.required:
        return {
            "approver": None,
            "decision": "approved",
            "comment": "approval not required by the spec",
            "at": pub.now(),
        }
    if approve:
        return {
            "approver": approve,
            "decision": "approved",
            "comment": "approved on the command line",
            "at": pub.now(),
        }
    rel = spec.release
    evidence = ", ".join(f"`{k}`" for k in keys)
    description = (
        f"Approve the public-use file {rel.name} {rel.year}? The whole release is staged in "
        f"{staged} (public/ as it would be published, internal/report.html). The evidence is in "
        f"this run's artifacts: {evidence}. Decision approved publishes exactly the staged "
        "files; rejected keeps the published release as it is. Approver is required. From a "
        f"terminal: puf approve {rel.name} {rel.year} --approver WHO [--reject] [--comment TEXT]."
    )
    for line in pause_lines(rel.name, rel.year, staged):
        PROGRESS.say(line)
    d = pause_flow_run(
        wait_for_input=ReleaseApproval.with_initial_data(description=description),
        timeout=spec.approval.timeout_s,
        poll_interval=poll_s,
        key=f"approval-{rel.name}-{rel.year}",
    )
    return {"approver": d.approver, "decision": d.decision, "comment": d.comment, "at": pub.now()}


def pause_lines(name: str, year: int, staged: Path) -> list[str]:
    """What a person needs at the pause: the flow run's page, the staged report, the two ways
    to decide (the UI form, `puf approve`)."""
    import shlex

    from prefect.runtime import flow_run

    run_id = flow_run.id
    url = flow_run_url(run_id)
    cmd = f"puf approve {shlex.quote(str(name))} {year} --approver WHO"
    return [
        f"waiting for the review board's decision on {name} {year} (flow run {run_id})",
        f"  flow run : {url or 'set PREFECT_UI_URL to link it (no UI URL known)'}",
        f"  report   : {staged / 'internal' / 'report.html'}",
        f"  files    : {staged / 'public'} (exactly what approval publishes)",
        "  decide   : in the Prefect UI, the run's Resume form (decision, approver, comment), or",
        f"             {cmd}   [--reject] [--comment TEXT]",
    ]


def run_release(
    spec_path: str,
    approve: str | None = None,
    year: int | None = None,
    runner: str = "thread",
    dask_address: str | None = None,
    partitions: int | None = None,
    workers: int = 2,
) -> Manifest:
    """Run the release flow; runner and dask_address choose where replications (or, with
    partitions, the partitions, `workers` at once) run."""
    if runner not in ("thread", "dask"):
        raise ValueError(f"runner must be 'thread' or 'dask', not {runner!r}")
    # lock, registry and output folder checked, leftovers recovered before Prefect starts: a
    # second run or a broken registry fails at once, with one line (the flow re-enters the lock)
    spec = load_spec(spec_path)
    if year is not None:
        spec.release.year = int(year)
    with Transaction.begin(spec):
        return _call_flow(spec_path, approve, year, runner, dask_address, partitions, workers)


def _call_flow(
    spec_path, approve, year, runner, dask_address, partitions=None, workers=2
) -> Manifest:  # noqa: ANN001
    return release_flow(
        spec_path=str(spec_path),
        approve=approve,
        year=year,
        runner=runner,
        dask_address=dask_address,
        partitions=partitions,
        workers=workers,
    )


# ---------------------------------------------------------------- by partition


def input_digest(path: str | Path) -> str:
    """The input's digest: sha256 of the file (as the release flow's), or of a folder of
    Parquet files the sha256 of their names and digests in name order."""

    path = Path(path)
    if path.is_file():
        return file_digest(path)
    h = hashlib.sha256()
    for f in sorted(path.glob("*.parquet")):
        h.update(f"{f.name}:{file_digest(f)}\n".encode())
    return h.hexdigest()


def _move_public(puf: Path, public: Path, digests: dict[str, str]) -> dict[str, str]:
    """The public files written into puf (digests: {name: sha256} as written) moved into public
    (created here, a rename on the same file system: the bytes are not read again); their
    digests as {'public/<name>': sha256}."""
    public.mkdir(parents=True)
    out = {}
    for name in public_names(puf):
        shutil.move(str(puf / name), str(public / name))
        out[f"public/{name}"] = digests[name]
    return out


PARTITIONED_STEPS = ("partitioned stages", "gates", "files", "approval", "publish")


def publish_partitioned(
    spec_path: str | Path,
    approve: str | None,
    runner: str = "thread",
    dask_address: str | None = None,
    partitions: int | None = None,
    workers: int = 2,
    decide: Callable[[Path, list[str]], dict] | None = None,
    post: Callable[..., list[str]] | None = None,
    year: int | None = None,
) -> tuple[Manifest, dict[str, Any]]:
    """The spec's release by partition outside a flow run (ReleaseRun): (the manifest, the
    run's summary: records, partitions, seconds, the scan, the stages' results, the public
    files). decide(staged, artifact keys): the board's decision (default: approve's name on
    the command line). Raises SpecError when the spec needs an approval and neither decide
    nor approve is given, and what ReleaseRun.publish raises."""
    spec = with_year(load_spec(spec_path), year)
    if decide is None and spec.approval.required and not approve:
        raise SpecError(
            [
                "approval.required: give the approver (--approve NAME), or run "
                "release_flow with partitions, which pauses for the board's decision"
            ]
        )
    run = ReleaseRun(
        spec, spec_path, runner, dask_address, partitions,
        lambda staged, keys: _decision(decide, staged, keys, approve), post, workers,
    )  # fmt: skip
    manifest = run.publish()
    return manifest, run.summary


def _decision(
    decide: Callable[[Path, list[str]], dict] | None,
    staged: Path,
    keys: list[str],
    approve: str | None,
) -> dict:
    """The board's decision: decide's (a flow run's pause), else approve's name."""
    if decide is not None:
        return decide(staged, keys)
    return {
        "approver": approve,
        "decision": "approved",
        "comment": "approved on the command line"
        if approve
        else "approval not required by the spec",
        "at": pub.now(),
    }
