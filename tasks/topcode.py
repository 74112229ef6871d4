"""Prefect task: top- and bottom-coding of the columns in spec.stages.topcode."""

from __future__ import annotations

import numpy as np
import pandas as pd
from prefect import task
from prefect.cache_policies import NO_CACHE

from sdl_design.spec import ReleaseSpec
from sdl_design.topcode import topcode_frame
from tasks.base import StageOutput


@task(name="topcode", cache_policy=NO_CACHE)
def topcode_task(df: pd.DataFrame, spec: ReleaseSpec, seed: int) -> StageOutput:
    """Code every column of spec.stages.topcode with the design weight (deterministic: seed unused)."""
    rules = spec.stages.topcode
    weight = spec.design.weight
    w = df[weight].to_numpy(dtype=float)
    w_total = float(w.sum())
    out, table = topcode_frame(df, rules, weight)
    metrics: dict[str, float] = {}
    params: dict[str, dict] = {}
    notes: list[str] = []
    for col, rule in rules.items():
        t = table[table["column"] == col]
        params[col] = {"by": list(rule.by)}
        for side in ("upper", "lower"):
            ts = t[t["side"] == side]
            if ts.empty:
                continue
            bound = getattr(rule, side).model_dump(exclude_none=True)
            thresholds = [float(v) for v in ts["threshold"]]
            params[col][side] = {
                **bound,
                "threshold": thresholds[0] if not rule.by else thresholds,
            }
            n = int(ts["n_coded"].sum())
            share = float(ts["weight_coded"].sum() / w_total)
            metrics[f"{col}.n_{side}"] = float(n)
            metrics[f"{col}.share_{side}"] = share
            where = f" within groups of {', '.join(rule.by)}" if rule.by else ""
            thr = (
                f"{thresholds[0]:,.6g}"
                if not rule.by
                else f"{np.nanmin(thresholds):,.6g} to {np.nanmax(thresholds):,.6g}"
            )
            how = (
                "their weighted mean (weighted totals preserved)"
                if bound["replace"] == "mean"
                else "the threshold"
            )
            kind = "top" if side == "upper" else "bottom"
            notes.append(
                f"{col}: {kind}-coded at {_rule_text(bound)}{where} (threshold {thr}); "
                f"{n} records ({100 * share:.2f}% of the weighted count) replaced by {how}."
            )
        before = float(np.nansum(w * df[col].to_numpy(dtype=float)))
        after = float(np.nansum(w * out[col].to_numpy(dtype=float)))
        metrics[f"{col}.total_ratio"] = after / before if before else float("nan")
    return StageOutput(
        name="topcode",
        data=out,
        params=params,
        metrics=metrics,
        tables={"thresholds": table},
        notes=notes,
        report_tables=["thresholds"],
    )


def _rule_text(bound: dict) -> str:
    if "percentile" in bound:
        return f"the {bound['percentile']:g}th weighted percentile"
    if "min_count" in bound:
        return f"the value of the {bound['min_count']}-th most extreme record"
    return f"the fixed value {bound['value']:g}"
