"""The partitioned release published (`puf partitioned --publish --approve NAME`): the run of
flows.scan.run_partitioned inside a release transaction (flows.txn), its public files staged
with the release's record (manifest, stage tables, report) and published as the release flow
publishes them: nothing reaches public/ unless every gate passes and a person approves.

The records after each stage are written inside the attempt's folder and deleted when the
attempt ends (published, rejected or failed; recovery deletes them after a crash): the record
keeps the stages' tables, as the release flow's does."""

from __future__ import annotations

# first: a deployment loads this file by path (not through flows/__init__), and the CPU
# kernels are pinned only when sdl_design is imported before numpy (sdl_design.cpu)
import sdl_design  # noqa: F401

# isort: split

import hashlib
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pandas as pd
from prefect import flow

from expectations.suites import GateFailed
from flows import publish as pub
from flows.manifest import Manifest
from flows.progress import prints_to_run_log
from flows.release import (
    ReleaseRejected,
    _approval,
    _post,
    _run_name,
    _Steps,
    close_attempt,
    publish_gated,
)
from flows.scan import run_partitioned
from flows.txn import PARTITIONED, Transaction
from sdl_design.io import file_digest
from sdl_design.spec import ReleaseSpec, SpecError, load_spec
from sdl_design.stage import StageResult


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
    for name in ("README.md", "codebook.csv", "puf.csv", "puf.parquet"):
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
) -> tuple[Manifest, dict[str, Any]]:
    """Run the spec's release by partition and publish it: (the manifest, run_partitioned's
    result). decide(staged, artifact keys): the board's decision (default: approve's name on
    the command line); post(manifest, ...): the run's artifacts (in a flow run). Raises
    GateFailed when a gate fails (nothing published), ReleaseRejected when the board rejects,
    SpecError when the spec needs an approval and neither decide nor approve is given or a
    stage has no partitioned path, and what the transaction raises (ReleaseLocked,
    RegistryError, PublishError). Each step prints its line (1..5, flows.release._Steps)."""

    spec = load_spec(spec_path)
    if decide is None and spec.approval.required and not approve:
        raise SpecError(
            [
                "approval.required: give the approver (--approve NAME), or run "
                "partitioned_release_flow, which pauses for the board's decision"
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
            _absorb(manifest, results, out)
            gates = pd.read_csv(work / "gates.csv", keep_default_na=False, na_values=[""])
            manifest.set_gates(gates)
            steps.done("gates", t0)
            if not gates["passed"].all():
                err = GateFailed("release gates failed; nothing was published", gates)
                close_attempt(txn, spec, manifest, results, gates, "rejected", str(err))
                raise err
            manifest.status = "gated"
            _publish(txn, spec, manifest, results, gates, work, steps, decide, approve, post)
            return manifest, out
        except ReleaseRejected:
            raise
        except GateFailed as e:  # the input's edit rules (the gates closed the attempt)
            if txn.state == "running":
                close_attempt(txn, spec, manifest, results, e.results, "rejected", str(e))
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


def _publish(
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


def _absorb(manifest: Manifest, results: list[StageResult], out: dict[str, Any]) -> None:
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


# log_prints off: Prefect's print_as_log drops the scan's partition lines (printed to stderr)
# below the quiet WARNING level, from the terminal too; prints_to_run_log sends them to both
@flow(name="puf-partitioned-release", log_prints=False, flow_run_name=_run_name)
def partitioned_release_flow(
    spec_path: str,
    approve: str | None = None,
    runner: str = "thread",
    dask_address: str | None = None,
    partitions: int | None = None,
    approval_poll_s: int = 10,
) -> Manifest:
    """publish_partitioned as a Prefect flow: the run's artifacts posted and, without an
    approver, a pause for the board's decision (the release flow's form: approved or rejected,
    a non-blank approver), as `puf run` waits."""

    spec = load_spec(spec_path)

    def decide(staged: Path, keys: list[str]) -> dict:
        return _approval(spec, approve, approval_poll_s, staged, keys)

    with prints_to_run_log():
        manifest, _ = publish_partitioned(
            spec_path, approve, runner, dask_address, partitions, decide=decide, post=_post
        )
    return manifest
