"""Prefect task: PRB post-randomization of the set C (spec.stages.prb)."""

from __future__ import annotations

import pandas as pd
from prefect import task
from prefect.cache_policies import NO_CACHE

from sdl_design.edits import failure_counts
from sdl_design.plots import histogram
from sdl_design.prb import (
    block_risk,
    count_changes,
    default_combos,
    empirical_risk,
    post_randomize,
    risk_by_block,
    tvd_table,
)
from sdl_design.rng import stage_rng
from sdl_design.spec import ReleaseSpec
from tasks.base import StageOutput, design_from_spec, gate


class PrbEditFailure(RuntimeError):
    pass


@task(name="prb", cache_policy=NO_CACHE)
def prb_task(df: pd.DataFrame, spec: ReleaseSpec, seed: int) -> StageOutput:
    """Post-randomize spec.stages.prb.variables; verification tables; gate on max R_j(1, t)."""
    cfg = spec.stages.prb
    weight = spec.design.weight
    xi = spec.gates.xi or cfg.xi
    rng = stage_rng(seed, "prb")
    notes: list[str] = []
    res = post_randomize(
        df,
        cfg.variables,
        cfg.xi,
        weight,
        cfg.partition,
        seed=rng,
        method=cfg.method,
        tuned=cfg.tuned,
    )
    risk = block_risk(res.block, res.cell, res.theta)  # eq. 2.2, apart from the draw
    bad = failure_counts(res.data, spec.edits)
    if bad:
        raise PrbEditFailure(
            "PRB output breaks edit rules "
            + "; ".join(f"edits[{i}] ({n} records)" for i, n in bad.items())
            + ": add the variables these rules tie to the set C or partition on them"
        )
    other = "nzy" if cfg.method == "prb" else "prb"
    base = post_randomize(
        df, cfg.variables, cfg.xi, weight, cfg.partition, seed=rng, method=other, theta=res.theta
    )
    combos = default_combos(cfg.variables[:5])  # pairs and triples (Table 6)
    tv = tvd_table(df, {cfg.method: res.data, other: base.data}, combos, weight)
    se = None
    if spec.design.replicate_weights and spec.replicate_columns(df):

        def se(frame: pd.DataFrame, v: str) -> pd.Series:
            est = design_from_spec(frame.assign(_one=1.0), spec).total("_one", by=v)
            return est["se"].droplevel("variable")

    max_risk = float(risk["risk"].max()) if len(risk) else 0.0
    n_changed = int(res.changed.sum())
    notes += res.merges + res.notes
    notes.append(
        f"PRB ({cfg.method}) changed {n_changed} of {int(res.block.notna().sum())} singleton/"
        f"doubleton records; max exact identification risk {max_risk:.4f} <= xi {xi}"
    )
    return StageOutput(
        name="prb",
        data=res.data,
        params={"xi": cfg.xi, "theta": res.theta, "m0": res.m0, "method": cfg.method},
        metrics={
            "theta": res.theta,
            "m0": float(res.m0),
            "max_risk": max_risk,
            "n_blocks": float(risk["block"].nunique()) if len(risk) else 0.0,
            "n_changed": float(n_changed),
            "share_changed": n_changed / max(len(df), 1),
            f"tvd_mean_{cfg.method}": float(tv[cfg.method].mean()) if len(tv) else 0.0,
            f"tvd_mean_{other}": float(tv[other].mean()) if len(tv) else 0.0,
        },
        tables={
            "blocks": res.block.to_frame(),
            "risk_by_block": risk_by_block(risk).reset_index(),
            "identification_risk": empirical_risk(res).reset_index(names="row"),
            "weighted_counts": count_changes(df, res.data, cfg.variables, weight, se).reset_index(),
            "tvd": tv,
        },
        gates=[gate("prb.max_identification_risk", max_risk, upper=xi)],
        figures={
            "risk_hist": histogram(
                risk["risk"].to_numpy(),
                "exact identification risk (eq. 2.2)",
                "Identification risk of singleton/doubleton records after PRB",
                vline=xi,
                vlabel=f"xi = {xi:g}",
            )
        }
        if len(risk)
        else {},
        notes=notes,
        report_tables=["identification_risk", "risk_by_block", "weighted_counts", "tvd"],
    )
