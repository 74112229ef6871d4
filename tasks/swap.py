"""Prefect task: segment/PSU masking by the sequential variance-preserving segment swap."""

from __future__ import annotations

import pandas as pd
from prefect import task
from prefect.cache_policies import NO_CACHE

from sdl_design.rng import stage_rng
from sdl_design.swap import design_columns, se_ratio_boxplot, swap_segments
from sdl_design.utility import broad_characteristics, deff_class_summary, se_ratio_metrics
from tasks.base import StageOutput, design_from_spec, gate

# the SE-ratio summaries (Table 1 form) the report shows, in order; the pairs stay in their CSV
SUMMARIES = ("se_ratio_summary", "se_ratio_summary_baseline", "se_ratio_summary_replicate")


@task(name="swap", cache_policy=NO_CACHE)
def swap_task(df: pd.DataFrame, spec, seed: int) -> StageOutput:
    """Swap segments between PSUs (spec.stages.swap); pseudo labels, rebuilt replicate weights,
    SE ratios by design-effect class against the baseline method."""
    st = spec.stages.swap
    design = design_from_spec(df, spec)
    dc = design_columns(design)
    exclude = list(spec.variables.direct_identifiers)
    if spec.design.household:
        exclude.append(spec.design.household)
    chars = broad_characteristics(df, design=dc, exclude=exclude, domains=spec.variables.keys[:2])
    kw = dict(
        max_share=st.max_share,
        cumulative=st.cumulative,
        scope=st.scope,
        replicate_method=st.replicate_method,
        rho=st.rho,
        characteristics=chars,
    )
    res = swap_segments(
        df, design, st.matching, st.rate, method=st.method, seed=stage_rng(seed, "swap"), **kw
    )
    other = "2a" if st.method == "2b" else "2b"
    base = swap_segments(
        df, design, st.matching, st.rate, method=other, seed=stage_rng(seed, "swap-baseline"), **kw
    )
    se = res.se_ratios
    metrics = {
        "n_swapped": float(res.params["n_swapped"]),
        "share_swapped": float(res.params["share_swapped"]),
        "n_characteristics": float(len(se)),
        **se_ratio_metrics(se, "se_ratio"),
        **se_ratio_metrics(se[se["matching"]], "se_ratio_matching"),
        **se_ratio_metrics(base.se_ratios, f"se_ratio_baseline_{other}"),
    }
    if "ratio_rep" in se.columns:
        metrics.update(se_ratio_metrics(se, "se_ratio_rep", column="ratio_rep"))
    tables = {
        "pairs": res.pairs,
        "se_ratios": se,
        "se_ratio_summary": _summary(se, "ratio", st.method, "taylor"),
        "se_ratio_summary_baseline": _summary(base.se_ratios, "ratio", other, "taylor"),
        "matching_variance": res.variance.reset_index(),
    }
    if "ratio_rep" in se.columns:
        tables["se_ratio_summary_replicate"] = _summary(se, "ratio_rep", st.method, "replicate")
    gates = []
    if spec.gates.se_ratio is not None:
        lo, hi = spec.gates.se_ratio
        for key, label in (
            ("median", "median"),
            ("p10", "10th percentile"),
            ("p90", "90th percentile"),
        ):
            gates.append(
                gate(
                    f"swap: {label} of SE ratios, broad set (Taylor)",
                    metrics[f"se_ratio_{key}"],
                    lo,
                    hi,
                )
            )
    figs = {
        "se_ratio_boxplot": se_ratio_boxplot(
            {
                "2a": (base if other == "2a" else res).se_ratios,
                "2b": (res if other == "2a" else base).se_ratios,
            }
        )
    }
    notes = [
        f"Method {st.method}: {res.params['n_pairs']} segment pairs swapped "
        f"({res.params['share_swapped']:.1%} of {res.params['n_segments']} segments); "
        f"median SE ratio {metrics['se_ratio_median']:.3f} over {len(se)} characteristics "
        f"(baseline {other}: {metrics[f'se_ratio_baseline_{other}_median']:.3f}).",
        *res.notes,
    ]
    return StageOutput(
        name="swap",
        data=res.data,
        params={**res.params, "baseline": other},
        metrics=metrics,
        tables=tables,
        gates=gates,
        figures=figs,
        drop_public=[c for c in (spec.design.segment,) if c],
        notes=notes,
        report_tables=[
            *(k for k in SUMMARIES if k in tables),
            "matching_variance",
            "se_ratios",
        ],
        se_ratio_table="se_ratios",
    )


def _summary(se: pd.DataFrame, column: str, method: str, variance: str) -> pd.DataFrame:
    t = deff_class_summary(se[column], se["deff"])
    t.index.name = "statistic"
    return t.reset_index().assign(method=method, variance=variance)
