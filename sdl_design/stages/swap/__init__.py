"""The swap stage: segment/PSU masking by the sequential variance-preserving swap."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pandas as pd

from sdl_design.describe import REPLICATES, Describes, NumberColumn, Tunable, cite, more_less, pct
from sdl_design.engine import partitions as part
from sdl_design.engine.records import Records, passes_result
from sdl_design.spec import ReleaseSpec, SwapSection
from sdl_design.stage import StageContext, StageResult
from sdl_design.stages.swap import passes as psw
from sdl_design.stages.swap.method import (
    _class_summary,
    se_ratio_boxplot,
    swap_design_problems,
    swap_segments,
)
from sdl_design.survey.design import SurveyDesign, design_columns
from sdl_design.utility import (
    broad_characteristics,
    original_domain_se,
    original_se_table,
    se_exclude,
    se_ratio_metrics,
)


class SwapStage(Describes):
    """Stage: segment/PSU masking by the sequential variance-preserving swap (Method 2b or 2a),
    with the other method run as the baseline; pseudo labels, rebuilt replicate weights, SE
    ratios by design-effect class (paper 003 Table 1)."""

    name = "swap"
    replications = 0
    treated_share = "share_swapped"  # of segments moved to another PSU
    keeps_se_ratios = True

    @classmethod
    def preflight_numbers(cls, spec: ReleaseSpec) -> list[NumberColumn]:
        """The matching variables: numbers or true/false, and varying (they guide the swap)."""
        return [
            NumberColumn(f"stages.swap.matching[{i}]", c, bool_ok=True, guides="guide the swap")
            for i, c in enumerate(spec.stages.swap.matching)
        ]

    @classmethod
    def preflight_design(cls, spec: ReleaseSpec, df: pd.DataFrame) -> list[str]:
        """Segments nested in PSUs of a stratified design (swap_design_problems)."""
        return swap_design_problems(spec, df)

    @classmethod
    def public_method(cls, result: StageResult, des: dict[str, Any]) -> list[str]:
        """The public README's section on the masked design."""
        p = result.params
        return [
            f"### Masked design (segment swapping): {cite('003')}",
            "",
            f"{p.get('n_swapped')} of {p.get('n_segments')} segments "
            f"({pct(p.get('share_swapped', 0.0))}) were swapped between PSUs, each partner chosen "
            "so that the variances of the matching characteristics change as little as possible "
            f"(method {p.get('method')}). The published `{des['strata']}` and `{des['psu']}` are "
            "pseudo-strata and pseudo-PSUs, renumbered; replicate weights were rebuilt for them. "
            "Use them as ordinary strata and PSUs (below); standard errors stay close to those "
            "of the original design (the release's SE-ratio gate checks them).",
            "",
        ]

    @classmethod
    def public_treatments(cls, result: StageResult, des: dict[str, Any]) -> dict[str, list[str]]:
        """The published design labels are pseudo labels; the replicate weights were rebuilt."""
        p = result.params
        label = (
            f"pseudo-design label: {p.get('n_swapped', '?')} of {p.get('n_segments', '?')} "
            f"segments ({pct(p.get('share_swapped', 0.0))}) swapped between PSUs by method "
            f"{p.get('method', '')} of {cite('003')}, labels renumbered"
        )
        out = {c: [label] for c in dict.fromkeys((des["strata"], des["psu"])) if c}
        return {**out, REPLICATES: [" rebuilt for the masked design"]}

    @classmethod
    def does(cls, spec: ReleaseSpec, column: str = "", side: str = "upper") -> str:
        """The swap exchanges whole segments (the design's segment column) between PSUs."""
        seg = spec.design.segment
        unit = f"segments (`{seg}`)" if seg else "segments"
        return f"the swap exchanges whole {unit} between PSUs"

    @classmethod
    def tunables(cls, spec: ReleaseSpec, original: pd.DataFrame | None) -> list[Tunable]:
        """The swap rate (a coarse ladder) and the choice of eq. 6a or 6b."""
        does = cls.does(spec)
        rate = more_less(
            does,
            "more of them change PSU, so the published pseudo-PSUs tell less about where a "
            "record was sampled",
            "fewer of them change PSU, so the published design stays closer to the original "
            "and its SEs change less",
        )

        def eq(o: Any, v: Any) -> str:
            return f"{does}, each pair chosen by " + (
                "eq. 6b (the cumulative change of the variances from the original) instead of "
                "eq. 6a (each swap's own change)"
                if v
                else "eq. 6a (each swap's own change of the variances) instead of eq. 6b "
                "(the cumulative change)"
            )

        return [
            Tunable("stages.swap.rate", [0.05, 0.1, 0.2, 0.3, 0.5], True, rate, +1),
            Tunable("stages.swap.cumulative", [not spec.stages.swap.cumulative], False, eq),
        ]

    def __init__(self, section: SwapSection, spec: ReleaseSpec):
        self.section, self.spec = section, spec

    @classmethod
    def from_spec(cls, spec: ReleaseSpec) -> SwapStage | None:
        section = spec.stages.active("swap")
        return None if section is None else cls(section, spec)

    def run(self, df: pd.DataFrame, ctx: StageContext) -> StageResult:

        st, spec = self.section, self.spec
        design = ctx.design if df is ctx.original else SurveyDesign.from_spec(df, spec.design)
        chars = broad_characteristics(
            df,
            design=design_columns(design),
            exclude=se_exclude(spec),
            domains=spec.variables.keys[:2],
        )
        if df is ctx.original:  # the original's SE table, kept for later stages
            original_se = original_se_table(ctx, se_exclude(spec), chars)
        else:
            original_se = original_domain_se(df, design_columns(design), chars)
        kw = dict(
            max_share=st.max_share,
            cumulative=st.cumulative,
            scope=st.scope,
            replicate_method=st.replicate_method,
            rho=st.rho,
            characteristics=chars,
            original_se=original_se,  # once for both methods
        )
        other = "2a" if st.method == "2b" else "2b"
        # the swap and its baseline at once: independent streams, both mostly numpy (which
        # leaves the interpreter); their peak stays under MASSC's at 1M records
        with ThreadPoolExecutor(2, thread_name_prefix="puf-swap") as pool:
            runs = [
                pool.submit(
                    swap_segments, df, design, st.matching, st.rate, method=m, seed=rng, **kw
                )
                for m, rng in ((st.method, ctx.rng("swap")), (other, ctx.rng("swap-baseline")))
            ]
            res, base = (r.result() for r in runs)
        se = res.se_ratios
        metrics = {
            "n_swapped": float(res.params["n_swapped"]),
            "share_swapped": float(res.params["share_swapped"]),
            "n_characteristics": float(len(se)),
            **se_ratio_metrics(se, "se_ratio"),
            **se_ratio_metrics(se[se["matching"]], "se_ratio_matching"),
            **se_ratio_metrics(base.se_ratios, f"se_ratio_baseline_{other}"),
        }
        tables = {
            "pairs": res.pairs,
            "se_ratios": se,
            "se_ratio_summary": _class_summary(se, "ratio", st.method, "taylor"),
            "se_ratio_summary_baseline": _class_summary(base.se_ratios, "ratio", other, "taylor"),
            "matching_variance": res.variance.reset_index(),
        }
        if "ratio_rep" in se.columns:
            metrics.update(se_ratio_metrics(se, "se_ratio_rep", column="ratio_rep"))
            tables["se_ratio_summary_replicate"] = _class_summary(
                se, "ratio_rep", st.method, "replicate"
            )
        by_method = {st.method: res.se_ratios, other: base.se_ratios}
        figures = {"se_ratio_boxplot": se_ratio_boxplot({m: by_method[m] for m in ("2a", "2b")})}
        notes = [
            f"Method {st.method}: {res.params['n_pairs']} segment pairs swapped "
            f"({res.params['share_swapped']:.1%} of {res.params['n_segments']} segments); "
            f"median SE ratio {metrics['se_ratio_median']:.3f} over {len(se)} characteristics "
            f"(baseline {other}: {metrics[f'se_ratio_baseline_{other}_median']:.3f}).",
            *res.notes,
        ]
        return StageResult(
            name=self.name,
            data=res.data,
            params={**res.params, "baseline": other},
            metrics=metrics,
            tables=tables,
            report_tables=[
                t
                for t in (
                    "se_ratio_summary",
                    "se_ratio_summary_baseline",
                    "se_ratio_summary_replicate",
                    "matching_variance",
                    "se_ratios",
                )
                if t in tables
            ],
            se_ratio_table="se_ratios",
            figures=figures,
            drop_public=[c for c in (spec.design.segment,) if c],
            notes=notes,
            masks_design=True,
        )

    @classmethod
    def summary_lines(cls, result: StageResult) -> list[str]:
        """Segment pairs swapped."""
        m = result.metrics
        return [
            f"  swap        : {int(m['n_pairs'])} segment pairs swapped "
            f"({m['share_swapped']:.1%} of {int(m['n_segments'])} segments); pairs in "
            "internal/swap/pairs.csv (confidential)"
        ]

    def run_partitions(self, records: Records, ctx: StageContext) -> StageResult:
        """The swap by partition: pass 1 reads each partition's segments and bounds, pass 2
        its exact segment sums; the driver chooses the swaps, pseudo labels and replicate
        factors from those sums with the stage's Generator; every worker masks and writes its
        partitions."""
        spec, parts, run_map = ctx.spec, records.parts, records.run_map
        req = psw.swap_request(spec, records.columns)
        missing = [c for c in req.columns if c not in records.columns]
        if missing:
            raise part.PartitionError(
                f"the spec names columns {missing} that are not in the input; fix them"
            )
        try:  # the swap's checks name the field to fix (design.segment, stages.swap.matching)
            first = run_map(psw.swap_pass1, parts, spec, req, what="swap pass 1")
            design = psw.swap_design(first, req)
        except ValueError as e:
            raise part.PartitionError(str(e)) from e
        records.lap("pass1")
        sums = run_map(psw.swap_pass2, parts, spec, req, design, what="swap pass 2")
        records.lap("pass2")
        masking, counts, tables = psw.swap_masking(req, design, sums, ctx.rng())
        records.lap("plan")
        n = f"{counts['n_pairs']} segment pairs swapped"
        records.say(f"{n} ({counts['n_swapped']} of {counts['n_segments']} segments)")
        args = (spec, req, design.segment_labels, masking, records.data)
        files = run_map(psw.swap_apply, parts, *args, what="swap masking")
        records.lap("masking")
        st = req.section
        settings = {
            "method": st.method,
            "rate": st.rate,
            "max_share": st.max_share,
            "cumulative": st.cumulative,
            "scope": st.scope,
        }
        params = {  # as run() makes them (its swap_segments' and the baseline's name)
            **settings,
            **counts,
            "replicate_method": st.replicate_method or req.dc["method"],
            "baseline": "2a" if st.method == "2b" else "2b",
        }
        return passes_result(
            self.name,
            {**counts, "files": [Path(f).name for f in files]},
            records,
            params=params,
            tables=tables,
            masks_design=True,  # pseudo strata and PSUs, rebuilt replicate weights
            drop_public=[c for c in (spec.design.segment,) if c],
        )
