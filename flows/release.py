"""The release flow: load -> edits -> risk -> swap -> PRB -> MASSC -> top-coding -> metrics -> gates
-> approval -> publish -> registry."""

from __future__ import annotations

import importlib
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
from sdl_design.spec import ReleaseSpec, load_spec
from tasks.base import StageOutput
from tasks.core import edits_task, gates_task, load_task

# stage name -> (module, task attribute); the order is the flow's
STAGES = [
    ("risk", "tasks.risk", "risk_task"),
    ("swap", "tasks.swap", "swap_task"),
    ("prb", "tasks.prb", "prb_task"),
    ("massc", "tasks.massc", "massc_task"),
    ("topcode", "tasks.topcode", "topcode_task"),
    ("final", "tasks.final", "final_task"),
]


class ReleaseApproval(RunInput):
    approved: bool
    approver: str
    comment: str = ""


class ReleaseRejected(RuntimeError):
    pass


def _lap(manifest: Manifest, name: str, t0: float) -> None:
    """Record a step's wall time in the manifest (internal only)."""
    manifest.timings_s[name] = round(time.perf_counter() - t0, 3)


def _progress(step: int, total: int, name: str, t0: float | None = None) -> None:
    if t0 is None:
        print(f"[puf] ({step}/{total}) {name} ...", file=sys.stderr, flush=True)
    else:
        print(
            f"[puf] ({step}/{total}) {name} done in {time.perf_counter() - t0:.1f} s",
            file=sys.stderr,
            flush=True,
        )


def stage_enabled(spec: ReleaseSpec, name: str) -> bool:
    s = spec.stages
    if name in ("swap", "prb", "massc"):
        cfg = getattr(s, name)
        return cfg is not None and cfg.enabled
    if name == "topcode":
        return bool(s.topcode)
    return True


def _stage_task(module: str, attr: str):
    return getattr(importlib.import_module(module), attr)


def _spec_hash(spec_path: str) -> str:
    return pub.sha256_file(Path(spec_path))


def _new_manifest(spec: ReleaseSpec, spec_hash: str, input_hash: str) -> Manifest:
    return Manifest.new(spec, spec_hash, input_hash)


def _absorb(manifest: Manifest, out: StageOutput) -> None:
    manifest.absorb(out)


def _tables(outputs: list[StageOutput], gates: pd.DataFrame | None) -> dict[str, pd.DataFrame]:
    tables = {f"{o.name}/{k}": v for o in outputs for k, v in o.tables.items()}
    if gates is not None:
        tables["gates"] = gates
    return tables


def _report_writer(outputs: list[StageOutput]):
    def write(manifest: Manifest, path: Path) -> None:
        from flows.report import render_report

        render_report(manifest, outputs, path, stages=[n for n, _, _ in STAGES])

    return write


def _record(manifest: Manifest, outputs: list[StageOutput], spec: ReleaseSpec) -> None:
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
    outputs: list[StageOutput],
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
        spec, manifest, _tables(outputs, gates), _report_writer(outputs), puf, notes
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
    names = [n for n, _, _ in STAGES if stage_enabled(spec, n)]
    total = len(names) + 5
    step = 1
    _progress(step, total, "load")
    t0 = time.perf_counter()
    original, input_hash = load_task(quote(spec))
    _progress(step, total, "load", t0)
    manifest = _new_manifest(spec, _spec_hash(spec_path), input_hash)
    _lap(manifest, "load", t0)
    manifest.counts.n_input = len(original)
    outputs: list[StageOutput] = []
    try:
        step += 1
        _progress(step, total, "edit validation")
        t0 = time.perf_counter()
        edits = edits_task(quote(original), quote(spec))
        _lap(manifest, "edits", t0)
        if not edits["passed"].all():
            err = GateFailed("edit validation failed on the input file", edits)
            _finish(spec, manifest, outputs, edits, "rejected", str(err))
            raise err

        df = original
        for name in names:
            step += 1
            _progress(step, total, name)
            t0 = time.perf_counter()
            module, attr = next((m, a) for n, m, a in STAGES if n == name)
            task = _stage_task(module, attr)
            if name in ("massc", "final"):
                out = task(quote(df), quote(spec), spec.release.seed, quote(original))
            else:
                out = task(quote(df), quote(spec), spec.release.seed)
            if name == "massc" and spec.stages.massc.replications > 0:
                out = _massc_replications(df, spec, original, out)
            outputs.append(out)
            _absorb(manifest, out)
            df = out.data
            out.data = df.iloc[:0]  # keep one frame alive, not one per stage (memory at 1M records)
            _lap(manifest, name, t0)
            _progress(step, total, name, t0)

        step += 1
        _progress(step, total, "gates")
        t0 = time.perf_counter()
        masked = any(o.name == "swap" for o in outputs)
        drop = [c for o in outputs for c in o.drop_public]
        puf = pub.public_frame(df, spec, masked, drop)
        replicate_cols = spec.replicate_columns(puf)
        manifest.counts.n_output = len(puf)
        gate_rows = [g for o in outputs for g in o.gates]
        gates = gates_task(quote(puf), quote(spec), gate_rows, replicate_cols, masked)
        _lap(manifest, "gates", t0)
        if not gates["passed"].all():
            err = GateFailed("release gates failed; nothing was published", gates)
            _finish(spec, manifest, outputs, gates, "rejected", str(err))  # reason: failed checks
            raise err
        manifest.status = "gated"

        step += 1
        _progress(step, total, "approval")
        decision = _approval(spec, approve, approval_poll_s)
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
        _progress(step, total, "publish")
        rep_method = spec.design.replicate_weights.method if spec.design.replicate_weights else None
        notes = pub.variance_notes(spec, masked, rep_method, len(replicate_cols))
        folder = _finish(spec, manifest, outputs, gates, "published", None, puf, notes)
        print(f"[puf] published {manifest.release.release_id} to {folder}", file=sys.stderr)
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


def _massc_replications(
    df: pd.DataFrame, spec: ReleaseSpec, original: pd.DataFrame, out: StageOutput
):
    """Replications of the whole MASSC treatment through the task runner (threads or Dask),
    in one chunk per worker; each replication's seed depends only on its index."""
    import numpy as np

    from tasks.massc import massc_epsilon, massc_replications

    chunks = [
        c.tolist() for c in np.array_split(np.arange(spec.stages.massc.replications), 2) if len(c)
    ]
    futures = massc_replications.map(
        # plain unmapped: Dask turns quote (a tuple subclass) into a tuple on the way to a worker
        unmapped(df),
        unmapped(spec.model_dump(mode="json")),
        spec.release.seed,
        unmapped(original),
        chunks,
    )
    return massc_epsilon(out, [f.result() for f in futures], spec)


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
    """Run the release flow with the chosen task runner (thread pool, or Dask)."""
    fl = release_flow
    if runner == "dask":
        import dask
        from prefect_dask import DaskTaskRunner

        dask.config.set({"distributed.nanny.pre-spawn-environ.MALLOC_MMAP_THRESHOLD_": 4194304})
        tr = (
            DaskTaskRunner(address=dask_address)
            if dask_address
            else DaskTaskRunner(cluster_kwargs={"n_workers": 2, "threads_per_worker": 1})
        )
        fl = release_flow.with_options(task_runner=tr)
    elif runner != "thread":
        raise ValueError(f"runner must be 'thread' or 'dask', not {runner!r}")
    return fl(
        spec_path=str(spec_path),
        approve=approve,
        year=year,
        runner=runner,
        dask_address=dask_address,
    )
