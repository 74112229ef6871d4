"""The release flow: load -> edits -> risk -> swap -> PRB -> MASSC -> top-coding -> metrics -> gates
-> approval -> publish -> registry."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pandas as pd
from prefect import flow
from prefect.flow_runs import pause_flow_run
from prefect.input import RunInput
from prefect.utilities.annotations import quote, unmapped

from expectations.suites import GateFailed
from flows import publish as pub
from flows.manifest import Manifest
from flows.progress import PROGRESS
from flows.public_docs import variance_notes
from flows.public_files import public_frame
from sdl_design.spec import ReleaseSpec, load_spec
from sdl_design.stage import StageContext, StageResult, build_stages, design_columns, public_design
from sdl_design.stages import RELEASE_STAGES
from tasks.core import edits_task, gates_task, load_task
from tasks.stage import replicate_stage, run_stage


class ReleaseApproval(RunInput):
    approved: bool
    approver: str
    comment: str = ""


class ReleaseRejected(RuntimeError):
    pass


def _lap(manifest: Manifest, name: str, t0: float) -> None:
    """Record a step's wall time in the manifest (internal only)."""
    manifest.timings_s[name] = round(time.perf_counter() - t0, 3)


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
    from flows.tune import tune_dir

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
        from flows.report import render_report

        shown = [*outputs, *_tune_map(spec)]
        render_report(manifest, shown, path, stages=[cls.name for cls in RELEASE_STAGES])

    return write


def _record(manifest: Manifest, outputs: list[StageResult], spec: ReleaseSpec) -> None:
    """Record the release in the registry; a registry failure never undoes a written release."""
    from flows.registry import record_release, se_ratio_tables

    ratios = se_ratio_tables(outputs)
    try:
        record_release(
            manifest, ratios, url=spec.release.registry, output_dir=spec.release.output_dir
        )
    except Exception as e:  # noqa: BLE001 - reported, the release folder stands
        print(
            f"[puf] WARNING: the registry could not record {manifest.release.release_id}: {e}",
            file=sys.stderr,
        )


def _finish(
    spec: ReleaseSpec,
    manifest: Manifest,
    outputs: list[StageResult],
    gates: pd.DataFrame | None,
    status: str,
    reason: str | None,
    puf: pd.DataFrame | None = None,
    notes: str | None = None,
) -> Path:
    manifest.status = status
    manifest.reason = reason
    if gates is not None:
        manifest.set_gates(gates)
    folder = pub.write_release(
        spec, manifest, _tables(outputs, gates), _report_writer(outputs, spec), puf, notes
    )
    _record(manifest, outputs, spec)
    from flows.report import post_artifacts

    post_artifacts(manifest)
    return folder


