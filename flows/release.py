"""The release flow: load -> edits -> risk -> swap -> PRB -> MASSC -> top-coding -> metrics -> gates
-> approval -> publish -> registry."""

from __future__ import annotations

# first: a deployment loads this file by path (not through flows/__init__), and the CPU
# kernels are pinned only when sdl_design is imported before numpy (sdl_design.cpu)
import sdl_design  # noqa: F401

# isort: split

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
from prefect.utilities.annotations import quote, unmapped
from pydantic import Field, field_validator

from expectations.suites import GateFailed
from flows import publish as pub
from flows.env import preload, return_freed_memory, task_runner
from flows.manifest import Manifest
from flows.progress import PROGRESS, flow_run_url, prints_to_run_log
from flows.public_docs import variance_notes
from flows.public_files import (
    detail_frame,
    public_names,
    public_records,
    record_map,
    write_public_files,
)
from flows.registry import se_ratio_tables
from flows.report import post_artifacts, render_report
from flows.scan import run_partitioned
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
from sdl_design.io import file_digest
from sdl_design.spec import ReleaseSpec, SpecError, load_spec, seed_warnings, with_year
from sdl_design.stage import (
    SharedInput,
    StageContext,
    StageResult,
    changed_release,
    design_columns,
    public_design,
)
from sdl_design.stages import RELEASE_STAGES, build_stages, reads_only_batches
from tasks.core import edits_task, gates_task, load_task
from tasks.stage import prepare_replications, replicate_stage, run_stage

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


def _spec_hash(spec_path: str) -> str:
    return pub.sha256_file(Path(spec_path))


def _new_manifest(spec: ReleaseSpec, spec_hash: str, input_hash: str) -> Manifest:
    return Manifest.new(spec, spec_hash, input_hash)


def _absorb(manifest: Manifest, out: StageResult) -> None:
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


@flow(name="puf-release", log_prints=True, flow_run_name=_run_name)
def release_flow(
    spec_path: str,
    approve: str | None = None,
    year: int | None = None,
    runner: str = "thread",
    dask_address: str | None = None,
    approval_poll_s: int = 10,
    partitions: int | None = None,
) -> Manifest:
    """Run one release of the spec; returns the manifest. Raises on a failed edit, gate or approval
    (the published release stays as it was), ReleaseLocked when another run holds the name and
    year, RegistryError or PublishError when the release cannot be recorded or moved.
    partitions: run the stages a partition at a time (about that many; the same public files)."""
    spec = load_spec(spec_path)
    if year is None:
        year = _scheduled_year()
    if year is not None:
        spec.release.year = int(year)
    if partitions is not None:

        def decide(staged: Path, keys: list[str]) -> dict:
            return _approval(spec, approve, approval_poll_s, staged, keys)

        with prints_to_run_log():  # the partitions' progress lines to the run's log too
            return publish_partitioned(
                spec_path, approve, runner, dask_address, partitions, decide=decide,
                post=_post, year=year,
            )[0]  # fmt: skip
    with Transaction.begin(spec) as txn:
        return _release(spec, spec_path, txn, approve, runner, dask_address, approval_poll_s)


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


def _release(
    spec: ReleaseSpec,
    spec_path: str,
    txn: Transaction,
    approve: str | None,
    runner: str,
    dask_address: str | None,
    approval_poll_s: int,
) -> Manifest:
    stages = build_stages(spec)
    weak = seed_warnings(spec.release.seed)
    if weak:
        PROGRESS.say("warning: " + "; ".join(weak))
    import pyarrow.parquet  # noqa: F401 - the reader's modules, before the preload thread starts

    preload()  # Great Expectations and matplotlib, while the input is read
    batches = reads_only_batches(stages)
    # load, edits, each batch of stages, gates, files, approval, publish
    steps = _Steps(len(batches) + 6)
    t0 = steps.start("load")
    original, input_hash = load_task(quote(spec))
    steps.done("load", t0)
    manifest = _new_manifest(spec, _spec_hash(spec_path), input_hash)
    _lap(manifest, "load", t0)
    manifest.counts.n_input = len(original)
    txn.open(manifest)
    outputs: list[StageResult] = []
    # the frames live in this dict only: the gates step empties it (memory at 1M records)
    frames = {"original": original}
    del original
    try:
        _treat(frames, spec, batches, outputs, manifest, txn, steps, runner, dask_address)
        gates, records = _gate(frames, spec, outputs, manifest, txn, steps)

        folder = publish_gated(
            txn,
            spec,
            manifest,
            outputs,
            gates,
            lambda: records,
            steps,
            lambda staged, keys: _approval(spec, approve, approval_poll_s, staged, keys),
            _post,
        )
        PROGRESS.say(f"published {manifest.release.release_id} to {folder}")
        return manifest
    except (GateFailed, ReleaseRejected, RegistryError, PublishError, ReleaseLocked):
        raise
    except BaseException as e:
        if txn.state in ("running", "awaiting_approval"):
            try:
                close_attempt(
                    txn, spec, manifest, outputs, None, "failed", f"{type(e).__name__}: {e}", _post
                )
            except Exception:  # noqa: BLE001 - keep the original error visible
                pass
        raise


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


