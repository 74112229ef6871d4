"""`puf tune`: candidate settings of the enabled stages, each run to the assessment of its
would-be public file, in parallel through the run's task runner; a table, the Duncan
risk-utility map and a recommended spec in a scratch folder (internal only, never public/).

The search itself is sdl_design.tune.search; this module maps its batches of candidates onto
Prefect tasks. A task gets the spec (JSON) and the changes, not the survey: it finds the
original in its process (the flow's own process for threads; a Dask worker loads it once from
release.input and checks the input hash) together with the process's cache of shared earlier
stage results.
"""

from __future__ import annotations

import base64
import json
import sys
import threading
import time
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pandas as pd
from prefect import flow, task
from prefect.cache_policies import NO_CACHE
from prefect.utilities.annotations import quote, unmapped

from flows.env import task_runner
from flows.html import artifact_key
from flows.report import _plain
from sdl_design import tune
from sdl_design.spec import ReleaseSpec, load_spec
from tasks.core import load_task

WORKERS = 2  # the task runners' parallelism (flows.env.task_runner)

_LOCK = threading.Lock()
_ORIGINALS: dict[str, tuple[pd.DataFrame, tune.PrefixCache]] = {}  # input hash -> (frame, cache)


def tune_dir(spec: ReleaseSpec) -> Path:
    """The scratch folder of a spec's tuning: <output_dir>/<name>/tune/<year> (beside the
    release folders <output_dir>/<name>/<year>, which a release replaces whole)."""
    rel = spec.release
    return Path(rel.output_dir) / rel.name / "tune" / str(rel.year)


def _original(spec: ReleaseSpec, input_hash: str) -> tuple[pd.DataFrame, tune.PrefixCache]:
    """The original file of this process and its stage cache; loaded from release.input (and
    checked against the flow's input hash) the first time a process needs it."""
    with _LOCK:
        hit = _ORIGINALS.get(input_hash)
        if hit is None:
            df, digest = load_task.fn(spec)
            if digest != input_hash:
                raise RuntimeError(
                    f"the worker read another input than the flow ({spec.release.input}): "
                    "give the workers the same file"
                )
            hit = _ORIGINALS[input_hash] = (df, tune.PrefixCache(df))
        return hit


def _register(original: pd.DataFrame, input_hash: str) -> None:
    """Make the flow's original the one of this process: the thread runner's tasks find it
    here, Dask workers load their own. (A function of its own: the flow's code is shipped to
    Dask workers, and a lock it named would not pickle.)"""
    with _LOCK:
        _ORIGINALS.setdefault(input_hash, (original, tune.PrefixCache(original)))


@task(name="tune-candidate", cache_policy=NO_CACHE, task_run_name="candidate-{label}")
def evaluate_task(
    spec_json: str,
    input_hash: str,
    changes: list,
    paths: list[str],
    skip: list[str],
    label: str = "",
) -> dict[str, Any]:
    """One candidate run to the assessment (sdl_design.tune.evaluate): its row."""
    spec = ReleaseSpec.model_validate_json(spec_json)
    original, cache = _original(spec, input_hash)
    return tune.evaluate(spec, original, [tuple(c) for c in changes], cache, paths, skip)


def progress_line(i: int, budget: int, c: tune.Candidate, r: dict) -> str:
    """One candidate's line: its risk index with the risk gate that sets it, its utility."""
    if r.get("error"):
        state = f"error: {r['error']}"
    else:
        by = tune.binding_text(r)
        state = (
            f"risk index {r['risk_index']:.3f}{f' ({by})' if by else ''}  utility "
            f"{r['utility']:.4f} (overlap median {r['overlap_median']:.4f}, beyond 2 SE "
            f"{r['share_abs_std_bias_gt2']:.4f})  "
            + ("passes every risk gate" if r["passes_risk"] else "fails a risk gate")
        )
    return f"[puf] tune ({i}/{budget}) {c.label}: {state}  [{r['seconds']:.1f} s]"


def _progress(i: int, budget: int, c: tune.Candidate, r: dict) -> None:
    """The candidate's line on stderr; after the first (the spec's own), what the numbers are."""
    lines = [progress_line(i, budget, c, r)]
    if i == 1 and not r.get("error"):
        lines += [f"[puf] tune: {ln}" for ln in tune.axis_lines(r)]
    # written, not printed: log_prints would turn a print into a log record below the level
    sys.stderr.write("".join(ln + "\n" for ln in lines))
    sys.stderr.flush()


