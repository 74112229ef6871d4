"""The swap stage: segment/PSU masking by the sequential variance-preserving swap."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pandas as pd

from sdl_design.describe import REPLICATES, Describes, NumberColumn, Tunable, cite, more_less, pct
from sdl_design.engine import characteristics as ch
from sdl_design.engine import partitions as part
from sdl_design.engine.records import Passes, Records, passes_result
from sdl_design.spec import KeySpec, ReleaseSpec, SwapSection
from sdl_design.stage import StageContext, StageResult
from sdl_design.stages.swap import passes as psw
from sdl_design.stages.swap.method import (
    _class_summary,
    rebuild_note,
    se_ratio_boxplot,
    swap_design_problems,
)
from sdl_design.utility import (
    se_exclude,
    se_ratio_merge,
    se_ratio_metrics,
)


class SwapStage(Passes, Describes):
    """Stage: segment/PSU masking by the sequential variance-preserving swap (Method 2b or 2a),
    with the other method run as the baseline; pseudo labels, rebuilt replicate weights, SE
    ratios by design-effect class (paper 003 Table 1)."""

    name = "swap"
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
        """The swap by partition (in memory: one partition): pass 1 reads each partition's
        segments and bounds, pass 2 its exact segment sums; the driver chooses the swaps,
        pseudo labels and replicate factors from those sums with the stage's Generator (and
        the other method's, the baseline, with its own); every worker masks and writes its
        partitions. Then the SE of every broad characteristic on the masked records of each
        method (the baseline's derived when read, never written) over its SE on the input."""
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
        st = req.section
        other = "2a" if st.method == "2b" else "2b"
        # the method's plan, the baseline's (each its own Generator) and the input's SEs at
        # once, in threads
        with ThreadPoolExecutor(3, thread_name_prefix="puf-swap") as pool:
            before = pool.submit(self._input_se, records, ctx)
            plans = [
                pool.submit(psw.swap_masking, req, design, sums, ctx.rng(label), m)
                for label, m in (("swap", st.method), ("swap-baseline", other))
            ]
            (masking, counts, tables), (baseline, _, _) = (f.result() for f in plans)
            before = before.result()
        records.lap("plan")
        n = f"{counts['n_pairs']} segment pairs swapped"
        records.say(f"{n} ({counts['n_swapped']} of {counts['n_segments']} segments)")
        args = (spec, req, design.segment_labels, masking, records.data)
        files = run_map(psw.swap_apply, parts, *args, what="swap masking")
        records.lap("masking")
        se = self._se_ratios(records, ctx, req, design.segment_labels, before, (masking, baseline))
        se = dict(zip((st.method, other), se, strict=True))
        records.lap("se")
        settings = {
            "method": st.method,
            "rate": st.rate,
            "max_share": st.max_share,
            "cumulative": st.cumulative,
            "scope": st.scope,
        }
        params = {
            **settings,
            **counts,
            "replicate_method": st.replicate_method or req.dc["method"],
            "baseline": other,
        }
        result = passes_result(
            self.name,
            {**counts, "files": [Path(f).name for f in files]},
            records,
            params=params,
            tables=tables,
            masks_design=True,  # pseudo strata and PSUs, rebuilt replicate weights
            drop_public=[c for c in (spec.design.segment,) if c],
            se_ratio_table="se_ratios",
        )
        return _with_se_ratios(result, se, st.method, other, req.dc, masking)

    def _se_ratios(
        self,
        records: Records,
        ctx: StageContext,
        req: psw.SwapRequest,
        segment_labels: Any,
        before: pd.DataFrame,
        maskings: tuple[Any, ...],
    ) -> list[pd.DataFrame]:
        """The SE table of the records masked by each masking against the swap's input:
        se_ratio_table's, with the matching characteristics marked. The first masking's
        records are those the stage wrote (records.data); the others' derived when read. The
        maskings' sides at once, in threads (mostly numpy, which leaves the interpreter)."""
        spec = ctx.spec
        ex = tuple(se_exclude(spec))
        columns = list(records.columns)
        keys = _domain_keys(spec)
        given = _input_chars(spec, columns)
        old = set(req.dc["replicate_weights"])
        plan = None  # by partition: the input's characteristics (the swap changes no other)
        if part.held_frame(records.parts, spec) is None:
            fr0 = ch.FinalRequest((given, given), keys)
            first = records.run_map(ch.final_pass1, records.parts, spec, fr0, 0, what="swap")
            plan = ch.final_plan(first, fr0, 0)

        def side(masking: Any) -> pd.DataFrame:
            mdesign = psw.masked_design(req, masking)
            cols = (*(c for c in columns if c not in old), *mdesign["replicate_weights"])
            fr = ch.FinalRequest((given, ch.FileChars(mdesign, ex, cols)), keys)
            view = [
                part.written_partition(records.data, p)
                if masking is maskings[0]
                else part.Derived(p, psw.masked_records, (req, segment_labels, masking))
                for p in records.parts
            ]
            mplan = None if plan is None else ch.with_design(plan, mdesign)
            masked = ch.file_se(records.run_map, view, spec, fr, 1, "SEs of the swap", mplan)
            se = se_ratio_merge(before, masked)
            se["matching"] = se["variable"].isin(list(req.matching)) & (se["domain"] == "all")
            return se

        with ThreadPoolExecutor(len(maskings), thread_name_prefix="puf-swap") as pool:
            return list(pool.map(side, maskings))

    @staticmethod
    def _input_se(records: Records, ctx: StageContext) -> pd.DataFrame:
        """The SE table of the swap's input: the original file's (once a release), else its
        records'."""
        given = _input_chars(ctx.spec, list(records.columns))
        fr = ch.FinalRequest((given, given), _domain_keys(ctx.spec))
        if records.parts is records.run.inputs:
            return ch.original_se(records.run_map, records.parts, ctx, fr)
        return ch.file_se(records.run_map, records.parts, ctx.spec, fr, 0, "SEs of the input")


def _domain_keys(spec: ReleaseSpec) -> tuple[KeySpec, ...]:
    """The keys whose levels are the SE tables' domains (the first two)."""
    return tuple(KeySpec(name=k) if isinstance(k, str) else k for k in spec.variables.keys[:2])


def _input_chars(spec: ReleaseSpec, columns: list[str]) -> Any:
    """The swap's input as one side of an SE table: the spec's design, se_exclude."""
    return ch.FileChars(
        ch.design_dict(spec.design, columns), tuple(se_exclude(spec)), tuple(columns)
    )


def _with_se_ratios(
    result: StageResult,
    se: dict[str, pd.DataFrame],
    method: str,
    other: str,
    dc: dict[str, Any],
    masking: Any,
) -> StageResult:
    """The swap's result with its SE ratios (by design-effect class, against the baseline's),
    their metrics, the box plot and the notes."""
    ratios, base = se[method], se[other]
    p = result.params
    m = {
        "n_characteristics": float(len(ratios)),
        **se_ratio_metrics(ratios, "se_ratio"),
        **se_ratio_metrics(ratios[ratios["matching"]], "se_ratio_matching"),
        **se_ratio_metrics(base, f"se_ratio_baseline_{other}"),
    }
    tables = {
        "se_ratios": ratios,
        "se_ratio_summary": _class_summary(ratios, "ratio", method, "taylor"),
        "se_ratio_summary_baseline": _class_summary(base, "ratio", other, "taylor"),
    }
    if "ratio_rep" in ratios.columns:
        m.update(se_ratio_metrics(ratios, "se_ratio_rep", column="ratio_rep"))
        tables["se_ratio_summary_replicate"] = _class_summary(
            ratios, "ratio_rep", method, "replicate"
        )
    result.metrics.update(m)
    result.tables.update(tables)
    order = ("se_ratio_summary", "se_ratio_summary_baseline", "se_ratio_summary_replicate",
             "matching_variance", "se_ratios")  # fmt: skip
    result.report_tables = [t for t in order if t in result.tables]
    result.figures["se_ratio_boxplot"] = se_ratio_boxplot(
        {k: se[k] for k in ("2a", "2b") if k in se}
    )
    notes = [
        f"Method {method}: {p['n_pairs']} segment pairs swapped "
        f"({p['share_swapped']:.1%} of {p['n_segments']} segments); "
        f"median SE ratio {m['se_ratio_median']:.3f} over {len(ratios)} characteristics "
        f"(baseline {other}: {m[f'se_ratio_baseline_{other}_median']:.3f}).",
    ]
    if p["n_pairs"] < p["target_pairs"]:
        notes.append(
            f"only {p['n_pairs']} of {p['target_pairs']} target pairs found under the "
            f"constraints (max_share={p['max_share']}, scope={p['scope']})"
        )
    if masking.factors is not None:
        R, old = masking.factors.shape[1], list(dc["replicate_weights"])
        notes.insert(1, rebuild_note(old, R, masking.method))
    result.notes = notes
    return result