def _treat(
    frames: dict,
    spec: ReleaseSpec,
    batches: list[list],
    outputs: list[StageResult],
    manifest: Manifest,
    txn: Transaction,
    steps: _Steps,
    runner: str,
    dask_address: str | None,
) -> None:
    """Edit validation, then the stages in release order (their results appended to outputs);
    frames["df"] becomes the treated frame. Raises GateFailed when an edit rule fails."""
    t0 = steps.start("edit validation")
    edits = edits_task(quote(frames["original"]), quote(spec))
    _lap(manifest, "edits", t0)
    steps.done("edit validation", t0)
    if not edits["passed"].all():
        err = GateFailed("edit validation failed on the input file", edits)
        close_attempt(txn, spec, manifest, outputs, edits, "rejected", str(err), _post)
        err.report = staged_report(txn)
        raise err

    df = frames["original"]
    base_ctx = StageContext(frames["original"], spec)
    for batch in batches:
        if len(batch) > 1:  # stages that only measure the frame: at once, in threads
            steps.n += 1
            for out in _measure_at_once(
                batch, df, base_ctx, outputs, steps.n, steps.total, manifest
            ):
                outputs.append(out)
                _absorb(manifest, out)
            continue
        stage = batch[0]
        t0 = steps.start(stage.name)
        ctx = base_ctx.for_stage(stage.name, outputs)
        out = run_stage(quote(stage), quote(df), quote(ctx))
        if stage.replications > 0:
            shared = prepare_replications(stage, df, ctx)
            reps = _replications(stage, shared, runner, dask_address)
            del shared
            out = stage.combine(out, reps, ctx)
        outputs.append(out)
        _absorb(manifest, out)
        df = out.data
        out.data = None  # keep one frame alive, not one per stage (memory at 1M records)
        _lap(manifest, stage.name, t0)
        steps.done(stage.name, t0)
    frames["df"] = df


def _gate(
    frames: dict,
    spec: ReleaseSpec,
    outputs: list[StageResult],
    manifest: Manifest,
    txn: Transaction,
    steps: _Steps,
) -> tuple[pd.DataFrame, pd.DataFrame]:
    """The public records and their files (prepared while the gates run), then the gates:
    (gates, record map). The frames are emptied first. Raises GateFailed when a gate fails."""
    t0 = steps.start("gates")
    df, original = frames["df"], frames["original"]
    masked = any(o.masks_design for o in outputs)
    drop = [c for o in outputs for c in o.drop_public]
    pdesign = public_design(spec, outputs)  # the spec's, or a stage's pseudo design
    labels = [c for c in (pdesign.strata, pdesign.psu) if c]
    puf, rows = public_records(
        df, spec, masked, drop, design_columns(pdesign, list(df.columns)), labels
    )
    records = record_map(original.index, rows)
    detail = detail_frame(puf, df, rows, spec)
    # the working and original frames are not read past here: freed before the public
    # files are written (at 1M records, 1.5 GB of the files step's peak)
    frames.clear()
    df = original = rows = None
    replicate_cols = (
        pdesign.replicate_weights.resolve(list(puf.columns)) if pdesign.replicate_weights else []
    )
    manifest.counts.n_output = len(puf)
    # the public files are written (into the attempt's folder, not the release's) while
    # the gates run; they are staged when every gate passes and deleted when one fails
    notes = variance_notes(spec, outputs, puf)
    txn.prepare_public(lambda folder: write_public_files(puf, folder, notes))
    gate_rows = [g.as_dict() for o in outputs for g in o.gates]
    gates = gates_task(quote(puf), quote(spec), gate_rows, replicate_cols, masked, detail)
    detail = None
    fault("gates")  # recovery tests: the public files may be half written here
    _lap(manifest, "gates", t0)
    steps.done("gates", t0)
    manifest.set_gates(gates)
    if not gates["passed"].all():
        err = GateFailed("release gates failed; nothing was published", gates)
        close_attempt(txn, spec, manifest, outputs, gates, "rejected", str(err), _post)
        err.report = staged_report(txn)
        raise err
    manifest.status = "gated"
    return gates, records


