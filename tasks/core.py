"""Prefect tasks of the flow backbone: load, edit validation, gates, publish."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
from prefect import task
from prefect.cache_policies import NO_CACHE

from expectations.suites import validate_edits, validate_metric_gates, validate_output
from flows.publish import sha256_file, sha256_frame
from sdl_design.spec import ReleaseSpec, SpecError


@task(name="load", cache_policy=NO_CACHE)
def load_task(spec: ReleaseSpec) -> tuple[pd.DataFrame, str]:
    """Read the input (Parquet or CSV; the embedded default survey when none) and check it fits the spec."""
    path = spec.release.input
    if path is None:
        from sdl_design.synth import make_survey

        df = make_survey(seed=spec.release.seed)
        digest = sha256_frame(df)
    else:
        path = Path(path)
        if not path.is_file():
            raise SpecError(
                [f"release.input: no file at {path}; give the path of a .parquet or .csv file"]
            )
        if path.suffix.lower() == ".parquet":
            df = pd.read_parquet(path)
        elif path.suffix.lower() == ".csv":
            df = pd.read_csv(path)
        else:
            raise SpecError(
                [f"release.input: {path.name} is neither .parquet nor .csv; convert it"]
            )
        digest = sha256_file(path)
    spec.check_data(df)
    return df, digest


@task(name="edit-validation", cache_policy=NO_CACHE)
def edits_task(df: pd.DataFrame, spec: ReleaseSpec) -> pd.DataFrame:
    # examples are row positions, never a direct identifier: the results reach Prefect's logs
    # (GateFailed) and artifacts (issue 15 item 8)
    return validate_edits(df, spec.edits)


@task(name="gates", cache_policy=NO_CACHE)
def gates_task(
    puf: pd.DataFrame,
    spec: ReleaseSpec,
    gates: list[dict],
    replicate_columns: list[str],
    masked: bool,
) -> pd.DataFrame:
    """Output-file gates and metric threshold gates, one results table."""
    return pd.concat(
        [validate_metric_gates(gates), validate_output(puf, spec, replicate_columns, masked)],
        ignore_index=True,
    )