@flow(name="puf-tune", log_prints=True)
def tune_flow(
    spec_path: str,
    budget: int = 24,
    runner: str = "thread",
    dask_address: str | None = None,
) -> dict[str, Any]:
    """Search the spec's treatment settings (sdl_design.tune.search) with candidates in parallel
    on the runner; write candidates.csv, risk_utility_map.png and recommended_spec.yaml to the
    scratch folder and post the map and the table as artifacts. Returns a summary."""

    spec = load_spec(spec_path)
    original, input_hash = load_task(quote(spec))
    _register(original, input_hash)
    spec_json = spec.model_dump_json()
    paths = [f.path for f in tune.factors(spec, original)]
    count = [0]

    with task_runner(runner, dask_address) as tr:

        def run_batch(cands: list[tune.Candidate], skip: Sequence[str]) -> list[dict]:
            futures = tr.map(
                evaluate_task,
                parameters={
                    "spec_json": unmapped(spec_json),
                    "input_hash": unmapped(input_hash),
                    "changes": [[list(ch) for ch in c.changes] for c in cands],
                    "paths": unmapped(paths),
                    "skip": unmapped(list(skip)),
                    "label": [c.label[:60] for c in cands],
                },
            )
            rows = []
            for c, f in zip(cands, futures, strict=True):
                rows.append(f.result())
                count[0] += 1
                _progress(count[0], budget, c, rows[-1])
            return rows

        result = tune.search(spec, original, budget, run_batch=run_batch, batch=WORKERS)
    folder = tune_dir(spec)
    out = write_outputs(result, spec, Path(spec_path), folder)
    post_tune_artifacts(result, spec, out)
    return out


def write_outputs(
    result: tune.TuneResult, spec: ReleaseSpec, spec_path: Path, folder: Path
) -> dict[str, Any]:
    """candidates.csv, risk_utility_map.png and (when a candidate passes every risk gate)
    recommended_spec.yaml in folder; returns their paths and the recommended row."""
    folder.mkdir(parents=True, exist_ok=True)
    t = result.table
    t.to_csv(folder / "candidates.csv", index=False)
    rel = spec.release
    title = f"Risk-utility map: {rel.name} {rel.year}, {len(t)} candidate settings"
    png = tune.risk_utility_map(t, result.recommended, title)
    (folder / "risk_utility_map.png").write_bytes(png)
    own = t[t["changes"] == "[]"].iloc[0]
    out: dict[str, Any] = {
        "folder": str(folder),
        "candidates": str(folder / "candidates.csv"),
        "map": str(folder / "risk_utility_map.png"),
        "recommended_spec": None,
        "recommended": None,
        "own": _summary(own),
        "axes": tune.axis_lines(own),
        "n_candidates": len(t),
        "seconds": round(result.seconds, 1),
    }
    rec_path = folder / "recommended_spec.yaml"
    if result.recommended is None:
        rec_path.unlink(missing_ok=True)
        return out
    row = t.loc[result.recommended]
    cand = result.candidates[result.recommended]
    changes = list(cand.changes)
    reasons = tune.change_reasons(result, result.recommended)
    changes, reasons = _rebase(spec_path, folder, changes, reasons)
    header = (
        f"Recommended by `puf tune` from {spec_path} ({datetime.now(UTC):%Y-%m-%d %H:%M} UTC), "
        f"{len(t)} candidates.\n"
        f"Candidate: {cand.label}\n"
        f"Risk index {row['risk_index']:.4f}, {tune.binding_text(row)} (every risk gate holds; "
        f"spec's own {own['risk_index']:.4f}); overlap median {row['overlap_median']:.4f} (own "
        f"{own['overlap_median']:.4f}); share beyond 2 SE {row['share_abs_std_bias_gt2']:.4f} "
        f"(own {own['share_abs_std_bias_gt2']:.4f}).\n"
        + (
            f"Gates still failing: {row['failed_gates']}"
            if row["failed_gates"]
            else "All gates hold."
        )
        + f"\n{tune.RISK_AXIS}.\n{tune.UTILITY_AXIS}."
    )
    text = tune.redact_seed(tune.recommended_yaml(spec_path.read_text(), changes, reasons, header))
    rec_path.write_text(text)
    out["recommended_spec"] = str(rec_path)
    out["recommended"] = _summary(row)
    return out