def _measure_at_once(
    batch: list,
    df: pd.DataFrame,
    base_ctx: StageContext,
    outputs: list[StageResult],
    step: int,
    total: int,
    manifest: Manifest,
) -> list[StageResult]:
    """Stages that only measure the frame, run at once in threads (each sees the results of
    the stages before the batch, as it would in order: none of the batch changes them); the
    results in stage order. A stage that changed the release anyway is an error, not a guess."""
    import contextvars
    from concurrent.futures import ThreadPoolExecutor

    def one(stage, ctx) -> tuple[StageResult, float]:
        t0 = time.perf_counter()
        out = run_stage(quote(stage), quote(df), quote(ctx))
        return out, time.perf_counter() - t0

    names = " + ".join(s.name for s in batch)
    t0 = _progress(step, total, names)
    with ThreadPoolExecutor(len(batch), thread_name_prefix="puf-stage") as pool:
        futures = [
            pool.submit(contextvars.copy_context().run, one, s, base_ctx.for_stage(s.name, outputs))
            for s in batch
        ]
        done = [f.result() for f in futures]
    for stage, (out, _) in zip(batch, done, strict=True):
        changed = changed_release(out, df)
        if changed:
            raise RuntimeError(
                f"stage {stage.name} says it only measures the frame (reads_only) but changed "
                f"{', '.join(changed)}; set reads_only = False on it"
            )
        out.data = None
    _lap_many(manifest, {s.name: sec for s, (_, sec) in zip(batch, done, strict=True)})
    _progress(step, total, names, t0)
    return [out for out, _ in done]


def _lap_many(manifest: Manifest, seconds: dict[str, float]) -> None:
    """_lap of steps that ran at once: each one's own wall time."""
    for name, sec in seconds.items():
        manifest.timings_s[name] = round(sec, 3)
    return_freed_memory()


def _replications(stage, shared: SharedInput, runner: str, address: str | None):
    """A stage's replications through the run's task runner (threads or Dask), one chunk per
    worker, each given the stage's shared input (its plan, not the frames); each replication's
    seed depends only on its index."""
    import numpy as np

    chunks = [c.tolist() for c in np.array_split(np.arange(stage.replications), 2) if len(c)]
    with task_runner(runner, address) as tr:
        # plain unmapped: Dask turns quote (a tuple subclass) into a tuple on the way to a worker
        futures = tr.map(
            replicate_stage,
            parameters={
                "stage": unmapped(stage),
                "shared": unmapped(shared),
                "indices": chunks,
            },
        )
        return [f.result() for f in futures]


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
) -> Manifest:
    """Run the release flow; runner and dask_address choose where replications (or, with
    partitions, the partitions) run."""
    if runner not in ("thread", "dask"):
        raise ValueError(f"runner must be 'thread' or 'dask', not {runner!r}")
    # lock, registry and output folder checked, leftovers recovered before Prefect starts: a
    # second run or a broken registry fails at once, with one line (the flow re-enters the lock)
    spec = load_spec(spec_path)
    if year is not None:
        spec.release.year = int(year)
    with Transaction.begin(spec):
        return _call_flow(spec_path, approve, year, runner, dask_address, partitions)