@flow(name="puf-release", log_prints=True)
def release_flow(
    spec_path: str,
    approve: str | None = None,
    year: int | None = None,
    runner: str = "thread",
    dask_address: str | None = None,
    approval_poll_s: int = 10,
) -> Manifest:
    """Run one release of the spec; returns the manifest. Raises on a failed edit, gate or approval."""
    spec = load_spec(spec_path)
    if year is None:
        year = _scheduled_year()
    if year is not None:
        spec.release.year = int(year)
    stages = build_stages(spec)
    total = len(stages) + 5
    step = 1
    _progress(step, total, "load")
    t0 = time.perf_counter()
    original, input_hash = load_task(quote(spec))
    _progress(step, total, "load", t0)
    manifest = _new_manifest(spec, _spec_hash(spec_path), input_hash)
    _lap(manifest, "load", t0)
    manifest.counts.n_input = len(original)
    outputs: list[StageResult] = []
    try:
        step += 1
        _progress(step, total, "edit validation")
        t0 = time.perf_counter()
        edits = edits_task(quote(original), quote(spec))
        _lap(manifest, "edits", t0)
        _progress(step, total, "edit validation", t0)
        if not edits["passed"].all():
            err = GateFailed("edit validation failed on the input file", edits)
            _finish(spec, manifest, outputs, edits, "rejected", str(err))
            raise err

        df = original
        base_ctx = StageContext(original, spec)
        for stage in stages:
            step += 1
            _progress(step, total, stage.name)
            t0 = time.perf_counter()
            ctx = base_ctx.for_stage(stage.name, outputs)
            out = run_stage(quote(stage), quote(df), quote(ctx))
            if stage.replications > 0:
                reps = _replications(stage, df, ctx, runner, dask_address)
                out = stage.combine(out, reps, ctx)
            outputs.append(out)
            _absorb(manifest, out)
            df = out.data
            out.data = None  # keep one frame alive, not one per stage (memory at 1M records)
            _lap(manifest, stage.name, t0)
            _progress(step, total, stage.name, t0)

        step += 1
        _progress(step, total, "gates")
        t0 = time.perf_counter()
        masked = any(o.masks_design for o in outputs)
        drop = [c for o in outputs for c in o.drop_public]
        pdesign = public_design(spec, outputs)  # the spec's, or a stage's pseudo design
        puf = public_frame(df, spec, masked, drop, design_columns(pdesign, list(df.columns)))
        replicate_cols = (
            pdesign.replicate_weights.resolve(list(puf.columns))
            if pdesign.replicate_weights
            else []
        )
        manifest.counts.n_output = len(puf)
        gate_rows = [g.as_dict() for o in outputs for g in o.gates]
        gates = gates_task(quote(puf), quote(spec), gate_rows, replicate_cols, masked)
        _lap(manifest, "gates", t0)
        _progress(step, total, "gates", t0)
        if not gates["passed"].all():
            err = GateFailed("release gates failed; nothing was published", gates)
            _finish(spec, manifest, outputs, gates, "rejected", str(err))  # reason: failed checks
            raise err
        manifest.status = "gated"

        step += 1
        t0 = _progress(step, total, "approval")
        decision = _approval(spec, approve, approval_poll_s)
        _progress(step, total, "approval", t0)
        manifest.approval = manifest.approval.model_copy(update=decision)
        if decision["decision"] != "approved":
            _finish(
                spec,
                manifest,
                outputs,
                gates,
                "rejected",
                f"rejected by {decision['approver']}: {decision['comment']}",
            )
            raise ReleaseRejected(
                f"release rejected by {decision['approver']}: {decision['comment']}"
            )

        step += 1
        t0 = _progress(step, total, "publish")
        notes = variance_notes(spec, outputs, puf)
        folder = _finish(spec, manifest, outputs, gates, "published", None, puf, notes)
        _progress(step, total, "publish", t0)
        PROGRESS.say(f"published {manifest.release.release_id} to {folder}")
        return manifest
    except (GateFailed, ReleaseRejected):
        raise
    except BaseException as e:
        if manifest.status not in ("rejected", "failed", "published"):
            try:
                _finish(spec, manifest, outputs, None, "failed", f"{type(e).__name__}: {e}")
            except Exception:  # keep the original error visible
                pass
        raise


def _task_runner(runner: str, dask_address: str | None):
    """The task runner the run asked for: a thread pool, or Dask (a cluster at dask_address, else
    a local cluster of two single-threaded workers)."""
    if runner == "thread":
        from prefect.task_runners import ThreadPoolTaskRunner

        return ThreadPoolTaskRunner(max_workers=2)
    if runner == "dask":
        import dask
        from prefect_dask import DaskTaskRunner

        dask.config.set({"distributed.nanny.pre-spawn-environ.MALLOC_MMAP_THRESHOLD_": 4194304})
        if dask_address:
            return DaskTaskRunner(address=dask_address)
        return DaskTaskRunner(cluster_kwargs={"n_workers": 2, "threads_per_worker": 1})
    raise ValueError(f"runner must be 'thread' or 'dask', not {runner!r}")


def _replications(stage, df: pd.DataFrame, ctx: StageContext, runner: str, address: str | None):
    """A stage's replications through the run's task runner (threads or Dask), one chunk per
    worker; each replication's seed depends only on its index."""
    import numpy as np

    chunks = [c.tolist() for c in np.array_split(np.arange(stage.replications), 2) if len(c)]
    with _task_runner(runner, address) as tr:
        # plain unmapped: Dask turns quote (a tuple subclass) into a tuple on the way to a worker
        futures = tr.map(
            replicate_stage,
            parameters={
                "stage": unmapped(stage),
                "df": unmapped(df),
                "ctx": unmapped(ctx),
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


def _approval(spec: ReleaseSpec, approve: str | None, poll_s: int) -> dict:
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
    d = pause_flow_run(
        wait_for_input=ReleaseApproval.with_initial_data(
            description=f"Approve the public-use file {spec.release.name} {spec.release.year}?",
            approved=False,
            approver="",
        ),
        timeout=spec.approval.timeout_s,
        poll_interval=poll_s,
        key=f"approval-{spec.release.name}-{spec.release.year}",
    )
    return {
        "approver": d.approver,
        "decision": "approved" if d.approved else "rejected",
        "comment": d.comment,
        "at": pub.now(),
    }


def run_release(
    spec_path: str,
    approve: str | None = None,
    year: int | None = None,
    runner: str = "thread",
    dask_address: str | None = None,
) -> Manifest:
    """Run the release flow; runner and dask_address choose where replications run."""
    if runner not in ("thread", "dask"):
        raise ValueError(f"runner must be 'thread' or 'dask', not {runner!r}")
    return release_flow(
        spec_path=str(spec_path),
        approve=approve,
        year=year,
        runner=runner,
        dask_address=dask_address,
    )
