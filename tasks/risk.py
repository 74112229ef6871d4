"""Prefect task: pre-treatment disclosure risk (risk strata, GenMASSC scores, log-linear tau1/tau2)."""

from __future__ import annotations

import pandas as pd
from prefect import task
from prefect.cache_policies import NO_CACHE

from sdl_design.plots import histogram
from sdl_design.risk import risk_profile
from sdl_design.spec import ReleaseSpec
from tasks.base import StageOutput, gate


@task(name="risk", cache_policy=NO_CACHE)
def risk_task(df: pd.DataFrame, spec: ReleaseSpec, seed: int) -> StageOutput:
    """Risk of the input file on spec.variables.keys; the data pass through unchanged.
    (No randomness: the seed is accepted for the common stage signature.)"""
    v = spec.variables
    cfg = getattr(spec.stages, "risk", None)  # optional stages.risk section (not in spec.py yet)
    interactions = getattr(cfg, "interactions", False) or False
    prof = risk_profile(
        df,
        v.keys,
        v.sensitive or None,
        weight=spec.design.weight,
        interactions=interactions,
        loglinear=getattr(cfg, "loglinear", True),
    )
    m = prof.metrics
    gates = []
    if spec.gates.max_unique_share is not None:
        gates.append(
            gate("risk.unique_share", m["unique_share"], upper=spec.gates.max_unique_share)
        )
    ll = prof.loglinear
    notes = [
        f"Key profiles on {', '.join(v.key_names)}: {int(m['n_profiles'])} profiles; "
        f"{int(m['n_unique'])} sample uniques ({m['unique_share']:.1%} of records), "
        f"{int(m['n_double'])} in doubles, {int(m['n_triple'])} in triples.",
    ]
    if "mean_score" in m:
        notes.append(
            f"GenMASSC risk scores over {', '.join(s.name for s in v.sensitive)}: "
            f"mean {m['mean_score']:.3f}, max {m['max_score']:.3f}; "
            f"{int(m['n_score_1'])} records at the maximum score 1."
        )
    if ll is not None:
        notes.append(
            f"Log-linear ({ll.method}, {'two-way interactions' if interactions else 'main effects'}, "
            f"{int(ll.info['model_cells'])} cells): "
            f"expected population uniques among sample uniques tau1 = {ll.tau1:.2f}, "
            f"expected correct matches tau2 = {ll.tau2:.2f}."
        )
    records = prof.records.reset_index(names="record")
    records["stratum"] = records["stratum"].astype(str)
    figures = {}
    if records["risk_score"].notna().any():
        figures["score_hist"] = histogram(
            {s: g["risk_score"].to_numpy() for s, g in records.groupby("stratum", sort=True)},
            "GenMASSC risk score r_k",
            "Record risk scores by risk stratum (U, D, T, O)",
        )
    return StageOutput(
        name="risk",
        data=df,
        params={
            "keys": [k.model_dump(exclude_none=True) for k in v.keys],
            "sensitive": [s.name for s in v.sensitive],
            "weight": spec.design.weight,
            "model": "poisson log-linear, pseudo-ML (paper 001 eq. 7)",
            "interactions": interactions if isinstance(interactions, bool) else list(interactions),
        },
        metrics={**m, **({"n_model_cells": ll.info["model_cells"]} if ll is not None else {})},
        tables={
            "records": records,
            "by_stratum": prof.by_stratum,
            "by_profile_size": prof.by_profile_size,
        },
        gates=gates,
        figures=figures,
        notes=notes,
        report_tables=["by_stratum", "by_profile_size"],
    )
