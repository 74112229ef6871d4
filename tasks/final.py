"""Final metrics: SE ratios of the released file against the original, post-treatment risk."""

from __future__ import annotations

import pandas as pd
from prefect import task
from prefect.cache_policies import NO_CACHE

from sdl_design.keys import key_frame
from sdl_design.risk import risk_strata
from sdl_design.spec import ReleaseSpec
from sdl_design.utility import (
    broad_characteristics,
    deff_class,
    deff_class_summary,
    domain_mean_se,
    se_ratio_metrics,
)
from tasks.base import StageOutput


def _se_table(df: pd.DataFrame, spec: ReleaseSpec) -> pd.DataFrame:
    d = spec.design
    rw = spec.replicate_columns(df)
    cols = {
        "weight": d.weight,
        "strata": d.strata,
        "psu": d.psu,
        "segment": d.segment,
        "replicate_weights": rw,
    }
    exclude = [*spec.variables.direct_identifiers, *(c for c in (d.household,) if c)]
    chars = broad_characteristics(df, cols, exclude=exclude, domains=spec.variables.keys[:2])
    method = d.replicate_weights.method if (rw and d.replicate_weights) else None
    rho = d.replicate_weights.rho if method else None
    return domain_mean_se(df, chars, d.weight, d.strata, d.psu, rw, method, rho)


@task(name="final", cache_policy=NO_CACHE)
def final_task(
    df: pd.DataFrame, spec: ReleaseSpec, seed: int, original: pd.DataFrame
) -> StageOutput:
    """SE of every characteristic on the released file (released design) over the original SE."""
    o, f = _se_table(original, spec), _se_table(df, spec)
    t = o.merge(f, on=["variable", "domain", "kind"], suffixes=("_original", "_final"))
    t = t[t["se_original"] > 1e-12 * t["estimate_original"].abs().clip(lower=1.0)]
    out = pd.DataFrame(
        {
            "characteristic": t["variable"] + "|" + t["domain"],
            "variable": t["variable"],
            "domain": t["domain"],
            "kind": t["kind"],
            "estimate_original": t["estimate_original"],
            "estimate_final": t["estimate_final"],
            "se_original": t["se_original"],
            "se_masked": t["se_final"],
            "ratio": t["se_final"] / t["se_original"],
            "deff": t["deff_original"],
        }
    ).reset_index(drop=True)
    if "se_rep_original" in t.columns and "se_rep_final" in t.columns:
        out["ratio_rep"] = (t["se_rep_final"] / t["se_rep_original"]).to_numpy()
    out["deff_class"] = deff_class(out["deff"]).astype(str).to_numpy()
    metrics = se_ratio_metrics(out)
    keys = spec.variables.keys
    before = (risk_strata(original, keys) == "U").mean()
    after = (risk_strata(df, keys) == "U").mean()
    common = df.index.intersection(original.index)
    changed = (key_frame(df.loc[common], keys) != key_frame(original.loc[common], keys)).any(axis=1)
    metrics.update(
        {
            "n_characteristics": float(len(out)),
            "unique_share_before": float(before),
            "unique_share_after": float(after),
            "share_keys_changed": float(changed.mean()) if len(common) else 0.0,
            "share_records_retained": len(df) / len(original),
        }
    )
    notes = [
        f"{len(out)} characteristics: median SE ratio (released / original) "
        f"{metrics.get('se_ratio_median', float('nan')):.3f}, 10th-90th percentile "
        f"{metrics.get('se_ratio_p10', float('nan')):.3f}-{metrics.get('se_ratio_p90', float('nan')):.3f}",
        f"sample uniques on the keys: {before:.1%} before, {after:.1%} after; "
        f"{metrics['share_keys_changed']:.1%} of retained records have a changed key",
    ]
    if metrics.get("se_ratio_n_zero"):
        zero = out.loc[out["ratio"] <= 0, "characteristic"].head(5).tolist()
        notes.append(
            f"{metrics['se_ratio_n_zero']:.0f} characteristics have SE 0 on the released file "
            f"(e.g. {', '.join(zero)}): the treatment left no variation there"
        )
    return StageOutput(
        name="final",
        data=df,
        metrics=metrics,
        tables={
            "se_ratios": out,
            "se_ratio_summary": deff_class_summary(out["ratio"], out["deff"]).reset_index(),
        },
        notes=notes,
        report_tables=["se_ratio_summary", "se_ratios"],
        se_ratio_table="se_ratios",
    )