def _call_flow(spec_path, approve, year, runner, dask_address, partitions=None) -> Manifest:  # noqa: ANN001
    return release_flow(
        spec_path=str(spec_path),
        approve=approve,
        year=year,
        runner=runner,
        dask_address=dask_address,
        partitions=partitions,
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


def _move_public(puf: Path, public: Path) -> dict[str, str]:
    """The partitioned run's public files moved into public (created here); their digests."""
    public.mkdir(parents=True)
    out = {}
    for name in public_names(puf):
        shutil.move(str(puf / name), str(public / name))
        out[f"public/{name}"] = pub.sha256_file(public / name)
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
    """Run the spec's release by partition and publish it: (the manifest, run_partitioned's
    result). decide(staged, artifact keys): the board's decision (default: approve's name on
    the command line); post(manifest, ...): the run's artifacts (in a flow run). Raises
    GateFailed when a gate fails (nothing published), ReleaseRejected when the board rejects,
    SpecError when the spec needs an approval and neither decide nor approve is given or a
    stage has no partitioned path, and what the transaction raises (ReleaseLocked,
    RegistryError, PublishError). Each step prints its line (1..5, _Steps)."""

    spec = with_year(load_spec(spec_path), year)
    if decide is None and spec.approval.required and not approve:
        raise SpecError(
            [
                "approval.required: give the approver (--approve NAME), or run "
                "release_flow with partitions, which pauses for the board's decision"
            ]
        )
    steps = _Steps(len(PARTITIONED_STEPS))
    with Transaction.begin(spec) as txn:
        manifest = Manifest.new(
            spec, pub.sha256_file(Path(spec_path)), input_digest(spec.release.input)
        )
        txn.open(manifest)
        work = txn.folder / PARTITIONED
        results: list[StageResult] = []
        gates = None
        try:
            t0 = steps.start("partitioned stages")
            out = run_partitioned(
                spec_path,
                runner,
                dask_address,
                partitions,
                out=work,
                workers=workers,
                damage=False,  # the release measures the published file (final, assess)
            )
            steps.done("partitioned stages", t0)
            if out["public_files"] is None:
                raise SpecError(
                    [
                        f"stages: {out['stopped_before']} has no partitioned path; "
                        "publish this spec with the release flow (`puf run`)"
                    ]
                )
            t0 = steps.start("gates")
            results = list(out["stages"].values())
            _absorb_partitioned(manifest, results, out)
            gates = pd.read_csv(work / "gates.csv", keep_default_na=False, na_values=[""])
            manifest.set_gates(gates)
            steps.done("gates", t0)
            if not gates["passed"].all():
                err = GateFailed("release gates failed; nothing was published", gates)
                close_attempt(txn, spec, manifest, results, gates, "rejected", str(err))
                err.report = staged_report(txn)
                raise err
            manifest.status = "gated"
            _publish_partitioned(
                txn, spec, manifest, results, gates, work, steps, decide, approve, post
            )
            return manifest, out
        except ReleaseRejected:
            raise
        except GateFailed as e:  # the input's edit rules (the gates closed the attempt)
            if txn.state == "running":
                close_attempt(txn, spec, manifest, results, e.results, "rejected", str(e))
            e.report = e.report or staged_report(txn)
            raise
        except BaseException as e:
            if txn.state in ("running", "awaiting_approval"):
                try:
                    close_attempt(
                        txn, spec, manifest, results, gates, "failed", f"{type(e).__name__}: {e}"
                    )
                except Exception:  # noqa: BLE001 - keep the original error visible
                    pass
            raise
        finally:
            shutil.rmtree(work, ignore_errors=True)  # the records after each stage


def _publish_partitioned(
    txn: Transaction,
    spec: ReleaseSpec,
    manifest: Manifest,
    results: list[StageResult],
    gates: pd.DataFrame,
    work: Path,
    steps: Any,
    decide: Callable[[Path, list[str]], dict] | None,
    approve: str | None,
    post: Callable[..., list[str]] | None,
) -> None:
    """The gated release staged (its artifacts posted), decided and published; raises
    ReleaseRejected when the board rejects it (the attempt recorded as rejected)."""

    txn.prepare_public(lambda folder: _move_public(work / "puf", folder))
    publish_gated(
        txn,
        spec,
        manifest,
        results,
        gates,
        lambda: pd.read_parquet(work / "internal" / "record_map.parquet"),
        steps,
        lambda staged, keys: _decision(decide, staged, keys, approve),
        post,
    )


def _absorb_partitioned(
    manifest: Manifest, results: list[StageResult], out: dict[str, Any]
) -> None:
    """The partitioned run's results, timings and counts into the manifest."""
    for r in results:
        # the run's timings go to the manifest's timings, not into its metrics
        for k in [k for k in r.metrics if k.endswith("seconds")]:
            manifest.timings_s[f"{r.name}.{k}"] = round(r.metrics.pop(k), 3)
        manifest.absorb(r)
    manifest.timings_s["scan"] = round(float(out["scan_seconds"]), 3)
    manifest.timings_s["partitioned"] = round(float(out["seconds"]), 3)
    manifest.counts.n_input = int(out["records"])
    manifest.counts.n_output = int(out["public_files"]["records"])


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