def _rebase(
    spec_path: Path, folder: Path, changes: list, reasons: list[str]
) -> tuple[list, list[str]]:
    """Relative release.input and release.output_dir of the spec, made absolute: the
    recommended spec sits in the tuning folder, not next to the original."""
    import yaml

    data = yaml.safe_load(spec_path.read_text())
    base = spec_path.resolve().parent
    if base == folder.resolve():
        return changes, reasons
    changes, reasons = list(changes), list(reasons)
    for key in ("input", "output_dir"):
        v = (data.get("release") or {}).get(key)
        if v is not None and not Path(str(v)).is_absolute():
            changes.append((f"release.{key}", str((base / str(v)).resolve())))
            reasons.append(f"absolute: this file sits in {folder}, not next to {spec_path.name}")
    return changes, reasons


def _summary(row: pd.Series) -> dict[str, Any]:
    keys = ["candidate", "risk_index", "utility", "overlap_median", "overlap_p5"]
    keys += ["share_abs_std_bias_gt2", "passes_risk", "passes_all", "failed_gates"]
    out = {k: (row[k].item() if hasattr(row[k], "item") else row[k]) for k in keys if k in row}
    out["risk_set_by"] = tune.binding_text(row)
    return out


TABLE_COLUMNS = [  # the artifact's columns: the candidate, its risk and utility, its verdict
    "candidate",
    "origin",
    *tune.RISK_COLUMNS,
    *tune.UTILITY_COLUMNS,
    "passes_risk",
    "passes_all",
    "pareto",
]


def post_tune_artifacts(result: tune.TuneResult, spec: ReleaseSpec, out: dict) -> list[str]:
    """A markdown artifact (summary and the map, embedded) and a table artifact (candidates)."""
    from prefect.artifacts import create_markdown_artifact, create_table_artifact

    rel = spec.release
    key = artifact_key(f"puf-tune-{rel.name}-{rel.year}")
    rec = out["recommended"]
    png = base64.b64encode(Path(out["map"]).read_bytes()).decode()
    md = [
        f"# Tuning {rel.name} {rel.year}: {out['n_candidates']} candidates in {out['seconds']} s",
        "",
        f"Spec's own: risk index {out['own']['risk_index']:.4f}, overlap median "
        f"{out['own']['overlap_median']:.4f}, share beyond 2 SE "
        f"{out['own']['share_abs_std_bias_gt2']:.4f}.",
        "",
        (
            f"**Recommended:** {rec['candidate']}: risk index {rec['risk_index']:.4f}, overlap "
            f"median {rec['overlap_median']:.4f}, share beyond 2 SE "
            f"{rec['share_abs_std_bias_gt2']:.4f}; spec `{out['recommended_spec']}`."
            if rec
            else "**No candidate passes every risk gate**: no spec is recommended."
        ),
        "",
        *[f"- {ln.strip()}" for ln in out.get("axes", [])],
        "",
        f"![risk-utility map](data:image/png;base64,{png})",
        "",
        f"Files: `{out['folder']}` (candidates.csv, risk_utility_map.png"
        + (", recommended_spec.yaml)" if rec else ")"),
    ]
    create_markdown_artifact(key=f"{key}-map", markdown="\n".join(md), description="tuning")
    cols = [c for c in TABLE_COLUMNS if c in result.table.columns]
    rows = [{c: _plain(v) for c, v in r.items()} for r in result.table[cols].to_dict("records")]
    create_table_artifact(key=f"{key}-candidates", table=rows, description="tuning candidates")
    return [f"{key}-map", f"{key}-candidates"]


def run_tune(
    spec_path: str, budget: int = 24, runner: str = "thread", dask_address: str | None = None
) -> dict[str, Any]:
    """Run the tuning flow; returns its summary (paths, spec's own and recommended rows)."""
    if runner not in ("thread", "dask"):
        raise ValueError(f"runner must be 'thread' or 'dask', not {runner!r}")
    t0 = time.perf_counter()
    out = tune_flow(
        spec_path=str(spec_path), budget=int(budget), runner=runner, dask_address=dask_address
    )
    out["wall_seconds"] = round(time.perf_counter() - t0, 1)
    return json.loads(json.dumps(out, default=str))
